"""Experiment S of ``docs/claims-2.md``: stability against a GRPO that learns.

    python -m megatron_tg.demo --suite stability --out runs/stability [--seeds 0,1,2] [--jobs 2]

The paper base (:mod:`.paper_base`, seed 0) with ``wrong_answer_fraction=0.5``: half its
demonstrations answer with a wrong value, so it fails the task on about half its episodes and
GRPO has a task gradient from step 1. Its measured ``success_no_hint`` is printed; outside
:data:`.claims2.S_BASE_SUCCESS_RANGE` a held-out call stops before any RL run. Three arms per
seed, 25 steps, ``recipes/demo_paper_cpu.yaml``, the same reward (all four criteria):
``grpo``, ``tg`` (part 1's) and ``placebo`` (``tg`` with the neutral sentence in the expert's
context, ``objective.expert_feedback=placebo``). The tests and claims are
:func:`.claims2.stability`'s; the output is ``OUT/stability.json``.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any, Mapping

from megatron_tg.demo import claims2 as K
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
        "success_all_hints")) + f", wrong_answer_fraction {K.S_WRONG_ANSWER_FRACTION:g}"
        + (" (cached)" if base.get("cached") else ""))


def run(a, py: str, log, base_overrides: Mapping[str, Any] | None = None) -> int:
    """The suite (``a``: the demo's parsed arguments). ``base_overrides``: the base build's
    settings on top of the pre-registered fraction (tests build a tiny one)."""
    from megatron_tg.demo.runs import convert, run_all

    refused = U.refuse_fix_seeds(a, log)
    if refused is not None:
        return refused
    ctx = U.start(a, log, "stability (experiment S)")
    out, seeds, t0 = ctx["out"], ctx["seeds"], time.perf_counter()
    recipe = U.recipe_for(a, RECIPE)
    log(f"S base -> {out / 'base'}")
    base = PB.build(out / "base", seed=0, log=lambda s: log("  " + s),
                    **{"wrong_answer_fraction": K.S_WRONG_ANSWER_FRACTION, **dict(base_overrides or {})})
    log(base_line(base))
    lo, hi = K.S_BASE_SUCCESS_RANGE
    s = base["success_no_hint"]
    if not U.base_gate(ctx, lo <= s <= hi, f"success_no_hint {s:.3f} in [{lo:g}, {hi:g}]", log):
        return U.BASE_REFUSED
    convert(out / "base", out / "base_megatron", py)
    p = U.plan(ctx["steps"], seeds, U.PAPER_RL_ARGS)
    specs = U.run_specs(RUNS, seeds)
    inputs = {"base_build": base["build_hash"], "recipe_sha256": hashlib.sha256(recipe.read_bytes()).hexdigest()}
    log(f"{len(specs)} RL runs of {p.steps} steps, {a.jobs} at a time: " + ", ".join(x.name for x in specs))
    got = run_all(specs, out, p, py, recipe, a.jobs, inputs)
    dirs = {arm: [got[f"{arm}-s{s}"] for s in seeds] for arm, _, _ in RUNS}
    m = U.measures(dirs, CRITERIA)
    v = K.stability(m, P.STYLE_CRITERIA)
    base_rec = {k: x for k, x in base.items() if isinstance(x, (int, float, str))}
    return U.finish(ctx, "stability", v, {"base": base_rec, "recipe": str(recipe), "measures": m},
                    base_line(base) + "\n" + U.seed_table(m, seeds, P.STYLE_CRITERIA), time.perf_counter() - t0)
