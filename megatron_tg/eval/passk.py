"""pass@k with the unbiased estimator, and intervals clustered by task.

**Estimator** (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1):
of a task's ``n`` samples ``c`` pass; the probability that at least one of ``k`` samples drawn
without replacement from those ``n`` passes is ``1 - C(n - c, k) / C(n, k)``, an unbiased
estimate of the task's pass@k. Computed as ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)``
(the paper's numerically stable form: no large binomials). pass@k of a set of tasks is the
mean over tasks. Defined for ``k <= n``; with unequal sample counts (a rollout that raised
is excluded) every k up to the smallest count is reported.

**Intervals.** A task's samples are not independent draws: an easy task passes on most of
them, a hard one on none, so a binomial interval over all samples treats ``T x n`` correlated
samples as that many independent ones and is too narrow. The independent units are the
tasks. :func:`clustered_interval` is a Wilson score interval at the *effective* sample size
``n_eff = p (1 - p) / Var(p)``, where ``Var(p)`` is the variance of the mean of the tasks'
values (``sum_i (x_i - p)^2 / T^2``, the cluster-robust variance of a mean; Korn & Graubard
1998 use this design-effect Wilson interval for clustered proportions). With one sample per
task it is exactly the Wilson interval over the ``T`` tasks; when every task has the same
pass rate the samples are as good as independent and ``n_eff`` reaches the sample count
(never more); when the variance is 0 because every task is all-pass or all-fail, the tasks
are the units (``n_eff = T``). ``tests/eval/test_passk.py`` measures its coverage against the
sample-level Wilson interval on simulated tasks of spread difficulty.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from megatron_tg.judge.intervals import wilson_bounds


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task with ``c`` of ``n`` samples passing."""
    if not 0 <= c <= n:
        raise ValueError(f"pass@k: c={c} passing samples must be in [0, n={n}]")
    if not 1 <= k <= n:
        raise ValueError(f"pass@k: k={k} must be in [1, n={n}] (the task's sample count)")
    if n - c < k:
        return 1.0  # every k-subset holds a passing sample
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def clustered_interval(values: Sequence[float], samples: Sequence[int],
                       confidence: float = 0.95) -> tuple[float, float, float]:
    """(mean, lo, hi) of per-task values in [0, 1], each from ``samples[i]`` samples: the
    design-effect Wilson interval described in the module docstring."""
    t = len(values)
    if t == 0:
        return math.nan, 0.0, 1.0
    p = sum(values) / t
    var = sum((x - p) ** 2 for x in values) / (t * t)
    total = float(sum(samples))
    if all(n == 1 for n in samples):
        n_eff = t  # independent tasks: exactly the Wilson interval over them (no rounding)
    elif var > 0:
        n_eff = min(max(p * (1 - p) / var, 1.0), total)
    else:  # no spread: all-pass/all-fail tasks are T units; equal rates, all the samples
        n_eff = t if p in (0.0, 1.0) else total
    lo, hi = wilson_bounds(p, n_eff, confidence)
    return p, lo, hi


def by_task(task_ids: Sequence[str], passed: Sequence[bool]) -> dict[str, tuple[int, int]]:
    """task id -> (samples, passing samples)."""
    if len(task_ids) != len(passed):
        raise ValueError(f"{len(task_ids)} task ids for {len(passed)} verdicts")
    out: dict[str, list[int]] = {}
    for tid, ok in zip(task_ids, passed):
        rec = out.setdefault(tid, [0, 0])
        rec[0] += 1
        rec[1] += int(bool(ok))
    return {tid: (n, c) for tid, (n, c) in out.items()}


def pass_at_k_table(counts: Mapping[str, tuple[int, int]], confidence: float = 0.95,
                    ks: Sequence[int] | None = None) -> dict[int, tuple[float, float, float]]:
    """k -> (pass@k, lo, hi) over tasks, for every k in 1..min samples (or ``ks``)."""
    if not counts:
        return {}
    n_min = min(n for n, _ in counts.values())
    ks = list(ks) if ks is not None else list(range(1, n_min + 1))
    bad = [k for k in ks if not 1 <= k <= n_min]
    if bad:
        raise ValueError(f"pass@k: k={bad} outside [1, {n_min}] (the fewest samples of a task)")
    samples = [n for n, _ in counts.values()]
    return {k: clustered_interval([pass_at_k(n, c, k) for n, c in counts.values()], samples,
                                  confidence) for k in ks}
