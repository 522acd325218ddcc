"""The phase experiment: where reverse KL starts to work, and where GRPO alone does.

    python -m megatron_tg.demo --suite phase --out runs/phase --jobs 1 [--phase-base quick]

Three quick-size base models that differ only in how likely the new tool format is without
the hint (the no-hint probability of its branch token, :func:`.base_eval.branch_probabilities`,
measured by each build's own evaluation: ``p_branch_no_hint_mean``): the paper's ~1e-6 and,
with :attr:`.base_config.BaseModelConfig.new_no_hint_fraction` /
``new_no_hint_branch_weight``, ~1e-4 and ~1e-2. On each: GRPO alone, TG with reverse KL and
TG with forward KL (both with the EMA expert), seed 0, seeded sampling, no staleness (the
``--quick`` plan's RL runs). The bases are the default (full-size, 400-step) build
(``--phase-base full``): the quick build's own no-hint probability is ~3e-5, not ~1e-6
(``--phase-base quick`` runs the suite on quick builds). Printed per run: the final rates, when the format reached 0.8, the rolling
task gap to the level's GRPO run, and the KL diagnostics on the rescue rows (gated rows where
the expert puts >= 0.5 of its mass on tokens the student gives < 1e-4): on how many steps
there were any, the mean rescue mass over the gated tokens of step 1 (``kl/rescue_mass``), the largest reverse-KL and the smallest forward-KL
logit-gradient norm there. The order runs reverse and GRPO at 1e-4 and 1e-2 first, so a cut
run still answers the main question.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path
from typing import Any

from megatron_tg.demo import base_model as B
from megatron_tg.demo import report as R

LEVELS: dict[str, dict[str, float]] = {
    "1e-6": {},
    "1e-4": dict(new_no_hint_fraction=0.05, new_no_hint_branch_weight=0.003),
    "1e-2": dict(new_no_hint_fraction=0.05, new_no_hint_branch_weight=0.2),
}
"""Target no-hint probability -> base model overrides (on top of :data:`.base_config.QUICK`).
The targets are names; the achieved probability is measured and printed."""

RUNS = (("grpo", "grpo", None), ("reverse", "tg", "reverse"), ("forward", "tg", "forward"))
"""(row name, objective.mode, objective.kl_direction); the TG runs use the EMA expert."""

ORDER = (("1e-4", "grpo"), ("1e-4", "reverse"), ("1e-2", "grpo"), ("1e-2", "reverse"),
         ("1e-6", "grpo"), ("1e-6", "reverse"), ("1e-4", "forward"), ("1e-2", "forward"),
         ("1e-6", "forward"))


def _diagnostics(run_dir: Path) -> dict[str, Any]:
    rows = [r for r in R.read_metrics(run_dir) if r.get("step", 0) >= 1]
    rescue = [r for r in rows if "kl/rescue_grad_reverse_max" in r]
    mass = R.series(rows, "kl/rescue_mass_max")
    first = rows[0].get("kl/rescue_mass", math.nan) if rows else math.nan
    return {"rescue_steps": len(rescue), "steps": len(rows), "rescue_mass_step1": first,
            "rescue_mass_max": max(mass) if mass else math.nan,
            "rescue_grad_reverse_max": max((r["kl/rescue_grad_reverse_max"] for r in rescue), default=math.nan),
            "rescue_grad_forward_min": min((r["kl/rescue_grad_forward_min"] for r in rescue), default=math.nan)}


def table(levels: dict[str, dict[str, Any]]) -> str:
    head = (f"{'level':>5} {'p_branch':>9} {'run':>8} {'new fmt':>8} {'task':>6} {'0.8 at':>6} "
            f"{'gap':>7} {'rescue steps':>12} {'mass@1':>8} {'g_rev max':>9} {'g_fwd min':>9} {'wall s':>7}")
    lines = [head]
    for lvl, info in levels.items():
        for name, s in info["runs"].items():
            hit = "-" if s["steps_to_0.8"] is None else str(s["steps_to_0.8"])
            gap = "-" if name == "grpo" else f"{s['rolling_gap']:+.3f}"
            lines.append(f"{lvl:>5} {info['p_branch_no_hint_mean']:>9.2e} {name:>8} "
                         f"{s['criterion_rate']:>8.3f} {s['pass_rate']:>6.3f} {hit:>6} {gap:>7} "
                         f"{s['rescue_steps']:>6}/{s['steps']:<5} {s['rescue_mass_step1']:>8.4f} "
                         f"{s['rescue_grad_reverse_max']:>9.4f} {s['rescue_grad_forward_min']:>9.4f} "
                         f"{s['seconds']:>7.0f}")
    return "\n".join(lines)


def run(a, plan, recipe: Path, py: str, log) -> int:
    """The suite (``a``: the demo's parsed arguments; ``plan``: the ``--quick`` plan)."""
    from megatron_tg.demo.runs import RunSpec, _write_atomic, convert, run_one

    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    recipe_sha = hashlib.sha256(recipe.read_bytes()).hexdigest()
    bases: dict[str, dict[str, Any]] = {}
    dirs: dict[tuple[str, str], Path] = {}
    for lvl, name in ORDER:  # one run at a time: the order is the priority
        lo = out / f"p{lvl}"
        if lvl not in bases:
            log(f"base {lvl} -> {lo / 'base'} ({LEVELS[lvl] or 'the default build'})")
            bases[lvl] = B.build_base_model(lo / "base", seed=0, log=lambda s: log("  " + s),
                                            **plan.base_overrides, **LEVELS[lvl])
            m = bases[lvl]
            log(f"base {lvl}: p_branch no hint mean {m['p_branch_no_hint_mean']:.2e} (max "
                f"{m['p_branch_no_hint_max']:.2e}), sampled new format without hint "
                f"{m['new_format_no_hint']:.3f}, task {m['success_no_hint']:.3f}, with hint "
                f"{m['new_format_hint']:.3f}{' (cached)' if m.get('cached') else ''}")
            convert(lo / "base", lo / "base_megatron", py)
        mode, direction = next((mo, d) for n, mo, d in RUNS if n == name)
        spec = RunSpec(name, mode, 0, direction, "ema" if mode == "tg" else None)
        inputs = {"base_build": bases[lvl]["build_hash"], "recipe_sha256": recipe_sha}
        dirs[(lvl, name)] = run_one(spec, lo, plan, py, recipe, inputs)

    levels: dict[str, dict[str, Any]] = {}
    for lvl in LEVELS:
        m = bases[lvl]
        runs = {}
        for name, _, _ in RUNS:
            d = dirs[(lvl, name)]
            s = {**R.summarize_run(d, plan.last), **_diagnostics(d),
                 "rolling_gap": R.rolling_gap(d, dirs[(lvl, "grpo")], 3),
                 "seconds": json.loads((d / "done.json").read_text())["seconds"]}
            runs[name] = s
        levels[lvl] = {"overrides": LEVELS[lvl], "base_build": m["build_hash"],
                       **{k: m[k] for k in ("p_branch_no_hint_mean", "p_branch_no_hint_max",
                                            "new_format_no_hint", "success_no_hint",
                                            "new_format_hint", "success_hint")},
                       "runs": runs}
    wall = time.perf_counter() - t0
    _write_atomic(out / "phase.json", json.dumps({"levels": levels, "steps": plan.steps,
                                                  "wall_seconds": round(wall, 1)}, indent=2) + "\n")
    png = R.plot(out / "phase.png", {f"{lvl} reverse": dirs[(lvl, "reverse")] for lvl in LEVELS},
                 {f"{lvl} {n}": [dirs[(lvl, n)]] for lvl in LEVELS for n, _, _ in RUNS})
    print()
    print(table(levels))
    print(f"\nwall {wall:.0f} s; {out / 'phase.json'}; plot {png}")
    return 0
