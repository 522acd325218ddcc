"""Binomial confidence intervals: the Wilson score interval of a rate and Newcombe's hybrid
score interval of a difference of two rates.

One implementation for the project: feedback vetting (:mod:`megatron_tg.judge.vetting`)
compares two arms with :func:`newcombe_interval`, held-out evaluation
(:mod:`megatron_tg.eval.heldout`, :mod:`megatron_tg.eval.passk`) reports
:func:`wilson_interval` of counts and :func:`wilson_bounds` at an effective (possibly
fractional) sample size. It sits in ``judge`` because ``eval`` is above ``judge`` in the layer
order (docs/architecture.md), so both may import it.
"""

from __future__ import annotations

import math
import statistics


def z_value(confidence: float) -> float:
    """The two-sided standard normal quantile of ``confidence`` (1.96 at 0.95)."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    return statistics.NormalDist().inv_cdf(0.5 + confidence / 2.0)


def wilson_bounds(p: float, n: float, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a rate ``p`` observed on ``n`` (possibly effective, fractional)
    units; (0, 1) when ``n <= 0``.

    At ``p == 0`` the lower bound and at ``p == 1`` the upper bound are exactly 0 and 1 (their
    closed form; the general formula leaves up to one ulp of rounding there). Elsewhere the
    bounds are clipped to [0, 1] (a no-op for ``p`` in [0, 1], kept against rounding)."""
    if n <= 0:
        return 0.0, 1.0
    z = z_value(confidence)
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(max(p * (1 - p), 0.0) / n + z * z / (4 * n * n)) / denom
    lo = 0.0 if p <= 0 else max(0.0, centre - half)
    hi = 1.0 if p >= 1 else min(1.0, centre + half)
    return lo, hi


def wilson_interval(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion ``k / n``; (0, 1) when ``n == 0``."""
    if not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return 0.0, 1.0
    return wilson_bounds(k / n, n, confidence)


def newcombe_interval(k1: int, n1: int, k0: int, n0: int,
                      confidence: float = 0.95) -> tuple[float, float, float]:
    """(d, lo, hi) for d = k1/n1 − k0/n0: Newcombe's hybrid score interval (method 10)."""
    if n1 == 0 or n0 == 0:
        return math.nan, -1.0, 1.0
    p1, p0 = k1 / n1, k0 / n0
    l1, u1 = wilson_interval(k1, n1, confidence)
    l0, u0 = wilson_interval(k0, n0, confidence)
    d = p1 - p0
    lo = d - math.sqrt((p1 - l1) ** 2 + (u0 - p0) ** 2)
    hi = d + math.sqrt((u1 - p1) ** 2 + (p0 - l0) ** 2)
    return d, lo, hi
