"""Shared pieces of the figures of ``sweep``, ``report`` and ``eig`` (matplotlib).

Figures are plain ``matplotlib.figure.Figure`` objects saved to files: pyplot is never imported
and the global backend is left alone, so a notebook's inline figures keep working after a sweep."""
from __future__ import annotations

from pathlib import Path


def figure(**kwargs):
    """A ``matplotlib.figure.Figure`` outside pyplot's figure manager (no display, no backend
    switch); ``kwargs`` go to ``Figure`` (``figsize``, ...)."""
    from matplotlib.figure import Figure
    return Figure(**kwargs)


def format_length(L: int) -> str:
    """``2048 -> "2K"``, ``400 -> "400"``."""
    return f"{L // 1024}K" if L % 1024 == 0 else str(L)


def accuracy_errorbar(ax, points, **kwargs) -> None:
    """Plot ``[(x, summary_row)]`` as accuracy % with the row's Wilson 95% interval as error bars."""
    x = [p[0] for p in points]
    y = [100 * p[1]["accuracy"] for p in points]
    err = [[100 * (p[1]["accuracy"] - p[1]["ci_low"]) for p in points],
           [100 * (p[1]["ci_high"] - p[1]["accuracy"]) for p in points]]
    ax.errorbar(x, y, yerr=err, marker="o", ms=4, capsize=3, **kwargs)


def save_accuracy_figure(fig, ax, path: Path, *, xlabel: str, title=None, lengths=None) -> Path:
    """Label an accuracy axis (a log2 length axis when ``lengths`` are given) and save."""
    if lengths is not None and len(lengths) > 1:
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths)
        ax.set_xticklabels([format_length(L) for L in lengths])
    ax.set_xlabel(xlabel)
    ax.set_ylabel("accuracy (%), Wilson 95% CI")
    ax.set_ylim(-3, 103)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return Path(path)
