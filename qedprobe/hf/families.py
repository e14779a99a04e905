r"""The transformers families whose linear-attention layers qedprobe can run, and their sizes.

Each supported ``model_type`` names the transformers modeling module, its linear-attention layer
class and its delta rule (transformers 5.25); a multimodal type stands for its text model (what
``AutoModelForCausalLM`` / ``AutoModelForImageTextToText`` build from such a folder)::

    model_type                        modeling module        layer class                      rule
    qwen3_5, qwen3_5_text             modeling_qwen3_5       Qwen3_5GatedDeltaNet             gdn
    qwen3_5_moe, qwen3_5_moe_text     modeling_qwen3_5_moe   Qwen3_5MoeGatedDeltaNet          gdn
    qwen3_next                        modeling_qwen3_next    Qwen3NextGatedDeltaNet           gdn
    olmo_hybrid                       modeling_olmo_hybrid   OlmoHybridGatedDeltaNet          gdn
    qwen4_exp, qwen4_exp_text         modeling_qwen4_exp     Qwen4ExpTextGatedDeltaNet        gdn
    lara_mini                         modeling_lara_mini     LaraMiniGatedDeltaNet            gdn
    kimi_linear                       modeling_kimi_linear   KimiLinearDeltaAttention         kda
    bailing_hybrid                    modeling_bailing_hybrid BailingHybridDeltaAttention     kda
    glm5_next, glm5_next_text         modeling_glm5_next     Glm5NextTextLinearAttention      kda

A rule names the two functions of the modeling module the layer calls for its recurrence
(:data:`RULES`: the chunked one for a prompt, the recurrent one for a cached decode step): Gated
DeltaNet (``gdn``: scalar log-decay ``g`` ``[B, T, Hv]``) or Kimi Delta Attention (``kda``:
per-channel log-decay ``g`` ``[B, T, Hv, K]``); both with one scalar ``beta`` ``[B, T, Hv]``.

:class:`HFQEDConfig` is what qedprobe knows of such a model: the sizes of its recurrence (read
from the transformers config, so a folder's ``config.json`` is enough, no weights) and the QED
erase term injected into it (``arm`` and lambda per linear-attention layer and value head).
"""
from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass

from qedprobe.model.aliases import TLAliases
from qedprobe.ops import ARMS, MODES

RULES = {
    "gdn": {"torch_chunk_gated_delta_rule": "prefill", "torch_recurrent_gated_delta_rule": "decode"},
    "kda": {"chunk_kimi_delta_attention": "prefill", "recurrent_kimi_delta_attention": "decode"},
}
"""Delta rule -> {name of a recurrence function in the modeling module: the phase its calls are}."""


@dataclass(frozen=True)
class Family:
    """A supported ``model_type``: ``folder`` (``transformers.models.<folder>``), the
    linear-attention ``layer_class`` there, and its delta ``rule`` (a key of :data:`RULES`)."""

    folder: str
    layer_class: str
    rule: str


FAMILIES = {
    "qwen3_5": Family("qwen3_5", "Qwen3_5GatedDeltaNet", "gdn"),
    "qwen3_5_text": Family("qwen3_5", "Qwen3_5GatedDeltaNet", "gdn"),
    "qwen3_5_moe": Family("qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet", "gdn"),
    "qwen3_5_moe_text": Family("qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet", "gdn"),
    "qwen3_next": Family("qwen3_next", "Qwen3NextGatedDeltaNet", "gdn"),
    "olmo_hybrid": Family("olmo_hybrid", "OlmoHybridGatedDeltaNet", "gdn"),
    "qwen4_exp": Family("qwen4_exp", "Qwen4ExpTextGatedDeltaNet", "gdn"),
    "qwen4_exp_text": Family("qwen4_exp", "Qwen4ExpTextGatedDeltaNet", "gdn"),
    "lara_mini": Family("lara_mini", "LaraMiniGatedDeltaNet", "gdn"),
    "kimi_linear": Family("kimi_linear", "KimiLinearDeltaAttention", "kda"),
    "bailing_hybrid": Family("bailing_hybrid", "BailingHybridDeltaAttention", "kda"),
    "glm5_next": Family("glm5_next", "Glm5NextTextLinearAttention", "kda"),
    "glm5_next_text": Family("glm5_next", "Glm5NextTextLinearAttention", "kda"),
}
"""``model_type`` -> its :class:`Family`."""

SUPPORTED = tuple(FAMILIES)


class UnsupportedModelError(ValueError):
    """A model (or config) whose type has no linear-attention layer qedprobe can run."""


def modeling_module_name(model_type: str) -> str:
    """``transformers.models.<folder>.modeling_<folder>`` of a supported ``model_type``."""
    folder = family(model_type).folder
    return f"transformers.models.{folder}.modeling_{folder}"


def family(model_type: str) -> Family:
    """The :class:`Family` of ``model_type``; refuses an unsupported one, naming the supported."""
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"qedprobe.hf: model type {model_type!r} is not supported; supported model types: "
            f"{', '.join(SUPPORTED)}")
    return FAMILIES[model_type]


def routed_functions(model_type: str) -> dict[str, str]:
    """``{function name: phase}`` of the recurrence functions ``model_type``'s layers call."""
    return RULES[family(model_type).rule]


def deltanet_class(model_type: str) -> type:
    """The transformers linear-attention layer class of ``model_type`` (refused, naming the
    installed transformers, when that version does not have it)."""
    name = family(model_type).layer_class
    try:
        return getattr(importlib.import_module(modeling_module_name(model_type)), name)
    except (ImportError, AttributeError):
        import transformers
        raise UnsupportedModelError(f"qedprobe.hf: transformers {transformers.__version__} has no {name}; "
                                    f"qedprobe.hf is tested with transformers 5.25") from None


@dataclass(frozen=True)
class HFQEDConfig(TLAliases):
    """Sizes of the recurrence of a transformers model, and the QED term injected into it.

    ``hidden_size`` is the residual width; ``num_hidden_layers`` counts every decoder layer;
    ``linear_layers`` are those with a linear-attention layer (the others are softmax attention). Per
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
        """From a transformers config of a supported family; for a multimodal type
        (``qwen3_5``, ``qwen3_5_moe``, ``qwen4_exp``, ``glm5_next``) its text config.
        ``qed``: ``arm``, ``lam``, ``rand_seed``, ``op_mode``."""
        family(getattr(config, "model_type", type(config).__name__))
        text = config.get_text_config()
        family(text.model_type)
        linear = tuple(i for i, t in enumerate(text.layer_types) if t == "linear_attention")
        return cls(model_type=text.model_type, vocab_size=int(text.vocab_size), hidden_size=int(text.hidden_size),
                   num_hidden_layers=int(text.num_hidden_layers), linear_layers=linear, **recurrence_sizes(text), **qed)


def recurrence_sizes(text) -> dict:
    """``num_heads``, ``num_key_heads``, ``head_dim``, ``head_v_dim`` of a supported text config:
    GDN configs name value and key heads apart (``linear_num_value_heads``, ...); KDA configs
    have one head count and one head size for q, k and v (``linear_num_heads``,
    ``linear_head_dim``)."""
    if family(text.model_type).rule == "kda":
        heads, dim = int(text.linear_num_heads), int(text.linear_head_dim)
        return dict(num_heads=heads, num_key_heads=heads, head_dim=dim, head_v_dim=dim)
    return dict(num_heads=int(text.linear_num_value_heads), num_key_heads=int(text.linear_num_key_heads),
                head_dim=int(text.linear_key_head_dim), head_v_dim=int(text.linear_value_head_dim))
