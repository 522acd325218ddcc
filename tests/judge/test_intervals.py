"""The one binomial-interval module against the three implementations it replaced.

Before :mod:`megatron_tg.judge.intervals` the project computed the Wilson interval three times:
``eval.heldout.wilson_interval`` and ``eval.passk.wilson`` (the same formula, bounds clipped to
[0, 1]) and ``judge.vetting.wilson_interval`` (``z / denom * sqrt(...)`` instead of
``z * sqrt(...) / denom``, and exactly 0 / 1 at k == 0 / k == n). The old ones are copied below
verbatim as the reference. They disagree with each other by one ulp at some points, so the new
one cannot equal both bit for bit; on a grid it equals the eval formula bit for bit everywhere
except the bound at k == 0 / k == n, which is vetting's exact 0 / 1, and stays within one ulp
of the other.
"""

from __future__ import annotations

import math
import statistics
from statistics import NormalDist

import pytest

from megatron_tg.judge.intervals import newcombe_interval, wilson_bounds, wilson_interval, z_value

CONFIDENCES = (0.5, 0.8, 0.9, 0.95, 0.99, 0.999)
ULP = math.ulp(1.0)  # every bound is in [0, 1], where one ulp is at most this


# ------------------------------------------------------------------ the replaced implementations
def old_heldout_wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    if n <= 0:
        return 0.0, 1.0
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in [0, n={n}], got {successes}")
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def old_passk_wilson(p: float, n: float, confidence: float) -> tuple[float, float]:
    if n <= 0:
        return 0.0, 1.0
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(max(p * (1 - p), 0.0) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def old_vetting_wilson_interval(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    if not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return 0.0, 1.0
    z = statistics.NormalDist().inv_cdf(0.5 + confidence / 2.0)
    p = k / n
    denom = 1.0 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (0.0 if k == 0 else center - half), (1.0 if k == n else center + half)


def old_newcombe_interval(k1, n1, k0, n0, confidence=0.95):
    if n1 == 0 or n0 == 0:
        return math.nan, -1.0, 1.0
    p1, p0 = k1 / n1, k0 / n0
    l1, u1 = old_vetting_wilson_interval(k1, n1, confidence)
    l0, u0 = old_vetting_wilson_interval(k0, n0, confidence)
    d = p1 - p0
    return d, d - math.sqrt((p1 - l1) ** 2 + (u0 - p0) ** 2), d + math.sqrt((u1 - p1) ** 2 + (p0 - l0) ** 2)


# ------------------------------------------------------------------ the grid
def test_wilson_interval_matches_the_replaced_ones_on_a_grid():
    differ_vetting = 0
    for c in CONFIDENCES:
        for n in range(1, 201):
            for k in range(n + 1):
                new = wilson_interval(k, n, c)
                ev, vt = old_heldout_wilson_interval(k, n, c), old_vetting_wilson_interval(k, n, c)
                assert old_passk_wilson(k / n, n, c) == ev  # the two eval copies agree exactly
                lo_exact, hi_exact = k == 0, k == n
                assert new[0] == (vt[0] if lo_exact else ev[0]), (c, n, k)
                assert new[1] == (vt[1] if hi_exact else ev[1]), (c, n, k)
                for old in (ev, vt):
                    assert abs(new[0] - old[0]) <= ULP and abs(new[1] - old[1]) <= ULP, (c, n, k)
                differ_vetting += new != vt
    assert differ_vetting > 0  # the grid does reach the points where the old two disagree


def test_wilson_bounds_matches_passk_at_effective_sizes():
    for c in CONFIDENCES:
        for n in (0.5, 1.0, 1.7, 3.25, 10.0, 12.5, 47.9, 160.0, 1e4):
            for i in range(0, 41):
                p = i / 40
                new, old = wilson_bounds(p, n, c), old_passk_wilson(p, n, c)
                assert new[0] == (0.0 if p == 0 else old[0]), (c, n, p)
                assert new[1] == (1.0 if p == 1 else old[1]), (c, n, p)
                assert abs(new[0] - old[0]) <= ULP and abs(new[1] - old[1]) <= ULP, (c, n, p)
    assert wilson_bounds(0.3, 0, 0.95) == old_passk_wilson(0.3, 0, 0.95) == (0.0, 1.0)
    assert wilson_bounds(0.3, -2, 0.95) == (0.0, 1.0)


def test_newcombe_matches_the_replaced_one_on_a_grid():
    worst = 0.0
    for c in (0.8, 0.95, 0.99):
        for n1 in range(0, 25):
            for n0 in range(0, 25, 3):
                for k1 in range(n1 + 1):
                    for k0 in range(n0 + 1):
                        new = newcombe_interval(k1, n1, k0, n0, c)
                        old = old_newcombe_interval(k1, n1, k0, n0, c)
                        if n1 == 0 or n0 == 0:
                            assert math.isnan(new[0]) and new[1:] == old[1:] == (-1.0, 1.0)
                            continue
                        assert new[0] == old[0]
                        worst = max(worst, abs(new[1] - old[1]), abs(new[2] - old[2]))
    # The Wilson bounds move by at most one ulp; through the square roots of the hybrid
    # interval that stays within an ulp or two of the difference.
    assert worst <= 2 * ULP


def test_errors_and_empty_samples():
    assert wilson_interval(0, 0) == old_vetting_wilson_interval(0, 0) == (0.0, 1.0)
    for k, n in ((5, 4), (-1, 3), (0, -1)):
        with pytest.raises(ValueError):
            wilson_interval(k, n)
        with pytest.raises(ValueError):
            old_vetting_wilson_interval(k, n)
    for bad in (0.0, 1.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="confidence"):
            z_value(bad)
    assert z_value(0.95) == pytest.approx(1.959964, abs=1e-6)
