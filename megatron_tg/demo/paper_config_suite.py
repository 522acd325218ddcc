"""Experiment P of ``docs/claims-2.md``: the paper's configuration where it should work.

    python -m megatron_tg.demo --suite paper_config --out runs/paper_config [--seeds 0,1,2] [--jobs 2]

Three full-size main-environment bases (:mod:`.base_model`, seed 0) at the target no-hint
probabilities of the new format 1e-4, 1e-3 and 1e-2 (:data:`LEVELS`); each level's measured
``p_branch_no_hint_mean`` is printed, and a held-out call stops before any RL run when a
level's is not within a factor :data:`.claims2.P_LEVEL_FACTOR` of its target. ``--build-only``
builds the three and writes their build hashes and metrics to
``docs/results/claims2-paper_config-base.json`` for committing; an RL call on a base whose
hash is not committed there is refused (exit 4). On each level,
per seed, 25 steps of ``recipes/demo_cpu.yaml`` (the main demo's reward): ``grpo``, and
``paper_tg`` (reverse KL, the shared expert, the failed criteria as feedback, no sampling with
the hint). The verdicts per level and the phase boundary are :func:`.claims2_verdicts.paper_config`'s;
the output is ``OUT/paper_config.json``, each level's runs under ``OUT/p<level>/``. The report
says that ``paper_tg`` is the paper's objective under the demo's optimizer.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any, Mapping

from megatron_tg.demo import base_model as B
from megatron_tg.demo import claims2 as K
from megatron_tg.demo import claims2_verdicts as V
from megatron_tg.demo import phase
from megatron_tg.demo import suite2 as U

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "demo_cpu.yaml"
LEVELS: dict[str, dict[str, float]] = {
    "1e-4": dict(phase.LEVELS["1e-4"]),
    # Interpolated between the phase levels on their measured log-log line: branch weights
    # 0.003 and 0.2 gave p_branch 4.83e-5 and 5.1e-3 (docs/demo.md, the phase experiment), a
    # slope of 1.11 in log p per log w; p = 1e-3 on that line is w = 0.046. Its base build
    # (full size, seed 0; base_model.build_base_model with these overrides, before any RL run
    # on it, and before the base modules' behaviour-neutral split, which changed the build
    # hash, then 134e28e4e062eb5b) measured p_branch_no_hint_mean 8.4e-4 (max 1.4e-3), task
    # success 0.984 without hint: within the factor of 3 the document asks. Built again on
    # another CPU (the machine the runs are made on) the same settings measured 2.62e-4,
    # outside it, and the 1e-4 and 1e-2 levels 4.83e-5 and 5.06e-3: rebuilt once, as
    # docs/claims-2.md's P rule allows, at the weight where the line through that machine's
    # 0.046 and 0.2 points (log-log slope 2.0) gives 1e-3: w = 0.09.
    "1e-3": dict(new_no_hint_fraction=0.05, new_no_hint_branch_weight=0.09),
    "1e-2": dict(phase.LEVELS["1e-2"]),
}
"""Target level -> base build overrides (the phase experiment's 1e-4 and 1e-2 ones, and 1e-3)."""
RUNS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("grpo", "grpo", ()),
    ("paper_tg", "tg", ("objective.kl_direction=reverse", "objective.expert=shared",
                        "objective.expert_feedback=failing", "objective.hinted_samples=0")))
"""(arm, objective.mode, overrides), in the order each seed makes them."""
CRITERIA = ("answer", "search_lines")
OPTIMIZER_NOTE = ("paper_tg: the paper's objective (reverse KL, shared expert, failed criteria as f_t, no "
                  "hinted samples) under the demo's optimizer (Adam beta1 0, lr 3e-4, clipping at 1, 25 steps)")


def within_factor(p: float, level: str, factor: float = K.P_LEVEL_FACTOR) -> bool:
    t = float(level)
    return p == p and t / factor <= p <= t * factor


def run(a, py: str, log, base_overrides: Mapping[str, Any] | None = None, require_record: bool = True) -> int:
    """The suite (``a``: the demo's parsed arguments; ``base_overrides`` and ``require_record``
    False: tests' tiny bases)."""
    from megatron_tg.demo.runs import convert, run_all

    refused = U.refuse_fix_seeds(a, log)
    if refused is not None:
        return refused
    ctx = U.start(a, log, "paper_config (experiment P)")
    out, seeds, t0 = ctx["out"], ctx["seeds"], time.perf_counter()
    recipe = U.recipe_for(a, RECIPE)
    recipe_sha = hashlib.sha256(recipe.read_bytes()).hexdigest()
    bases: dict[str, dict[str, Any]] = {}
    for lvl in K.P_LEVELS:  # every base first: the gate is decided before any RL run
        lo = out / f"p{lvl}"
        log(f"base {lvl} -> {lo / 'base'} ({LEVELS[lvl]})")
        b = bases[lvl] = B.build_base_model(lo / "base", seed=0, log=lambda s: log("  " + s),
                                            **{**LEVELS[lvl], **dict(base_overrides or {})})
        p = b["p_branch_no_hint_mean"]
        log(f"base {lvl}: p_branch no hint mean {p:.2e} (max {b['p_branch_no_hint_max']:.2e}; within "
            f"x{K.P_LEVEL_FACTOR} of {lvl}: {'yes' if within_factor(p, lvl) else 'no'}), new format without "
            f"hint {b['new_format_no_hint']:.3f}, task {b['success_no_hint']:.3f}, with hint "
            f"{b['new_format_hint']:.3f}{' (cached)' if b.get('cached') else ''}")
    if getattr(a, "build_only", False):
        U.write_base_record("paper_config", bases, log)
        return 0
    miss = [f"{lvl} ({b['p_branch_no_hint_mean']:.2e})" for lvl, b in bases.items()
            if not within_factor(b["p_branch_no_hint_mean"], lvl)]
    if not U.base_gate(ctx, not miss, f"every level's p_branch_no_hint_mean within a factor {K.P_LEVEL_FACTOR} "
                       f"of its target{'; missed: ' + ', '.join(miss) if miss else ''}", log):
        return U.BASE_REFUSED
    if not U.bases_recorded(bases, log, enforce=require_record):
        return U.BASE_UNRECORDED
    pl = U.plan(ctx["steps"], seeds, ())
    m: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for lvl in K.P_LEVELS:
        lo = out / f"p{lvl}"
        convert(lo / "base", lo / "base_megatron", py)
        specs = U.run_specs(RUNS, seeds)
        log(f"level {lvl}: {len(specs)} RL runs of {pl.steps} steps, {a.jobs} at a time: "
            + ", ".join(x.name for x in specs))
        got = run_all(specs, lo, pl, py, recipe, a.jobs,
                      {"base_build": bases[lvl]["build_hash"], "recipe_sha256": recipe_sha})
        m[lvl] = U.measures({arm: [got[f"{arm}-s{s}"] for s in seeds] for arm, _, _ in RUNS}, CRITERIA)
    v = V.paper_config(m)
    named = {lvl: f"{lvl} (measured {bases[lvl]['p_branch_no_hint_mean']:.2e})" for lvl in K.P_LEVELS}
    lines = [f"level {lvl}: p_branch_no_hint_mean {bases[lvl]['p_branch_no_hint_mean']:.2e}, overrides "
             f"{LEVELS[lvl]}\n" + "\n".join(
                 f"  {arm:<9} seed {s:>3}: final search_lines {U._f(x['final']['search_lines'], '.3f')}, "
                 f"final pass {U._f(x['pass'], '.3f')}, worst {U._f(x['worst'], '.3f')}"
                 for arm, xs in m[lvl].items() for s, x in zip(seeds, xs)) for lvl in K.P_LEVELS]
    base_rec = {lvl: {k: x for k, x in b.items() if isinstance(x, (int, float, str))} for lvl, b in bases.items()}
    return U.finish(ctx, "paper_config", v["levels"],
                    {"boundary": v["boundary"], "levels": LEVELS, "bases": base_rec, "recipe": str(recipe),
                     "measures": m}, "\n".join(lines), time.perf_counter() - t0,
                    footer=[f"phase boundary (Figures 1 and 3): {v['boundary']}",
                            "levels by measured probability: " + ", ".join(named.values()), OPTIMIZER_NOTE])
