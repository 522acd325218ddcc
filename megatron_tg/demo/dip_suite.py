"""Experiment D of ``docs/claims-2.md``: the cause of TG's mid-run dip in task success.

    python -m megatron_tg.demo --suite dip --out runs/dip [--seeds 0,1,2] [--jobs 2] [--build-only]
    python -m megatron_tg.demo --suite dip --out runs/dip --seeds 13,14,15,16,17   # the fix, once

Part 1's paper base, unchanged (:mod:`.paper_base`, seed 0). Nine arms per seed, 25 steps,
``recipes/demo_paper_cpu.yaml``, the same reward, each differing from its reference in one
setting (:data:`RUNS`): ``tg``; ``grpo`` (the probes' control); ``lambda_10``, ``lambda_0.1``,
``lr_low`` (H1); ``action_x4`` (H2); ``tg_ra`` and, on it, ``no_thinking_ra`` and
``thinking_only_ra`` (H3). The precondition and the hypotheses' verdicts are
:func:`.claims2_verdicts.dip`'s; the output is ``OUT/dip.json``.

The fix is fixed in advance (:data:`.claims2_verdicts.FIXES`): a call on exactly the fix seeds
13-17, in the held-out call's output directory, reads that call's first verdicts
(``OUT/heldout_first.json``), runs ``tg`` and ``tg_fix`` (H1 -> lr 1e-4, H2 -> action weight 4,
both when both are confirmed; none when neither is) and keeps its first verdicts in
``OUT/fix_first.json``; once that exists the fix seeds are spent and a later call is refused.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any, Mapping

from megatron_tg.demo import claims2 as K
from megatron_tg.demo import claims2_verdicts as V
from megatron_tg.demo import paper_base as PB
from megatron_tg.demo import paper_env as P
from megatron_tg.demo import suite2 as U
from megatron_tg.demo.stability_suite import CRITERIA

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "demo_paper_cpu.yaml"
RA = "objective.kl_token_normalization=rollout_assistant"
RUNS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("tg", "tg", ()), ("grpo", "grpo", ()),
    ("lambda_10", "tg", ("objective.kl_coef=10.0",)), ("lambda_0.1", "tg", ("objective.kl_coef=0.1",)),
    ("lr_low", "tg", (f"optimizer.lr={K.D_LR_LOW}",)),
    ("action_x4", "tg", (f"objective.kl_action_weight={K.D_ACTION_WEIGHT}",)),
    ("tg_ra", "tg", (RA,)), ("no_thinking_ra", "no_thinking", (RA,)),
    ("thinking_only_ra", "tg", (RA, "objective.distill_actions=false")))
"""(arm, objective.mode, overrides), in the order each seed makes them."""


def fix_plan(out: Path, log) -> tuple[int | None, tuple[str, ...]]:
    """(refusal exit status or None, the fix's overrides) for a call on the fix seeds."""
    first = out / U.FIRST[True]
    if first.exists():
        rec = json.loads(first.read_text())
        log(f"the fix was run once already ({first}: {json.dumps({k: v['verdict'] for k, v in rec['verdicts'].items()})}); "
            "first write wins: another try needs new seeds (18 on) and an amendment")
        return U.FIX_REFUSED, ()
    try:
        held = json.loads((out / U.FIRST[False]).read_text())
    except (OSError, ValueError):
        held = None
    if not held or held.get("suite") != "dip" or not held.get("seed_set", "").startswith("held-out"):
        log(f"no held-out dip record in {out / U.FIRST[False]}: the fix follows the held-out call, "
            "made first in this output directory")
        return U.FIX_REFUSED, ()
    verdicts = {k: v["verdict"] for k, v in held["verdicts"].items()}
    fx = V.fix_overrides(verdicts)
    log(f"held-out verdicts {json.dumps(verdicts)} -> tg_fix: {', '.join(fx) if fx else 'none'}")
    return None, fx


def run(a, py: str, log, base_overrides: Mapping[str, Any] | None = None, require_record: bool = True) -> int:
    """The suite (``a``: the demo's parsed arguments; ``base_overrides`` and ``require_record``
    False: a test's tiny base)."""
    from megatron_tg.demo.runs import convert, run_all

    refused = U.refuse_fix_seeds(a, log, allowed=True)
    if refused is not None:
        return refused
    if a.seeds and tuple(a.seeds) == K.FIX_SEEDS and (a.steps or K.STEPS) != K.STEPS:
        log(f"the fix runs once, at the pre-registered {K.STEPS} steps: --steps {a.steps} on the fix seeds is not run")
        return U.FIX_REFUSED
    ctx = U.start(a, log, "dip (experiment D)")
    out, seeds, t0 = ctx["out"], ctx["seeds"], time.perf_counter()
    runs, fixing = RUNS, seeds == K.FIX_SEEDS
    if fixing and not getattr(a, "build_only", False):
        refused, fx = fix_plan(out, log)
        if refused is not None:
            return refused
        if not fx:
            log("no hypothesis implying a fix (H1, H2) is confirmed: no fix is run (H3 alone implies none)")
            return 0
        runs = (RUNS[0], ("tg_fix", "tg", fx))
    recipe = U.recipe_for(a, RECIPE)
    log(f"paper base -> {out / 'base'}")
    base = PB.build(out / "base", seed=0, log=lambda s: log("  " + s), **dict(base_overrides or {}))
    line = "D base (part 1's): " + ", ".join(f"{k} {base[k]:.3f}" for k in (
        "success_no_hint", "search_lines_no_hint", "search_lines_all_hints")) + (" (cached)" if base.get("cached") else "")
    log(line)
    if getattr(a, "build_only", False):
        U.write_base_record("dip", {"D": base}, log)
        return 0
    if not U.bases_recorded({"D": base}, log, enforce=require_record):
        return U.BASE_UNRECORDED
    convert(out / "base", out / "base_megatron", py)
    p = U.plan(ctx["steps"], seeds, U.PAPER_RL_ARGS)
    specs = U.run_specs(runs, seeds)
    inputs = {"base_build": base["build_hash"], "recipe_sha256": hashlib.sha256(recipe.read_bytes()).hexdigest()}
    log(f"{len(specs)} RL runs of {p.steps} steps, {a.jobs} at a time: " + ", ".join(x.name for x in specs))
    got = run_all(specs, out, p, py, recipe, a.jobs, inputs)
    dirs = {arm: [got[f"{arm}-s{s}"] for s in seeds] for arm, _, _ in runs}
    m = U.measures(dirs, CRITERIA)
    v = V.dip(m)
    table = line + "\n" + U.seed_table(m, seeds, P.STYLE_CRITERIA)
    base_rec = {k: x for k, x in base.items() if isinstance(x, (int, float, str))}
    extra = {"base": base_rec, "recipe": str(recipe), "measures": m}
    if fixing:
        extra["fix_overrides"] = list(runs[1][2])
        return U.finish(ctx, "dip_fix", v, extra, table, time.perf_counter() - t0)
    return U.finish(ctx, "dip", v, extra, table, time.perf_counter() - t0,
                    footer=[f"reading: {V.reading(v)}",
                            f"the fix this implies (run once on seeds {','.join(map(str, K.FIX_SEEDS))}): "
                            + (", ".join(V.fix_overrides({k: x['verdict'] for k, x in v.items()})) or "none")])
