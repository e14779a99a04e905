"""Strength sweeps against the targets of a model whose correction carries weight.

    python scripts/strength_targets.py EVAL_DIR [--training-length 2048] [--points 20] [--p 1e-3]
        [--cell mk4-all] [--figure PATH]

EVAL_DIR holds ``<model>/<cell>/summary.json`` (``qedprobe sweep`` folders, as
``scripts/strong_lambda.sh eval`` writes them). For every sweep with more than one strength it
prints, per length, the accuracy at s = 1 and the strength whose accuracy lies furthest from it
(points, with the sweep's exact McNemar p against s = 1 and the discordant counts b / c), then
per model: whether s = 1 reaches 90 % at the training length on the 4-needle cell with the
strength in prefill and decode (``mk4-all``), and whether some cell has an s at least
``--points`` from s = 1 with p below ``--p``. With ``--figure``, one panel per model: accuracy
against s at every length of its ``--cell`` sweep (Wilson 95 % intervals; a ``*`` where the exact
McNemar p against s = 1 is below ``--p``).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from qedprobe.eval.plots import (accuracy_errorbar, figure, format_length, label_accuracy_axis, linear_spread,
                                 mark_significant, save_figure, series_color, series_style)


def furthest(rows: list[dict]) -> tuple[dict, dict]:
    """The s = 1 row of one length and the row of the strength furthest from it in accuracy."""
    ref = next(r for r in rows if r["s"] == 1.0)
    other = max((r for r in rows if r["s"] != 1.0), key=lambda r: abs(r["accuracy"] - ref["accuracy"]))
    return ref, other


def sweep_lines(model: str, cell: str, summary: dict) -> list[str]:
    """Table lines of one sweep, one per length: s = 1 and the strength furthest from it."""
    lines = []
    for length in sorted({r["length"] for r in summary["rows"]}):
        ref, other = furthest([r for r in summary["rows"] if r["length"] == length])
        points = 100 * (other["accuracy"] - ref["accuracy"])
        lines.append(f"| {model} | {cell} | {length} | {100 * ref['accuracy']:.0f} | {other['s']:g} | "
                     f"{points:+.0f} | {other['b']} / {other['c']} | {other['mcnemar_p']:.2g} |")
    return lines


def strength_figure(summaries: dict[str, dict], path: Path, *, cell: str, p: float) -> Path:
    """One panel per model (``summaries``: model name -> its ``cell`` sweep's summary): accuracy
    against s, a series per length, a ``*`` over each point whose McNemar p against s = 1 is below
    ``p``."""
    names = sorted(summaries)
    cols = min(3, len(names))
    rows = -(-len(names) // cols)
    fig = figure(figsize=(4.2 * cols + 1.2, 3.4 * rows))
    for k, name in enumerate(names):
        ax = fig.add_subplot(rows, cols, k + 1)
        summary = summaries[name]["rows"]
        lengths = sorted({r["length"] for r in summary})
        strengths = sorted({r["s"] for r in summary})
        for j, length in enumerate(lengths):
            style = series_style(j, len(lengths), linear_spread(strengths))
            points = sorted((r["s"], r) for r in summary if r["length"] == length)
            x = accuracy_errorbar(ax, points, offset=style["offset"], marker=style["marker"],
                                  color=series_color(j), label=format_length(length))
            mark_significant(ax, x, [r for _, r in points], series_color(j), p=p)
        ax.axvline(1.0, color="grey", linestyle=":", linewidth=1)
        label_accuracy_axis(ax, xlabel="strength s (lambda x s)", title=name, strengths=strengths,
                            legend=k == len(names) - 1)
    note = f"{cell}: every length's sweep on the same prompts; *: exact McNemar p < {p:g} against s = 1 (dotted line)."
    return save_figure(fig, path, note, right=1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("eval_dir", type=Path)
    parser.add_argument("--training-length", type=int, default=2048)
    parser.add_argument("--points", type=float, default=20.0)
    parser.add_argument("--p", type=float, default=1e-3)
    parser.add_argument("--cell", default="mk4-all", help="the sweep folder drawn by --figure")
    parser.add_argument("--figure", type=Path, help="write the strength figure of every model's --cell sweep here")
    args = parser.parse_args()
    table = ["| model | cell | length | s = 1 % | furthest s | points | b / c | McNemar p |",
             "|---|---|---|---|---|---|---|---|"]
    verdicts, drawn = [], {}
    for model_dir in sorted(p for p in args.eval_dir.iterdir() if p.is_dir()):
        met_effect, base = False, None
        for summary_file in sorted(model_dir.glob("*/summary.json")):
            summary = json.loads(summary_file.read_text())
            if summary_file.parent.name == args.cell:
                drawn[model_dir.name] = summary
            if len({r["s"] for r in summary["rows"]}) < 2:
                continue
            table += sweep_lines(model_dir.name, summary_file.parent.name, summary)
            for r in summary["rows"]:
                if r["s"] != 1.0 and r["mcnemar_p"] is not None and r["mcnemar_p"] < args.p:
                    ref = next(x for x in summary["rows"] if x["s"] == 1.0 and x["length"] == r["length"])
                    met_effect |= 100 * abs(r["accuracy"] - ref["accuracy"]) >= args.points
            if summary_file.parent.name == "mk4-all":
                base = next((r["accuracy"] for r in summary["rows"]
                             if r["s"] == 1.0 and r["length"] == args.training_length), None)
        if base is not None:
            verdicts.append(f"* {model_dir.name}: s = 1 at {args.training_length} (mk4-all) {100 * base:.0f} % "
                            f"({'>=' if base >= 0.9 else '<'} 90 %); some s >= {args.points:g} points from s = 1 "
                            f"with p < {args.p:g}: {'yes' if met_effect else 'no'}")
    print("\n".join(table + [""] + verdicts))
    if args.figure:
        if not drawn:
            raise SystemExit(f"--figure: no model folder of {args.eval_dir} has a {args.cell}/summary.json")
        print(f"figure: {strength_figure(drawn, args.figure, cell=args.cell, p=args.p)}")


if __name__ == "__main__":
    main()
