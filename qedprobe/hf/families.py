r"""The transformers families whose linear-attention layers qedprobe can run, and their sizes.

Each supported ``model_type`` names the transformers modeling module and its Gated DeltaNet
class (transformers 5.x)::

    qwen3_5, qwen3_5_text            modeling_qwen3_5       Qwen3_5GatedDeltaNet
    qwen3_5_moe, qwen3_5_moe_text    modeling_qwen3_5_moe   Qwen3_5MoeGatedDeltaNet
    qwen3_next                       modeling_qwen3_next    Qwen3NextGatedDeltaNet
    olmo_hybrid                      modeling_olmo_hybrid   OlmoHybridGatedDeltaNet

:class:`HFQEDConfig` is what qedprobe knows of such a model: the sizes of its recurrence (read
from the transformers config, so a folder's ``config.json`` is enough, no weights) and the QED
erase term injected into it (``arm`` and lambda per linear-attention layer and value head).
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import os
from dataclasses import dataclass

from qedprobe.model.aliases import TLAliases
from qedprobe.ops import ARMS, MODES

FAMILIES = {
    "qwen3_5": ("qwen3_5", "Qwen3_5GatedDeltaNet"),
    "qwen3_5_text": ("qwen3_5", "Qwen3_5GatedDeltaNet"),
    "qwen3_5_moe": ("qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet"),
    "qwen3_5_moe_text": ("qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet"),
    "qwen3_next": ("qwen3_next", "Qwen3NextGatedDeltaNet"),
    "olmo_hybrid": ("olmo_hybrid", "OlmoHybridGatedDeltaNet"),
}
"""``model_type`` -> (transformers model folder, Gated DeltaNet class name)."""

SUPPORTED = tuple(FAMILIES)


class UnsupportedModelError(ValueError):
    """A model (or config) whose type has no linear-attention layer qedprobe can run."""


def modeling_module_name(model_type: str) -> str:
    """``transformers.models.<folder>.modeling_<folder>`` of a supported ``model_type``."""
    folder = family(model_type)[0]
    return f"transformers.models.{folder}.modeling_{folder}"


def family(model_type: str) -> tuple[str, str]:
    """``(folder, class name)`` of ``model_type``; refuses an unsupported one, naming the supported."""
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"qedprobe.hf: model type {model_type!r} is not supported; supported model types: "
            f"{', '.join(SUPPORTED)} (Qwen3.5 dense and MoE, Qwen3-Next, OLMo-Hybrid)")
    return FAMILIES[model_type]


def refuse_shadowed_kernels() -> None:
    """Refuse, naming the cause and the fix, a process whose bare ``import kernels`` would find
    this repository's ``kernels/`` folder (qedprobe's Triton kernels, installed as
    ``qedprobe.kernels``) instead of the ``kernels`` package that transformers loads its hub
    kernels from once that package is installed (transformers 5.25 requires it): that happens
    when the repository root is on ``sys.path``, e.g. Python started in the repository root."""
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return  # transformers will not import it
    spec = importlib.util.find_spec("kernels")
    ours = os.path.dirname(importlib.util.find_spec("qedprobe.kernels").origin)
    if spec is not None and spec.origin and os.path.dirname(os.path.abspath(spec.origin)) == ours:
        raise ImportError(f"qedprobe.hf: `import kernels` finds qedprobe's own {ours!r} (the repository root is on "
                          "sys.path, e.g. Python was started there), not the `kernels` package transformers "
                          "loads; start Python in another directory")


def deltanet_class(model_type: str) -> type:
    """The transformers Gated DeltaNet class of ``model_type`` (refused, naming the installed
    transformers, when that version does not have it)."""
    refuse_shadowed_kernels()
    name = family(model_type)[1]
    try:
        return getattr(importlib.import_module(modeling_module_name(model_type)), name)
    except (ImportError, AttributeError):
        import transformers
        raise UnsupportedModelError(f"qedprobe.hf: transformers {transformers.__version__} has no {name}; "
                                    f"qedprobe.hf is tested with transformers 5.24") from None


@dataclass(frozen=True)
class HFQEDConfig(TLAliases):
    """Sizes of the recurrence of a transformers model, and the QED term injected into it.

    ``hidden_size`` is the residual width; ``num_hidden_layers`` counts every decoder layer;
    ``linear_layers`` are those with a Gated DeltaNet (the others are softmax attention). Per
    linear-attention layer: ``num_heads`` value heads (the heads of every probe),
    ``num_key_heads`` q/k heads (value head ``j`` reads q/k head
    ``j // (num_heads // num_key_heads)``), ``head_dim`` K, ``head_v_dim`` V.
    ``arm`` and ``lam`` (one tuple of ``num_heads`` floats per linear layer, in the order of
    ``linear_layers``) are the injected erase term (``"gdn2"`` and zeros: the model as trained);
    ``rand_seed`` seeds the ``rand`` arm's directions (layer ``l`` uses ``rand_seed + l``);
    ``op_mode`` is passed to ``qedprobe.ops.qed_attention``.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    linear_layers: tuple
    num_heads: int
    num_key_heads: int
    head_dim: int
    head_v_dim: int
    arm: str = "gdn2"
    lam: tuple = ()
    rand_seed: int = 0
    op_mode: str = "auto"

    def __post_init__(self):
        if self.arm not in ARMS:
            raise ValueError(f"HFQEDConfig: `arm` must be one of {ARMS}, got {self.arm!r}")
        if self.op_mode not in MODES:
            raise ValueError(f"HFQEDConfig: `op_mode` must be one of {MODES}, got {self.op_mode!r}")
        if self.num_heads % self.num_key_heads:
            raise ValueError(f"HFQEDConfig: {self.num_heads} value heads are not a multiple of "
                             f"{self.num_key_heads} key heads")
        if not self.lam:
            object.__setattr__(self, "lam", tuple((0.0,) * self.num_heads for _ in self.linear_layers))
        shape = [len(row) for row in self.lam]
        if shape != [self.num_heads] * len(self.linear_layers):
            raise ValueError(f"HFQEDConfig: `lam` must hold {self.num_heads} values for each of the "
                             f"{len(self.linear_layers)} linear-attention layers, got rows of {shape}")
        if self.arm == "gdn2" and any(x != 0 for row in self.lam for x in row):
            raise ValueError("HFQEDConfig: arm 'gdn2' has no erase term: `lam` must be 0")

    @property
    def group_size(self) -> int:
        """Value heads per q/k head (``m``: value head ``j`` reads q/k head ``j // m``)."""
        return self.num_heads // self.num_key_heads

    def to_dict(self) -> dict:
        return {k: list(map(list, v)) if k == "lam" else (list(v) if isinstance(v, tuple) else v)
                for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_transformers(cls, config, **qed) -> "HFQEDConfig":
        """From a transformers config of a supported family; for Qwen3.5's multimodal
        ``qwen3_5`` / ``qwen3_5_moe`` its text config (``qwen3_5_text`` / ``qwen3_5_moe_text``,
        what ``AutoModelForCausalLM`` builds from such a folder). ``qed``: ``arm``, ``lam``,
        ``rand_seed``, ``op_mode``."""
        family(getattr(config, "model_type", type(config).__name__))
        text = config.get_text_config()
        family(text.model_type)
        linear = tuple(i for i, t in enumerate(text.layer_types) if t == "linear_attention")
        return cls(model_type=text.model_type, vocab_size=int(text.vocab_size), hidden_size=int(text.hidden_size),
                   num_hidden_layers=int(text.num_hidden_layers), linear_layers=linear,
                   num_heads=int(text.linear_num_value_heads), num_key_heads=int(text.linear_num_key_heads),
                   head_dim=int(text.linear_key_head_dim), head_v_dim=int(text.linear_value_head_dim), **qed)
