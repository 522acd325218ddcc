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
import sys
from pathlib import Path
from typing import Any, Sequence

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
    curves = out / "curves.png"
    if not curves.exists() or curves.stat().st_size < 10_000:
        miss.append(f"{curves} was not drawn")
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
    miss = check_summary(json.loads(summary_path.read_text()), args.stdout.read_text()) + check_run_dir(args.out)
    for m in miss:
        print(f"quick_check: MISSED: {m}", file=sys.stderr)
    print(f"quick_check: {'all checks met' if not miss else f'{len(miss)} missed'} ({args.out})")
    return 1 if miss else 0


if __name__ == "__main__":
    sys.exit(main())
