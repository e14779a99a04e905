"""Training checkpoints: ``OUT/step-NNNNNN/`` folders and the ``OUT/latest`` link.

A checkpoint folder holds the model as :meth:`QEDModel.save_pretrained` writes it
(``config.json`` + ``model.safetensors``, float32 master weights) and ``trainer_state.pt``:
the step, the optimizer and scheduler state dicts, the RNG states (Python, torch CPU, torch
CUDA), the cumulative wall time and the :class:`TrainConfig` as a dict. Folders are written
under a temporary name and renamed; ``latest`` is a symlink replaced atomically, so a run killed
at any moment leaves the previous checkpoint intact.
"""
from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import torch

from qedprobe.model.checkpoint import WEIGHTS_NAME, check_state_dict, read_safetensors

STATE_NAME = "trainer_state.pt"
LATEST = "latest"


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def rng_state() -> dict:
    """Python and torch generator states (CUDA ones when CUDA is initialised)."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(out: Path, step: int, save_model, trainer_state: dict) -> Path:
    """Write ``out/step-NNNNNN`` (``save_model(folder)`` writes the model) and point ``latest`` at it."""
    final = out / step_dir_name(step)
    tmp = out / f".tmp-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(tmp)
    torch.save({**trainer_state, "step": step}, tmp / STATE_NAME)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    link = out / f".tmp-{LATEST}"
    if link.is_symlink() or link.exists():
        link.unlink()
    os.symlink(final.name, link)
    os.replace(link, out / LATEST)
    return final


def complete_checkpoints(out: Path) -> list[Path]:
    """The ``step-NNNNNN`` folders of ``out`` that hold both the weights and the trainer state,
    oldest first (a folder left half-written by hand or by a full disk is skipped)."""
    found = [p for p in Path(out).glob("step-" + "[0-9]" * 6)
             if (p / STATE_NAME).is_file() and (p / WEIGHTS_NAME).is_file()]
    return sorted(found, key=lambda p: p.name)


def load_latest(out: Path) -> tuple[Path, dict] | None:
    """``(folder, trainer_state)`` to resume from: ``out/latest``, or, when that link is absent,
    the newest of :func:`complete_checkpoints`; None when ``out`` has no checkpoint."""
    link = out / LATEST
    if link.is_symlink() or link.exists():
        folder = link.resolve()
        if not folder.is_dir():
            raise ValueError(f"{link} points to {folder}, which is missing; restore it, or remove {link} "
                             "to resume from the newest complete step-NNNNNN folder")
    else:
        found = complete_checkpoints(out)
        if not found:
            return None
        folder = found[-1]
    state_file = folder / STATE_NAME
    if not state_file.is_file():
        raise ValueError(f"checkpoint {folder} has no {STATE_NAME}")
    return folder, torch.load(state_file, map_location="cpu", weights_only=True)


def load_model_weights(model: torch.nn.Module, folder: Path) -> None:
    """Load ``folder/model.safetensors`` into ``model`` exactly (names and shapes checked)."""
    tensors = read_safetensors(folder / WEIGHTS_NAME)
    check_state_dict(model.state_dict(), tensors, folder / WEIGHTS_NAME)
    model.load_state_dict(tensors, strict=True)
