"""`TrainConfig`: everything that defines a training run; presets for the micro and small models.

Two runs with equal configs (and the same code) produce the same model: the seed fixes the
initialisation (``torch.manual_seed(seed)`` before the model is built) and the data
(:class:`qedprobe.train.data.TrainData` with the same seed). Arms share the seed's
initialisation of every shared parameter (``theta`` and ``z`` draw from no global generator)
and the seed's data, so arms of one seed form matched pairs.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from qedprobe.constants import THETA_LR_MULT

from .mixtures import MIXTURES

LOSSES = ("all", "answer")
DEVICES = ("auto", "cpu", "cuda")

PRESETS = {
    # Trains on 2 CPU cores in under two minutes; for tests and plumbing, not for retrieval.
    "micro": dict(model=dict(hidden_size=64, num_hidden_layers=2, num_heads=2, head_dim=16),
                  seq_len=512, batch_size=8, steps=200, lr=3e-3, warmup_steps=20, decay_steps=60,
                  mixture="short", save_every=100, device="cpu"),
    # The GPU shape for the six arms x two seeds: 3.75M parameters, 7.5 MB as bf16; 32 rows x
    # 1024 tokens per step (scripts/train_checkpoints.sh passes the step count a run can afford).
    "small": dict(model=dict(hidden_size=256, num_hidden_layers=4, num_heads=2, head_dim=128, hidden_ratio=2),
                  seq_len=1024, batch_size=32, steps=1500, lr=1.5e-3, warmup_steps=100,
                  decay_steps=300, mixture="niah", save_every=250, device="cuda"),
}

MODEL_KEYS = ("hidden_size", "num_hidden_layers", "num_heads", "head_dim", "expand_v", "hidden_ratio",
              "conv_size", "lambda_max", "rand_seed", "initializer_range", "op_mode", "decay_a_range",
              "decay_dt_range")


@dataclass
class TrainConfig:
    """One training run.

    ``model`` holds :class:`qedprobe.model.QEDConfig` keyword arguments (``MODEL_KEYS``); the
    vocabulary comes from the tokenizer and the arm from ``arm``. A step sees
    ``batch_size * accum`` rows of ``seq_len`` tokens (``accum`` micro-batches of
    ``batch_size``). ``loss``: ``"all"`` (next-token loss on every non-PAD target, the default:
    a language model) or ``"answer"`` (only the answer values); ``key_weight`` is the weight of the key-dependent answer
tokens in either (the others weigh 1; see :func:`qedprobe.train.trainer.token_weights`).
``device="auto"`` is CUDA when
    available; bf16 autocast is used on CUDA only, with float32 master weights. ``op_fallback``:
    when the configured op has no backward on the device, train with the PyTorch reference
    (logged as a warning) instead of stopping. ``init``: a model folder whose weights start the
    run instead of the seeded initialisation (a second training stage, e.g. interference after
    the recall recipe); the data seed stays ``seed``. ``theta_init``: start every head's
    ``theta`` at this value instead of :data:`qedprobe.lam.THETA_INIT` (or the ``init`` model's),
    so that ``lambda`` starts at ``lambda_max * sigmoid(theta_init)``: 0 gives ``lambda_max / 2``
    (None: keep the start; not for arm ``gdn2``, which has no ``theta``).
    """

    arm: str = "full"
    seed: int = 0
    model: dict = field(default_factory=dict)
    tokenizer: str = "bytes"
    mixture: str = "niah"
    seq_len: int = 2048
    batch_size: int = 32
    accum: int = 1
    steps: int = 3000
    lr: float = 1e-3
    theta_lr_mult: float = THETA_LR_MULT
    weight_decay: float = 0.1
    betas: tuple = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 200
    decay_steps: int = 600
    min_lr_ratio: float = 0.0
    clip: float = 1.0
    loss: str = "all"
    key_weight: float = 1.0
    save_every: int = 500
    device: str = "auto"
    op_fallback: bool = True
    init: str | None = None
    theta_init: float | None = None

    def __post_init__(self):
        for name in ("seq_len", "batch_size", "accum", "steps", "save_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TrainConfig: `{name}` must be a positive int, got {value!r}")
        for name in ("seed", "warmup_steps", "decay_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"TrainConfig: `{name}` must be an int >= 0, got {value!r}")
        # theta_lr_mult may be 0: theta frozen, lambda held at its initial value
        for name, zero_ok in (("lr", False), ("theta_lr_mult", True), ("eps", False), ("clip", False),
                              ("key_weight", False)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    (0 <= value if zero_ok else 0 < value) and value < math.inf):
                what = "a finite number >= 0" if zero_ok else "a positive finite number"
                raise ValueError(f"TrainConfig: `{name}` must be {what}, got {value!r}")
        if self.theta_init is not None:
            if isinstance(self.theta_init, bool) or not isinstance(self.theta_init, (int, float)) \
                    or not math.isfinite(self.theta_init):
                raise ValueError(f"TrainConfig: `theta_init` must be a finite number or None, got {self.theta_init!r}")
            if self.arm == "gdn2":
                raise ValueError("TrainConfig: `theta_init` does not apply to arm 'gdn2', which has no theta")
        if not 0 <= self.weight_decay < math.inf:
            raise ValueError(f"TrainConfig: `weight_decay` must be >= 0, got {self.weight_decay!r}")
        self.betas = tuple(self.betas)
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"TrainConfig: `betas` must be two numbers in [0, 1), got {self.betas!r}")
        if self.loss not in LOSSES:
            raise ValueError(f"TrainConfig: `loss` must be one of {LOSSES}, got {self.loss!r}")
        if self.device not in DEVICES:
            raise ValueError(f"TrainConfig: `device` must be one of {DEVICES}, got {self.device!r}")
        if self.mixture not in MIXTURES:
            raise ValueError(f"TrainConfig: `mixture` must be one of {sorted(MIXTURES)}, got {self.mixture!r}")
        unknown = sorted(set(self.model) - set(MODEL_KEYS))
        if unknown:
            raise ValueError(f"TrainConfig: `model` has unknown keys {unknown}; allowed: {list(MODEL_KEYS)}")
        if self.warmup_steps + self.decay_steps > self.steps:
            raise ValueError(f"TrainConfig: `warmup_steps` + `decay_steps` ({self.warmup_steps} + "
                             f"{self.decay_steps}) must not exceed `steps` ({self.steps})")

    @property
    def rows_per_step(self) -> int:
        return self.batch_size * self.accum

    @classmethod
    def from_preset(cls, preset: str, **overrides) -> "TrainConfig":
        """A preset of :data:`PRESETS` with ``overrides`` (``model`` entries are merged)."""
        if preset not in PRESETS:
            raise ValueError(f"TrainConfig: `preset` must be one of {sorted(PRESETS)}, got {preset!r}")
        values = {**PRESETS[preset], **overrides}
        values["model"] = {**PRESETS[preset]["model"], **overrides.get("model", {})}
        return cls(**values)

    def to_dict(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_dict(cls, data: dict) -> "TrainConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"TrainConfig: unknown keys {unknown}")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    def differences(self, other: "TrainConfig") -> list[str]:
        """``"name: mine != other"`` for every field that differs."""
        a, b = self.to_dict(), other.to_dict()
        return [f"{k}: {a[k]!r} != {b[k]!r}" for k in sorted(a) if a[k] != b[k]]
