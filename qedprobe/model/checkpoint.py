"""Save and load a :class:`QEDModel` as ``config.json`` + ``model.safetensors``.

Loading is strict: missing, unexpected or mis-shaped tensors are refused with a ``ValueError``
that names them; an unreadable ``model.safetensors`` or ``config.json`` is a ``ValueError`` too.

The config keys that define the recurrence but leave no trace in the tensor shapes
(:data:`RECURRENCE_KEYS`: the arms share parameter names) are also written into the
safetensors metadata, and a ``config.json`` that disagrees with them is refused by name. Files
written before this (no such metadata) load as before.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from .config import QEDConfig

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
TOKENIZER_NAME = "tokenizer.json"
RECURRENCE_KEYS = ("arm", "lambda_max")
"""Config keys stored in the weights' metadata (key ``qedprobe.recurrence``, a JSON object)."""
RECURRENCE_META = "qedprobe.recurrence"


def save_pretrained(model, path) -> None:
    """Write ``model.cfg`` and ``model.state_dict()`` into directory ``path`` (created if needed)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.cfg.save(path / CONFIG_NAME)
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    recurrence = json.dumps({k: getattr(model.cfg, k) for k in RECURRENCE_KEYS}, sort_keys=True)
    save_file(tensors, str(path / WEIGHTS_NAME),
              metadata={"format": "pt", "library": "qedprobe", RECURRENCE_META: recurrence})


def state_dict_sha256(model: torch.nn.Module) -> str:
    """SHA-256 over ``model.state_dict()``: every tensor's name, dtype, shape and bytes, in name
    order. Two models hash equal exactly when they hold the same tensors in the same dtype."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{name}|{flat.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def check_recurrence(cfg: QEDConfig, file: Path) -> None:
    """Refuse a config whose :data:`RECURRENCE_KEYS` differ from those saved in ``file``'s metadata."""
    with safe_open(str(file), framework="pt") as fh:
        stored = (fh.metadata() or {}).get(RECURRENCE_META)
    if stored is None:
        return
    for key, saved in json.loads(stored).items():
        if getattr(cfg, key) != saved:
            raise ValueError(f"{file.parent / CONFIG_NAME} has {key}={getattr(cfg, key)!r} but {file} was "
                             f"saved with {key}={saved!r}: the config does not describe these weights")


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
    A folder with a ``tokenizer.json`` becomes the model's ``tokenizer`` (read on first use).
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"from_pretrained: {path} is not a directory")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"from_pretrained: `dtype` must be a floating torch.dtype or None, got {dtype!r}")
    cfg = QEDConfig.load(path / CONFIG_NAME)
    tensors = read_safetensors(path / WEIGHTS_NAME)
    check_recurrence(cfg, path / WEIGHTS_NAME)
    model = cls(cfg)
    check_state_dict(model.state_dict(), tensors, path / WEIGHTS_NAME)
    model.load_state_dict(tensors, strict=True)
    model.to(dtype=dtype or tensors["embeddings.weight"].dtype)
    if device is not None:
        model.to(device)
    if (path / TOKENIZER_NAME).is_file():
        model.tokenizer = str(path)  # read on first use (model.to_tokens, model.tokenizer)
    return model
