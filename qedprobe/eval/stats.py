"""Exact statistics for accuracy comparisons (no scipy needed).

* :func:`wilson_interval`: Wilson score interval for a binomial proportion (the default interval
  of the sweep summaries; 95% uses ``z = 1.959963984540054``).
* :func:`clopper_pearson_interval`: exact (conservative) Clopper-Pearson interval, by bisection on
  the binomial tail, for readers who want it.
* :func:`mcnemar_exact`: exact two-sided McNemar test on the discordant counts
  ``p = min(1, 2 * P[X <= min(b, c)])``, ``X ~ Binomial(b + c, 1/2)``, computed with integers.
* :func:`paired_counts`: the 2 x 2 table of two paired boolean outcome lists.
"""
from __future__ import annotations

import math
from fractions import Fraction

__all__ = ["Z95", "wilson_interval", "clopper_pearson_interval", "binom_cdf", "mcnemar_exact",
           "paired_counts"]

Z95 = 1.959963984540054


def _z(confidence: float) -> float:
    if abs(confidence - 0.95) < 1e-12:
        return Z95
    # inverse normal CDF by bisection on erf (rarely used)
    target = 0.5 + confidence / 2
    lo, hi = 0.0, 10.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if 0.5 * (1 + math.erf(mid / math.sqrt(2))) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def wilson_interval(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of ``k`` successes in ``n`` trials; ``(nan, nan)`` when ``n == 0``."""
    if n < 0 or k < 0 or k > n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return (math.nan, math.nan)
    z = _z(confidence)
    p = k / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    lo = 0.0 if k == 0 else max(0.0, center - half)
    hi = 1.0 if k == n else min(1.0, center + half)
    return (lo, hi)


def _log_pmf(i: int, n: int, p: float) -> float:
    return (math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1)
            + i * math.log(p) + (n - i) * math.log1p(-p))


def binom_cdf(k: int, n: int, p: float) -> float:
    """``P[X <= k]`` for ``X ~ Binomial(n, p)`` (log-space sum; exact enough for intervals)."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    logs = [_log_pmf(i, n, p) for i in range(k + 1)]
    m = max(logs)
    return min(1.0, math.exp(m) * sum(math.exp(x - m) for x in logs))


def clopper_pearson_interval(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Exact Clopper-Pearson interval of ``k`` successes in ``n`` trials."""
    if n < 0 or k < 0 or k > n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return (math.nan, math.nan)
    alpha = 1 - confidence

    def bisect(f, increasing):  # root of f(p) = alpha / 2 on (0, 1)
        lo, hi = 0.0, 1.0
        for _ in range(100):
            mid = (lo + hi) / 2
            if (f(mid) < alpha / 2) == increasing:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2

    # lower: P[X >= k | p] = alpha/2 (increasing in p); upper: P[X <= k | p] = alpha/2 (decreasing)
    lower = 0.0 if k == 0 else bisect(lambda p: 1 - binom_cdf(k - 1, n, p), True)
    upper = 1.0 if k == n else bisect(lambda p: binom_cdf(k, n, p), False)
    return (lower, upper)


def mcnemar_exact(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value from the discordant counts ``b`` and ``c``.

    ``p = min(1, 2 * sum_{i <= min(b, c)} C(b + c, i) / 2^(b + c))``; 1.0 when ``b = c = 0``.
    Example: ``b = 1, c = 6`` gives ``2 * (1 + 7) / 128 = 0.125``.
    """
    b, c = int(b), int(c)
    if b < 0 or c < 0:
        raise ValueError("discordant counts must be >= 0")
    n = b + c
    if n == 0:
        return 1.0
    tail = Fraction(sum(math.comb(n, i) for i in range(min(b, c) + 1)), 2 ** n)
    return float(min(Fraction(1), 2 * tail))


def paired_counts(x, y) -> dict:
    """2 x 2 table of paired boolean outcomes: ``both``, ``x_only`` (= b: x right, y wrong),
    ``y_only`` (= c), ``neither``, ``n``."""
    x, y = list(x), list(y)
    if len(x) != len(y):
        raise ValueError("paired outcome lists differ in length")
    both = sum(1 for a, b in zip(x, y) if a and b)
    xo = sum(1 for a, b in zip(x, y) if a and not b)
    yo = sum(1 for a, b in zip(x, y) if b and not a)
    return {"both": both, "x_only": xo, "y_only": yo, "neither": len(x) - both - xo - yo, "n": len(x)}
