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
import textwrap
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
                      **kwargs) -> list[float]:
    """Plot ``[(x, summary_row)]`` as accuracy % with the row's Wilson 95% interval as error bars,
    each x moved by ``offset`` (in octaves with ``log_x``: ``x * 2 ** offset``); returns the
    moved x values."""
    x = [p[0] * 2 ** offset if log_x else p[0] + offset for p in points]
    y = [100 * p[1]["accuracy"] for p in points]
    err = [[100 * (p[1]["accuracy"] - p[1]["ci_low"]) for p in points],
           [100 * (p[1]["ci_high"] - p[1]["accuracy"]) for p in points]]
    ax.errorbar(x, y, yerr=err, marker=marker, ms=4, capsize=3, **kwargs)
    return x


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


def label_accuracy_axis(ax, *, xlabel: str, title=None, lengths=None, strengths=None, legend: bool = True) -> None:
    """Label an accuracy axis: a log2 length axis with ``lengths``, a strength axis with a tick
    per value with ``strengths``; with ``legend``, the legend beside the axes (it hides no point)."""
    if lengths is not None:
        _length_axis(ax, sorted(lengths))
    if strengths is not None:
        _strength_axis(ax, sorted(strengths))
    ax.set_xlabel(xlabel)
    ax.set_ylabel("accuracy (%), Wilson 95% CI")
    ax.set_ylim(-3, 103)
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)
    if title:  # lines of at most 80 characters: a sweep's title names the model and the task's settings
        ax.set_title("\n".join(textwrap.fill(line, 80, break_on_hyphens=False) for line in title.split("\n")),
                     fontsize=9)


def save_accuracy_figure(fig, ax, path: Path, *, xlabel: str, title=None, lengths=None,
                         strengths=None, note: str | None = None) -> Path:
    """:func:`label_accuracy_axis`, ``note`` (a line under the axes: the paired tests) and save."""
    label_accuracy_axis(ax, xlabel=xlabel, title=title, lengths=lengths, strengths=strengths)
    return save_figure(fig, path, note)


def save_figure(fig, path: Path, note: str | None = None, right: float = 1.0) -> Path:
    """Lay out ``fig`` (``note`` as a small line at the bottom; the axes left of ``right``, a
    fraction of the width, e.g. for a figure legend) and save it to ``path``."""
    bottom = 0.0
    if note:
        fig.text(0.01, 0.01, note, fontsize=7, ha="left", va="bottom", wrap=True)
        bottom = 0.35 * (1 + note.count("\n")) / fig.get_figheight()
    fig.tight_layout(rect=(0, bottom, right, 1))
    fig.savefig(path, dpi=120)
    return Path(path)


def series_color(j: int, reference: bool = False):
    """Series ``j``'s colour: matplotlib's ``tab10`` (saturated, distinct, none pale), black for
    the reference strength's series."""
    from matplotlib import colormaps
    return "black" if reference else colormaps["tab10"](j % 10)


SIGNIFICANT = 0.05
"""McNemar p below which a figure lists a cell as differing from the reference strength."""


def paired_note(summary: list[dict], named: bool = False) -> str | None:
    """The paired tests of ``summary`` in one line for a figure: which cells differ from the
    reference strength at ``p < 0.05`` (exact McNemar on the same prompts), or that none does;
    None when no test ran."""
    tested = [r for r in summary if r.get("mcnemar_p") is not None and r["s"] != r.get("ref_s")]
    if not tested:
        return None
    ref = tested[0]["ref_s"]
    hits = sorted((r for r in tested if r["mcnemar_p"] < SIGNIFICANT), key=lambda r: r["mcnemar_p"])
    head = f"McNemar vs the reference s = {ref:g} (same prompts), {len(tested)} cells tested; "
    head = head if not any(r["mcnemar_p"] < SIGNIFICANT for r in tested) else "* " + head
    if not hits:
        return head + f"none differs at p < {SIGNIFICANT:g}"
    where = [f"{r['task'] + ' ' if named else ''}s = {r['s']:g}"
             + ("" if r["length"] is None else f" at {format_length(r['length'])}")
             + f" (b {r['b']}, c {r['c']}, p = {r['mcnemar_p']:.2g})" for r in hits[:3]]
    more = f" and {len(hits) - 3} more" if len(hits) > 3 else ""
    return head + f"p < {SIGNIFICANT:g} for " + "; ".join(where) + more


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
    """``acc_vs_strength.png`` (one line per length) and, with two lengths or more,
    ``acc_vs_length.png`` (one line per s, over the cells that have a length; with one length it
    would show only the strengths side by side); with several tasks in the summary (an lm-eval
    folder, ``qedprobe.lmeval.run``) one line per task and s / task and length, named by the task.
    The series differ in colour and marker and are offset a little along x (see ``plots``); the
    reference strength is black (its series) or a dotted line (the strength axis), and a line
    under the axes gives the paired tests against it (:func:`paired_note`)."""
    out = Path(out)
    cell = {(r.get("task", ""), r["length"], r["s"]): r for r in summary}
    named = len({task for task, _, _ in cell}) > 1
    lengths = sorted({L for _, L, _ in cell if L is not None})
    strengths = sorted({s for _, _, s in cell})
    ref = next((r["ref_s"] for r in summary if r.get("ref_s") is not None), None)
    note = paired_note(summary, named)
    paths = []
    if len(lengths) > 1:
        series = sorted({(t, s) for t, L, s in cell if L is not None})
        lines = [(_series_label(t if named else "", f"s = {s:g}" + (" (reference)" if s == ref else "")),
                  [(L, cell.get((t, L, s))) for L in lengths], s == ref) for t, s in series]
        paths.append(_accuracy_plot(out / "acc_vs_length.png", lines, by_length=True, xs=lengths, title=title,
                                    note=note))
    series = sorted({(t, L) for t, L, _ in cell}, key=cell_order)
    lines = [(_series_label(t if named else "", None if L is None else f"L = {format_length(L)}"),
              [(s, cell.get((t, L, s))) for s in strengths], False) for t, L in series]
    paths.append(_accuracy_plot(out / "acc_vs_strength.png", lines, by_length=False, xs=strengths, title=title,
                                note=note, ref=ref))
    return paths


def mark_significant(ax, xs, rows, color, p: float = SIGNIFICANT) -> None:
    """A ``*`` above each point whose McNemar test against the reference strength has ``p <``
    ``p`` (default :data:`SIGNIFICANT`, the level :func:`paired_note` lists)."""
    for x, r in zip(xs, rows):
        if r.get("mcnemar_p") is not None and r["s"] != r.get("ref_s") and r["mcnemar_p"] < p:
            ax.annotate("*", (x, 100 * r["ci_high"]), textcoords="offset points", xytext=(0, 2), ha="center",
                        fontsize=12, color=color)


def _series_label(task: str, value: str | None) -> str:
    return ", ".join(x for x in (task, value) if x) or "all"


def _accuracy_plot(path: Path, lines, *, by_length: bool, xs, title, note=None, ref=None) -> Path:
    """One accuracy figure: ``lines`` are ``(label, [(x, summary row or None)], is the reference)``,
    over lengths (a log2 axis) or strengths (``ref``: the reference strength, a dotted line)."""
    fig = figure(figsize=(7.2, 4.6))
    ax = fig.subplots()
    width = LOG_SPREAD if by_length else linear_spread(xs)
    if ref is not None and not by_length:
        ax.axvline(ref, color="grey", lw=1, ls=":", label=f"reference s = {ref:g}")
    for j, (label, points, is_ref) in enumerate(lines):
        pts = [(x, r) for x, r in points if r is not None and r["n"]]
        if pts:
            moved = accuracy_errorbar(ax, pts, log_x=by_length, **series_style(j, len(lines), width),
                                      color=series_color(j, is_ref), label=label, lw=2 if is_ref else 1)
            mark_significant(ax, moved, [r for _, r in pts], series_color(j, is_ref))
    return save_accuracy_figure(fig, ax, path, xlabel="context length (tokens)" if by_length else "strength s (lambda x s)",
                                title=title, lengths=xs if by_length else None, strengths=None if by_length else xs,
                                note=note)
