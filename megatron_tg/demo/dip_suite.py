"""Experiment D of ``docs/claims-2.md``: the cause of TG's mid-run dip in task success.

    python -m megatron_tg.demo --suite dip --out runs/dip [--seeds 0,1,2] [--jobs 2]

Part 1's paper base, unchanged (:mod:`.paper_base`, seed 0). Six arms per seed, 25 steps,
``recipes/demo_paper_cpu.yaml``, the same reward:

=============  ==========================================  ==========
arm            what                                        tests
=============  ==========================================  ==========
tg             part 1's tg                                 every one
lambda_10      ``objective.kl_coef=10``                    H1
lr_low         ``optimizer.lr=1.0e-4`` (a third of 3e-4)   H1
norm_global    ``objective.kl_token_normalization=global`` H2
no_thinking    ``mode=no_thinking``                        H3
thinking_only  ``objective.distill_actions=false``         H3
=============  ==========================================  ==========

The hypotheses' verdicts are :func:`.claims2.dip`'s; the output is ``OUT/dip.json``. No fix
is defined yet (a fix is an amendment of ``docs/claims-2.md`` with its arm ``tg_fix``), so
this suite (like the other two) refuses the fix seeds 13-17.
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
from megatron_tg.demo.stability_suite import CRITERIA

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "demo_paper_cpu.yaml"
RUNS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("tg", "tg", ()), ("lambda_10", "tg", ("objective.kl_coef=10.0",)),
    ("lr_low", "tg", (f"optimizer.lr={K.D_LR_LOW}",)),
    ("norm_global", "tg", ("objective.kl_token_normalization=global",)),
    ("no_thinking", "no_thinking", ()), ("thinking_only", "tg", ("objective.distill_actions=false",)))
"""(arm, objective.mode, overrides), in the order each seed makes them."""


def run(a, py: str, log, base_overrides: Mapping[str, Any] | None = None) -> int:
    """The suite (``a``: the demo's parsed arguments; ``base_overrides``: tests' tiny base)."""
    from megatron_tg.demo.runs import convert, run_all

    refused = U.refuse_fix_seeds(a, log)
    if refused is not None:
        return refused
    ctx = U.start(a, log, "dip (experiment D)")
    out, seeds, t0 = ctx["out"], ctx["seeds"], time.perf_counter()
    recipe = U.recipe_for(a, RECIPE)
    log(f"paper base -> {out / 'base'}")
    base = PB.build(out / "base", seed=0, log=lambda s: log("  " + s), **dict(base_overrides or {}))
    line = "D base (part 1's): " + ", ".join(f"{k} {base[k]:.3f}" for k in (
        "success_no_hint", "search_lines_no_hint", "search_lines_all_hints")) + (" (cached)" if base.get("cached") else "")
    log(line)
    convert(out / "base", out / "base_megatron", py)
    p = U.plan(ctx["steps"], seeds, U.PAPER_RL_ARGS)
    specs = U.run_specs(RUNS, seeds)
    inputs = {"base_build": base["build_hash"], "recipe_sha256": hashlib.sha256(recipe.read_bytes()).hexdigest()}
    log(f"{len(specs)} RL runs of {p.steps} steps, {a.jobs} at a time: " + ", ".join(x.name for x in specs))
    got = run_all(specs, out, p, py, recipe, a.jobs, inputs)
    dirs = {arm: [got[f"{arm}-s{s}"] for s in seeds] for arm, _, _ in RUNS}
    m = U.measures(dirs, CRITERIA)
    v = K.dip(m, P.STYLE_CRITERIA)
    ratios = [K.update_ratio(x, y) for x, y in zip(m["lambda_10"], m["tg"])]
    table = (line + "\n" + U.seed_table(m, seeds, P.STYLE_CRITERIA)
             + "\nupdate ratio lambda_10 / tg (steps 1..10) per seed: " + ", ".join(U._f(r, ".3f") for r in ratios)
             + "\nno fix defined: none run")
    base_rec = {k: x for k, x in base.items() if isinstance(x, (int, float, str))}
    return U.finish(ctx, "dip", v, {"base": base_rec, "recipe": str(recipe), "measures": m,
                                    "update_ratio_lambda_10": ratios, "fix": "none defined"},
                    table, time.perf_counter() - t0)
