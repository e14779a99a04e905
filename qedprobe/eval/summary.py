"""Rows -> per-cell statistics: accuracy with its Wilson 95% interval, RULER's score and the
paired exact McNemar test of every strength against a reference one.

A cell is ``(task, length, s)`` (``length`` None for a task without lengths); its rows are those
of :mod:`qedprobe.eval.store` (any runner's).
``summary.csv`` / ``summary.json`` (:func:`write_summary`; rewritten at the end of every completed
run, from all shards, by rank 0: :func:`summarize_folder`) hold per cell: accuracy (every answer
found) and Wilson 95% interval, RULER's score ``score_pct`` (``string_match_all``: the mean share
of answers found, in percent), the task ``format``, and the exact McNemar test of each s against
the reference strength (default 1) on the samples both have: ``b`` = right at s and wrong at the
reference, ``c`` = the reverse, two-sided ``p``.
"""
from __future__ import annotations

import csv
import json
import math
from collections import defaultdict
from pathlib import Path

from qedprobe import dist

from .stats import mcnemar_exact, wilson_interval
from .store import load_results, shard_paths, strength_key

__all__ = ["SUMMARY_FIELDS", "summarize", "summarize_folder", "write_summary", "length_key", "cell_order"]

SUMMARY_FIELDS = ["task", "format", "length", "s", "n", "correct", "accuracy", "ci_low", "ci_high",
                  "score_pct", "ref_s", "n_paired", "b", "c", "mcnemar_p"]
"""``b``: right at s, wrong at ref_s; ``c``: wrong at s, right at ref_s (paired on sample ids)."""


def summarize(rows, ref_s=1.0) -> list[dict]:
    """Accuracy, Wilson 95% interval, RULER's score in percent (``score_pct``: the mean of the rows'
    ``score``) and the exact McNemar test against ``ref_s`` per ``(task, length, s)``, in that
    order; ``ref_s=None`` leaves the tests out. Rows written before
    task formats existed have no ``score`` or ``format``: their ``correct`` is their score and
    their format is ``legacy``."""
    by = defaultdict(dict)  # (task, length, s) -> {sample_id: correct}
    share = defaultdict(dict)  # (task, length, s) -> {sample_id: share of the answers found}
    fmt = {}
    for r in rows:
        cell = (r.get("task", ""), length_key(r["length"]), strength_key(r["s"]))
        by[cell][int(r["sample_id"])] = bool(r["correct"])
        share[cell][int(r["sample_id"])] = float(r.get("score", r["correct"]))
        fmt[cell[:2]] = r.get("format", "legacy")
    ref = None if ref_s is None else strength_key(ref_s)
    return [_cell_row(cell, by, share[cell], fmt[cell[:2]], ref) for cell in sorted(by, key=cell_order)]


def length_key(length) -> int | None:
    """A row's ``length`` as cells key it: an int, or None for a task without lengths (an lm-eval
    task such as fda: ``qedprobe.lmeval.run``)."""
    return None if length is None else int(length)


def cell_order(cell) -> tuple:
    """Sort key of ``(task, length, ...)`` cells: by task, then length (a task's None first)."""
    task, length, *rest = cell
    return (task, length is not None, length or 0, *rest)


def _cell_row(cell, by, share, fmt, ref) -> dict:
    """The summary row of ``cell = (task, length, s)``: ``by`` maps every cell to ``{sample_id:
    correct}``, ``share`` the cell's samples to their share of answers found."""
    task, length, s = cell
    res = by[cell]
    n, k = len(res), sum(res.values())
    lo, hi = wilson_interval(k, n)
    row = {"task": task, "format": fmt, "length": length, "s": s, "n": n, "correct": k,
           "accuracy": k / n if n else math.nan, "ci_low": lo, "ci_high": hi,
           "score_pct": round(100 * sum(share.values()) / n, 2) if n else math.nan,
           "ref_s": ref, "n_paired": None, "b": None, "c": None, "mcnemar_p": None}
    base = by.get((task, length, ref)) if ref is not None else None
    if base is not None:
        shared = sorted(set(res) & set(base))
        b = sum(1 for i in shared if res[i] and not base[i])
        c = sum(1 for i in shared if base[i] and not res[i])
        row.update(n_paired=len(shared), b=b, c=c, mcnemar_p=mcnemar_exact(b, c))
    return row


def write_summary(summary: list[dict], out) -> list[Path]:
    """``summary.csv`` and ``summary.json`` in ``out``."""
    out = Path(out)
    paths = [out / "summary.csv", out / "summary.json"]
    with open(paths[0], "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=SUMMARY_FIELDS)
        w.writeheader()
        for row in summary:
            w.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in SUMMARY_FIELDS})
    paths[1].write_text(json.dumps({"interval": "wilson95", "test": "mcnemar_exact_two_sided",
                                    "b": "right at s, wrong at ref_s", "c": "wrong at s, right at ref_s",
                                    "rows": summary}, indent=2) + "\n")
    return paths


def summarize_folder(folder, ref_s=1.0) -> list[dict]:
    """The summary of every shard in ``folder``, once all ranks are done (a barrier); rank 0
    writes ``summary.csv`` / ``summary.json``."""
    dist.barrier()
    summary = summarize(load_results(folder) if shard_paths(folder) else [], ref_s)
    if dist.is_main():
        write_summary(summary, folder)
    return summary
