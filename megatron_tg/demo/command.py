"""The main job: the paper's didactic experiment (§5.1, Figures 1 and 3) at toy scale on CPU.

    python -m megatron_tg.demo --out runs/demo            # default: 4 RL runs
    python -m megatron_tg.demo --full --out runs/full     # + the KL direction x expert grid (20)
    python -m megatron_tg.demo --quick --out runs/quick   # CI-sized, seeded: a few minutes
    python -m megatron_tg.demo --suite phase --out runs/phase  # why reverse KL fails (:mod:`.phase`)
    python -m megatron_tg.demo --suite paper --out runs/paper  # Table 1, Figs 5-7 (:mod:`.paper_suite`)
    python -m megatron_tg.demo --suite paper --seeds 3,4,5,6,7 --out runs/paper  # its held-out verdicts
    python -m megatron_tg.demo --suite stability --out runs/stability  # docs/claims-2.md, S (:mod:`.stability_suite`)
    python -m megatron_tg.demo --suite dip --out runs/dip              # D, the dip (:mod:`.dip_suite`)
    python -m megatron_tg.demo --suite paper_config --out runs/pconf   # P (:mod:`.paper_config_suite`)

1. base model: a tiny Qwen3-MoE SFT'd on the key-lookup task (:mod:`.base_model`): it solves
   the task with the ``search`` tool, never uses the new ``lines=`` format unaided, and uses it
   when the feedback hint stands right before the tool-call turn. Saved as an HF checkpoint
   with its tokenizer, then converted with ``megatron-tg convert hf-to-megatron``;
2. RL from that base through the real TG loop (:mod:`.rl`: megatron-core trainer, embedded
   engine over SGLang's HTTP API, async rollout manager, judge, weight sync), criteria =
   task success (``answer``, primary) + new tool format (``search_lines``), three methods:
   ``grpo``, ``opsd`` and ``tg`` (the recipe's default KL direction and expert);
3. the KL-direction comparison, a fixed set of (direction, expert) variants (no winner is
   picked from the data): by default forward vs reverse KL with the EMA expert on seed 0
   (the ``tg`` run is the forward one); with ``--full`` the whole grid reverse / forward /
   jsd x shared / ema over 3 seeds (``--seeds``); the expert probe (the expert's own
   new-format rate, with the hint) every few steps;
4. the table (like the paper's Table 1), ``OUT/summary.json`` and ``OUT/curves.png``.

``--quick`` runs are seeded (``rollout.sampling_seed`` = the run's seed, ``max_staleness``
0: generation waits for each step's weights), so they do not depend on timing; the default
and full runs keep the recipe's one step of asynchrony (``--seeded`` turns seeding on).
The command prints the runs it will make before making them.

The command reports the issue's targets as measured and exits 0 whether they are met or not
(a reproduction reports; it is not a test). Exit 1 means a run failed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from megatron_tg.demo import base_config as BC
from megatron_tg.demo import base_model as B
from megatron_tg.demo import report as R
from megatron_tg.demo.runs import (DEFAULT, DIRECTIONS, EXPERTS, FULL, METHODS, QUICK, RECIPE, ROLLING, Plan,
                                   RunSpec, _log, _write_atomic, convert, recipe_defaults, run_all)


PART2_SUITES = {"stability": "megatron_tg.demo.stability_suite", "dip": "megatron_tg.demo.dip_suite",
                "paper_config": "megatron_tg.demo.paper_config_suite"}
"""docs/claims-2.md's experiments S, D and P: suite name -> its module."""


def targets(methods: dict[str, Any], wall: float, quick: bool,
            rolling_gap: float) -> dict[str, Any]:
    """The issue's targets as measured. ``rolling_gap``: the lowest, over steps, of TG's
    ``ROLLING``-step rolling task success minus GRPO's on the same seed (:func:`R.rolling_gap`)."""
    g, t = methods["grpo"], methods["tg"]
    reached = t["steps_to_0.8"]
    checks = {
        "grpo_criterion_rate_le_0.05": (g["criterion_rate"], g["criterion_rate"] <= 0.05),
        "tg_criterion_rate_ge_0.8": (t["criterion_rate"], t["criterion_rate"] >= 0.8),
        "tg_criterion_0.8_by_step_20": (math.inf if reached is None else reached,
                                        reached is not None and reached <= 20),
        "tg_pass_rate_ge_grpo_minus_0.05": (t["pass_rate"] - g["pass_rate"],
                                            t["pass_rate"] >= g["pass_rate"] - 0.05),
        f"tg_rolling{ROLLING}_pass_ge_grpo_minus_0.1": (rolling_gap, rolling_gap >= -0.1),
        "tg_criterion_rate_above_grpo": (t["criterion_rate"] - g["criterion_rate"],
                                         t["criterion_rate"] > g["criterion_rate"]),
    }
    if not quick:
        checks["wall_seconds_le_900"] = (wall, wall <= 900)
    return {k: {"measured": v, "met": bool(ok)} for k, (v, ok) in checks.items()}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_tg.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    a = ap.parse_args(argv)
    problem = _bad_arguments(a)
    if problem:
        ap.error(problem)
    return run(a)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", default="runs/demo", help="output directory (reused: a finished run with the same settings, base model and "
                         "recipe is kept)")
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="CI-sized and seeded: quick base, 25 steps, no comparison")
    size.add_argument("--full", action="store_true",
                      help="the whole comparison grid: reverse / forward / jsd x shared / ema, "
                           "3 seeds each (20 RL runs)")
    ap.add_argument("--steps", type=int, help="RL steps per run (default: 30; 25 with --quick)")
    ap.add_argument("--seeds", type=seed_list, metavar="N|S,S,...|A-B",
                    help="seeds: a count N (seeds 0..N-1; default: 1, 3 with --full) or the seeds "
                         "themselves, as a list (3,4,5; one seed: 5,) or a range (3-7); "
                         "--suite paper: default 0,1,2 (development), its pre-registered report "
                         "is --seeds 3,4,5,6,7 (docs/claims.md)")
    ap.add_argument("--no-compare", action="store_true", help="skip the KL-direction comparison")
    ap.add_argument("--seeded", action="store_true",
                    help="seed sampling and drop the asynchrony (always on with --quick)")
    ap.add_argument("--jobs", type=int, default=2, help="RL runs at a time (default 2: one per core)")
    ap.add_argument("--recipe", default=str(RECIPE), help="the RL recipe (default recipes/demo_cpu.yaml)")
    ap.add_argument("--suite", choices=("main", "phase", "paper", *PART2_SUITES), default="main",
                    help="main: the demo above; phase: base models with new-format no-hint "
                         "probability ~1e-6 / 1e-4 / 1e-2, each with GRPO, reverse+EMA and "
                         "forward+EMA TG at the quick size, seed 0 (9 RL runs); paper: Table 1 "
                         "and Figures 5-7 on the environment with thinking and four criteria "
                         "(7 runs per seed, seeds 0,1,2 unless --seeds; recipes/demo_paper_cpu.yaml; "
                         "rules: docs/claims.md); stability, dip, paper_config: experiments S, D "
                         "and P of docs/claims-2.md (default seeds: its held-out 8-12; "
                         "--seeds 0,1,2 for the development ones)")
    ap.add_argument("--build-only", action="store_true",
                    help="--suite stability/dip/paper_config: build the base(s) only and write "
                         "their build hashes and metrics to docs/results/claims2-<suite>-base.json, "
                         "to be committed before any RL run from them (docs/claims-2.md)")
    ap.add_argument("--phase-base", choices=("full", "quick"), default="full",
                    help="--suite phase: the base models' SFT size (full: the default build, "
                         "whose no-hint probability is ~1e-6; quick: the --quick build's)")


def seed_list(text: str) -> tuple[int, ...]:
    """``--seeds``: "N" = the first N seeds (0..N-1, as before lists existed); "3,4,5" (or
    "5," for one seed) = those seeds; "3-7" = 3 to 7 inclusive."""
    text = text.strip()
    try:
        if "," in text:
            seeds = tuple(int(x) for x in text.split(",") if x.strip())
        elif "-" in text.lstrip("-"):
            lo, hi = text.split("-", 1)
            seeds = tuple(range(int(lo), int(hi) + 1))
        else:
            n = int(text)
            if n < 1:
                raise argparse.ArgumentTypeError(f"a count of seeds must be at least 1, got {n}")
            seeds = tuple(range(n))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a count, list or range of seeds: {text!r}") from None
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"seeds must be distinct integers >= 0, got {text!r}")
    return seeds


def _bad_arguments(a: argparse.Namespace) -> str | None:
    for name, value, least in (("--steps", a.steps, 3), ("--jobs", a.jobs, 1)):
        if value is not None and value < least:
            return f"{name} must be at least {least}, got {value}"
    if getattr(a, "suite", "main") == "phase" and (getattr(a, "full", False) or a.seeds or a.no_compare):
        return "--suite phase has its own fixed runs (quick size, seed 0): drop --full/--seeds/--no-compare"
    if getattr(a, "suite", "main") == "paper" and (getattr(a, "full", False) or a.quick or a.no_compare):
        return "--suite paper has its own fixed runs: drop --full/--quick/--no-compare (--seeds/--steps set their number and length)"
    if getattr(a, "suite", "main") in PART2_SUITES and (getattr(a, "full", False) or a.quick or a.no_compare):
        return (f"--suite {a.suite} has its own fixed runs: drop --full/--quick/--no-compare "
                "(--seeds/--steps set their number and length)")
    if getattr(a, "build_only", False) and getattr(a, "suite", "main") not in PART2_SUITES:
        return f"--build-only is for --suite {'/'.join(PART2_SUITES)}"
    if not Path(a.recipe).is_file():
        return f"--recipe {a.recipe}: no such file"
    return None


def run(a: argparse.Namespace) -> int:
    """``megatron-tg demo`` (the parsed arguments of :func:`add_arguments`)."""
    problem = _bad_arguments(a)
    if problem:
        print(f"demo: error: {problem}", file=sys.stderr)
        return 2
    try:
        if getattr(a, "suite", "main") in PART2_SUITES:
            import importlib

            return importlib.import_module(PART2_SUITES[a.suite]).run(a, sys.executable, _log)
        if getattr(a, "suite", "main") == "paper":
            from megatron_tg.demo import paper_suite

            return paper_suite.run(a, sys.executable, _log)
        if getattr(a, "suite", "main") == "phase":
            from megatron_tg.demo import phase

            base = dict(BC.QUICK) if a.phase_base == "quick" else {}
            plan = Plan(**{**QUICK.__dict__, "heldout": 0, "base_overrides": base,
                           **({"steps": a.steps} if a.steps is not None else {})})
            return phase.run(a, plan, Path(a.recipe).resolve(), sys.executable, _log)
        return _main(a)
    except RuntimeError as exc:  # a conversion or an RL run failed: its log tail is in the message
        print(f"demo: error: {exc}", file=sys.stderr)
        return 1


def choose_plan(a: argparse.Namespace) -> Plan:
    plan = QUICK if a.quick else FULL if getattr(a, "full", False) else DEFAULT
    over: dict[str, Any] = {}
    if a.steps is not None:
        over["steps"] = a.steps
    if a.seeds is not None:
        over["seeds"] = tuple(a.seeds)
    if a.no_compare:
        over["variants"] = ()
    if getattr(a, "seeded", False):
        over["seeded"] = True
    return Plan(**{**plan.__dict__, **over})


def variant_name(direction: str, expert: str) -> str:
    return f"{direction}+{expert}"


def plan_runs(plan: Plan, default: tuple[str, str]) -> tuple[list[RunSpec], dict[str, list[str]]]:
    """(every run to make, variant name -> its runs' names). The method rows run seed 0; seed 0
    of the recipe's own (direction, expert) is the ``tg`` row, not a second run."""
    specs = [RunSpec(m, m, 0) for m in METHODS]
    variants: dict[str, list[str]] = {}
    for direction, expert in plan.variants:
        if direction not in DIRECTIONS or expert not in EXPERTS:
            raise ValueError(f"comparison variant ({direction!r}, {expert!r}): direction must be "
                             f"one of {DIRECTIONS}, expert one of {EXPERTS}")
        names = []
        for s in plan.seeds:
            if (direction, expert) == default and s == 0:
                names.append("tg")
                continue
            spec = RunSpec(f"tg-{direction}-{expert}-s{s}", "tg", s, direction, expert)
            specs.append(spec)
            names.append(spec.name)
        variants[variant_name(direction, expert)] = names
    return specs, variants


def compare(dirs: dict[str, Path], variants: dict[str, list[str]], plan: Plan, out: Path,
            default: tuple[str, str]) -> dict[str, Any]:
    """The comparison's summary: per variant, the seed aggregate of its runs (no winner)."""
    per = {v: {**R.aggregate([R.summarize_run(dirs[n], plan.last) for n in names]),
               "rolling_pass_min": [R.rolling_min(dirs[n]) for n in names]}
           for v, names in variants.items()}
    return {"default": {"kl_direction": default[0], "expert": default[1]},
            "variants_note": "direction+expert; every variant runs every seed (a fixed grid, "
                             "no variant is chosen from the results)",
            "seeds": list(plan.seeds), "variants": per,
            "runs": {k: [str(dirs[n].relative_to(out)) for n in v] for k, v in variants.items()}}


def _main(a: argparse.Namespace) -> int:
    plan = choose_plan(a)
    out, recipe, py = Path(a.out).resolve(), Path(a.recipe).resolve(), sys.executable
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    _log(f"base model -> {out / 'base'}")
    base = B.build_base_model(out / "base", seed=0, log=lambda s: _log("  " + s), **plan.base_overrides)
    _log(f"base: task success {base['success_no_hint']:.3f}, new format without hint "
         f"{base['new_format_no_hint']:.3f}, with hint {base['new_format_hint']:.3f}"
         f"{' (cached)' if base.get('cached') else ''}")
    convert(out / "base", out / "base_megatron", py)

    default = recipe_defaults(recipe)  # the headline tg run's (direction, expert)
    inputs = {"base_build": base["build_hash"],
              "recipe_sha256": hashlib.sha256(recipe.read_bytes()).hexdigest()}
    specs, variants = plan_runs(plan, default)
    _log(f"{len(specs)} RL runs of {plan.steps} steps, {a.jobs} at a time"
         f"{' (seeded, no staleness)' if plan.seeded else ''}: " + ", ".join(s.name for s in specs))
    _log(f"tg = {variant_name(*default)} (the recipe's); comparison: "
         + (", ".join(f"{v} x {len(n)} seed(s)" for v, n in variants.items()) or "none"))
    dirs = run_all(specs, out, plan, py, recipe, a.jobs, inputs)
    comparison = compare(dirs, variants, plan, out, default) if variants else None

    methods = {}
    for m in METHODS:
        methods[m] = {**R.summarize_run(dirs[m], plan.last), "rolling_pass_min": R.rolling_min(dirs[m]),
                      "base_criterion_rate": base["new_format_no_hint"],
                      "base_pass_rate": base["success_no_hint"], "run": str(dirs[m].relative_to(out))}
    methods["tg"]["kl_direction"], methods["tg"]["expert"] = default
    gap = R.rolling_gap(dirs["tg"], dirs["grpo"], ROLLING)
    wall = time.perf_counter() - t_start
    summary: dict[str, Any] = {
        "methods": methods, "steps": plan.steps, "wall_seconds": round(wall, 1),
        "last_steps_averaged": plan.last, "quick": a.quick, "seeded": plan.seeded,
        "runs": [s.name for s in specs],
        "definitions": {"criterion_rate": R.CRITERION, "pass_rate": R.PASS,
                        "rolling_pass_min": f"lowest {ROLLING}-step rolling mean of the pass rate",
                        "tg_rolling_gap": f"lowest over steps of tg's {ROLLING}-step rolling pass "
                                          "rate minus grpo's (same seed, same steps)"},
        "tg_rolling_gap": gap,
        "base": {k: base.get(k) for k in ("n_params", "success_no_hint", "new_format_no_hint",
                                          "new_format_hint", "success_hint", "p_branch_no_hint_mean",
                                          "expert_kl_branch_mean", "expert_kl_off_branch_max")},
        "targets": targets(methods, wall, a.quick, gap),
    }
    if comparison is not None:
        summary["kl_directions"] = comparison
    _write_atomic(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    png = R.plot(out / "curves.png", {m: dirs[m] for m in METHODS},
                 {k: [dirs[n] for n in v] for k, v in variants.items()} if comparison else None)

    print()
    print(R.methods_table(methods, plan.last))
    if comparison is not None:
        print()
        print(R.directions_table(comparison["variants"]))
        print(f"recipe default (the tg row): {default[0]} KL, {default[1]} expert")
    print()
    for k, v in summary["targets"].items():
        print(f"target {k:<42} {'met   ' if v['met'] else 'MISSED'} (measured {v['measured']:.3f})")
    print(f"\nwall {wall:.0f} s; summary {out / 'summary.json'}; plot {png}")
    return 0

