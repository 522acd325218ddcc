"""pass@k (Chen et al. 2021's unbiased estimator) and task-clustered intervals.

The estimator is checked against brute force: the fraction of all k-subsets of a task's
samples that hold a passing one. The interval's coverage is measured by simulation on
tasks of spread difficulty (several samples per task): the task-clustered interval covers
the true pass@1 at about its nominal rate, the sample-level Wilson interval (what eval
logged before) far less often.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest

from megatron_tg.eval.heldout import rates
from megatron_tg.eval.passk import by_task, clustered_interval, pass_at_k, pass_at_k_table
from megatron_tg.judge.intervals import wilson_interval


@pytest.mark.parametrize("n,c", [(1, 0), (1, 1), (5, 0), (5, 2), (6, 5), (8, 3), (10, 10)])
def test_pass_at_k_equals_the_fraction_of_k_subsets_with_a_pass(n, c):
    samples = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(samples, k))
        brute = sum(any(s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)
    assert pass_at_k(n, c, 1) == pytest.approx(c / n)


def test_pass_at_k_refuses_bad_counts():
    with pytest.raises(ValueError, match=r"k=4 must be in \[1, n=3\]"):
        pass_at_k(3, 1, 4)
    with pytest.raises(ValueError, match=r"c=5 passing samples"):
        pass_at_k(3, 5, 1)


def test_pass_at_k_table_over_tasks_and_unequal_counts():
    counts = {"a": (4, 0), "b": (4, 1), "c": (3, 3)}  # c lost a sample (a rollout raised)
    table = pass_at_k_table(counts)
    assert sorted(table) == [1, 2, 3]  # up to the fewest samples of a task
    for k, (mean, lo, hi) in table.items():
        want = sum(pass_at_k(n, c, k) for n, c in counts.values()) / 3
        assert mean == pytest.approx(want) and lo <= mean <= hi
    assert table[1][0] < table[2][0] < table[3][0]  # pass@k grows with k
    with pytest.raises(ValueError, match=r"k=\[4\] outside \[1, 3\]"):
        pass_at_k_table(counts, ks=[4])


def test_one_sample_per_task_is_the_wilson_interval_over_tasks():
    values = [1.0] * 7 + [0.0] * 13
    p, lo, hi = clustered_interval(values, [1] * 20)
    assert p == 0.35 and (lo, hi) == pytest.approx(wilson_interval(7, 20))


def test_all_or_nothing_tasks_count_as_tasks_not_samples():
    # 10 tasks x 8 samples, each task all-pass or all-fail: 10 units of information, not 80.
    values = [1.0] * 4 + [0.0] * 6
    _, lo, hi = clustered_interval(values, [8] * 10)
    assert (lo, hi) == pytest.approx(wilson_interval(4, 10))
    naive = wilson_interval(32, 80)
    assert hi - lo > 2 * (naive[1] - naive[0])  # the sample-level interval is far too narrow
    # and all failing: the interval is over 10 tasks, not 80 samples
    assert clustered_interval([0.0] * 10, [8] * 10)[2] == pytest.approx(wilson_interval(0, 10)[1])


def test_clustered_interval_covers_and_the_sample_wilson_does_not():
    """40 tasks of Beta(0.3, 0.3) difficulty (mostly very easy or very hard), 8 samples each:
    coverage of the population pass@1 (0.5) over 400 simulated evaluations."""
    rng = random.Random(0)
    t, n, reps = 40, 8, 400
    hit_cluster = hit_naive = 0
    for _ in range(reps):
        ps = [rng.betavariate(0.3, 0.3) for _ in range(t)]
        cs = [sum(rng.random() < p for _ in range(n)) for p in ps]
        _, lo, hi = clustered_interval([c / n for c in cs], [n] * t)
        hit_cluster += lo <= 0.5 <= hi
        nlo, nhi = wilson_interval(sum(cs), t * n)
        hit_naive += nlo <= 0.5 <= nhi
    print(f"coverage at 95%: task-clustered {hit_cluster / reps:.3f}, "
          f"sample-level Wilson {hit_naive / reps:.3f}")
    assert 0.91 <= hit_cluster / reps <= 0.98
    assert hit_naive / reps < 0.75


def test_rates_report_pass_at_k_for_every_k_clustered_by_task():
    # 3 tasks x 4 samples: task t0 passes 4/4, t1 1/4, t2 0/4.
    ids, passed = [], []
    for tid, c in (("t0", 4), ("t1", 1), ("t2", 0)):
        for i in range(4):
            ids.append(tid)
            passed.append({"task": i < c, "style": tid == "t0"})
    m = rates(passed, ["task", "style"], ["task"], task_ids=ids)
    assert m["eval/n"] == 12
    assert [k for k in m if k.startswith("eval/pass@") and "_" not in k] == [
        f"eval/pass@{k}" for k in range(1, 5)]
    for k in range(1, 5):
        want = (1 + pass_at_k(4, 1, k) + 0) / 3
        assert m[f"eval/pass@{k}"] == pytest.approx(want)
        assert m[f"eval/pass@{k}_lo"] <= want <= m[f"eval/pass@{k}_hi"]
    assert m["eval/pass@4"] == pytest.approx(2 / 3)
    # the interval is the tasks' (3 units), wider than a Wilson over 12 samples
    naive = wilson_interval(5, 12)
    assert m["eval/pass@1_hi"] - m["eval/pass@1_lo"] > naive[1] - naive[0]
    assert m["eval/criteria/style"] == pytest.approx(1 / 3)
    assert math.isclose(by_task(ids, [p["task"] for p in passed])["t1"][1], 1)
