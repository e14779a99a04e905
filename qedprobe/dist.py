"""``torch.distributed`` glue shared by the sweep, eig and training commands.

Every helper works with and without a process group: with none (or one of size 1) it is the
single-process case (rank 0 of 1, barriers are no-ops), so callers have one code path.

``torchrun --nproc_per_node=N -m qedprobe.cli CMD ...`` sets ``RANK``, ``WORLD_SIZE`` and
``LOCAL_RANK``; :func:`init_from_env` then starts the group (NCCL for CUDA devices, gloo
otherwise) and :func:`rank_device` gives each rank its own GPU ``cuda:LOCAL_RANK``.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["rank", "world_size", "is_main", "init_from_env", "rank_device", "barrier",
           "gather_objects", "agree", "DistributedError"]


class DistributedError(RuntimeError):
    """Another rank failed; the message is that rank's error."""


def _active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if _active() else 0


def world_size() -> int:
    """Number of ranks (1 without a process group)."""
    return dist.get_world_size() if _active() else 1


def is_main() -> bool:
    """Rank 0: the process that writes shared files (summaries, checkpoints, plots)."""
    return rank() == 0


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def rank_device(device) -> torch.device:
    """``device`` for this rank: a CUDA device without an index becomes ``cuda:LOCAL_RANK``
    under torchrun (one GPU per rank); anything else is returned as given."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None and launched_by_torchrun():
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return dev


def init_from_env(device) -> bool:
    """Start the process group torchrun describes (backend NCCL if ``device`` is CUDA, else
    gloo); returns whether a group is active. Does nothing outside torchrun or when a group
    already exists (a caller that initialised its own keeps it)."""
    if _active():
        return True
    if not launched_by_torchrun():
        return False
    dev = rank_device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
    return True


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def gather_objects(obj) -> list:
    """``[obj of rank 0, obj of rank 1, ...]`` on every rank (picklable objects)."""
    if world_size() == 1:
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def agree(error: BaseException | None, kind=DistributedError) -> None:
    """Collective check: re-raise this rank's ``error``, or raise ``kind`` with the first
    failing rank's message, so that every rank stops when one cannot go on (a lone failure
    would leave the others waiting in the next collective). Single process: re-raises ``error``."""
    messages = gather_objects(None if error is None else str(error))
    if error is not None:
        raise error
    for r, msg in enumerate(messages):
        if msg is not None:
            raise kind(f"rank {r}: {msg}")
