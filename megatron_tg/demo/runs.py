"""The main job's runs (:mod:`megatron_tg.demo.command`): its plans, one RL run as its own
process, reused when finished with the same inputs, and the base model's conversion. In a
module of their own because the suites the main job dispatches to (:mod:`.paper_suite`,
:mod:`.phase`) run them too, and must not import the entry point that imports them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from megatron_tg.demo import base_config as BC
from megatron_tg.demo import report as R

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "demo_cpu.yaml"
METHODS = ("grpo", "opsd", "tg")
DIRECTIONS = ("reverse", "forward", "jsd")
EXPERTS = ("shared", "ema")
GRID = tuple((d, e) for d in DIRECTIONS for e in EXPERTS)
"""The ``--full`` comparison: every KL direction with the paper's shared expert and the EMA one."""
ROLLING = 3
"""Window (steps) of the rolling task-success mean the stability target compares."""


@dataclass(frozen=True)
class Plan:
    steps: int
    seeds: tuple[int, ...]
    """Seeds of each comparison variant (the method rows run seed 0)."""
    last: int
    """Final rates = mean over the last ``last`` steps."""
    variants: tuple[tuple[str, str], ...]
    """(KL direction, expert) pairs of the comparison, each run on every seed; () = none."""
    probe_every: int
    heldout: int = 0
    """Held-out episodes evaluated at step 0 and the last step of each method's run
    (``evaluation.num_tasks``; 0: none)."""
    base_overrides: dict[str, Any] = field(default_factory=dict)
    seeded: bool = False
    """Seed every run's sampling (``rollout.sampling_seed`` = its seed) and generate on the
    current weights only (``rollout.max_staleness=0``): a run no longer depends on timing."""
    rl_args: tuple[str, ...] = ()
    """Extra arguments of each ``megatron_tg.demo.rl`` process (e.g. ``--env paper``)."""

    def run_overrides(self, seed: int) -> list[str]:
        return [f"rollout.sampling_seed={seed}", "rollout.max_staleness=0"] if self.seeded else []


DEFAULT = Plan(steps=30, seeds=(0,), last=10, variants=(("forward", "ema"), ("reverse", "ema")),
               probe_every=10, heldout=128)
FULL = Plan(steps=30, seeds=(0, 1, 2), last=10, variants=GRID, probe_every=10, heldout=128)
QUICK = Plan(steps=25, seeds=(0,), last=5, variants=(), probe_every=0, heldout=32,
             base_overrides=dict(BC.QUICK), seeded=True)


@dataclass(frozen=True)
class RunSpec:
    name: str
    mode: str
    seed: int
    direction: str | None = None
    """None: the recipe's ``objective.kl_direction``."""
    expert: str | None = None
    """None: the recipe's ``objective.expert``."""
    extra: tuple[str, ...] = ()
    """More ``key=value`` overrides of this run (e.g. ``objective.kl_coef=10``)."""

    def overrides(self) -> list[str]:
        out = [f"objective.mode={self.mode}", f"seed={self.seed}", *self.extra]
        if self.expert is not None:
            out.append(f"objective.expert={self.expert}")
        if self.direction is not None:
            out.append(f"objective.kl_direction={self.direction}")
        return out


def _log(text: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {text}", flush=True)


def recipe_defaults(recipe: Path) -> tuple[str, str]:
    """The recipe's (KL direction, expert): what the headline ``tg`` run uses."""
    from megatron_tg.config import load_config

    obj = load_config(recipe).objective
    return obj.kl_direction, obj.expert


def convert(base: Path, out: Path, py: str) -> None:
    """HF base model -> megatron torch_dist checkpoint, with the project's conversion tool
    (skipped when ``out`` already holds the conversion of this very build)."""
    stamp = json.loads((base / "base_metrics.json").read_text())["build_hash"]
    marker = out / "demo_build_hash"
    if marker.exists() and marker.read_text() == stamp:
        return
    if out.exists():
        shutil.rmtree(out)
    cmd = [py, "-m", "megatron_tg.cli", "convert", "hf-to-megatron", "--hf-dir", str(base),
           "--out-dir", str(out), "--no-progress"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=_env())
    if res.returncode != 0:
        raise RuntimeError(f"conversion failed ({' '.join(cmd)}):\n{res.stdout[-2000:]}{res.stderr[-4000:]}")
    _log(res.stdout.strip().splitlines()[-1] if res.stdout.strip() else "converted")
    marker.write_text(stamp)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONWARNINGS", "ignore")
    env["OMP_NUM_THREADS"] = "1"  # one thread per process: 2 runs share 2 cores
    return env


def _identity(spec: RunSpec, plan: Plan, inputs: dict[str, str]) -> dict[str, Any]:
    """What makes a finished run reusable: its overrides, length, probe, base model build
    and recipe text. Anything else changed: the run is redone."""
    ident = {"overrides": spec.overrides() + plan.run_overrides(spec.seed), "steps": plan.steps,
             "probe_every": plan.probe_every if spec.mode == "tg" else 0,
             "heldout": _heldout(spec, plan), **inputs}
    if plan.rl_args:  # only when set: the main demo's finished runs stay reusable
        ident["rl_args"] = list(plan.rl_args)
    return ident


def _heldout(spec: RunSpec, plan: Plan) -> int:
    """Held-out episodes of a run: the method rows of the table only (the KL-direction
    variants report training-batch rates), to keep the demo within its time budget."""
    return plan.heldout if spec.name in METHODS else 0


def _finished(done: Path) -> dict[str, Any] | None:
    try:
        return json.loads(done.read_text())
    except (OSError, ValueError):  # absent, or cut by a kill: not finished
        return None


def run_one(spec: RunSpec, out: Path, plan: Plan, py: str, recipe: Path,
            inputs: dict[str, str]) -> Path:
    """One RL run as its own process (its own gloo world, engine and port); returns its dir."""
    from megatron_tg.parallel.ports import free_port

    run_dir = out / "runs" / spec.name
    done = run_dir / "done.json"
    ident = _identity(spec, plan, inputs)
    prev = _finished(done)
    if prev is not None and prev.get("identity") == ident:
        _log(f"{spec.name}: reusing the finished run in {run_dir}")
        return run_dir
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    base = out / "base"
    args = [py, "-m", "megatron_tg.demo.rl", "--recipe", str(recipe), *plan.rl_args,
            "--probe-every", str(plan.probe_every if spec.mode == "tg" else 0),
            f"model.hf_config={base}", f"model.hf_checkpoint={base}",
            f"model.megatron_checkpoint={out / 'base_megatron'}",
            f"logging.run_dir={run_dir}", f"run_name=demo-{spec.name}", f"steps={plan.steps}",
            f"evaluation.num_tasks={_heldout(spec, plan)}", *spec.overrides(),
            *plan.run_overrides(spec.seed)]
    env = {**_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    t0 = time.perf_counter()
    with open(run_dir / "stdout.log", "w") as log:
        code = subprocess.run(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode
    if code != 0:
        tail = (run_dir / "stdout.log").read_text()[-3000:]
        raise RuntimeError(f"run {spec.name} failed with exit code {code}; its log ends:\n{tail}")
    secs = time.perf_counter() - t0
    _write_atomic(done, json.dumps({"identity": ident, "seconds": round(secs, 1)}) + "\n")
    s = R.summarize_run(run_dir, plan.last)
    _log(f"{spec.name}: {secs:.0f} s, new format {s['criterion_rate']:.3f}, task {s['pass_rate']:.3f}"
         f"{', COLLAPSED' if s['collapsed'] else ''}")
    return run_dir


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def run_all(specs: Sequence[RunSpec], out: Path, plan: Plan, py: str, recipe: Path, jobs: int,
            inputs: dict[str, str]) -> dict[str, Path]:
    """Run ``specs``, ``jobs`` at a time; the first failure is raised once all have ended
    (finished runs stay reusable)."""
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futs = {s.name: pool.submit(run_one, s, out, plan, py, recipe, inputs) for s in specs}
        return {name: f.result() for name, f in futs.items()}
