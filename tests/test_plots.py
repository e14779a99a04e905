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


# ------------------------------------------------------------------ what a researcher reads off them (issue 43)
def _saved_figures(monkeypatch) -> list:
    import matplotlib.figure
    figures, real = [], matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda self, *a, **k: (figures.append(self), real(self, *a, **k)))
    return figures


def test_eig_histograms_say_what_falls_outside_their_bins(tmp_path, monkeypatch):
    acc = _eig({"log10_corr": (120, 2)})
    acc.binned["log10_corr", 1].counts[1, 0] = 1201          # layer 1, head 1: 1,201 tokens below 1e-8 (or 0)
    acc.binned["log10_corr", 1].counts[1, -1] = 7            # and 7 above 1e4
    assert acc.outside_range("log10_corr", acc.hist["log10_corr"][1]) == [
        "h1: 1,201 of 1,210 below 1e-8 (or 0), not drawn", "h1: 7 of 1,210 above 1e4, not drawn"]
    assert acc.outside_range("log10_corr", acc.hist["log10_corr"][0]) == []
    figures = _saved_figures(monkeypatch)
    acc.plot(tmp_path)
    corr = next(f for f in figures if f.axes[0].get_xlabel() == "" and any(
        "below 1e-8" in t.get_text() for ax in f.axes for t in ax.texts))
    texts = [t.get_text() for t in corr.axes[1].texts]
    assert texts == ["h1: 1,201 of 1,210 below 1e-8 (or 0), not drawn\nh1: 7 of 1,210 above 1e4, not drawn"]
    assert len(corr.axes[0].texts) == 0


def _cell(L, s, correct, b=None, c=None, p=None, n=40):
    from qedprobe.eval.stats import wilson_interval
    lo, hi = wilson_interval(correct, n)
    return dict(task="niah_single_1", format="ruler", length=L, s=s, n=n, correct=correct, accuracy=correct / n,
                ci_low=lo, ci_high=hi, score_pct=100 * correct / n, ref_s=1.0, b=b, c=c, mcnemar_p=p)


def test_sweep_figures_mark_the_reference_and_the_paired_tests_in_saturated_colours(tmp_path, monkeypatch):
    from matplotlib.colors import to_rgb
    from qedprobe.eval.plots import plot_summary

    summary = [_cell(L, s, 20, *(((0, 0, 1.0),) if s != 1 else ((None, None, None),))[0])
               for L in (1024, 4096) for s in (-1, 0, 0.5, 1, 1.5, 2)]
    summary[-1] = _cell(4096, 2, 32, b=12, c=0, p=0.00049)
    figures = _saved_figures(monkeypatch)
    paths = plot_summary(summary, tmp_path, title="m (arm full), niah_single_1 (ruler), 40 prompts per cell, seed 0")
    assert [p.name for p in paths] == ["acc_vs_length.png", "acc_vs_strength.png"]
    by_length, by_strength = (f.axes[0] for f in figures)
    series = {t.get_text(): h for h, t in zip(by_length.get_legend().legend_handles, by_length.get_legend().get_texts())}
    assert to_rgb(series["s = 1 (reference)"].get_color()) == (0, 0, 0)
    for label, handle in series.items():                      # no pale series: relative luminance below 0.6
        r, g, b = to_rgb(handle.get_color())
        assert 0.2126 * r + 0.7152 * g + 0.0722 * b < 0.6, label
    assert any(line.get_xdata()[0] == 1.0 and line.get_linestyle() == ":" for line in by_strength.get_lines())
    stars = [t for t in by_strength.texts if t.get_text() == "*"]
    assert len(stars) == 1 and stars[0].xy[1] == pytest.approx(100 * summary[-1]["ci_high"])
    note = figures[1].texts[0].get_text()
    assert note.startswith("* McNemar vs the reference s = 1 (same prompts), 10 cells tested; p < 0.05 for s = 2 at 4K "
                           "(b 12, c 0, p = 0.00049)")


def test_one_length_draws_no_length_axis(tmp_path):
    from qedprobe.eval.plots import plot_summary

    summary = [_cell(1024, s, 20, *((0, 0, 1.0) if s != 1 else (None, None, None))) for s in (0, 1, 2)]
    assert [p.name for p in plot_summary(summary, tmp_path)] == ["acc_vs_strength.png"]
    assert not (tmp_path / "acc_vs_length.png").exists()


def test_sweep_titles_restate_the_task_settings():
    from qedprobe.tasks import make_task

    task = make_task("mk-niah", "bytes", format="legacy", num_needles=8, haystack="prose")
    assert plot_title("/c/interference-full-s0", "full", task, 0, None, None, "all", samples=10) == \
        "interference-full-s0 (arm full), mk-niah (legacy, 8 needles, prose haystack), 10 prompts per cell, seed 0"


def test_report_figure_shows_the_strength_dimension(tmp_path, monkeypatch):
    import json

    from qedprobe.eval.report import build_report

    folders = []
    for name, strengths in (("gdn2", [1.0]), ("qed", [0.0, 1.0, 2.0])):
        rows = [{"task": "s-niah-1", "length": L, "s": s, "sample_id": i, "correct": (i + int(s)) % 3 == 0,
                 "prompt_sha": f"{L}-{i}"} for L in (1024, 2048) for s in strengths for i in range(6)]
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"ref_strength": 1.0}))
        (tmp_path / name / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        folders.append(str(tmp_path / name))
    figures = _saved_figures(monkeypatch)
    build_report(folders, labels=["GDN-2", "QED"], out=tmp_path / "rep")
    (fig,) = figures
    by_length, by_strength = fig.axes
    assert by_strength.get_xlabel() == "strength s (lambda x s)" and "at L = 2K" in by_strength.get_title()
    qed_x = sorted(round(x) for x in by_strength.containers[1].lines[0].get_xdata())
    assert qed_x == [0, 1, 2] and len(by_strength.containers[0].lines[0].get_xdata()) == 1
