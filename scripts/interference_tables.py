"""Markdown tables for docs/RESULTS.md from the evaluation of the interference checkpoints.

    python scripts/interference_tables.py EVAL REPORTS [--checkpoints checkpoints]

EVAL is the folder `scripts/eval_checkpoints.sh --cells interference` wrote (``<name>/<cell>/summary.json``,
``<name>/eig/eig.json``); REPORTS holds one ``qedprobe report`` folder per
seed and cell, ``seed<n>-<cell>/report.json``, with the sweeps labelled by arm and the baseline
``gdn2``. Prints:

* accuracy % at s = 1 of every checkpoint, one table per cell (rows: checkpoints, columns: lengths);
* the paired exact McNemar tests of each QED arm against GDN-2 of the same seed, per cell and
  length, as ``b/c`` (b: right in the QED arm only; c: right in GDN-2 only) and the p value;
* the Table-4 strength sweep of every QED checkpoint on the first cell: accuracy % at each s,
  and the discordant pairs against s = 1 summed over lengths;
* the learned lambda per layer and head, and the erase eigenvalue e_t over all layers and heads
  against its bound [-lambda_max, 1 + lambda_max] (``scripts/results_tables.py``'s rows).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from results_tables import eig_row
from qedprobe.eval.plots import format_length
from qedprobe.model import QEDModel

QED_ARMS = ("full", "noproj", "full-lm1.0")
ARM_ORDER = ("gdn2",) + QED_ARMS


def run_order(name: str) -> tuple[int, int]:
    """Sort ``interference-<arm>-s<seed>`` by seed, then gdn2, full, noproj, full-lm1.0."""
    arm, seed = name.removeprefix("interference-").rsplit("-s", 1)
    return int(seed), ARM_ORDER.index(arm)


def summary(cell: Path) -> dict[tuple[int, float], dict]:
    """The sweep's own summary of one cell (``summary.json`` of ``qedprobe sweep``): its row per
    ``(length, s)``, with ``correct``, ``n`` and the paired ``b``, ``c`` against s = 1; empty for a
    sweep that has not finished (no summary yet), whose cells the tables show as ``pending``."""
    path = cell / "summary.json"
    if not path.is_file():
        return {}
    return {(r["length"], r["s"]): r for r in json.loads(path.read_text())["rows"]}


def percent(row: dict) -> str:
    return f"{100 * row['correct'] / row['n']:.0f}"


def accuracy_tables(ev: Path, names: list[str], cells: list[str]) -> None:
    for cell in cells:
        acc = {n: {length: row for (length, s), row in summary(ev / n / cell).items() if s == 1.0} for n in names}
        lengths = sorted({length for a in acc.values() for length in a})
        print(f"\n**{cell}**, accuracy % at s = 1 (100 prompts per cell)\n")
        print("| checkpoint | " + " | ".join(format_length(x) for x in lengths) + " |")
        print("|---|" + "---|" * len(lengths))
        for n in names:
            cells_ = [percent(acc[n][x]) if x in acc[n] else "pending" for x in lengths]
            print(f"| {n} | " + " | ".join(cells_) + " |")


def paired_tests(report: Path) -> dict:
    """The paired tests of one ``qedprobe report`` folder by arm and length; empty where no report
    was made (a seed whose GDN-2 sweep has not finished), whose cells show as ``pending``."""
    path = report / "report.json"
    return json.loads(path.read_text())["paired_tests"] if path.is_file() else {}


def mcnemar_tables(reports: Path, seeds: list[int], cells: list[str]) -> None:
    for cell in cells:
        tests = {s: paired_tests(reports / f"seed{s}-{cell}") for s in seeds}
        lengths = sorted({int(x) for t in tests.values() for arm in t.values() for x in arm})
        print(f"\n**{cell}**: QED arm against GDN-2 of the same seed, b/c (p)\n")
        print("| arm | seed | " + " | ".join(format_length(x) for x in lengths) + " |")
        print("|---|---|" + "---|" * len(lengths))
        for arm in QED_ARMS:
            for s in seeds:
                t = tests[s].get(arm, {})
                row = [f"{t[str(x)]['b']}/{t[str(x)]['c']} ({t[str(x)]['p']:.2g})" if str(x) in t else "pending"
                       for x in lengths]
                print(f"| {arm} | {s} | " + " | ".join(row) + " |")


def strength_table(ev: Path, names: list[str], cell: str) -> None:
    print(f"\n**{cell}**: accuracy % by strength s at 2K / 8K / 32K; discordant pairs against s = 1 "
          "over all five lengths (b: right at s only, c: right at s = 1 only)\n")
    strengths = (-1.0, 0.0, 0.5, 1.0, 1.5, 2.0)
    print("| checkpoint | " + " | ".join(f"s={s:g}" for s in strengths) + " | b/c at s=-1 | b/c at s=0 | b/c at s=2 |")
    print("|---|" + "---|" * (len(strengths) + 3))
    for n in names:
        rows = summary(ev / n / cell)
        if not rows:
            print(f"| {n} | " + " | ".join(["pending"] * (len(strengths) + 3)) + " |")
            continue
        shown = [" / ".join(percent(rows[(x, s)]) for x in (2048, 8192, 32768)) for s in strengths]
        disc = [f"{sum(r['b'] for (_, rs), r in rows.items() if rs == s)}/"
                f"{sum(r['c'] for (_, rs), r in rows.items() if rs == s)}" for s in (-1.0, 0.0, 2.0)]
        print(f"| {n} | " + " | ".join(shown) + " | " + " | ".join(disc) + " |")


def lambda_tables(checkpoints: Path, names: list[str]) -> None:
    models = {n: QEDModel.from_pretrained(checkpoints / n) for n in names}
    layers = len(next(iter(models.values())).blocks)
    print("\nLearned lambda per layer (heads 0, 1) and lambda_max\n")
    print("| checkpoint | lambda_max | " + " | ".join(f"layer {i}" for i in range(layers)) + " |")
    print("|---|---|" + "---|" * layers)
    for n, model in models.items():
        with torch.no_grad():
            lams = [block.attn.lam().float().flatten().tolist() for block in model.blocks]
        per_layer = " | ".join(", ".join(f"{x:+.4f}" for x in lam) for lam in lams)
        print(f"| {n} | {model.cfg.lambda_max:g} | {per_layer} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("eval", type=Path)
    ap.add_argument("reports", type=Path)
    ap.add_argument("--checkpoints", type=Path, default=Path("checkpoints"))
    ap.add_argument("--cells", default="mk4-prose,mk4-noise,mk8-prose,mk16-prose,mk4-prose-control,s1,s2,s3")
    a = ap.parse_args()
    names = sorted((p.name for p in a.eval.glob("interference-*-s[0-9]") if p.is_dir()), key=run_order)
    if not names:
        raise SystemExit(f"no interference-<arm>-s<seed> folders in {a.eval}")
    seeds = sorted({int(n[-1]) for n in names})
    cells = a.cells.split(",")
    accuracy_tables(a.eval, names, cells)
    mcnemar_tables(a.reports, seeds, [c for c in cells if (a.reports / f"seed{seeds[0]}-{c}").is_dir()])
    qed = [n for n in names if not n.startswith("interference-gdn2-")]
    strength_table(a.eval, qed, cells[0])
    lambda_tables(a.checkpoints, qed)
    print("\n| checkpoint | tokens x heads | min e | max e | e < 0 | abs(e) > 1 | max sigma(M) |")
    print("|---|---|---|---|---|---|---|")
    for n in qed:
        row = eig_row(a.eval / n)
        if row:
            print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
