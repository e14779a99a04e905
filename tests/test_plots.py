"""What the figures draw: coinciding series kept apart, tick labels that never touch, single-length
axes, empty histogram bins as gaps, integer head ticks and titles that name model, arm, input and s."""
import math

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from qedprobe.eval.eig import BINS, EigAccumulator
from qedprobe.eval.plots import (LOG_SPREAD, accuracy_errorbar, figure, linear_spread, save_accuracy_figure,
                                 series_style, spaced_labels)
from qedprobe.eval.plots import plot_title

ROW = {"accuracy": 0.0, "ci_low": 0.0, "ci_high": 0.04}


def test_series_get_distinct_markers_and_centred_offsets():
    styles = [series_style(j, 6, LOG_SPREAD) for j in range(6)]
    assert len({s["marker"] for s in styles}) == 6
    offsets = [s["offset"] for s in styles]
    assert offsets == sorted(offsets) and math.isclose(sum(offsets), 0, abs_tol=1e-12)
    assert math.isclose(offsets[-1] - offsets[0], LOG_SPREAD)
    assert series_style(0, 1, LOG_SPREAD)["offset"] == 0
    assert math.isclose(linear_spread([-1, 0, 0.5, 1, 2]), 0.4 * 0.5)


def test_coinciding_series_are_drawn_apart(tmp_path):
    fig = figure()
    ax = fig.subplots()
    for j in range(3):
        accuracy_errorbar(ax, [(1024, ROW), (2048, ROW)], log_x=True, **series_style(j, 3, LOG_SPREAD), label=str(j))
    save_accuracy_figure(fig, ax, tmp_path / "a.png", xlabel="L", lengths=[1024, 2048])
    xs = [tuple(c.lines[0].get_xdata()) for c in ax.containers]  # each errorbar's data line
    assert len(set(xs)) == 3                                       # every series at its own x
    assert [x[0] for x in sorted(xs)] == pytest.approx([1024 * 2 ** d for d in (-0.2, 0, 0.2)])
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1K", "2K"]


def test_a_single_length_gets_one_tick_in_the_middle(tmp_path):
    fig = figure()
    ax = fig.subplots()
    accuracy_errorbar(ax, [(4096, ROW)], log_x=True, label="s = 1")
    save_accuracy_figure(fig, ax, tmp_path / "a.png", xlabel="L", lengths=[4096])
    lo, hi = ax.get_xlim()
    assert [t.get_text() for t in ax.get_xticklabels()] == ["4K"]
    assert math.isclose(math.log2(4096 / lo), math.log2(hi / 4096)) and hi / lo > 1.5


def test_crowded_tick_labels_are_thinned():
    assert spaced_labels([0, 0.01, 1, 1.5, 1.51], list("abcde"), 0.1) == ["a", "", "c", "d", ""]


def _eig(counts: dict) -> EigAccumulator:
    acc = EigAccumulator(2, 3, 8)
    for l in range(2):
        for name, (bin_, n) in counts.items():
            acc.binned[name, l].counts[:, bin_] = n
        acc.moments["e", l].min[:], acc.moments["e", l].max[:] = 0.2, 0.8
        acc.moments["sigma", l].max[:] = 1.01
    acc.meta = {"model": "/x/recall-full-s1", "arm": "full", "task": "s-niah-1", "length": 4096, "s": 1.5}
    return acc


def test_eig_figures_have_a_title_gaps_for_empty_bins_and_integer_head_ticks(tmp_path, monkeypatch):
    acc = _eig({"e": (400, 5), "rho": (100, 3), "log10_corr": (120, 2), "log10_sigma_m1": (50, 1)})
    assert acc.title() == "recall-full-s1 (arm full), s-niah-1, L = 4096, s = 1.5"
    lo, hi, n = BINS["e"]
    hist = acc.hist
    a, b = acc.hist_range("e", hist["e"])                      # occupied bins plus margin, and always 0 and 1
    assert a == pytest.approx(-0.05) and b == pytest.approx(1.05)
    a, b = acc.hist_range("rho", hist["rho"])
    width = 2 / BINS["rho"][2]
    assert a == pytest.approx(-1 + 97 * width) and b == pytest.approx(-1 + 102 * width)
    figures = []
    import matplotlib.figure
    real_savefig = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda self, *a, **k: (figures.append(self), real_savefig(self, *a, **k)))
    acc.plot(tmp_path)
    assert len(figures) == 5 and all(f.get_suptitle() == acc.title() for f in figures)
    y = figures[0].axes[0].get_lines()[0].get_ydata()
    assert np.isnan(y).sum() == n - 1 and np.nanmax(y) == 5  # one occupied bin, the rest are gaps
    heat = figures[-1].axes[0]
    assert [t for t in heat.get_xticks() if -0.5 <= t <= 2.5] == [0, 1, 2]


def test_sweep_titles_name_model_arm_task_and_where_s_acts():
    assert plot_title("/c/recall-full-s1", "full", "s-niah-1", 0, None, None, "all") == \
        "recall-full-s1 (arm full), s-niah-1, seed 0"
    assert plot_title(None, "gdn2", "mk-niah", 1, [0, 2], None, "decode") == \
        "model (arm gdn2), mk-niah, seed 1; s on layers [0, 2], decode only"
