"""The figures of a results folder (:func:`plot_summary`) and the pieces that ``report`` and ``eig``
share with them (matplotlib).

Figures are plain ``matplotlib.figure.Figure`` objects saved to files: pyplot is never imported
and the global backend is left alone, so a notebook's inline figures keep working after a sweep.

Accuracy figures draw several series over the same x values (strengths at one length, arms at
one strength), which often coincide (every arm at 0 %): each series gets its own marker and a
small horizontal offset (:func:`series_style`), so no line hides another. Tick labels that would
touch are thinned (:func:`spaced_labels`).
"""
from __future__ import annotations

import math
from pathlib import Path

from .summary import cell_order

MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
LOG_SPREAD = 0.4
"""Octaves over which the series of a log2 length axis are spread around each length."""
LINEAR_SPREAD = 0.4
"""Fraction of the smallest gap between x values over which series of a linear axis are spread."""


def figure(**kwargs):
    """A ``matplotlib.figure.Figure`` outside pyplot's figure manager (no display, no backend
    switch); ``kwargs`` go to ``Figure`` (``figsize``, ...)."""
    from matplotlib.figure import Figure
    return Figure(**kwargs)


def format_length(L: int) -> str:
    """``2048 -> "2K"``, ``400 -> "400"``."""
    return f"{L // 1024}K" if L % 1024 == 0 else str(L)


def series_style(j: int, n: int, width: float) -> dict:
    """Marker and x offset of series ``j`` of ``n``: the offsets spread the series evenly over
    ``width`` (in x units, or octaves on a log axis), centred on the true x."""
    return {"marker": MARKERS[j % len(MARKERS)], "offset": (j - (n - 1) / 2) * width / max(n - 1, 1)}


def linear_spread(xs) -> float:
    """The offset width for series over the linear x values ``xs``."""
    xs = sorted(set(xs))
    gaps = [b - a for a, b in zip(xs, xs[1:])]
    return LINEAR_SPREAD * (min(gaps) if gaps else 1.0)


def accuracy_errorbar(ax, points, *, offset: float = 0.0, log_x: bool = False, marker: str = "o",
                      **kwargs) -> None:
    """Plot ``[(x, summary_row)]`` as accuracy % with the row's Wilson 95% interval as error bars,
    each x moved by ``offset`` (in octaves with ``log_x``: ``x * 2 ** offset``)."""
    x = [p[0] * 2 ** offset if log_x else p[0] + offset for p in points]
    y = [100 * p[1]["accuracy"] for p in points]
    err = [[100 * (p[1]["accuracy"] - p[1]["ci_low"]) for p in points],
           [100 * (p[1]["ci_high"] - p[1]["accuracy"]) for p in points]]
    ax.errorbar(x, y, yerr=err, marker=marker, ms=4, capsize=3, **kwargs)


def spaced_labels(positions, labels, min_gap: float) -> list[str]:
    """``labels`` with every one closer than ``min_gap`` (in position units) to the previous
    shown label blanked, so tick labels never overlap."""
    out, last = [], -math.inf
    for pos, label in zip(positions, labels):
        keep = pos - last >= min_gap
        out.append(label if keep else "")
        last = pos if keep else last
    return out


def _length_axis(ax, lengths) -> None:
    """A log2 axis with one tick per length (also for a single length, centred in two octaves)."""
    from matplotlib.ticker import NullLocator
    ax.set_xscale("log", base=2)
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticks(lengths)
    octaves = [math.log2(L) for L in lengths]
    span = max(octaves) - min(octaves)
    ax.set_xticklabels(spaced_labels(octaves, [format_length(L) for L in lengths], 0.06 * max(span, 2)))
    ax.set_xlim(min(lengths) / 2 ** max(0.35, 0.06 * span), max(lengths) * 2 ** max(0.35, 0.06 * span))


def _strength_axis(ax, strengths) -> None:
    ax.set_xticks(strengths)
    span = max(strengths) - min(strengths)
    ax.set_xticklabels(spaced_labels(strengths, [f"{s:g}" for s in strengths], 0.06 * max(span, 1)))
    if span == 0:
        ax.set_xlim(strengths[0] - 0.5, strengths[0] + 0.5)


def save_accuracy_figure(fig, ax, path: Path, *, xlabel: str, title=None, lengths=None,
                         strengths=None) -> Path:
    """Label an accuracy axis (a log2 length axis with ``lengths``, a strength axis with a tick
    per value with ``strengths``) and save."""
    if lengths is not None:
        _length_axis(ax, sorted(lengths))
    if strengths is not None:
        _strength_axis(ax, sorted(strengths))
    ax.set_xlabel(xlabel)
    ax.set_ylabel("accuracy (%), Wilson 95% CI")
    ax.set_ylim(-3, 103)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)  # beside the axes: hides no point
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return Path(path)


def task_label(task) -> str:
    """A task generator's name with the settings that define its prompts, ``"mk-niah (legacy, 8
    needles, prose haystack)"``; a plain name stays as it is."""
    if not hasattr(task, "describe"):
        return str(task)
    d = task.describe()
    parts = [d.get("format")]
    parts += [f"{d['num_needles']} needles"] if (d.get("num_needles") or 1) > 1 else []
    parts += [f"{d['haystack']} haystack"] if d.get("haystack") else []
    parts += ["foreign-key control"] if d.get("control") else []
    return f"{d['task']} ({', '.join(p for p in parts if p)})"


def plot_title(model_id, arm, task, seed, layers, heads, phase, samples=None) -> str:
    """``"recall-full-s1 (arm full), s-niah-1 (legacy, noise haystack), 10 prompts per cell, seed 0"``
    (``task``: a name or a task generator, :func:`task_label`), plus where the strength acts
    when not everywhere."""
    name = Path(model_id).name if model_id else "model"
    where = [f"{k} {v}" for k, v in (("layers", layers), ("heads", heads)) if v is not None]
    where += [f"{phase} only"] if phase != "all" else []
    n = f", {samples} prompts per cell" if samples else ""
    return f"{name} (arm {arm}), {task_label(task)}{n}, seed {seed}" + (f"; s on {', '.join(where)}" if where else "")


def plot_summary(summary: list[dict], out, title=None) -> list[Path]:
    """``acc_vs_length.png`` (one line per s, over the cells that have a length) and
    ``acc_vs_strength.png`` (one line per length); with several tasks in the summary (an lm-eval
    folder, ``qedprobe.lmeval.run``) one line per task and s / task and length, named by the task.
    The series differ in colour and marker and are offset a little along x (see ``plots``)."""
    out = Path(out)
    cell = {(r.get("task", ""), r["length"], r["s"]): r for r in summary}
    named = len({task for task, _, _ in cell}) > 1
    lengths = sorted({L for _, L, _ in cell if L is not None})
    strengths = sorted({s for _, _, s in cell})
    paths = []
    if lengths:
        series = sorted({(t, s) for t, L, s in cell if L is not None})
        lines = [(_series_label(t if named else "", f"s = {s:g}"), [(L, cell.get((t, L, s))) for L in lengths])
                 for t, s in series]
        paths.append(_accuracy_plot(out / "acc_vs_length.png", lines, by_length=True, xs=lengths, title=title))
    series = sorted({(t, L) for t, L, _ in cell}, key=cell_order)
    lines = [(_series_label(t if named else "", None if L is None else f"L = {format_length(L)}"),
              [(s, cell.get((t, L, s))) for s in strengths]) for t, L in series]
    paths.append(_accuracy_plot(out / "acc_vs_strength.png", lines, by_length=False, xs=strengths, title=title))
    return paths


def _series_label(task: str, value: str | None) -> str:
    return ", ".join(x for x in (task, value) if x) or "all"


def _accuracy_plot(path: Path, lines, *, by_length: bool, xs, title) -> Path:
    """One accuracy figure: ``lines`` are ``(label, [(x, summary row or None)])``, over lengths
    (a log2 axis) or strengths."""
    from matplotlib import colormaps
    fig = figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    cmap = colormaps["viridis"]
    width = LOG_SPREAD if by_length else linear_spread(xs)
    for j, (label, points) in enumerate(lines):
        pts = [(x, r) for x, r in points if r is not None and r["n"]]
        if pts:
            accuracy_errorbar(ax, pts, log_x=by_length, **series_style(j, len(lines), width),
                              color=cmap(0.9 * j / max(1, len(lines) - 1)), label=label)
    return save_accuracy_figure(fig, ax, path, xlabel="context length (tokens)" if by_length else "strength s (lambda x s)",
                                title=title, lengths=xs if by_length else None, strengths=None if by_length else xs)
