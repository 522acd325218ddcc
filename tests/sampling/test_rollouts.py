"""Judged groups -> training samples: rewards, group-relative advantages, framed feedback,
judge errors excluded (never a pass or a fail), modes' feedback choice."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_tg.chat import get_tiny_tokenizer
from megatron_tg.chat.builder import simulate_rollout
from megatron_tg.config import load_config
from megatron_tg.judge import Judge, load_rubric
from megatron_tg.sampling.rollouts import judged_samples
from tests.chat.convos import SEARCH_TOOL, call


def _rollout(tok, gid, rid, lines: bool, passed: bool):
    args = {"query": "def count", **({"lines": 5} if lines else {})}
    msgs = [{"role": "system", "content": "agent"}, {"role": "user", "content": "fix it"},
            {"role": "assistant", "content": "look", "tool_calls": [call("search", **args)]},
            {"role": "tool", "content": "src/a.py:1: def count"},
            {"role": "assistant", "content": "done"}]
    return simulate_rollout(tok, msgs, tools=[SEARCH_TOOL], group_id=gid, rollout_id=rid,
                            metadata={"tests_passed": passed})


@pytest.fixture(scope="module")
def judged():
    tok = get_tiny_tokenizer()
    rubric = load_rubric("recipes/rubrics/tool_format.yaml")
    judge = Judge(rubric, tok)
    g0 = [_rollout(tok, "g0", "a", lines=False, passed=True),
          _rollout(tok, "g0", "b", lines=True, passed=True)]
    g1 = [_rollout(tok, "g1", "c", lines=False, passed=False),
          _rollout(tok, "g1", "d", lines=False, passed=True)]
    groups = [SimpleNamespace(group_id="g0", rollouts=g0), SimpleNamespace(group_id="g1", rollouts=g1)]
    results = [[judge.judge_sync(r) for r in g.rollouts] for g in groups]
    return rubric, groups, results


def test_rewards_advantages_and_framed_feedback(judged):
    rubric, groups, results = judged
    cfg = load_config("recipes/tiny_cpu.yaml", ["judge.feedback_framing='Hint: {feedback}'"])
    samples, lost, metrics = judged_samples(groups, results, rubric, cfg)
    assert lost == [] and len(samples) == 4
    # tests_pass (weight 1) + search_lines (weight 0.5): rewards 1, 1.5 | 0, 1
    assert metrics["criteria/tests_pass"] == 0.75 and metrics["criteria/search_lines"] == 0.25
    a, b, c, d = (s.advantage for s in samples)
    assert b > a and d > c and a + b == pytest.approx(0, abs=1e-6)  # group-relative
    assert samples[0].feedback_by_turn == {0: "Hint: Use the lines= argument of the search tool."}
    assert samples[1].feedback_by_turn == {}  # passes: no KL anywhere in this rollout


def test_placebo_feedback_keeps_the_gate_rewards_and_advantages_but_not_the_text(judged):
    """objective.expert_feedback=placebo: the control arm. The same turns carry feedback (so
    the same rows are gated) and the rewards are the same; only the text differs."""
    rubric, groups, results = judged
    frame = ["judge.feedback_framing='Hint: {feedback}'"]
    real, _, _ = judged_samples(groups, results, rubric, load_config("recipes/tiny_cpu.yaml", frame))
    cfg = load_config("recipes/tiny_cpu.yaml", frame + [
        "objective.expert_feedback=placebo", "objective.placebo_feedback='Go on.'"])
    placebo, _, _ = judged_samples(groups, results, rubric, cfg)
    assert [s.feedback_by_turn.keys() for s in placebo] == [s.feedback_by_turn.keys() for s in real]
    assert [(s.advantage, s.reward) for s in placebo] == [(s.advantage, s.reward) for s in real]
    assert placebo[0].feedback_by_turn == {0: "Hint: Go on."}
    assert any(s.feedback_by_turn for s in real)  # not vacuous: some turn is gated


def test_opsd_rewards_primary_only_and_always_on_feedback(judged):
    rubric, groups, results = judged
    opsd = load_config("recipes/tiny_cpu.yaml", ["objective.mode=opsd"])
    samples, _, _ = judged_samples(groups, results, rubric, opsd)
    a, b, _, _ = (s.advantage for s in samples)
    assert a == pytest.approx(b)  # same task outcome; the style criterion is not a reward
    # feedback on every turn a criterion with feedback covers (any_tool_call: turn 0), even
    # for the rollout that passes it
    assert samples[1].feedback_by_turn.keys() == {0}


def test_judge_errors_are_excluded_and_whole_lost_groups_reported(judged):
    rubric, groups, results = judged
    bad = [[r for r in results[0]], [r.__class__(r.rollout_id, r.task_id, r.group_id,
                                                 judge_error="llm judge: not JSON")
                                     for r in results[1]]]
    cfg = load_config("recipes/tiny_cpu.yaml", [])
    samples, lost, metrics = judged_samples(groups, bad, rubric, cfg)
    assert [s.rollout.rollout_id for s in samples] == ["a", "b"]
    assert lost == ["g1"] and metrics["rollout/judge_errors"] == 2


def test_probes_run_when_due_and_a_failing_probe_does_not_stop_training():
    from megatron_tg.sampling.rollouts import RolloutSide

    side = object.__new__(RolloutSide)  # probes need no engines
    calls = []

    def good(step):
        calls.append(step)
        return {"probe/x": float(step)}

    def bad(step):
        raise ConnectionError("engine gone")

    side.probes = [(2, good), (3, bad)]
    assert side.probe_metrics(1) == {}
    assert side.probe_metrics(2) == {"probe/x": 2.0}
    assert side.probe_metrics(3) == {"probe/errors": 1.0}
    assert side.probe_metrics(6) == {"probe/x": 6.0, "probe/errors": 1.0}
    assert calls == [2, 6]


def test_primary_criteria_come_from_the_rubric_unless_named(judged):
    from megatron_tg.config import ConfigError
    from megatron_tg.judge import parse_rubric
    from megatron_tg.sampling.rollouts import primary_criteria

    rubric, groups, results = judged
    cfg = load_config("recipes/tiny_cpu.yaml", [])
    # tool_format.yaml marks tests_pass primary; the config names none
    assert cfg.objective.primary_criteria == [] and primary_criteria(cfg.objective, rubric) == ["tests_pass"]
    _, _, metrics = judged_samples(groups, results, rubric, cfg)
    assert metrics["criteria/primary"] == 0.75
    named = load_config("recipes/tiny_cpu.yaml", ["objective.primary_criteria=[search_lines]"])
    assert primary_criteria(named.objective, rubric) == ["search_lines"]
    _, _, metrics = judged_samples(groups, results, rubric, named)
    assert metrics["criteria/primary"] == 0.25
    # a name the rubric lacks would weigh nothing: refused, naming the rubric's criteria
    typo = load_config("recipes/tiny_cpu.yaml", ["objective.primary_criteria=[tests_passed]"])
    with pytest.raises(ConfigError, match=r"\['tests_passed'\] are not criteria of the rubric"):
        judged_samples(groups, results, rubric, typo)
    # a rubric without tests_pass and without a primary flag: fine in tg, refused in opsd
    style_only = parse_rubric({"name": "s", "criteria": [
        {"name": "search_lines", "scope": "any_tool_call", "feedback": "Use lines=.",
         "checker": {"type": "tool_format", "args": {"tool": "search", "parameter": "lines"}}}]})
    tok = get_tiny_tokenizer()
    res = [[Judge(style_only, tok).judge_sync(r) for r in g.rollouts] for g in groups]
    samples, _, metrics = judged_samples(groups, res, style_only, cfg)
    assert len(samples) == 4 and "criteria/primary" not in metrics
    with pytest.raises(ConfigError, match="mode 'opsd' rewards only the primary criteria"):
        judged_samples(groups, res, style_only, load_config("recipes/tiny_cpu.yaml",
                                                            ["objective.mode=opsd"]))


@pytest.mark.parametrize("finish", ["stop", "max_turns", "length"])
def test_final_turn_feedback_only_when_the_agent_ended_the_rollout(finish):
    """A rollout cut by a limit ends on a tool-call turn: a final_turn criterion fails it
    (no final answer) but inserts no feedback before that tool call."""
    from dataclasses import replace

    from megatron_tg.judge import parse_rubric

    tok = get_tiny_tokenizer()
    rb = parse_rubric({"name": "f", "criteria": [
        {"name": "summary", "scope": "final_turn", "feedback": "End with a summary.",
         "checker": {"type": "regex", "args": {"pattern": "(?i)summary"}}}]})
    msgs = [{"role": "system", "content": "agent"}, {"role": "user", "content": "fix it"},
            {"role": "assistant", "content": "look", "tool_calls": [call("search", query="x")]}]
    ro = replace(simulate_rollout(tok, msgs, tools=[SEARCH_TOOL], group_id="g", rollout_id="r"),
                 finish_reason=finish)
    res = Judge(rb, tok).judge_sync(ro)
    assert res.passed["summary"] is False
    crit = res.criteria["summary"]
    if finish == "stop":
        assert crit.failing_turns == [0] and res.feedback_by_turn() == {0: "End with a summary."}
    else:
        assert crit.failing_turns == [] and res.feedback_by_turn() == {}
        assert f"ended by {finish}" in crit.detail
    # always-on feedback (opsd) follows the same rule
    from megatron_tg.sampling.rollouts import feedback_for

    assert feedback_for(ro, res, rb, always=True) == ({0: "End with a summary."} if finish == "stop" else {})


def test_rollout_side_implements_the_loops_interface():
    """The loop only uses RolloutSource; the in-process side has each of its methods with
    the same parameters (a rollout service must too)."""
    import inspect

    from megatron_tg.sampling.protocols import RolloutSource
    from megatron_tg.sampling.rollouts import RolloutSide

    wanted = {n: f for n, f in vars(RolloutSource).items()
              if callable(f) and not n.startswith("_")}
    assert {"next_batch", "weight_target", "run_sync", "call", "probe_metrics", "identity",
            "state_dict", "load_state_dict", "close"} <= set(wanted)
    for name, proto in wanted.items():
        impl = getattr(RolloutSide, name)
        assert list(inspect.signature(impl).parameters) == list(inspect.signature(proto).parameters), name
    assert "last_judged" in RolloutSource.__annotations__


def test_sglang_tool_call_reading_without_sglang_fails_at_start():
    """The rollout side refuses the setting before any engine starts, not once per rollout."""
    import importlib.util

    from megatron_tg.sampling.rollouts import RolloutSide

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed here: the setting is usable")
    cfg = load_config("recipes/tiny_cpu.yaml", ["rollout.tool_call_reading=sglang"])
    with pytest.raises(ImportError, match="needs the sglang package"):
        RolloutSide(cfg, get_tiny_tokenizer(), None, [], load_rubric("recipes/rubrics/tool_format.yaml"),
                    engine_model_dir=None, log_dir="unused")
