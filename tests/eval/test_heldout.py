"""Held-out evaluation: the rates and intervals, which steps are due, and held-out tasks that
are also training tasks being refused. The end-to-end run (``megatron-tg eval`` on an SFT
checkpoint) is in tests/sft/test_sft.py, which makes the checkpoint."""

from __future__ import annotations

import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_tg.config import ConfigError, TGConfig
from megatron_tg.eval.heldout import HeldOutEvaluation, disjoint_tasks, rates
from megatron_tg.judge.intervals import wilson_interval


@pytest.mark.parametrize("k,n,lo,hi", [  # textbook Wilson 95% intervals
    (0, 10, 0.0, 0.2775), (5, 10, 0.2366, 0.7634), (10, 10, 0.7225, 1.0), (1, 4, 0.0456, 0.6994)])
def test_wilson_matches_reference_values(k, n, lo, hi):
    got = wilson_interval(k, n, 0.95)
    assert got == pytest.approx((lo, hi), abs=1e-4)


def test_wilson_widens_with_confidence_and_narrows_with_n():
    a, b = wilson_interval(30, 100, 0.8), wilson_interval(30, 100, 0.99)
    assert b[0] < a[0] < 0.3 < a[1] < b[1]
    small, big = wilson_interval(3, 10), wilson_interval(300, 1000)
    assert big[1] - big[0] < small[1] - small[0]
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        wilson_interval(5, 4)


def test_rates_gate_pass_at_1_on_primary_criteria():
    passed = [{"task": True, "style": False}, {"task": True, "style": True},
              {"task": False, "style": True}, {"task": True}]  # a criterion not evaluated fails
    m = rates(passed, ["task", "style"], ["task"])
    assert m["eval/n"] == 4 and m["eval/pass@1"] == 0.75
    assert m["eval/criteria/style"] == 0.5 and m["eval/criteria/task"] == 0.75
    assert (m["eval/pass@1_lo"], m["eval/pass@1_hi"]) == wilson_interval(3, 4)
    assert rates(passed, ["task", "style"], [])["eval/pass@1"] == 0.25  # no primary: all criteria
    empty = rates([], ["task"], ["task"])
    assert math.isnan(empty["eval/pass@1"]) and empty["eval/pass@1_hi"] == 1.0


def test_due_steps_are_zero_every_and_last():
    cfg = TGConfig()
    cfg.steps, cfg.evaluation.every = 25, 10
    ev = HeldOutEvaluation.__new__(HeldOutEvaluation)
    ev.cfg = cfg
    assert [s for s in range(26) if ev.due(s)] == [0, 10, 20, 25]
    cfg.evaluation.every = 0
    assert [s for s in range(26) if ev.due(s)] == [0, 25]


def test_held_out_tasks_that_are_training_tasks_are_refused():
    t = lambda i: SimpleNamespace(id=i)  # noqa: E731
    assert [x.id for x in disjoint_tasks([t("a"), t("b")], [t("c")], "h.jsonl")] == ["a", "b"]
    with pytest.raises(ConfigError, match=r"evaluation.tasks \(h.jsonl\): .*1 task id\(s\) are also training .*\['b'\]"):
        disjoint_tasks([t("a"), t("b")], [t("b"), t("c")], "h.jsonl")


@pytest.mark.parametrize("override,msg", [
    ("evaluation.samples=0", "evaluation.samples: must be >= 1; got 0"),
    ("evaluation.every=-1", "evaluation.every: must be >= 0; got -1"),
    ("evaluation.confidence=1.0", "evaluation.confidence: must be < 1; got 1.0"),
    ("evaluation.num_tasks=-2", "evaluation.num_tasks: must be >= 0; got -2"),
    ("evaluation.bogus=1", "unknown key 'evaluation.bogus'")])
def test_bad_evaluation_config_names_the_field(override, msg):
    from megatron_tg.config import load_config

    with pytest.raises(ConfigError, match=re.escape(msg)):
        load_config(str(Path(__file__).resolve().parents[2] / "recipes" / "tiny_cpu.yaml"), [override])


def test_held_out_rates_are_plotted_with_their_intervals(tmp_path):
    import json

    from megatron_tg.plot.command import bands, curves, plot_runs

    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "criteria/primary": 0.5} for s in range(1, 5)]
    for s, k in ((0, 1), (4, 3)):  # held-out rows at step 0 and the last step
        rows.append({"step": s, **rates([{"task": i < k} for i in range(4)], ["task"], ["task"])})
    rows.sort(key=lambda r: r["step"])
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = curves([run], labels=["tg"])
    assert data["held-out pass@1"]["tg"] == ([0, 4], [0.25, 0.75])
    assert list(data["held-out criterion rates"]) == ["tg"]  # the _lo/_hi keys are no lines
    xs, lo, hi = bands([run], labels=["tg"])["tg"]
    assert xs == [0, 4] and (lo[1], hi[1]) == wilson_interval(3, 4)
    assert plot_runs([run], tmp_path / "c.png").stat().st_size > 0
    assert len(curves([run])) == 6
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "metrics.jsonl").write_text(json.dumps({"step": 1, "criteria/primary": 0.5}) + "\n")
    assert len(curves([plain])) == 4  # no held-out rows: the four training panels only


def test_a_restart_from_scratch_logs_the_step_0_evaluation_once(tmp_path):
    from megatron_tg.config.train import LoggingConfig
    from megatron_tg.train.metrics import MetricsLogger, read_metrics

    cfg = LoggingConfig(progress_bar=False)
    log = MetricsLogger(cfg, tmp_path, enabled=True, total_steps=3)
    for s in (0, 1, 2):
        log.log(s, {"eval/n": 4.0} if s == 0 else {"loss": 1.0})
    log.close()
    MetricsLogger(cfg, tmp_path, enabled=True, total_steps=3, start_step=1).close()  # resumed at 1
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]
    log = MetricsLogger(cfg, tmp_path, enabled=True, total_steps=3, start_step=0)  # no checkpoint
    log.log(0, {"eval/n": 4.0})
    log.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [0]
