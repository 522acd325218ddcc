"""The demo's RL side: the rollout function, the run summaries, the plans and the checks.

The main job end to end (``bash scripts/demo.sh --quick``, base model -> conversion -> grpo /
opsd / tg through the real loop) runs once in CI, as the README's first command, and
``python -m megatron_tg.demo.quick_check`` checks its output; the checker's own rules are
tested here.
"""

from __future__ import annotations

import asyncio
import json
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
        from megatron_tg.chat.template import assistant_generation_text, encode

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
    from megatron_tg.chat.template import assistant_generation_text, encode

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


from megatron_tg.demo.quick_check import QUICK_TARGETS_MET, ROLLING_TARGET  # noqa: E402


def _quick_summary(**tg) -> tuple[dict, str]:
    """A quick-demo summary shaped like the one ``python -m megatron_tg.demo --quick`` writes,
    with the figures it printed on seed 0 (TG learns the format, GRPO does not)."""
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
        f"target {n:<42} met    (measured 1.000)\n" for n in QUICK_TARGETS_MET) + \
        f"target {ROLLING_TARGET:<42} MISSED (measured -0.115)\n"
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
    assert any("not printed with its gap" in m
               for m in check_summary(summary, stdout.replace("MISSED (measured -0.115)", "MISSED")))


def test_quick_check_recomputes_the_summary_from_the_runs_metrics(tmp_path):
    """The summary's rates and the rolling gap must be the runs' own metrics, recomputed by
    the checker without the report code: a doctored figure is a named miss."""
    from megatron_tg.demo.quick_check import check_against_metrics

    runs = {"grpo": ([0.0] * 6, [0.9, 1.0, 0.9, 1.0, 0.9, 0.9]), "opsd": ([0.2, 0.5, 0.9, 0.9, 1.0, 1.0], [0.9] * 6),
            "tg": ([0.1, 0.6, 0.9, 1.0, 1.0, 1.0], [0.9, 0.9, 0.3, 0.3, 0.9, 0.9])}
    methods = {}
    for name, (crit, passed) in runs.items():
        _write_rows(tmp_path / "runs" / name, crit, passed)
        methods[name] = {**R.summarize_run(tmp_path / "runs" / name, last=2),
                         "rolling_pass_min": R.rolling_min(tmp_path / "runs" / name), "run": f"runs/{name}"}
    summary = {"methods": methods, "last_steps_averaged": 2,
               "tg_rolling_gap": R.rolling_gap(tmp_path / "runs" / "tg", tmp_path / "runs" / "grpo")}
    assert check_against_metrics(summary, tmp_path) == []
    methods["tg"]["pass_rate_start"] = 0.8  # e.g. a mean over 5 steps instead of 3
    assert any("tg: summary pass_rate_start" in m for m in check_against_metrics(summary, tmp_path))
    methods["tg"]["pass_rate_start"] = R.summarize_run(tmp_path / "runs" / "tg", last=2)["pass_rate_start"]
    summary["tg_rolling_gap"] = -summary["tg_rolling_gap"]
    assert any("tg_rolling_gap" in m for m in check_against_metrics(summary, tmp_path))


def test_rolling_means_and_the_gap_to_the_baseline(tmp_path):
    assert R.rolling_mean([1.0, 0.0, 0.5, 1.0], 3) == pytest.approx([0.5, 0.5])
    assert R.rolling_mean([1.0, 0.5], 3) == []
    with pytest.raises(ValueError, match="window"):
        R.rolling_mean([1.0], 0)
    _write_rows(tmp_path / "tg", [0.0] * 6, [0.9, 0.9, 0.3, 0.3, 0.9, 0.9])
    _write_rows(tmp_path / "grpo", [0.0] * 5, [0.9, 1.0, 0.9, 1.0, 0.9])
    assert R.rolling_min(tmp_path / "tg") == pytest.approx(0.5)
    # tg (steps 1-5) 0.7, 0.5, 0.5 against grpo 0.933, 0.967, 0.933: lowest difference −0.467
    assert R.rolling_gap(tmp_path / "tg", tmp_path / "grpo") == pytest.approx(0.5 - 2.9 / 3)
    assert R.rolling_gap(tmp_path / "grpo", tmp_path / "grpo") == 0.0
    s = R.summarize_run(tmp_path / "tg", last=2)
    assert s["pass_rate_start"] == pytest.approx(0.7) and s["pass_rate_min"] == pytest.approx(0.3)


def test_step_table_and_stability_line(tmp_path, capsys):
    _write_rows(tmp_path / "tg", [0.0, 0.5, 1.0], [0.9, 0.3, 0.9])
    _write_rows(tmp_path / "grpo", [0.0] * 3, [0.9, 0.9, 0.9])
    assert R.main([str(tmp_path / "tg"), "--baseline", str(tmp_path / "grpo")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[:3] == ["step", "task", "new_fmt"]
    assert out[3].split()[:3] == ["2", "0.300", "0.500"] and out[3].split()[4] == "-"
    assert out[5] == "task min 0.300, rolling3 min 0.700, rolling3 gap to baseline -0.200"


def test_targets_can_fail():
    from megatron_tg.demo import command as D

    good = {"criterion_rate": 0.9, "pass_rate": 0.95, "steps_to_0.8": 12}
    bad = {"criterion_rate": 0.0, "pass_rate": 0.95, "steps_to_0.8": None}
    t = D.targets({"grpo": bad, "tg": good}, wall=100.0, quick=True, rolling_gap=-0.05)
    assert all(v["met"] for v in t.values()) and "wall_seconds_le_900" not in t
    t = D.targets({"grpo": good, "tg": {**bad, "pass_rate": 0.5}}, wall=1000.0, quick=False,
                  rolling_gap=-0.2)
    assert not any(v["met"] for v in t.values())
    assert t["tg_rolling3_pass_ge_grpo_minus_0.1"]["measured"] == -0.2


def test_plans_make_a_fixed_grid_and_say_which_runs(tmp_path):
    from megatron_tg.demo import command as D
    from megatron_tg.demo import runs

    default = ("forward", "ema")
    specs, variants = D.plan_runs(D.FULL, default)
    names = [s.name for s in specs]
    assert len(names) == len(set(names)) == 3 + 6 * 3 - 1  # the tg row is forward+ema seed 0
    assert set(variants) == {f"{d}+{e}" for d in D.DIRECTIONS for e in D.EXPERTS}
    assert all(len(v) == 3 for v in variants.values()) and variants["forward+ema"][0] == "tg"
    assert {(s.direction, s.expert) for s in specs if s.name.startswith("tg-")} == set(runs.GRID)
    specs, variants = D.plan_runs(D.DEFAULT, default)
    assert [s.name for s in specs] == ["grpo", "opsd", "tg", "tg-reverse-ema-s0"]
    assert variants == {"forward+ema": ["tg"], "reverse+ema": ["tg-reverse-ema-s0"]}
    # seeded runs carry their seed into sampling, with no staleness
    assert D.QUICK.seeded and D.QUICK.run_overrides(2) == ["rollout.sampling_seed=2",
                                                           "rollout.max_staleness=0"]
    assert D.DEFAULT.run_overrides(0) == []
    with pytest.raises(ValueError, match="comparison variant"):
        D.plan_runs(D.Plan(steps=3, seeds=(0,), last=1, variants=(("sideways", "ema"),),
                           probe_every=0), default)
    # the grid's summary, table and plot on tiny fake runs
    out = tmp_path / "grid"
    plan = D.Plan(steps=4, seeds=(0, 1, 2), last=2, variants=runs.GRID, probe_every=0)
    specs, variants = D.plan_runs(plan, default)
    dirs = {}
    for i, s in enumerate(specs):
        dirs[s.name] = out / "runs" / s.name
        _write_rows(dirs[s.name], [0.1 * (i % 5)] * 4, [1.0, 0.2 if i % 2 else 0.9, 0.9, 0.9])
    comp = D.compare(dirs, variants, plan, out, default)
    assert set(comp["variants"]) == set(variants) and "winner" not in comp
    v = comp["variants"]["reverse+shared"]
    assert v["seeds"] == 3 and len(v["rolling_pass_min"]) == 3
    table = R.directions_table(comp["variants"])
    assert all(name in table for name in variants) and "rolling3 pass min" in table
    png = R.plot(tmp_path / "grid.png", {m: dirs[m] for m in D.METHODS},
                 {k: [dirs[n] for n in names] for k, names in variants.items()})
    assert png.stat().st_size > 10_000


def test_finished_runs_are_reused_only_with_the_same_inputs(tmp_path):
    from megatron_tg.demo import command as D
    from megatron_tg.demo import runs

    plan, spec = D.QUICK, D.RunSpec("tg", "tg", 0)
    inputs = {"base_build": "abc", "recipe_sha256": "123"}
    run_dir = tmp_path / "runs" / "tg"
    run_dir.mkdir(parents=True)
    (run_dir / "done.json").write_text(json.dumps({"identity": runs._identity(spec, plan, inputs)}))
    # same identity: reused, nothing is run (the "python" here would fail)
    assert runs.run_one(spec, tmp_path, plan, "/bin/false", D.RECIPE, inputs) == run_dir
    # another base model build: the stale run is discarded and redone; a failing run is
    # reported with its name and exit code, and leaves no done.json behind
    with pytest.raises(RuntimeError, match="run tg failed with exit code 1"):
        runs.run_one(spec, tmp_path, plan, "/bin/false", D.RECIPE, {**inputs, "base_build": "xyz"})
    assert not (run_dir / "done.json").exists()
    # a done.json cut by a kill counts as unfinished
    (run_dir / "done.json").write_text('{"identity": ')
    assert runs._finished(run_dir / "done.json") is None


def test_main_rejects_bad_arguments(capsys):
    from megatron_tg.demo import command as D

    for argv, msg in ((["--steps", "2"], "--steps must be at least 3"),
                      (["--quick", "--full"], "not allowed with argument"),
                      (["--jobs", "0"], "--jobs must be at least 1"),
                      (["--recipe", "missing.yaml"], "no such file"),
                      (["--suite", "phase", "--full"], "--suite phase has its own fixed runs")):
        with pytest.raises(SystemExit) as exc:
            D.main(argv)
        assert exc.value.code == 2 and msg in capsys.readouterr().err


def test_phase_diagnostics_count_rescue_steps(tmp_path):
    """The phase table's KL columns come from the rescue-row metrics of the steps that had any."""
    from megatron_tg.demo import phase as P

    d = tmp_path / "rev"
    _write_rows(d, [0.0] * 4, [1.0] * 4)
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    rows[0].update({"kl/rescue_mass": 0.05, "kl/rescue_mass_max": 1.0, "kl/rescue_grad_reverse_max": 0.004,
                    "kl/rescue_grad_forward_min": 1.41})
    rows[2].update({"kl/rescue_mass_max": 0.7, "kl/rescue_grad_reverse_max": 0.2,
                    "kl/rescue_grad_forward_min": 1.2})
    rows[3]["kl/rescue_mass_max"] = 0.3  # below 0.5: no rescue row that step
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    g = P._diagnostics(d)
    assert g == {"rescue_steps": 2, "steps": 4, "rescue_mass_step1": 0.05, "rescue_mass_max": 1.0,
                 "rescue_grad_reverse_max": 0.2, "rescue_grad_forward_min": 1.2}
    s = {**R.summarize_run(d, 2), **g, "rolling_gap": -0.25, "seconds": 12.0}
    text = P.table({"1e-4": {"p_branch_no_hint_mean": 1.2e-4, "runs": {"grpo": s, "reverse": s}}})
    assert "1.20e-04" in text and "-0.250" in text and "2/4" in text and "0.0500" in text
    assert [ln.split()[2] for ln in text.splitlines()[1:]] == ["grpo", "reverse"]
