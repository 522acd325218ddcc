"""Feedback vetting (:mod:`megatron_tg.judge.vetting`, paper §4).

* the interval math on published counts (Newcombe 1998);
* the feedback placement: what the engine is sent equals the trainer's expert context
  (:func:`~megatron_tg.chat.feedback.insert_feedback`) up to the turn being generated, for
  fresh rollouts (shared and exact contexts) and for final-turn branches (replayed prefix);
* verdicts with a scripted engine whose response to the hint is known: it follows the hint
  (keep), ignores it (reject), or follows it but breaks the task (reject on the primary);
* the command line end to end with a tiny random model behind the embedded engine.

The agent loop is the real harness (tools, sandbox, hidden tests) over the built-in
``shop_discount`` task. Only scripted commands run in it, so without bubblewrap the scripted
tests fall back to the unsandboxed mode; the tiny-model test (model-written commands) needs
bubblewrap and is skipped without it.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from megatron_tg.agent import AgentHarness, builtin_tasks
from megatron_tg.agent.sandbox import Limits, Sandbox, bwrap_path
from megatron_tg.chat.feedback import feedback_message_ids, insert_feedback
from megatron_tg.chat.template import assistant_generation_text, generation_prompt_ids
from megatron_tg.config.rollout import RolloutConfig
from megatron_tg.judge import Judge, parse_rubric
from megatron_tg.judge.intervals import newcombe_interval, wilson_interval
from megatron_tg.judge.feedback_context import FeedbackContext, replay_turns
from megatron_tg.judge.vet_report import format_report
from megatron_tg.judge.vetting import VetConfig, feedback_text, vet_feedback
from megatron_tg.rollout.context import RolloutContext
from megatron_tg.rollout.responses import GenerateResult

LINES_FB = "Use the lines= argument of the search tool."
TABLE_FB = "End with a markdown table of what you changed."
TEMPLATE = VetConfig().message_template()
RUBRIC = {
    "name": "vet_test",
    "criteria": [
        {"name": "tests_pass", "scope": "rollout", "primary": True, "feedback": None,
         "checker": {"type": "tests_pass", "args": {"key": "tests_passed"}}},
        {"name": "search_lines", "scope": "any_tool_call", "weight": 0.5, "feedback": LINES_FB,
         "checker": {"type": "tool_format", "args": {"tool": "search", "parameter": "lines"}}},
        {"name": "final_table", "scope": "final_turn", "weight": 0.5, "feedback": TABLE_FB,
         "checker": {"type": "markdown_table", "args": {}}},
    ],
}


# ---------------------------------------------------------------------- interval math
def test_wilson_interval_published_values():
    # Newcombe (1998), Stat Med 17:857, Table I: 81/263 -> 0.2553 to 0.3662
    lo, hi = wilson_interval(81, 263)
    assert (round(lo, 4), round(hi, 4)) == (0.2553, 0.3662)
    # 0/10: upper bound z^2 / (n + z^2) = 0.2775
    lo, hi = wilson_interval(0, 10)
    assert lo == 0.0 and round(hi, 4) == 0.2775
    assert wilson_interval(10, 10)[1] == 1.0 and wilson_interval(0, 0) == (0.0, 1.0)


def test_newcombe_difference_published_values():
    # Newcombe (1998), Stat Med 17:873, example (a): 56/70 - 48/80 = 0.2000, method 10
    # (hybrid score) -> 0.0524 to 0.3339
    d, lo, hi = newcombe_interval(56, 70, 48, 80)
    assert (round(d, 4), round(lo, 4), round(hi, 4)) == (0.2, 0.0524, 0.3339)
    # swapping the arms mirrors the interval
    d2, lo2, hi2 = newcombe_interval(48, 80, 56, 70)
    assert (d2, lo2, hi2) == pytest.approx((-d, -hi, -lo))
    # 4/4 vs 0/4 is already significant at 95%; 2/4 vs 1/4 is not
    assert newcombe_interval(4, 4, 0, 4)[1] > 0 and newcombe_interval(2, 4, 1, 4)[1] < 0
    # a wider confidence gives a wider interval
    assert newcombe_interval(56, 70, 48, 80, 0.99)[1] < lo


# ---------------------------------------------------------------------- scripted engine
def _turn(tok, content="", *calls):
    return assistant_generation_text(tok, {
        "role": "assistant", "content": content,
        "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}}
                       for n, a in calls]})


def _contains(ids, sub):
    return any(ids[i:i + len(sub)] == sub for i in range(len(ids) - len(sub) + 1))


def _count(ids, sub):
    return sum(ids[i:i + len(sub)] == sub for i in range(len(ids) - len(sub) + 1))


class HintClient:
    """Duck-typed SGLangClient playing an agent that solves ``shop_discount`` in three turns
    (search, edit, final message) and reacts to the hints in its context:

    ``follow``: use ``lines=`` when the search_lines hint is in the context, and end with a
    markdown table when the final_table hint is; ``break_tests``: when any hint is in the
    context, run the tests instead of fixing the bug (the hint hurts the task)."""

    def __init__(self, tok, follow: bool = True, break_tests: bool = False):
        self.tok, self.follow, self.break_tests = tok, follow, break_tests
        self.gen = generation_prompt_ids(tok)
        self.hints = {name: feedback_message_ids(tok, feedback_text(fb, TEMPLATE), "user")
                      for name, fb in (("search_lines", LINES_FB), ("final_table", TABLE_FB))}
        self.requests: list[list[int]] = []

    async def generate(self, input_ids, sampling_params=None, return_logprob=True, rid=None):
        ids = list(input_ids)
        self.requests.append(ids)
        turn = _count(ids, self.gen) - 1  # one generation prompt per turn so far (+ this one)
        seen = {n for n, h in self.hints.items() if _contains(ids, h)}
        if turn == 0:
            args = {"query": "apply discount"}
            if self.follow and "search_lines" in seen:
                args["lines"] = "2"
            text = _turn(self.tok, "", ("search", args))
        elif turn == 1 and not (self.break_tests and seen):
            text = _turn(self.tok, "", ("edit_file", {
                "path": "shop/pricing.py", "old_string": "amount - percent",
                "new_string": "amount * (1 - percent / 100)"}))
        elif turn == 1:
            text = _turn(self.tok, "", ("run_tests", {}))
        else:
            text = "Fixed the discount."
            if self.follow and "final_table" in seen:
                text += "\n\n| File | Change |\n|---|---|\n| shop/pricing.py | percentage |"
            text = _turn(self.tok, text)
        out = self.tok(text, add_special_tokens=False)["input_ids"]
        return GenerateResult(rid or "r", out, [-0.1] * len(out), {"type": "stop"}, "0", "fake")


@pytest.fixture(scope="module")
def harness(tok):
    sandbox = (Sandbox("bwrap", limits=Limits(wall_s=10.0, cpu_s=5)) if bwrap_path()
               else Sandbox("none", allow_unsandboxed=True, limits=Limits(wall_s=10.0, cpu_s=5)))
    return AgentHarness(tok, RolloutConfig(max_turns=6, max_new_tokens=256), sandbox=sandbox)


@pytest.fixture(scope="module")
def task():
    return next(t for t in builtin_tasks() if t.id == "shop_discount")


def _run(harness, client, task, wrap=None, rid="r0"):
    ctx = RolloutContext(client, task, group_id="g", rollout_id=rid)
    ctx = wrap(ctx) if wrap else ctx
    return asyncio.run(harness.run(ctx)), ctx


def _expert_prefix(tok, rollout, feedback_by_turn, k):
    """The trainer's expert context for ``rollout`` up to (not including) turn k's tokens."""
    es = insert_feedback(rollout, feedback_by_turn, tok, "user", truncate=False)
    return es.token_ids[:es.position_map[rollout.turn(k).start]]


@pytest.mark.parametrize("persist", [True, False], ids=["shared", "exact"])
def test_fresh_rollout_engine_sees_the_trainers_expert_context(tok, harness, task, persist):
    text = feedback_text(LINES_FB, TEMPLATE)
    f_ids = feedback_message_ids(tok, text, "user")
    client = HintClient(tok)
    ro, ctx = _run(harness, client, task,
                   lambda c: FeedbackContext(c, f_ids, generation_prompt_ids(tok), persist=persist))
    assert ro.num_turns == 3 and ro.metadata["tests_passed"] is True
    # the recorded rollout is the student's: no feedback message in it
    assert not _contains(ro.token_ids, f_ids)
    assert len(client.requests) == 3 and ctx.requests == client.requests
    for k, req in enumerate(client.requests):
        fb = {j: text for j in range(k + 1)} if persist else {k: text}
        assert req == _expert_prefix(tok, ro, fb, k), f"turn {k}"
    assert "lines" in tok.decode(ro.token_ids[ro.turn(0).start:ro.turn(0).end])


def test_final_turn_branch_replays_the_prefix(tok, harness, task):
    client = HintClient(tok)
    base, _ = _run(harness, client, task)
    k = base.num_turns - 1
    text = feedback_text(TABLE_FB, TEMPLATE)
    f_ids = feedback_message_ids(tok, text, "user")
    client = HintClient(tok)
    ro, ctx = _run(harness, client, task, lambda c: FeedbackContext(
        c, f_ids, generation_prompt_ids(tok), start_turn=k, replay=replay_turns(base, k)))
    # only the last turn went to the engine, with the feedback right before it
    assert len(client.requests) == 1 and ctx.replay_mismatches == 0
    assert ro.token_ids[:ro.turn(k).start] == base.token_ids[:base.turn(k).start]
    assert client.requests[0] == _expert_prefix(tok, ro, {k: text}, k)
    assert "|---|" in tok.decode(ro.token_ids[ro.turn(k).start:])
    assert "|---|" not in tok.decode(base.token_ids[base.turn(k).start:])


def _vet(tok, harness, task, client, samples=4, **cfg):
    rubric = parse_rubric(RUBRIC)
    return asyncio.run(vet_feedback(rubric, [task], tok, client, harness, Judge(rubric, tok),
                                    VetConfig(samples=samples, **cfg)))


def test_verdicts_with_known_effects(tok, harness, task):
    follow = _vet(tok, harness, task, HintClient(tok, follow=True))
    by = {r["name"]: r for r in follow["criteria"]}
    assert set(by) == {"search_lines", "final_table"}  # tests_pass has no feedback string
    for name, design in (("search_lines", "fresh"), ("final_table", "branch_final_turn")):
        r = by[name]
        assert r["design"] == design
        assert (r["without"]["passed"], r["without"]["n"], r["with"]["passed"], r["with"]["n"]) \
            == (0, 4, 4, 4)
        assert r["diff"] == 1.0 and r["ci"][0] > 0 and r["verdict"] == "keep", r
        assert r["without"]["primary_rate"] == r["with"]["primary_rate"] == 1.0
    assert by["final_table"]["replay_mismatches"] == 0

    ignore = _vet(tok, harness, task, HintClient(tok, follow=False), samples=3)
    for r in ignore["criteria"]:
        assert r["with"]["passed"] == 0 and r["diff"] == 0.0 and r["verdict"] == "reject"
        assert "not significant" in r["reasons"][0]

    broken = _vet(tok, harness, task, HintClient(tok, follow=True, break_tests=True))
    by = {r["name"]: r for r in broken["criteria"]}
    # search_lines: the hint works but the agent stops fixing the bug -> rejected
    r = by["search_lines"]
    assert r["with"]["passed"] == 4 and r["with"]["primary_rate"] == 0.0
    assert r["primary_diff"] == -1.0 and r["verdict"] == "reject"
    assert r["reasons"] == ["primary pass rate drops by 1.000 > 0.050"]
    # final_table: only the final message is regenerated; the fix was made before -> kept
    assert by["final_table"]["verdict"] == "keep"
    text = format_report(broken)
    assert "search_lines" in text and "reject" in text and "keep" in text
    json.dumps(broken, allow_nan=False)  # strict JSON


def test_bad_inputs(tok, harness, task):
    rubric = parse_rubric(RUBRIC)

    def vet(**kw):
        return asyncio.run(vet_feedback(rubric, [task], tok, HintClient(tok), harness,
                                        Judge(rubric, tok), **kw))

    with pytest.raises(ValueError, match="unknown criteria"):
        vet(criteria=["nope"])
    with pytest.raises(ValueError, match="no criterion with a feedback"):
        vet(criteria=["tests_pass"])

    class Down:
        async def generate(self, *a, **kw):
            raise ConnectionError("engine down")

    # A setup problem (every baseline rollout fails) is an error, never a "reject" verdict.
    with pytest.raises(RuntimeError, match="engine down"):
        asyncio.run(vet_feedback(rubric, [task], tok, Down(), harness, Judge(rubric, tok),
                                 VetConfig(samples=2)))


# ---------------------------------------------------------------------- tiny model, CLI
def test_cli_with_tiny_model_and_embedded_engine(tok, tmp_path):
    if bwrap_path() is None:
        pytest.skip("bubblewrap not installed: a model's own commands must run sandboxed")
    import yaml

    from megatron_tg.judge.command import main
    from tests.models.qwen3_moe.common import tiny_hf_model

    model_dir = tmp_path / "model"
    _, model, _ = tiny_hf_model(vocab_size=len(tok))
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    rubric = {"name": "tiny", "criteria": [
        RUBRIC["criteria"][0], RUBRIC["criteria"][1],
        {"name": "says_done", "scope": "final_turn", "feedback": "Say done at the end.",
         "checker": {"type": "regex", "args": {"pattern": "done"}}}]}
    (tmp_path / "rubric.yaml").write_text(yaml.safe_dump(rubric))
    out = tmp_path / "report.json"
    rc = main(["--model", str(model_dir), "--rubric", str(tmp_path / "rubric.yaml"),
               "--tasks", "builtin", "--task-ids", "fizzbuzz", "--samples", "2",
               "--max-new-tokens", "6", "--max-turns", "2", "--out", str(out),
               "--log-dir", str(tmp_path / "logs")])
    assert rc == 0
    report = json.loads(out.read_text())
    by = {r["name"]: r for r in report["criteria"]}
    assert set(by) == {"search_lines", "says_done"}
    assert by["search_lines"]["design"] == "fresh"
    assert by["says_done"]["design"] == "branch_final_turn"
    for r in by.values():
        for arm in ("without", "with"):
            a = r[arm]
            assert (a["rollouts"], a["rollout_errors"], a["judge_errors"], a["n"]) == (2, 0, 0, 2)
        # The random tiny model's effect is unknown, so the verdict is checked against the
        # report's own numbers: the documented rule, recomputed from the counts it printed.
        w, wo = r["with"], r["without"]
        d, lo, hi = newcombe_interval(w["passed"], w["n"], wo["passed"], wo["n"], report["confidence"])
        assert (r["diff"], r["ci"]) == (pytest.approx(d), pytest.approx([lo, hi]))
        pd = w["primary_passed"] / w["n"] - wo["primary_passed"] / wo["n"]
        assert r["primary_diff"] == pytest.approx(pd)
        th = report["thresholds"]
        keep = lo > th["min_improvement"] and pd >= -th["max_primary_drop"] - 1e-12
        assert r["verdict"] == ("keep" if keep else "reject"), r
        assert (r["reasons"] == []) == keep
    assert report["command"]["samples"] == 2 and report["tasks"] == ["fizzbuzz"]
