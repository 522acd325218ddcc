"""The launch package's two subcommands: ``megatron-tg memory`` and ``megatron-tg plan``.

    megatron-tg memory --recipe recipes/tg_30b.yaml [key=value ...]
    megatron-tg plan --recipe recipes/tg_30b.yaml --nodes 7 --format json [key=value ...]

The arithmetic is in :mod:`megatron_tg.launch.memory` / :mod:`~megatron_tg.launch.timeplan` and
:mod:`megatron_tg.launch.plan`; this module only reads flags and prints. Each subcommand is a
:class:`Command` (``add_arguments``, ``run``), which ``megatron_tg.cli`` names by attribute.
``slurm/lib.sh`` runs the plan as ``python -m megatron_tg.cli plan``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, NamedTuple

from megatron_tg.config import ConfigError, load_config
from megatron_tg.launch import ema_plan, timeplan
from megatron_tg.launch import memory as M
from megatron_tg.launch import plan as P
from megatron_tg.launch.render import RENDERERS


class Command(NamedTuple):
    add_arguments: Callable[[argparse.ArgumentParser], None]
    """Adds the subcommand's flags (and its ``overrides`` positional) to its parser."""
    run: Callable[[argparse.Namespace], int]
    """Runs it on the parsed flags; returns the exit status."""


# --------------------------------------------------------------------------- memory

def _memory_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", required=True, metavar="FILE", help="recipe YAML")
    parser.add_argument("--world-size", type=int, metavar="N",
                        help="trainer ranks (default: parallel.nodes x parallel.gpus_per_node)")
    parser.add_argument("--mem-fraction-static", type=float, metavar="F",
                        help="the engines' SGLang --mem-fraction-static (default: SGLang's own)")
    timeplan.add_arguments(parser)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides")


def _run_memory(args: argparse.Namespace) -> int:
    """``megatron-tg memory``: the plan, term by term per role, its time per step, then JSON."""
    cfg = load_config(args.recipe, args.overrides)
    plan = M.memory_plan(cfg, args.recipe, args.world_size, args.mem_fraction_static)
    times = timeplan.time_plan(cfg, plan, timeplan.assumptions_from(args))
    lay = plan.layout
    print(f"memory plan: {args.recipe} {' '.join(args.overrides)}".rstrip())
    print(f"model: {plan.total_params / 1e9:.2f}B params ({plan.active_params / 1e9:.2f}B active); "
          f"trainer world {lay['world_size']}: tp={lay['tp']} pp={lay['pp']} cp={lay['cp']} "
          f"ep={lay['ep']} etp={lay['etp']} dp={lay['dp']} edp={lay['edp']}")
    for role in plan.roles.values():
        print(f"\n{role.role} GPU ({role.capacity_gib:.1f} GiB, plan must stay under "
              f"{role.usable_fraction:.0%}):")
        for name, value in role.terms.items():
            print(f"  {name:<24} {value / M.GIB:9.2f} GiB")
        print(f"  {'total':<24} {role.total / M.GIB:9.2f} GiB  {'fits' if role.fits() else 'DOES NOT FIT'}")
        for note in role.notes:
            print(f"  - {note}")
    print()
    for line in timeplan.render(times) + ema_plan.render(plan.ema_time):
        print(line)
    ckpt = timeplan.checkpoint_plan(cfg, lay["world_size"], plan.total_params, timeplan.step_seconds(times))
    print(timeplan.render_checkpoint(ckpt))
    refusal = plan.refusal()
    if refusal:
        print(refusal)
    out = {"recipe": args.recipe, "layout": lay, "total_params": plan.total_params,
           **{name: role.as_json() for name, role in plan.roles.items()},
           "time": {**times, "ema": plan.ema_time},
           "checkpoint": ckpt}
    if "engine" in plan.roles:
        out["engine"]["kv"] = plan.roles["engine"].kv
    print(json.dumps(out))
    return 0 if refusal is None else 1


# --------------------------------------------------------------------------- plan

def _csv(text: str) -> tuple[str, ...]:
    return tuple(x for x in text.replace(" ", ",").split(",") if x)


def _plan_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--recipe", required=True, metavar="FILE", help="the recipe YAML the job trains")
    ap.add_argument("--format", choices=sorted(RENDERERS), default="text",
                    help="text: the table people read; json; env: what slurm/lib.sh sources")
    sizes = ap.add_argument_group("sizes (default: from the recipe)")
    sizes.add_argument("--nodes", type=int, help="nodes in the allocation; the rollout role takes the rest")
    sizes.add_argument("--train-nodes", type=int, help="nodes of the trainer role (default: the recipe's parallel.nodes x gpus_per_node)")
    sizes.add_argument("--rollout-nodes", type=int, help="nodes of the engines (default: what rollout.num_engines x engine_tp needs, or the rest of --nodes)")
    sizes.add_argument("--judge-nodes", type=int, help="nodes of the judge server (default: judge TP / GPUs per node, at least 1; none without an LLM criterion or with --judge-url)")
    sizes.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: parallel.gpus_per_node)")
    sizes.add_argument("--accel", choices=P.ACCELERATORS, help="gpu (default), or cpu for the tiny CPU twin")
    nodes = ap.add_argument_group("nodes")
    nodes.add_argument("--hosts", type=_csv, help="node names in allocation order (default node1..nodeN)")
    nodes.add_argument("--addrs", type=_csv, help="their addresses, same order (default: the names)")
    servers = ap.add_argument_group("servers")
    servers.add_argument("--engine", choices=P.ENGINE_SERVERS, help="rollout server: SGLang, or the embedded CPU engine")
    servers.add_argument("--engine-model", help="HF directory the engines serve (default: model.hf_checkpoint)")
    servers.add_argument("--router", type=int, choices=(0, 1), help="put an sglang-router in front of the engines (default: 1 for more than one SGLang engine)")
    servers.add_argument("--judge-model", help="HF directory the judge node serves (an LLM-judged rubric needs it or --judge-url)")
    servers.add_argument("--judge-name", help="model name the judge is asked for (OpenAI API)")
    servers.add_argument("--judge-url", help="an already running judge (then no judge node)")
    servers.add_argument("--judge-tp", type=int, help="tensor-parallel size of the judge server")
    servers.add_argument("--service", type=int, choices=(0, 1),
                         help="the rollout side as its own step (default: as rollout.service says)")
    ap.add_argument("--port-base", type=int, default=P.DEFAULT_PORT_BASE,
                    help="every port of the job is an offset from this (two jobs on one host stay apart)")
    ap.add_argument("--usr1-lead", type=int, metavar="S",
                    help="seconds before the time limit the job gets USR1 (its --signal=B:USR1@S); "
                         "refused when shorter than one step plus one checkpoint save needs")
    ap.add_argument("--job-dir", default="runs/slurm/JOB", help="per-job dir (default: a placeholder)")
    ap.add_argument("--out-dir", help="also write plan.env, plan.txt and plan.json here (one planning "
                                      "for all three: each Python start costs the batch job ~1 s)")
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides, as for the trainer")


def _run_plan(args: argparse.Namespace) -> int:
    """``megatron-tg plan`` (the arguments of :func:`add_arguments`)."""
    knobs = P.Knobs(
        nodes=args.nodes, hosts=args.hosts, addrs=args.addrs, train_nodes=args.train_nodes,
        rollout_nodes=args.rollout_nodes, judge_nodes=args.judge_nodes, gpus_per_node=args.gpus_per_node,
        accel=args.accel, engine=args.engine, engine_model=args.engine_model,
        router=None if args.router is None else bool(args.router), judge_model=args.judge_model,
        judge_name=args.judge_name, judge_url=args.judge_url, judge_tp=args.judge_tp,
        service=None if args.service is None else bool(args.service),
        port_base=args.port_base, job_dir=args.job_dir, usr1_lead_s=args.usr1_lead)
    try:
        plan = P.make_plan(args.recipe, args.overrides, knobs)
    except ConfigError as exc:  # PlanError too: one line naming the knob, no traceback
        print(f"plan: error: {exc}", file=sys.stderr)
        return 2
    if args.out_dir:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        for fmt, render in RENDERERS.items():
            (out / f"plan.{'txt' if fmt == 'text' else fmt}").write_text(render(plan))
    sys.stdout.write(RENDERERS[args.format](plan))
    return 0


memory = Command(_memory_arguments, _run_memory)
plan = Command(_plan_arguments, _run_plan)
