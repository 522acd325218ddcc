"""Experiment S of ``docs/claims-2.md``: stability against a GRPO that learns.

    python -m megatron_tg.demo --suite stability --out runs/stability [--seeds 0,1,2] [--jobs 2]

The paper base (:mod:`.paper_base`, seed 0) with ``skip_search_fraction=0.3``: 30 % of its
demonstrations answer at once, without the search and without a value, so about half its
hint-less decisions skip the search, it fails the task on about half its episodes by that one
early decision, and GRPO has a task gradient from step 1 (the two settings before,
``wrong_answer_fraction=0.5`` and ``skip_search_fraction=0.5`` with a wrong value, built bases
that had lost the copy: docs/claims-2.md's amendments). Its measured ``success_no_hint`` is printed; outside
:data:`.claims2.S_BASE_SUCCESS_RANGE` a held-out call stops before any RL run. Three arms per
seed, 25 steps, ``recipes/demo_paper_cpu.yaml``, the same reward (all four criteria):
``grpo``, ``tg`` (part 1's) and ``placebo`` (``tg`` with the neutral sentence in the expert's
context, ``objective.expert_feedback=placebo``). The tests and claims are
:func:`.claims2_verdicts.stability`'s; the output is ``OUT/stability.json``. A held-out call
first runs (or reuses) grpo and tg on development seeds 0-2 for the power check.

The base is fixed before any RL run: ``--build-only`` builds it and writes its build hash and
metrics to ``docs/results/claims2-stability-base.json`` for committing; an RL call on a base
whose hash is not committed there is refused (exit 4).
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any, Mapping

from megatron_tg.demo import claims2 as K
from megatron_tg.demo import claims2_verdicts as V
from megatron_tg.demo import paper_base as PB
from megatron_tg.demo import paper_env as P
from megatron_tg.demo import suite2 as U

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "demo_paper_cpu.yaml"
RUNS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("grpo", "grpo", ()), ("tg", "tg", ()), ("placebo", "tg", ("objective.expert_feedback=placebo",)))
"""(arm, objective.mode, overrides), in the order each seed makes them."""
CRITERIA = ("answer", *P.STYLE_CRITERIA)


def base_line(base: Mapping[str, Any]) -> str:
    return ("S base: " + ", ".join(f"{k} {base[k]:.3f}" for k in (
        "success_no_hint", "search_lines_no_hint", "answer_style_no_hint", "brief_thinking_no_hint",
        "success_all_hints")) + f", skip_search_fraction {K.S_SKIP_SEARCH_FRACTION:g}"
        + (" (cached)" if base.get("cached") else ""))


def _power(ctx, a, py: str, recipe: Path, inputs: Mapping[str, str], log, got=None) -> dict[str, Any] | None:
    """The power check from development seeds 0-2 (grpo and tg, reused when made already):
    before a held-out call's runs, or from a development call on exactly those seeds."""
    from megatron_tg.demo.runs import run_all

    if ctx["kind"].startswith("held-out"):
        p = U.plan(ctx["steps"], K.DEV_SEEDS, U.PAPER_RL_ARGS)
        specs = U.run_specs([r for r in RUNS if r[0] in ("grpo", "tg")], K.DEV_SEEDS)
        log(f"power check: {len(specs)} development runs (seeds {','.join(map(str, K.DEV_SEEDS))})")
        got = run_all(specs, ctx["out"], p, py, recipe, a.jobs, dict(inputs))
    elif got is None or tuple(ctx["seeds"]) != K.DEV_SEEDS:
        return None
    dev = U.measures({arm: [got[f"{arm}-s{s}"] for s in K.DEV_SEEDS] for arm in ("grpo", "tg")}, CRITERIA)
    pw = V.power(dev)
    log(f"power (development seeds {','.join(map(str, K.DEV_SEEDS))}): sd of worst(tg) - worst(grpo) "
        f"{U._f(pw['sd'], '.3f')}, a {len(K.HELDOUT_SEEDS)}-seed 95% half-width {U._f(pw['half_width'], '.3f')}"
        + ("" if pw["separates"] is not False else
           f" > {K.S_POWER_HALF_WIDTH:g}: test 2 (worst_vs_grpo) cannot separate the margin from noise"))
    return pw


def run(a, py: str, log, base_overrides: Mapping[str, Any] | None = None, require_record: bool = True) -> int:
    """The suite (``a``: the demo's parsed arguments). ``base_overrides``: the base build's
    settings on top of the pre-registered fraction, and ``require_record`` False: a test's tiny
    base, whose unrecorded hash is then only warned about."""
    from megatron_tg.demo.runs import convert, run_all

    refused = U.refuse_fix_seeds(a, log)
    if refused is not None:
        return refused
    ctx = U.start(a, log, "stability (experiment S)")
    out, seeds, t0 = ctx["out"], ctx["seeds"], time.perf_counter()
    recipe = U.recipe_for(a, RECIPE)
    log(f"S base -> {out / 'base'}")
    base = PB.build(out / "base", seed=0, log=lambda s: log("  " + s),
                    **{"skip_search_fraction": K.S_SKIP_SEARCH_FRACTION, **dict(base_overrides or {})})
    log(base_line(base))
    lo, hi = K.S_BASE_SUCCESS_RANGE
    s = base["success_no_hint"]
    ok = lo <= s <= hi
    if getattr(a, "build_only", False):
        log(f"success_no_hint {s:.3f} {'in' if ok else 'OUTSIDE'} [{lo:g}, {hi:g}]")
        U.write_base_record("stability", {"S": base}, log)
        return 0
    if not U.base_gate(ctx, ok, f"success_no_hint {s:.3f} in [{lo:g}, {hi:g}]", log):
        return U.BASE_REFUSED
    if not U.bases_recorded({"S": base}, log, enforce=require_record):
        return U.BASE_UNRECORDED
    convert(out / "base", out / "base_megatron", py)
    inputs = {"base_build": base["build_hash"], "recipe_sha256": hashlib.sha256(recipe.read_bytes()).hexdigest()}
    pw = _power(ctx, a, py, recipe, inputs, log)
    p = U.plan(ctx["steps"], seeds, U.PAPER_RL_ARGS)
    specs = U.run_specs(RUNS, seeds)
    log(f"{len(specs)} RL runs of {p.steps} steps, {a.jobs} at a time: " + ", ".join(x.name for x in specs))
    got = run_all(specs, out, p, py, recipe, a.jobs, inputs)
    if pw is None:
        pw = _power(ctx, a, py, recipe, inputs, log, got)
    dirs = {arm: [got[f"{arm}-s{s}"] for s in seeds] for arm, _, _ in RUNS}
    m = U.measures(dirs, CRITERIA)
    v = V.stability(m, P.STYLE_CRITERIA, pw)
    base_rec = {k: x for k, x in base.items() if isinstance(x, (int, float, str))}
    return U.finish(ctx, "stability", v, {"base": base_rec, "recipe": str(recipe), "measures": m, "power": pw},
                    base_line(base) + "\n" + U.seed_table(m, seeds, P.STYLE_CRITERIA), time.perf_counter() - t0)
