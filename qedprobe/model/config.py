"""`QEDConfig`: the size and arm of a hooked QED language model; round-trips to ``config.json``.

Defaults are the paper's 340M layout: hidden 1024, 24 layers, 6 heads of dimension 128,
SwiGLU MLP (``intermediate_size`` = 256-rounded ``2/3 * hidden_ratio * hidden``, as fla's
``GatedMLP``), RMSNorm, tied embeddings, short convolution of width 4, vocabulary 32000.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from qedprobe.kernels.qed import ARMS
from qedprobe.lam import LAMBDA_MAX
from qedprobe.ops import MODES
from qedprobe.tasks import FORMATS

from .aliases import TLAliases


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"QEDConfig: `{name}` must be a positive int, got {value!r}")


def _positive_float(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"QEDConfig: `{name}` must be a positive finite number, got {value!r}")


@dataclass
class QEDConfig(TLAliases):
    """Hyper-parameters of :class:`qedprobe.model.QEDModel`.

    ``arm`` picks the erase direction (``qedprobe.ops.ARMS``); ``gdn2`` has no ``theta``.
    ``lambda_max`` bounds ``lambda = lambda_max * sigmoid(theta)``; ``rand_seed`` seeds the
    ``rand`` arm's directions (layer ``l`` uses seed ``rand_seed + l``). ``head_v_dim`` is
    ``head_dim * expand_v``. ``op_mode`` is passed to ``qedprobe.ops.qed_attention``
    (``"naive"`` forces the PyTorch reference, also on CUDA). ``decay_a_range`` and
    ``decay_dt_range`` set the initial log-decay ``g = -A softplus(f_proj(x) + dt_bias)``:
    ``A ~ U(decay_a_range)`` per head and ``softplus(dt_bias)`` log-uniform in ``decay_dt_range``
    per key channel (fla's defaults ``(1, 16)`` and ``(1e-3, 1e-1)``: initial half-lives of
    about 0.4 to 700 tokens). ``task_format`` records the NIAH prompt format the model was trained
    on (``qedprobe.tasks.FORMATS``; ``qedprobe train`` writes it, None = not recorded): a
    record for evaluation, it changes nothing the model computes.
    """

    vocab_size: int = 32000
    hidden_size: int = 1024
    num_hidden_layers: int = 24
    num_heads: int = 6
    head_dim: int = 128
    arm: str = "full"
    expand_v: float = 1.0
    hidden_ratio: int = 4
    intermediate_size: int | None = None
    conv_size: int = 4
    conv_bias: bool = False
    norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    lambda_max: float = LAMBDA_MAX
    rand_seed: int = 0
    initializer_range: float = 0.02
    op_mode: str = "auto"
    decay_a_range: tuple = (1.0, 16.0)
    decay_dt_range: tuple = (1e-3, 1e-1)
    task_format: str | None = None

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "head_dim",
                     "hidden_ratio", "conv_size"):
            _positive_int(name, getattr(self, name))
        for name in ("expand_v", "norm_eps", "lambda_max", "initializer_range"):
            _positive_float(name, getattr(self, name))
        if self.arm not in ARMS:
            raise ValueError(f"QEDConfig: `arm` must be one of {ARMS}, got {self.arm!r}")
        if self.op_mode not in MODES:
            raise ValueError(f"QEDConfig: `op_mode` must be one of {MODES}, got {self.op_mode!r}")
        if isinstance(self.rand_seed, bool) or not isinstance(self.rand_seed, int):
            raise ValueError(f"QEDConfig: `rand_seed` must be an int, got {self.rand_seed!r}")
        for name in ("conv_bias", "tie_word_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"QEDConfig: `{name}` must be a bool, got {getattr(self, name)!r}")
        if not math.isclose(self.head_dim * self.expand_v, round(self.head_dim * self.expand_v)):
            raise ValueError(f"QEDConfig: `head_dim * expand_v` must be an integer, got "
                             f"{self.head_dim} * {self.expand_v}")
        if self.task_format is not None:
            if self.task_format not in FORMATS:
                raise ValueError(f"QEDConfig: `task_format` must be None or one of {FORMATS}, "
                                 f"got {self.task_format!r}")
        if self.intermediate_size is None:
            size = int(self.hidden_size * self.hidden_ratio * 2 / 3)
            self.intermediate_size = 256 * ((size + 255) // 256)
        _positive_int("intermediate_size", self.intermediate_size)
        for name in ("decay_a_range", "decay_dt_range"):
            value = getattr(self, name)
            if not isinstance(value, (tuple, list)) or len(value) != 2:
                raise ValueError(f"QEDConfig: `{name}` must be a pair (low, high), got {value!r}")
            for bound in value:
                _positive_float(name, bound)
            if value[0] > value[1]:
                raise ValueError(f"QEDConfig: `{name}` must have low <= high, got {value!r}")
            setattr(self, name, tuple(float(b) for b in value))

    @property
    def head_v_dim(self) -> int:
        """Value dimension per head, ``V = head_dim * expand_v``."""
        return int(round(self.head_dim * self.expand_v))

    @property
    def d_mlp(self) -> int:
        return self.intermediate_size

    # What TransformerLens' ActivationCache residual helpers read (QEDActivationCache): no
    # attention-only model, RMSNorm before each sub-layer and before the unembedding.
    attn_only = False
    normalization_type = "RMS"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "QEDConfig":
        """Build from a dict; unknown keys are refused (named), missing keys take defaults."""
        if not isinstance(data, dict):
            raise ValueError(f"QEDConfig.from_dict: expected a dict, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"QEDConfig: unknown keys {unknown}; known keys are {sorted(known)}")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        """Write ``config.json`` (``path`` is the file)."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "QEDConfig":
        """Read a ``config.json`` written by :meth:`save`; a corrupt file is a ``ValueError``."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"QEDConfig: no config file at {path}")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"QEDConfig: {path} is not valid JSON ({err})") from err
        return cls.from_dict(data)
