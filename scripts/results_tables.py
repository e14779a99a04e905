"""Markdown tables for docs/RESULTS.md from the shipped checkpoints and their measurements.

    python scripts/results_tables.py RESULTS [--checkpoints checkpoints] [--prefix recall-]

e.g. for the recall checkpoints, whose raw results are in git at c4b33d1 (docs/RESULTS.md):

    git archive c4b33d1 docs/results/gpu-recall-2026-11-30 | tar -x -C /tmp
    python scripts/results_tables.py /tmp/docs/results/gpu-recall-2026-11-30 --prefix recall-

Reads, for every ``<arm>-s<seed>`` folder of the results directory, ``loss.jsonl.gz`` (the
training log), ``sweep/summary.csv`` and ``eig/eig.json`` (written by
``scripts/eval_checkpoints.sh``), and the checkpoint itself (its lambdas: ``<checkpoints>/<prefix><arm>-s<seed>``). Prints three tables:
training (final loss, answer-token loss and accuracy, lambda), the learned lambda per layer
(mean over heads, max |lambda|), and the erase eigenvalue ``e_t`` over every layer and head
(range, tokens with ``e < 0`` or ``|e| > 1``, largest singular value of ``M_t``).
"""
from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import torch

from qedprobe.model import QEDModel


def training_row(folder: Path) -> str:
    log = [json.loads(line) for line in gzip.open(folder / "loss.jsonl.gz", "rt")]
    last = log[-20:]
    mean = lambda key: sum(r[key] for r in last) / len(last)  # noqa: E731
    return (f"| {folder.name} | {log[-1]['step']} | {log[-1]['tokens'] / 1e6:.1f}M | {mean('loss'):.4f} | "
            f"{mean('answer_loss'):.3f} | {mean('answer_acc'):.3f} | {log[-1]['lambda_mean']:.4f} | "
            f"{log[-1]['wall_s']:.0f} s |")


def lambda_row(model: QEDModel, name: str) -> str:
    with torch.no_grad():
        lams = [block.attn.lam().float() for block in model.blocks]
    per_layer = " | ".join(f"{lam.mean():+.4f}" for lam in lams)
    return f"| {name} | {per_layer} | {max(lam.abs().max() for lam in lams):.4f} |"


def eig_row(folder: Path) -> str | None:
    path = folder / "eig" / "eig.json"
    if not path.is_file():
        return None
    heads = [h for layer in json.loads(path.read_text())["layers"] for h in layer["heads"]]
    n = sum(h["n"] for h in heads)
    return (f"| {folder.name} | {n:,} | {min(h['e']['min'] for h in heads):.4f} | "
            f"{max(h['e']['max'] for h in heads):.4f} | {sum(h['e_lt0'] for h in heads)} | "
            f"{sum(h['e_abs_gt1'] for h in heads)} | {max(h['sigma']['max'] for h in heads):.4f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--checkpoints", type=Path, default=Path("checkpoints"))
    ap.add_argument("--prefix", default="", help="checkpoint folder = prefix + results folder name")
    a = ap.parse_args()
    folders = sorted(p for p in a.results.glob("*-s[0-9]") if (p / "loss.jsonl.gz").is_file())
    if not folders:
        raise SystemExit(f"no <arm>-s<seed> folders in {a.results}")
    print("| run | steps | tokens | loss (last 20 steps) | answer loss | answer token acc. | mean lambda | wall |")
    print("|---|---|---|---|---|---|---|---|")
    for f in folders:
        print(training_row(f))
    models = {f.name: QEDModel.from_pretrained(a.checkpoints / f"{a.prefix}{f.name}") for f in folders}
    layers = len(next(iter(models.values())).blocks)
    print("\n| run | " + " | ".join(f"layer {i} mean lambda" for i in range(layers)) + " | max abs lambda |")
    print("|---|" + "---|" * (layers + 1))
    for name, model in models.items():
        if model.cfg.arm != "gdn2":
            print(lambda_row(model, name))
    print("\n| run | tokens x heads | min e | max e | e < 0 | abs(e) > 1 | max sigma(M) |")
    print("|---|---|---|---|---|---|---|")
    for f in folders:
        row = eig_row(f)
        if row:
            print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
