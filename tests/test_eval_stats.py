"""Exact statistics of the sweep summaries against known values."""
import math

import pytest

from qedprobe.eval.stats import (binom_cdf, clopper_pearson_interval, mcnemar_exact, paired_counts,
                                 wilson_interval)
from qedprobe.eval.summary import summarize


@pytest.mark.parametrize("b,c,p", [
    (1, 6, 0.125),            # 2 * (1 + 7) / 2^7
    (6, 1, 0.125),            # symmetric
    (0, 5, 0.0625),           # 2 / 2^5
    (2, 8, 0.109375),         # 2 * (1 + 10 + 45) / 1024
    (0, 10, 0.001953125),     # 2 / 1024
    (3, 3, 1.0),
    (0, 0, 1.0),
    (5, 6, 1.0),              # tail > 1/2 is capped at 1
])
def test_mcnemar_exact_known_values(b, c, p):
    assert mcnemar_exact(b, c) == p


def test_mcnemar_large_counts_match_normal_tail():
    # b=200, c=300: the exact p is close to the continuity-corrected chi-square p (8.9e-6)
    p = mcnemar_exact(200, 300)
    assert 5e-6 < p < 1.5e-5


def test_wilson_known_values():
    lo, hi = wilson_interval(5, 10)
    assert lo == pytest.approx(0.2365930905, abs=1e-9) and hi == pytest.approx(0.7634069095, abs=1e-9)
    lo, hi = wilson_interval(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.2775327999, abs=1e-9)
    lo, hi = wilson_interval(10, 10)
    assert hi == 1.0 and lo == pytest.approx(0.7224672001, abs=1e-9)
    # 95 of 100: (0.8882, 0.9785)
    lo, hi = wilson_interval(95, 100)
    assert lo == pytest.approx(0.88825, abs=1e-4) and hi == pytest.approx(0.97846, abs=1e-4)
    assert all(math.isnan(x) for x in wilson_interval(0, 0))


def test_clopper_pearson_known_values():
    lo, hi = clopper_pearson_interval(5, 10)       # R: binom.test(5, 10)$conf.int
    assert lo == pytest.approx(0.1870860, abs=1e-6) and hi == pytest.approx(0.8129140, abs=1e-6)
    lo, hi = clopper_pearson_interval(0, 10)
    assert lo == 0.0 and hi == pytest.approx(1 - 0.025 ** 0.1, abs=1e-9)
    lo, hi = clopper_pearson_interval(10, 10)
    assert hi == 1.0 and lo == pytest.approx(0.025 ** 0.1, abs=1e-9)


def test_binom_cdf():
    assert binom_cdf(1, 7, 0.5) == pytest.approx(8 / 128)
    assert binom_cdf(7, 7, 0.5) == 1.0


def test_paired_counts_and_summary_mcnemar():
    ref = [True] * 6 + [False] * 4 + [True] * 10   # s = 1
    alt = [False] * 6 + [True] * 1 + [False] * 3 + [True] * 10   # s = 0: b = 1, c = 6
    assert paired_counts(alt, ref) == {"both": 10, "x_only": 1, "y_only": 6, "neither": 3, "n": 20}
    rows = [{"task": "t", "length": 64, "s": 1.0, "sample_id": i, "correct": v} for i, v in enumerate(ref)]
    rows += [{"task": "t", "length": 64, "s": 0.0, "sample_id": i, "correct": v} for i, v in enumerate(alt)]
    summ = {r["s"]: r for r in summarize(rows, ref_s=1.0)}
    assert summ[0.0]["b"] == 1 and summ[0.0]["c"] == 6 and summ[0.0]["mcnemar_p"] == 0.125
    assert summ[0.0]["n_paired"] == 20 and summ[0.0]["correct"] == 11
    assert summ[1.0]["b"] == 0 and summ[1.0]["c"] == 0 and summ[1.0]["mcnemar_p"] == 1.0
    lo, hi = wilson_interval(16, 20)
    assert (summ[1.0]["ci_low"], summ[1.0]["ci_high"]) == (lo, hi)


def test_summary_pairs_only_shared_samples():
    rows = [{"length": 8, "s": 1.0, "sample_id": i, "correct": True} for i in range(5)]
    rows += [{"length": 8, "s": 2.0, "sample_id": i, "correct": False} for i in range(3)]
    summ = {r["s"]: r for r in summarize(rows)}
    assert summ[2.0]["n_paired"] == 3 and summ[2.0]["c"] == 3 and summ[2.0]["b"] == 0
    assert summ[2.0]["mcnemar_p"] == 0.25
