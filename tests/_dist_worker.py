"""Run by tests/test_distributed.py under ``torchrun --nproc_per_node=2`` (gloo, CPU):

1. eig on this rank's share of the inputs, reduced over the ranks (rank 0 saves ``OUT/eig``);
2. sweep folders that one or all ranks cannot use are refused on every rank;
3. DDP training: the whole run in ``OUT/train``, and a run stopped after step 1 in
   ``OUT/train_resume`` (the test resumes it in one process).

    torchrun --standalone --nproc_per_node=2 tests/_dist_worker.py OUT
"""
import sys
from pathlib import Path

import torch
from helpers import tiny_model

from qedprobe import dist
from qedprobe.eval.eig import run_eig, task_batches
from qedprobe.eval.store import SweepError, open_store
from qedprobe.train import TrainConfig, train

EIG = {"task": "s-niah-1", "length": 400, "samples": 3, "batch_size": 1, "format": "legacy"}
TRAIN = {"model": {"hidden_size": 32, "num_hidden_layers": 1, "num_heads": 2, "head_dim": 8},
         "seq_len": 512, "batch_size": 2, "steps": 2, "warmup_steps": 1, "decay_steps": 1,
         "save_every": 1, "lr": 3e-3}


def train_config() -> TrainConfig:
    return TrainConfig.from_preset("micro", **TRAIN)


def eig(out: Path) -> None:
    acc = run_eig(tiny_model(), task_batches(**EIG, shard=(dist.rank(), dist.world_size())))
    if dist.is_main():
        acc.save(out / "eig", plots=False)


def refusal(out: Path) -> None:
    """Both ranks refuse ``OUT/other`` (a sweep of another seed) and ``OUT/locked`` (the test
    holds rank 1's lock, so only rank 1 fails there by itself); the message goes to
    ``OUT/<folder>.<rank>``."""
    for name in ("other", "locked"):
        try:
            open_store(out / name, {"samples_spec": {"seed": 1}, "intervention": {}, "model": {}}).close()
        except SweepError as exc:
            (out / f"{name}.{dist.rank()}").write_text(str(exc))


def main(out: Path) -> int:
    torch.set_num_threads(1)
    dist.init_from_env("cpu")
    eig(out)
    refusal(out)
    train(train_config(), out / "train")
    train(train_config(), out / "train_resume", until_step=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
