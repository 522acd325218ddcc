"""How many nodes each role of a Slurm job gets (:func:`size_roles`), checked against the
trainer's layout, the engines' width, the allocation, the memory plan and the USR1 lead time.

Part of the launch planner (:mod:`megatron_tg.launch.plan`); pure arithmetic on the config,
except the memory check, which imports the memory plan (torch) only when it runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from megatron_tg.config import ConfigError, TGConfig
from megatron_tg.launch.spec import ACCELERATORS, ENGINE_SERVERS, Knobs, PlanError
from megatron_tg.parallel.dims import ParallelDims

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Sizes:
    """Node counts per role and what they imply (:func:`size_roles`)."""

    gpn: int
    accel: str
    train_nodes: int
    world: int
    dims: ParallelDims
    want_engines: bool
    engine: str
    per_node: int
    """Engines per rollout node (0: an engine spans ``span`` nodes)."""
    span: int
    rollout_nodes: int
    judge_nodes: int
    start_judge: bool
    judge_needed: bool
    judge_why: str
    colocated: bool = False
    """The engines run on the trainer's nodes and GPUs (``rollout.placement="colocated"``)."""
    checkpoint: dict = field(default_factory=dict)
    """The checkpoint plan (GPU plans whose model config is here): size, save and step time,
    the USR1 lead time they need."""


def size_roles(cfg: TGConfig, knobs: Knobs, notes: list[str]) -> Sizes:
    """Node counts of the train, rollout and judge roles, checked against the layout, the
    engines' width and the allocation; the trainer's memory plan is checked here too."""
    p = cfg.parallel
    gpn = _positive("gpus_per_node", knobs.gpus_per_node, p.gpus_per_node)
    accel = knobs.accel or ("cpu" if p.backend == "gloo" else "gpu")
    _choice("accel", accel, ACCELERATORS)

    min_world = ParallelDims.smallest_world(tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, etp=p.etp)
    node_step = math.lcm(min_world, gpn) // gpn  # train node counts must be multiples of it
    if knobs.train_nodes is not None:
        train_nodes = _positive("train_nodes", knobs.train_nodes, None)
    elif p.nodes is not None:
        # The recipe's GPU count, on nodes of another size if gpus_per_node was changed.
        train_nodes = math.ceil(math.ceil(p.nodes * p.gpus_per_node / gpn) / node_step) * node_step
    else:
        train_nodes = node_step
    world = train_nodes * gpn
    try:
        dims = cfg.layout(world)
    except ConfigError as exc:
        raise PlanError(f"train: {train_nodes} nodes x {gpn} GPUs = {world} ranks do not fit the "
                        f"layout ({exc}); use a multiple of {node_step} trainer nodes") from exc
    checkpoint: dict = {}
    notes += _memory_check(cfg, world, accel, checkpoint)

    r = cfg.rollout
    want_engines = r.engine == "sglang" and not r.server_urls
    engine = knobs.engine or "sglang"
    _choice("engine", engine, ENGINE_SERVERS)
    tp = r.engine_tp
    if not want_engines:
        per_node, span = 1, 1
    elif tp <= gpn:
        if gpn % tp:
            raise PlanError(f"rollout: rollout.engine_tp={tp} does not divide gpus_per_node={gpn}")
        per_node, span = gpn // tp, 1
    else:
        if tp % gpn:
            raise PlanError(f"rollout: rollout.engine_tp={tp} is not a multiple of gpus_per_node={gpn}")
        per_node, span = 0, tp // gpn
    min_rollout = span if want_engines else 0
    recipe_rollout = (math.ceil(r.num_engines / per_node) if per_node else r.num_engines * span)

    needed, judge_why = judge_needed(cfg)
    external_judge = bool(knobs.judge_url) or cfg.judge.endpoint is not None
    start_judge = needed and not external_judge
    judge_nodes = 0
    if start_judge:
        default_judge = math.ceil(knobs.judge_tp / gpn) if knobs.judge_tp else 1
        judge_nodes = _positive("judge_nodes", knobs.judge_nodes, default_judge)
    elif knobs.judge_nodes or knobs.judge_model:
        notes.append(f"JUDGE_NODES/JUDGE_MODEL ignored: no judge server to start "
                     f"({'external endpoint' if external_judge else judge_why})")

    colocated = want_engines and r.placement == "colocated"
    if colocated:  # the engines share the trainer's nodes and GPUs: no rollout nodes
        rollout_nodes = _colocated_engines(r, knobs, train_nodes, gpn, per_node, span)
    elif not want_engines:
        rollout_nodes = 0
        if knobs.rollout_nodes:
            raise PlanError(f"rollout: {knobs.rollout_nodes} rollout nodes asked for, but the recipe "
                            f"starts no servers (rollout.engine={r.engine!r}, "
                            f"{len(r.server_urls)} server_urls)")
    elif knobs.rollout_nodes is not None:
        rollout_nodes = knobs.rollout_nodes
    elif knobs.nodes is not None:
        rollout_nodes = knobs.nodes - train_nodes - judge_nodes  # the rest; checked below
    else:
        rollout_nodes = recipe_rollout
    if want_engines and not colocated and (rollout_nodes < min_rollout or rollout_nodes % span):
        need = f"a multiple of {span}" if span > 1 else "at least 1"
        source = ("ROLLOUT_NODES" if knobs.rollout_nodes is not None else
                  f"what {knobs.nodes} nodes leave after train {train_nodes} + judge {judge_nodes}")
        raise PlanError(f"rollout: {rollout_nodes} rollout nodes ({source}); engines of "
                        f"rollout.engine_tp={tp} on {gpn}-GPU nodes need {need} (the recipe's "
                        f"{r.num_engines} engines need {recipe_rollout}: "
                        f"{train_nodes + judge_nodes + recipe_rollout} nodes in all)")
    total = train_nodes + rollout_nodes + judge_nodes
    if knobs.nodes is not None and knobs.nodes != total:
        raise PlanError(f"nodes: the allocation has {knobs.nodes} nodes but the roles need {total} "
                        f"(train {train_nodes} + rollout {rollout_nodes} + judge {judge_nodes}); "
                        f"submit with --nodes={total} or change TRAIN_NODES/ROLLOUT_NODES/JUDGE_NODES")
    return Sizes(gpn=gpn, accel=accel, train_nodes=train_nodes, world=world, dims=dims,
                  want_engines=want_engines, engine=engine, per_node=per_node, span=span,
                  rollout_nodes=rollout_nodes, judge_nodes=judge_nodes, start_judge=start_judge,
                  judge_needed=needed, judge_why=judge_why, checkpoint=checkpoint, colocated=colocated)


def _colocated_engines(r, knobs: Knobs, train_nodes: int, gpn: int, per_node: int, span: int) -> int:
    """Colocated engines take no nodes of their own (returns 0): one engine TP rank on each
    trainer GPU, so an engine fits one node and the engines fill the trainer's GPUs exactly."""
    why = "rollout.placement='colocated' (the engines run on the trainer's GPUs)"
    if knobs.rollout_nodes:
        raise PlanError(f"rollout: {knobs.rollout_nodes} rollout nodes asked for (ROLLOUT_NODES), "
                        f"but {why}: leave ROLLOUT_NODES unset")
    if span > 1:
        raise PlanError(f"rollout: rollout.engine_tp={r.engine_tp} spans {span} nodes of {gpn} GPUs, "
                        f"but {why}: an engine must fit one node (engine_tp <= {gpn})")
    engines = train_nodes * per_node
    if r.num_engines != engines:
        raise PlanError(f"rollout: rollout.num_engines={r.num_engines}, but {why}: {train_nodes} "
                        f"trainer nodes x {gpn} GPUs hold {engines} engines of rollout.engine_tp="
                        f"{r.engine_tp}; set rollout.num_engines={engines}")
    return 0


def _memory_check(cfg: TGConfig, world: int, accel: str, checkpoint: dict) -> list[str]:
    """Refuse a recipe that does not fit its GPUs (megatron_tg/launch/memory.py); its time plan
    becomes notes, its checkpoint plan goes to ``checkpoint``. Imported here: it needs torch,
    the rest of the planner does not."""
    from megatron_tg.launch.memory import launch_check

    return launch_check(cfg, world, accel, checkpoint)


def check_usr1_lead(ckpt: dict, knobs: Knobs) -> None:
    """Refuse a job whose USR1 warning comes too late to finish a step and write a checkpoint."""
    if not ckpt or knobs.usr1_lead_s is None or knobs.usr1_lead_s >= ckpt["usr1_lead_s"]:
        return
    raise PlanError(
        f"usr1_lead: the job is warned {knobs.usr1_lead_s} s before its time limit "
        f"(--signal=B:USR1@{knobs.usr1_lead_s}), but one step ({ckpt['step_s']:,} s) plus one "
        f"checkpoint save ({ckpt['checkpoint_bytes'] / 1e9:,.0f} GB at {ckpt['write_gbps']:g} GB/s: "
        f"{ckpt['save_s']:,} s) and the exit need {ckpt['usr1_lead_s']} s: submit with "
        f"--signal=B:USR1@{ckpt['usr1_lead_s']} (USR1_LEAD={ckpt['usr1_lead_s']}), or set "
        f"checkpoint.write_gbps_per_node to what the filesystem measures")


def judge_needed(cfg: TGConfig) -> tuple[bool, str]:
    """Whether the rubric has LLM-judged criteria, and a sentence saying which."""
    if cfg.judge.rubric is None:
        return False, "no rubric"
    path = Path(cfg.judge.rubric)
    if not path.is_file() and not path.is_absolute() and (REPO_ROOT / path).is_file():
        path = REPO_ROOT / path  # recipes give rubric paths relative to the repo root
    if not path.is_file():
        raise PlanError(f"judge.rubric: {cfg.judge.rubric!r} not found")
    from megatron_tg.judge.rubric import load_rubric  # no torch; only when a rubric is set

    llm = [c.name for c in load_rubric(path).llm_criteria()]
    if not llm:
        return False, f"rubric {cfg.judge.rubric} is rule-based"
    return True, f"rubric {cfg.judge.rubric} has LLM-judged criteria ({', '.join(llm)})"


def _positive(name: str, value: Optional[int], default: Optional[int]) -> int:
    value = default if value is None else value
    if value is None or value < 1:
        raise PlanError(f"{name}: must be >= 1; got {value!r}")
    return value


def _choice(name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise PlanError(f"{name}: must be one of {', '.join(choices)}; got {value!r}")


# --------------------------------------------------------------------------- command line
