"""The demo's RL side: the rollout function, the run summaries, and the main job end to end.

The end-to-end test runs ``python -m megatron_tg.demo --quick`` exactly as CI's users would
(base model -> conversion -> grpo / opsd / tg through the real loop) and asserts the
direction of the paper's result: GRPO never finds the new tool format, TG teaches it.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_tg.chat.tokenizer import get_tiny_tokenizer
from megatron_tg.demo import report as R
from megatron_tg.demo import task as T
from megatron_tg.demo.agent import DemoAgent
from megatron_tg.demo.rl import episode_rates
from megatron_tg.judge import Judge
from megatron_tg.rollout.context import TurnOutput

REPO = Path(__file__).resolve().parents[2]


class ScriptedCtx:
    """A RolloutContext stand-in whose ``generate`` returns the reference turns."""

    def __init__(self, tok, task, *, new_format: bool, answer: str | None = None):
        self.task, self.group_id, self.rollout_id = task, "g", "g/0"
        msgs = T.reference_messages(task, new_format=new_format, lines=2)
        from megatron_tg.chat.framing import assistant_generation_text, encode

        self.turns = [encode(tok, assistant_generation_text(tok, m)) for m in msgs if m["role"] == "assistant"]
        if answer is not None:
            self.turns[-1] = encode(tok, assistant_generation_text(tok, {"role": "assistant", "content": answer}))
        self.inputs: list[list[int]] = []

    async def generate(self, ids, max_new_tokens=None):
        self.inputs.append(list(ids))
        out = self.turns[len(self.inputs) - 1]
        return TurnOutput(out, [-0.5] * len(out), 3, [3], "stop")

    def tool_slot(self):
        import contextlib

        return contextlib.nullcontext()


@pytest.mark.parametrize("new_format, answer, success", [
    (False, None, True), (True, None, True), (False, "The value is 12 or 13.", False)])
def test_demo_agent_episode_and_judge(new_format, answer, success):
    tok = get_tiny_tokenizer()
    task = T.make_task(0, 4)
    ctx = ScriptedCtx(tok, task, new_format=new_format, answer=answer)
    ro = asyncio.run(DemoAgent(tok, max_turns=4)(ctx))
    assert ro.num_turns == 2 and ro.finish_reason == "stop"
    assert ro.metadata["new_format"] is new_format and ro.metadata["success"] is success
    assert all(s.policy_version == 3 for s in ro.assistant_turns())
    # the second turn saw the tool's real output for the call the first turn made
    lines = 2 if new_format else None
    assert tok.decode(ctx.inputs[1]).count(T.search(task, task.key, lines)) == 1
    res = asyncio.run(Judge(T.rubric(), tok).judge_many([ro], task_infos={task.id: task}))[0]
    assert res.passed == {"answer": success, "search_lines": new_format}
    assert episode_rates([ro]) == {"demo/new_format": float(new_format), "demo/success": float(success),
                                   "demo/both": float(new_format and success), "demo/search_calls": 1.0,
                                   "demo/malformed": 0.0, "demo/tool_error": 0.0,
                                   "demo/no_answer": 0.0, "demo/turns": 2.0}


def test_demo_agent_counts_malformed_calls_and_tool_errors():
    tok = get_tiny_tokenizer()
    task = T.make_task(0, 4)
    ctx = ScriptedCtx(tok, task, new_format=True)
    from megatron_tg.chat.framing import assistant_generation_text, encode

    bad_lines = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "search", "arguments": {"query": task.key, "lines": "0"}}}]}
    broken = encode(tok, "<tool_call>\n<function=search>\n<parameter=query>\nk1\n</tool_call><|im_end|>")
    ctx.turns = [encode(tok, assistant_generation_text(tok, bad_lines)), broken, broken]
    ro = asyncio.run(DemoAgent(tok, max_turns=3)(ctx))
    assert ro.metadata["n_tool_errors"] >= 1 and ro.metadata["n_malformed_calls"] >= 1
    rates = episode_rates([ro])
    assert rates["demo/tool_error"] == rates["demo/malformed"] == rates["demo/no_answer"] == 1.0
    assert rates["demo/success"] == 0.0 and rates["demo/turns"] == 3.0


def test_demo_agent_keeps_rollouts_within_the_context_limit():
    """Tool results that would fill the context are not appended: no turn would read them,
    and the rollout stays within max_context_tokens (the trainer's micro-batch plan)."""
    tok = get_tiny_tokenizer()
    task = T.make_task(0, 4)
    ctx = ScriptedCtx(tok, task, new_format=False)
    full = asyncio.run(DemoAgent(tok, max_turns=4)(ScriptedCtx(tok, task, new_format=False)))
    first_turn_end = full.assistant_turns()[0].end
    ro = asyncio.run(DemoAgent(tok, max_turns=4, max_context_tokens=first_turn_end + 5)(ctx))
    assert ro.finish_reason == "length" and ro.num_turns == 1
    assert len(ro.token_ids) == first_turn_end <= first_turn_end + 5
    assert ro.segments[-1].kind == "assistant"


def test_demo_agent_refuses_a_foreign_task():
    ctx = ScriptedCtx(get_tiny_tokenizer(), T.make_task(0, 1), new_format=False)
    ctx.task = {"id": "x"}
    with pytest.raises(TypeError, match="FactTask"):
        asyncio.run(DemoAgent(get_tiny_tokenizer())(ctx))


def _write_rows(d: Path, crit, passed):
    d.mkdir(parents=True)
    with open(d / "metrics.jsonl", "w") as f:
        for i, (c, p) in enumerate(zip(crit, passed)):
            f.write(json.dumps({"step": i + 1, R.CRITERION: c, R.PASS: p, "time/step": 1.0}) + "\n")


def test_summaries_final_rates_threshold_and_collapse(tmp_path):
    _write_rows(tmp_path / "a", [0.0, 0.1, 0.5, 0.85, 0.9, 1.0], [1.0, 0.9, 0.95, 0.4, 0.95, 0.95])
    s = R.summarize_run(tmp_path / "a", last=2)
    assert s["criterion_rate"] == pytest.approx(0.95) and s["criterion_rate_std"] == pytest.approx(0.05)
    assert s["pass_rate"] == pytest.approx(0.95) and s["steps_to_0.8"] == 4
    assert s["collapsed"] and s["recovered"]  # 0.4 < half of the start (0.95), then back
    _write_rows(tmp_path / "b", [0.0] * 4, [1.0, 1.0, 0.6, 0.7])
    s = R.summarize_run(tmp_path / "b", last=2)
    assert s["steps_to_0.8"] is None and not s["collapsed"] and not s["recovered"]
    agg = R.aggregate([R.summarize_run(tmp_path / n, 2) for n in "ab"])
    assert agg["criterion_rate"] == pytest.approx(0.475) and agg["collapsed_runs"] == 1
    assert agg["steps_to_0.8"] == [4, None]
    _write_rows(tmp_path / "empty", [], [])
    with pytest.raises(ValueError, match="no 'demo/new_format'"):
        R.summarize_run(tmp_path / "empty", last=2)


def _quick_summary(**tg) -> tuple[dict, str]:
    """A quick-demo summary shaped like the one ``python -m megatron_tg.demo --quick`` writes,
    with the figures it printed on seed 0 (TG learns the format, GRPO does not)."""
    from megatron_tg.demo.quick_check import QUICK_TARGETS_MET, ROLLING_TARGET

    def method(crit, steps_to):
        return {"criterion_rate": crit, "criterion_rate_std": 0.01, "pass_rate": 0.95, "pass_rate_std": 0.02,
                "base_criterion_rate": 0.0, "steps_to_0.8": steps_to, "pass_rate_min": 0.6,
                "rolling_pass_min": 0.8, "heldout_steps": [0, 25], "heldout_pass_rate_start": 0.9,
                "heldout_pass_rate_final": 0.95}

    methods = {"grpo": method(0.0, None), "opsd": method(0.9, 12), "tg": {**method(0.95, 11), **tg}}
    targets = {n: {"met": True, "measured": 1.0} for n in QUICK_TARGETS_MET}
    targets[ROLLING_TARGET] = {"met": False, "measured": -0.115}
    summary = {"seeded": True, "runs": ["grpo", "opsd", "tg"], "steps": 25, "methods": methods,
               "targets": targets, "tg_rolling_gap": -0.115}
    stdout = "Final rates ...\n\nHeld-out (32 episodes never trained on; ...)\n" + "".join(
        f"target {n:<42} met    (measured 1.000)\n" for n in QUICK_TARGETS_MET)
    return summary, stdout


def test_quick_check_accepts_the_demo_s_result_and_names_each_miss():
    """CI runs ``python -m megatron_tg.demo.quick_check`` on the README command's output (the
    quick demo runs once in CI, there); each way the result can be wrong is a named miss."""
    from megatron_tg.demo.quick_check import check_summary

    summary, stdout = _quick_summary()
    assert check_summary(summary, stdout) == []
    bad, out = _quick_summary(criterion_rate=0.5)
    assert any("TG did not teach" in m for m in check_summary(bad, out))
    bad, out = _quick_summary(**{"steps_to_0.8": 24})
    assert any("not by step 20" in m for m in check_summary(bad, out))
    bad, out = _quick_summary()
    bad["methods"]["grpo"]["criterion_rate"] = 0.2
    assert any("GRPO learned" in m for m in check_summary(bad, out))
    bad, out = _quick_summary()
    bad["targets"]["tg_rolling3_pass_ge_grpo_minus_0.1"]["met"] = True  # inconsistent with the gap
    assert any("says met=True" in m for m in check_summary(bad, out))
    bad, out = _quick_summary(heldout_steps=[0])
    assert any("held-out evaluations at steps [0]" in m for m in check_summary(bad, out))
    summary, stdout = _quick_summary()
    assert any("held-out evaluation table" in m
               for m in check_summary(summary, stdout.replace("Held-out (", "Held out (")))
    assert any("printed as met" in m
               for m in check_summary(summary, stdout.replace("tg_criterion_rate_ge_0.8 ", "x ")))
