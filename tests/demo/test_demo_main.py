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


QUICK_TARGETS_MET = ("grpo_criterion_rate_le_0.05", "tg_criterion_rate_ge_0.8",
                     "tg_criterion_0.8_by_step_20", "tg_pass_rate_ge_grpo_minus_0.05",
                     "tg_criterion_rate_above_grpo")
"""The README's targets the seeded quick demo meets (measured: ``python -m megatron_tg.demo
--quick``, seed 0: TG's final pass rate 0.053 above GRPO's, with hinted turns and Adam
without momentum). Its 3-step rolling task-success rule against GRPO (TG never more than 0.1
below) is missed at this size (measured -0.115; README "hinted turns": the rule is within
GRPO-vs-GRPO noise at 64 rollouts a step): it is checked to be reported, not to be met."""


def _recomputed(run_dir: Path, last: int = 5) -> dict:
    """A run's summary numbers from its metrics.jsonl, computed here without the demo's
    report code: final rates (last ``last`` steps), the lowest step and the lowest 3-step mean
    of the pass rate, its first-3-step mean."""
    import statistics

    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] >= 1 and R.PASS in r]
    crit, passed = [r[R.CRITERION] for r in rows], [r[R.PASS] for r in rows]
    roll = [sum(passed[i:i + 3]) / 3 for i in range(len(passed) - 2)]
    return {"criterion_rate": statistics.fmean(crit[-last:]), "criterion_rate_std": statistics.pstdev(crit[-last:]),
            "pass_rate": statistics.fmean(passed[-last:]), "pass_rate_std": statistics.pstdev(passed[-last:]),
            "pass_rate_min": min(passed), "rolling_pass_min": min(roll), "pass_rate_start": statistics.fmean(passed[:3]),
            "pass_by_step": {r["step"]: r[R.PASS] for r in rows}}


def check_quick_summary(summary: dict, stdout: str, out: Path | None = None) -> None:
    """What the quick demo's output must show; shared by the end-to-end test and usable on
    any ``--quick`` output directory (``out``: that directory, whose runs' metrics the
    summary's numbers are checked against)."""
    methods = summary["methods"]
    assert summary["seeded"] is True and summary["runs"] == ["grpo", "opsd", "tg"]
    g, t = methods["grpo"], methods["tg"]
    # the README's targets, as numbers (not only as the printed verdicts)
    assert g["criterion_rate"] <= 0.05
    assert t["criterion_rate"] >= 0.8
    assert t["steps_to_0.8"] is not None and t["steps_to_0.8"] <= 20
    for name in QUICK_TARGETS_MET:
        assert summary["targets"][name]["met"], (name, summary["targets"][name])
        assert f"target {name:<42} met    (measured" in stdout, name
    # the rolling rule is reported (met or not) with the measured gap
    name = "tg_rolling3_pass_ge_grpo_minus_0.1"
    rolling = summary["targets"][name]
    assert rolling["measured"] == pytest.approx(summary["tg_rolling_gap"])
    assert f"target {name:<42} {'met   ' if rolling['met'] else 'MISSED'} " \
           f"(measured {summary['tg_rolling_gap']:.3f})" in stdout
    if out is None:
        return
    # the summary's numbers are those of the runs' metrics, recomputed independently
    got = {m: _recomputed(out / methods[m]["run"], summary["last_steps_averaged"]) for m in methods}
    for m, want in got.items():
        for key in ("criterion_rate", "criterion_rate_std", "pass_rate", "pass_rate_std", "pass_rate_min",
                    "rolling_pass_min", "pass_rate_start"):
            assert methods[m][key] == pytest.approx(want[key]), (m, key)
    a, b = got["tg"]["pass_by_step"], got["grpo"]["pass_by_step"]
    steps = sorted(set(a) & set(b))
    gap = min(sum(a[s] - b[s] for s in steps[i:i + 3]) / 3 for i in range(len(steps) - 2))
    assert summary["tg_rolling_gap"] == pytest.approx(gap)


@pytest.mark.slow
def test_quick_demo_end_to_end(quick_base, tmp_path):
    base_dir, base = quick_base
    out = tmp_path / "demo"
    shutil.copytree(base_dir, out / "base")  # the shared quick build: reused by hash
    res = subprocess.run([sys.executable, "-m", "megatron_tg.demo", "--quick", "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "(cached)" in res.stdout
    assert "3 RL runs of 25 steps, 2 at a time (seeded, no staleness): grpo, opsd, tg" in res.stdout
    summary = json.loads((out / "summary.json").read_text())
    methods = summary["methods"]
    assert set(methods) == {"grpo", "opsd", "tg"} and summary["steps"] == 25
    for m in methods.values():
        assert m["base_criterion_rate"] == base["new_format_no_hint"] <= 0.01
    check_quick_summary(summary, res.stdout, out)
    assert summary["wall_seconds"] > 0 and (out / "curves.png").stat().st_size > 10_000
    assert "Final rates" in res.stdout
    # the runs went through the real loop, seeded: converted checkpoint, engines, weight syncs
    assert (out / "base_megatron" / "metadata.json").exists()
    cfg = (out / "runs" / "tg" / "config.yaml").read_text()
    assert "sampling_seed: 0" in cfg and "max_staleness: 0" in cfg
    rows = [json.loads(x) for x in (out / "runs" / "tg" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] >= 1]
    assert len(steps) == 25 and all(r["sync/tensors"] > 0 for r in steps)
    assert all(r["rollout/staleness_max"] == 0 for r in steps)
    # the KL diagnostics are logged wherever something was gated
    gated = [r for r in steps if r.get("kl/frac_gated", 0) > 0]
    assert gated and all(0.0 <= r["kl/rescue_mass"] <= 1.0 and r["kl/grad_norm_forward"] > 0
                         for r in gated)
    # held-out evaluation: a step-0 row (the base policy) and the last step, never trained on
    evals = [r for r in rows if "eval/n" in r]
    assert [r["step"] for r in evals] == [0, 25] and rows[0]["step"] == 0
    assert evals[0]["eval/n"] + evals[0]["eval/judge_errors"] + evals[0]["eval/rollout_errors"] == 32
    assert evals[0]["eval/demo/new_format"] <= 0.1  # the base never uses the new format unhinted
    for m in methods.values():
        assert m["heldout_episodes"] <= 32 and m["heldout_steps"] == [0, 25]
        lo, hi = m["heldout_pass_ci_final"]
        assert lo <= m["heldout_pass_rate_final"] <= hi
    assert "Held-out (" in res.stdout


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
    from megatron_tg.demo import __main__ as D

    good = {"criterion_rate": 0.9, "pass_rate": 0.95, "steps_to_0.8": 12}
    bad = {"criterion_rate": 0.0, "pass_rate": 0.95, "steps_to_0.8": None}
    t = D.targets({"grpo": bad, "tg": good}, wall=100.0, quick=True, rolling_gap=-0.05)
    assert all(v["met"] for v in t.values()) and "wall_seconds_le_900" not in t
    t = D.targets({"grpo": good, "tg": {**bad, "pass_rate": 0.5}}, wall=1000.0, quick=False,
                  rolling_gap=-0.2)
    assert not any(v["met"] for v in t.values())
    assert t["tg_rolling3_pass_ge_grpo_minus_0.1"]["measured"] == -0.2


def test_plans_make_a_fixed_grid_and_say_which_runs(tmp_path):
    from megatron_tg.demo import __main__ as D

    default = ("forward", "ema")
    specs, variants = D.plan_runs(D.FULL, default)
    names = [s.name for s in specs]
    assert len(names) == len(set(names)) == 3 + 6 * 3 - 1  # the tg row is forward+ema seed 0
    assert set(variants) == {f"{d}+{e}" for d in D.DIRECTIONS for e in D.EXPERTS}
    assert all(len(v) == 3 for v in variants.values()) and variants["forward+ema"][0] == "tg"
    assert {(s.direction, s.expert) for s in specs if s.name.startswith("tg-")} == set(D.GRID)
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
    plan = D.Plan(steps=4, seeds=(0, 1, 2), last=2, variants=D.GRID, probe_every=0)
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
    from megatron_tg.demo import __main__ as D

    plan, spec = D.QUICK, D.RunSpec("tg", "tg", 0)
    inputs = {"base_build": "abc", "recipe_sha256": "123"}
    run_dir = tmp_path / "runs" / "tg"
    run_dir.mkdir(parents=True)
    (run_dir / "done.json").write_text(json.dumps({"identity": D._identity(spec, plan, inputs)}))
    # same identity: reused, nothing is run (the "python" here would fail)
    assert D.run_one(spec, tmp_path, plan, "/bin/false", D.RECIPE, inputs) == run_dir
    # another base model build: the stale run is discarded and redone; a failing run is
    # reported with its name and exit code, and leaves no done.json behind
    with pytest.raises(RuntimeError, match="run tg failed with exit code 1"):
        D.run_one(spec, tmp_path, plan, "/bin/false", D.RECIPE, {**inputs, "base_build": "xyz"})
    assert not (run_dir / "done.json").exists()
    # a done.json cut by a kill counts as unfinished
    (run_dir / "done.json").write_text('{"identity": ')
    assert D._finished(run_dir / "done.json") is None


def test_main_rejects_bad_arguments(capsys):
    from megatron_tg.demo import __main__ as D

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
