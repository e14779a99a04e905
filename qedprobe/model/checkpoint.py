"""Save and load a :class:`QEDModel` as ``config.json`` + ``model.safetensors``.

Loading is strict: missing, unexpected or mis-shaped tensors are refused with a ``ValueError``
that names them; an unreadable ``model.safetensors`` or ``config.json`` is a ``ValueError`` too.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .config import QEDConfig

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def save_pretrained(model, path) -> None:
    """Write ``model.cfg`` and ``model.state_dict()`` into directory ``path`` (created if needed)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.cfg.save(path / CONFIG_NAME)
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(path / WEIGHTS_NAME), metadata={"format": "pt", "library": "qedprobe"})


def read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file on CPU; a missing or corrupt file is a clear error."""
    if not file.is_file():
        raise FileNotFoundError(f"no weights file at {file}")
    try:
        return load_file(str(file), device="cpu")
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"{file} is not a readable safetensors file ({err})") from err


def check_state_dict(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor], source) -> None:
    """Refuse missing, unexpected or mis-shaped keys, naming each."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    shapes = sorted(f"{k}: expected {tuple(expected[k].shape)}, got {tuple(found[k].shape)}"
                    for k in set(expected) & set(found) if expected[k].shape != found[k].shape)
    problems = []
    if missing:
        problems.append(f"missing keys {missing}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected}")
    if shapes:
        problems.append(f"mis-shaped tensors [{'; '.join(shapes)}]")
    if problems:
        raise ValueError(f"{source}: state dict does not match the model: " + "; ".join(problems))


def load_pretrained(cls, path, dtype: torch.dtype | None = None, device=None):
    """Build ``cls(config)`` and load the weights of directory ``path`` exactly.

    ``dtype``: None keeps the dtype stored for ``embeddings.weight``; ``device``: default CPU.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"from_pretrained: {path} is not a directory")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"from_pretrained: `dtype` must be a floating torch.dtype or None, got {dtype!r}")
    cfg = QEDConfig.load(path / CONFIG_NAME)
    tensors = read_safetensors(path / WEIGHTS_NAME)
    model = cls(cfg)
    check_state_dict(model.state_dict(), tensors, path / WEIGHTS_NAME)
    model.load_state_dict(tensors, strict=True)
    model.to(dtype=dtype or tensors["embeddings.weight"].dtype)
    if device is not None:
        model.to(device)
    return model
