"""What the seeded quick demo (``python -m megatron_tg.demo --quick``) must show; CI runs it on
the output of the README's first command (``bash scripts/demo.sh --quick``):

    python -m megatron_tg.demo.quick_check OUT --stdout OUT.log   # exit 1 naming every miss

The demo itself reports and exits 0 whether its targets are met or not (a reproduction
reports; it is not a test); this is the test. It checks the direction of the paper's result
as numbers and as the printed verdicts, that the runs went through the real loop (converted
checkpoint, weight syncs, seeded config), and that the held-out table was printed.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any, Sequence

from megatron_tg.demo.report import CRITERION, PASS

QUICK_TARGETS_MET = ("grpo_criterion_rate_le_0.05", "tg_criterion_rate_ge_0.8",
                     "tg_criterion_0.8_by_step_20", "tg_pass_rate_ge_grpo_minus_0.05",
                     "tg_criterion_rate_above_grpo")
"""The targets the seeded quick demo meets (measured: ``python -m megatron_tg.demo --quick``,
seed 0). Its 3-step rolling task-success rule against GRPO (TG never more than 0.1 below) is
missed at this size (docs/demo.md, "hinted turns": the rule is within GRPO-vs-GRPO noise at 64
rollouts a step): it is checked to be reported consistently, not to be met."""
ROLLING_TARGET = "tg_rolling3_pass_ge_grpo_minus_0.1"


def check_summary(summary: dict[str, Any], stdout: str) -> list[str]:
    """The misses of one quick summary (``OUT/summary.json``) and its printed output."""
    miss: list[str] = []

    def need(ok: bool, what: str) -> None:
        if not ok:
            miss.append(what)

    methods = summary.get("methods", {})
    need(summary.get("seeded") is True, f"the quick demo must be seeded, got seeded={summary.get('seeded')!r}")
    need(summary.get("runs") == ["grpo", "opsd", "tg"], f"runs {summary.get('runs')!r} != grpo, opsd, tg")
    need(summary.get("steps") == 25, f"steps {summary.get('steps')!r} != 25")
    if set(methods) != {"grpo", "opsd", "tg"}:
        return miss + [f"methods {sorted(methods)} != grpo, opsd, tg"]
    g, t = methods["grpo"], methods["tg"]
    need(g["criterion_rate"] <= 0.05, f"GRPO learned the new format ({g['criterion_rate']:.3f} > 0.05)")
    need(t["criterion_rate"] >= 0.8, f"TG did not teach the new format ({t['criterion_rate']:.3f} < 0.8)")
    need(t["steps_to_0.8"] is not None and t["steps_to_0.8"] <= 20,
         f"TG reached 0.8 at step {t['steps_to_0.8']}, not by step 20")
    targets = summary.get("targets", {})
    for name in QUICK_TARGETS_MET:
        got = targets.get(name, {})
        need(bool(got.get("met")), f"target {name} missed: {got}")
        need(f"target {name:<42} met    (measured" in stdout, f"target {name} is not printed as met")
    rolling = targets.get(ROLLING_TARGET)
    if rolling is None:
        miss.append(f"target {ROLLING_TARGET} is not reported")
    else:
        gap = summary.get("tg_rolling_gap")
        need(gap is not None and math.isclose(rolling["measured"], gap, abs_tol=1e-9),
             f"{ROLLING_TARGET} measured {rolling['measured']} != tg_rolling_gap {gap}")
        need(gap is not None and rolling["met"] == (gap >= -0.1),
             f"{ROLLING_TARGET} says met={rolling['met']} for a gap of {gap}")
        need(gap is not None and f"target {ROLLING_TARGET:<42} {'met   ' if rolling['met'] else 'MISSED'} "
             f"(measured {gap:.3f})" in stdout, f"target {ROLLING_TARGET} is not printed with its gap")
    for name, m in methods.items():
        for key in ("criterion_rate", "criterion_rate_std", "pass_rate", "pass_rate_std", "base_criterion_rate"):
            need(0.0 <= m[key] <= 1.0, f"{name}: {key}={m[key]} is not a rate")
        need(m["base_criterion_rate"] <= 0.01,
             f"{name}: the base already uses the new format ({m['base_criterion_rate']})")
    need("Final rates" in stdout, "the rates table was not printed")
    need("\nHeld-out (" in stdout, "the held-out evaluation table was not printed")
    for name in ("grpo", "opsd", "tg"):
        m = methods[name]
        need(m.get("heldout_steps") == [0, summary.get("steps")],
             f"{name}: held-out evaluations at steps {m.get('heldout_steps')}, not at 0 and the last step")
        for when in ("start", "final"):
            rate = m.get(f"heldout_pass_rate_{when}")
            need(rate is not None and 0.0 <= rate <= 1.0, f"{name}: held-out pass rate ({when}) is {rate!r}")
    return miss


def check_run_dir(out: Path) -> list[str]:
    """The runs went through the real loop, seeded: converted checkpoint, weight syncs."""
    miss = []
    if not (out / "base_megatron" / "metadata.json").exists():
        miss.append(f"{out}/base_megatron holds no converted megatron checkpoint")
    cfg_path = out / "runs" / "tg" / "config.yaml"
    cfg = cfg_path.read_text() if cfg_path.exists() else ""
    if "sampling_seed: 0" not in cfg or "max_staleness: 0" not in cfg:
        miss.append(f"{cfg_path}: not seeded (sampling_seed 0, max_staleness 0)")
    rows_path = out / "runs" / "tg" / "metrics.jsonl"
    rows = [json.loads(x) for x in rows_path.read_text().splitlines()] if rows_path.exists() else []
    steps = [r for r in rows if r.get("step", 0) >= 1]
    if len(steps) != 25:
        miss.append(f"{rows_path}: {len(steps)} steps logged, not 25")
    if not all(r.get("sync/tensors", 0) > 0 for r in steps):
        miss.append("a step synced no weights to the engine")
    if not all(r.get("rollout/staleness_max") == 0 for r in steps):
        miss.append("a step trained on stale rollouts in a seeded run")
    gated = [r for r in steps if r.get("kl/frac_gated", 0) > 0]
    if not gated:
        miss.append("no TG step gated anything")
    elif not all(0.0 <= r["kl/rescue_mass"] <= 1.0 and r["kl/grad_norm_forward"] > 0 for r in gated):
        miss.append("the KL diagnostics are missing or out of range on a gated step")
    evals = [r for r in rows if "eval/n" in r]
    if [r["step"] for r in evals] != [0, 25]:
        miss.append(f"{rows_path}: held-out evaluations at steps {[r['step'] for r in evals]}, not 0 and 25")
    elif evals[0]["eval/n"] + evals[0].get("eval/judge_errors", 0) + evals[0].get("eval/rollout_errors", 0) != 32:
        miss.append("the step-0 held-out evaluation did not account for its 32 episodes")
    elif evals[0].get("eval/demo/new_format", 1.0) > 0.1:
        miss.append("the base already uses the new format on held-out episodes")
    curves = out / "curves.png"
    if not curves.exists() or curves.stat().st_size < 10_000:
        miss.append(f"{curves} was not drawn")
    return miss


def _recomputed(run_dir: Path, last: int) -> dict[str, Any]:
    """A run's summary numbers from its metrics.jsonl, computed here without the demo's
    report code: final rates (last ``last`` steps), the lowest step and the lowest 3-step mean
    of the pass rate, its first-3-step mean, the pass rate by step."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] >= 1 and PASS in r]
    crit, passed = [r[CRITERION] for r in rows], [r[PASS] for r in rows]
    roll = [sum(passed[i:i + 3]) / 3 for i in range(len(passed) - 2)]
    return {"criterion_rate": statistics.fmean(crit[-last:]), "criterion_rate_std": statistics.pstdev(crit[-last:]),
            "pass_rate": statistics.fmean(passed[-last:]), "pass_rate_std": statistics.pstdev(passed[-last:]),
            "pass_rate_min": min(passed), "rolling_pass_min": min(roll),
            "pass_rate_start": statistics.fmean(passed[:3]), "pass_by_step": {r["step"]: r[PASS] for r in rows}}


def check_against_metrics(summary: dict[str, Any], out: Path) -> list[str]:
    """The summary's numbers are those of the runs' metrics, recomputed independently."""
    miss = []
    methods = summary["methods"]
    got = {m: _recomputed(out / methods[m]["run"], summary["last_steps_averaged"]) for m in methods}
    for m, want in got.items():
        for key in ("criterion_rate", "criterion_rate_std", "pass_rate", "pass_rate_std", "pass_rate_min",
                    "rolling_pass_min", "pass_rate_start"):
            if not math.isclose(methods[m][key], want[key], rel_tol=1e-6, abs_tol=1e-9):
                miss.append(f"{m}: summary {key}={methods[m][key]} but its metrics give {want[key]}")
    a, b = got["tg"]["pass_by_step"], got["grpo"]["pass_by_step"]
    steps = sorted(set(a) & set(b))
    gap = min(sum(a[s] - b[s] for s in steps[i:i + 3]) / 3 for i in range(len(steps) - 2))
    if not math.isclose(summary["tg_rolling_gap"], gap, rel_tol=1e-6, abs_tol=1e-9):
        miss.append(f"tg_rolling_gap {summary['tg_rolling_gap']} but the runs' metrics give {gap}")
    return miss


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_tg.demo.quick_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the quick demo's --out directory")
    ap.add_argument("--stdout", type=Path, required=True, help="a file holding the demo's printed output")
    args = ap.parse_args(argv)
    summary_path = args.out / "summary.json"
    if not summary_path.exists():
        print(f"quick_check: {summary_path} does not exist: did the demo finish?", file=sys.stderr)
        return 1
    summary = json.loads(summary_path.read_text())
    miss = check_summary(summary, args.stdout.read_text()) + check_run_dir(args.out)
    if not miss:
        miss = check_against_metrics(summary, args.out)
    for m in miss:
        print(f"quick_check: MISSED: {m}", file=sys.stderr)
    print(f"quick_check: {'all checks met' if not miss else f'{len(miss)} missed'} ({args.out})")
    return 1 if miss else 0


if __name__ == "__main__":
    sys.exit(main())
