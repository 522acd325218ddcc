"""Student-t intervals over seeds and the test kinds of ``docs/claims-2.md``.

A test's statistic is the mean over seeds of a per-seed value (a paired difference or a
value); its interval is the two-sided Student-t interval at the test's confidence with
df = seeds - 1. The t quantile is computed here, without scipy: the t CDF from the
regularized incomplete beta (a continued fraction) and bisection on it.

Kinds, with margin (or level) m:

* ``greater``: estimate >= m and the interval's lower end > 0;
* ``not_worse``: lower end >= -m;
* ``not_better``: upper end <= m;
* ``equivalent``: the interval inside [-m, m];
* ``at_least`` / ``at_most``: the estimate >= m / <= m, and the interval condition the test
  names (``cond``: ``"lo>0"`` or ``"hi<0"``), if any;
* ``reported``: estimated and printed, decides nothing.

A statistic that cannot be computed (a NaN per-seed value: a crashed run, a missing probe,
too few steps; no seeds; or one seed where the kind needs an interval) makes the test
**undecided** (``passed`` None), never failed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

KINDS = ("greater", "not_worse", "not_better", "equivalent", "at_least", "at_most", "reported")
CONDS = {None: "", "lo>0": "interval low > 0", "hi<0": "interval high < 0"}


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((qam + m2) * (a + m2)),
                    -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    ln = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(ln) * _betacf(a, b, x) / a
    return 1.0 - math.exp(ln) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: int) -> float:
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: int) -> float:
    """The p quantile of Student's t with df degrees of freedom (p in (0, 1)), by bisection."""
    if not 0.0 < p < 1.0 or df < 1:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df >= 1, got p={p}, df={df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


def t_interval(xs: Sequence[float], confidence: float) -> tuple[float, float, float]:
    """(mean, low, high): the two-sided Student-t interval over ``xs``; NaN where it cannot
    be computed (no values, a NaN value; the ends also with one value)."""
    n = len(xs)
    if n == 0 or any(x != x for x in xs):
        return math.nan, math.nan, math.nan
    mean = sum(xs) / n
    if n < 2:
        return mean, math.nan, math.nan
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = t_quantile(1.0 - (1.0 - confidence) / 2.0, n - 1) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def half_width(sd: float, n: int, confidence: float) -> float:
    """The half-width an n-seed t-interval would have with standard deviation ``sd``."""
    return t_quantile(1.0 - (1.0 - confidence) / 2.0, n - 1) * sd / math.sqrt(n)


@dataclass(frozen=True)
class Test2:
    """One pre-registered test: ``values`` are its per-seed values, the statistic their mean."""
    name: str
    what: str
    kind: str
    margin: float
    values: Sequence[float] = field(default_factory=tuple)
    confidence: float = 0.95
    cond: str | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown kind {self.kind!r}")
        if self.cond not in CONDS or (self.cond and self.kind not in ("at_least", "at_most")):
            raise ValueError(f"interval condition {self.cond!r} is for at_least / at_most only")

    def rule(self) -> str:
        m = self.margin
        text = {"greater": f">= {m:g} and interval low > 0", "not_worse": f"interval low >= {-m:g}",
                "not_better": f"interval high <= {m:g}", "equivalent": f"interval inside [{-m:g}, {m:g}]",
                "at_least": f">= {m:g}", "at_most": f"<= {m:g}", "reported": "reported, decides nothing"}[self.kind]
        return text + (f" and {CONDS[self.cond]}" if self.cond else "")

    def decide(self, est: float, lo: float, hi: float) -> bool | None:
        m, k = self.margin, self.kind
        needs_interval = k in ("greater", "not_worse", "not_better", "equivalent") or self.cond
        if est != est or (needs_interval and lo != lo):
            return None
        if k == "greater":
            return est >= m and lo > 0
        if k == "not_worse":
            return lo >= -m
        if k == "not_better":
            return hi <= m
        if k == "equivalent":
            return -m <= lo and hi <= m
        ok = est >= m if k == "at_least" else est <= m
        if self.cond == "lo>0":
            ok = ok and lo > 0
        elif self.cond == "hi<0":
            ok = ok and hi < 0
        return ok

    def evaluate(self) -> dict[str, Any]:
        xs = [float(x) for x in self.values]
        est, lo, hi = t_interval(xs, self.confidence)
        ok = None if self.kind == "reported" else self.decide(est, lo, hi)
        status = "reported" if self.kind == "reported" else "undecided" if ok is None else \
            "passes" if ok else "FAILS"
        return {"what": self.what, "rule": self.rule(), "estimate": est, "interval": [lo, hi],
                "confidence": self.confidence, "n": len(xs), "values": xs,
                "passed": ok if ok is None else bool(ok), "status": status}
