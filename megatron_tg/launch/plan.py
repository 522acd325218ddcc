"""Who runs where in a Slurm job: a recipe plus a node list resolved into roles, GPUs and ports.

    python -m megatron_tg.launch.plan --recipe recipes/tg_30b.yaml --format text
    python -m megatron_tg.launch.plan --recipe recipes/tg_30b.yaml --nodes 7 --format json
    eval "$(python -m megatron_tg.launch.plan --recipe R --hosts n1,n2 --format env)"  # slurm/lib.sh

Roles, in the order they take nodes from the allocation (the first node runs the batch
script, so it is the first trainer node and MASTER_ADDR is local to it):

* ``train``:  ``parallel.nodes`` nodes, one rank per GPU (``--ntasks-per-node=gpus_per_node``).
* ``engine``: rollout servers of ``rollout.engine_tp`` GPUs each, packed ``gpus_per_node //
  engine_tp`` to a node; an engine wider than a node spans ``engine_tp // gpus_per_node``
  nodes (multi-node SGLang). Only when the recipe wants servers (``rollout.engine: sglang``
  and no ``rollout.server_urls``).
* ``router``: an sglang-router in front of the engines, CPU-only, sharing the first rollout
  node (``srun --overlap``).
* ``judge``:  an OpenAI-compatible judge server on its own node(s), when the rubric has
  LLM-judged criteria and no external endpoint is given.
* ``rollout_service``: the rollout side (manager, environment workers and sandboxes, judge
  client) as its own process, CPU-only, on the first rollout node (``srun --overlap``; the
  first trainer node when the plan has no rollout nodes), when ``--service 1`` or the
  recipe's ``rollout.service`` is not "in_process". It gets the trainer's arguments; the
  trainer gets ``rollout.service=remote`` and its URL (docs/rollout-service.md).

Node counts come from the recipe unless given. With ``--nodes`` (the allocation) and no
``--rollout-nodes``, the rollout role takes the nodes the others leave: generation is
what an async RL job usually runs short of. A count that cannot hold the layout is a
:class:`PlanError` naming the role, the sizes and a count that would work.

The plan is pure arithmetic on the config (no Slurm calls, no torch), so the dry-run on a
laptop and the batch script on the cluster print the same plan for the same node count.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from megatron_tg.auth import KEY_NAME, SGLANG_CONFIG_NAME
from megatron_tg.config import ConfigError, RolloutConfig, TGConfig, load_config
from megatron_tg.launch.render import RENDERERS
from megatron_tg.launch.router_health import router_health
from megatron_tg.launch.spec import (  # noqa: F401 (the planner's API, re-exported)
    ACCELERATORS,
    DEFAULT_PORT_BASE,
    ENGINE_SERVERS,
    PORT_OFFSETS,
    Knobs,
    Plan,
    PlanError,
    Server,
    Step,
)
from megatron_tg.parallel.dims import ParallelDims

REPO_ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- planning

@dataclass
class _Sizes:
    """Node counts per role and what they imply (``_size_roles``)."""

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
    checkpoint: dict = field(default_factory=dict)
    """The checkpoint plan (GPU plans whose model config is here): size, save and step time,
    the USR1 lead time they need."""


def make_plan(recipe: str, overrides: Sequence[str] = (), knobs: Knobs = Knobs()) -> Plan:
    """Resolve ``recipe`` + ``overrides`` and the launcher's ``knobs`` into a :class:`Plan`.
    Raises :class:`ConfigError` (bad recipe) or :class:`PlanError` (sizes that do not fit)."""
    cfg = load_config(recipe, overrides)
    notes: list[str] = []
    blockers: list[str] = []
    z = _size_roles(cfg, knobs, notes)                                  # how many nodes each
    _check_usr1_lead(z.checkpoint, knobs)                               # a warning long enough
    hosts, addrs, by_role = _assign_hosts(z, knobs)                     # which nodes
    addr_of = dict(zip(hosts, addrs))
    servers, steps, engine_urls, router_url = _place_rollout(cfg, z, knobs, by_role, addr_of, notes)
    judge_url, judge_model, judge_name = _place_judge(cfg, z, knobs, by_role["judge"], addr_of,
                                                      servers, steps, blockers)
    train_hosts = by_role["train"]
    master_addr = addr_of[train_hosts[0]]
    sync_master = master_addr if engine_urls else ""
    train_args = _trainer_args(recipe, overrides, z, knobs, engine_urls, judge_url, judge_name,
                               sync_master, router_url)
    # The job's key (made by slurm/lib.sh at job start, megatron_tg.auth): every server of the
    # job requires it and the trainer and service read it, by path only (docs/security.md).
    secret = f"{knobs.job_dir.rstrip('/')}/secret"
    key_file, sglang_auth = f"{secret}/{KEY_NAME}", f"{secret}/{SGLANG_CONFIG_NAME}"
    train_args.append(f"rollout.api_key_file={key_file}")
    if z.start_judge:
        train_args.append(f"judge.api_key_file={key_file}")
    service_url, service_args = _place_service(cfg, knobs, by_role, addr_of, servers, steps, train_args,
                                               notes)
    _add_step(steps, servers, knobs, "tg-train", "train", train_hosts, z.gpn,
              gpus_per_node=z.gpn if z.accel == "gpu" else 0)
    if service_url:
        train_args += ["rollout.service=remote", f"rollout.service_url={service_url}"]
    want, engine = z.want_engines, z.engine
    return Plan(
        recipe=recipe, overrides=list(overrides), run_name=cfg.run_name, accel=z.accel,
        gpus_per_node=z.gpn, hosts=hosts, addrs=addrs, roles=by_role, layout=z.dims.describe(),
        master_addr=master_addr, master_port=knobs.port_base + PORT_OFFSETS["master"],
        sync_master=sync_master, engine=engine if want else "",
        engine_model=(knobs.engine_model or cfg.model.hf_checkpoint or cfg.model.hf_config) if want else "",
        engine_tp=cfg.rollout.engine_tp if want else 0,
        engine_args=engine_flags(cfg.rollout, engine) if want else [],
        judge_model=judge_model if z.start_judge else "",
        judge_name=judge_name if judge_url else "", judge_url=judge_url, router_url=router_url,
        router_args=router_health(cfg).flags() if router_url else [],
        service_url=service_url, service_args=service_args, servers=servers, steps=steps,
        train_args=train_args, notes=notes, blockers=blockers, key_file=key_file, sglang_auth=sglang_auth,
        timeouts=cfg.timeouts.table(cfg), checkpoint=z.checkpoint)


def _size_roles(cfg: TGConfig, knobs: Knobs, notes: list[str]) -> _Sizes:
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

    judge_needed, judge_why = _judge_needed(cfg)
    external_judge = bool(knobs.judge_url) or cfg.judge.endpoint is not None
    start_judge = judge_needed and not external_judge
    judge_nodes = 0
    if start_judge:
        default_judge = math.ceil(knobs.judge_tp / gpn) if knobs.judge_tp else 1
        judge_nodes = _positive("judge_nodes", knobs.judge_nodes, default_judge)
    elif knobs.judge_nodes or knobs.judge_model:
        notes.append(f"JUDGE_NODES/JUDGE_MODEL ignored: no judge server to start "
                     f"({'external endpoint' if external_judge else judge_why})")

    if not want_engines:
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
    if want_engines and (rollout_nodes < min_rollout or rollout_nodes % span):
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
    return _Sizes(gpn=gpn, accel=accel, train_nodes=train_nodes, world=world, dims=dims,
                  want_engines=want_engines, engine=engine, per_node=per_node, span=span,
                  rollout_nodes=rollout_nodes, judge_nodes=judge_nodes, start_judge=start_judge,
                  judge_needed=judge_needed, judge_why=judge_why, checkpoint=checkpoint)


def _assign_hosts(z: _Sizes, knobs: Knobs) -> tuple[list[str], list[str], dict[str, list[str]]]:
    """Hosts in allocation order, their addresses, and the hosts of each role (train first:
    the batch script runs on the first node)."""
    total = z.train_nodes + z.rollout_nodes + z.judge_nodes
    hosts = list(knobs.hosts) if knobs.hosts else [f"node{i + 1}" for i in range(total)]
    addrs = list(knobs.addrs) if knobs.addrs else list(hosts)
    if len(hosts) != total or len(addrs) != len(hosts):
        raise PlanError(f"hosts: {len(hosts)} hosts and {len(addrs)} addresses given for {total} nodes")
    t, r = z.train_nodes, z.rollout_nodes
    return hosts, addrs, {"train": hosts[:t], "rollout": hosts[t:t + r], "judge": hosts[t + r:]}


def _add_step(steps: list[Step], servers: list[Server], knobs: Knobs, name: str, role: str,
              step_hosts: list[str], tasks_per_node: int, first: int = 0, serves: int = 0,
              **kw) -> None:
    """A step whose tasks run servers ``first .. first + serves - 1`` (none for the trainer)."""
    job_dir = knobs.job_dir.rstrip("/")
    steps.append(Step(name=name, role=role, hosts=step_hosts, ntasks=len(step_hosts) * tasks_per_node,
                      tasks_per_node=tasks_per_node, first=first,
                      output=f"{job_dir}/logs/step-{name}.log", **kw))
    for server in servers[first:first + serves]:
        server.step = len(steps) - 1


def _place_rollout(cfg: TGConfig, z: _Sizes, knobs: Knobs, by_role: dict[str, list[str]],
                   addr_of: dict[str, str], notes: list[str]
                   ) -> tuple[list[Server], list[Step], list[str], str]:
    """The engines on the rollout nodes and the router in front of them."""
    servers: list[Server] = []
    steps: list[Step] = []
    engine_urls: list[str] = []
    if not z.want_engines:
        return servers, steps, engine_urls, ""
    r, tp, per_node, span = cfg.rollout, cfg.rollout.engine_tp, z.per_node, z.span
    rollout_hosts = by_role["rollout"]
    job_dir = knobs.job_dir.rstrip("/")
    port = {k: knobs.port_base + off for k, off in PORT_OFFSETS.items()}
    gpu = z.accel == "gpu"
    n_engines = len(rollout_hosts) * per_node if per_node else len(rollout_hosts) // span
    if n_engines != r.num_engines:
        notes.append(f"rollout: {n_engines} engines fill {len(rollout_hosts)} rollout nodes "
                     f"(recipe: rollout.num_engines={r.num_engines})")
    for e in range(n_engines):
        node = e // per_node if per_node else e * span
        eh = rollout_hosts[node:node + span]
        servers.append(Server(name=f"engine{e}", role="engine", hosts=eh, addr=addr_of[eh[0]],
                              port=port["engine"] + e, gpus=tp, log=f"{job_dir}/logs/engine{e}.log",
                              dist=f"{addr_of[eh[0]]}:{port['engine_dist'] + 10 * e}" if span > 1 else ""))
    if per_node:
        for k, h in enumerate(rollout_hosts):
            _add_step(steps, servers, knobs, f"tg-engines-{h}", "engine", [h], per_node,
                      first=k * per_node, serves=per_node, gpus_per_task=tp if gpu else 0)
    else:
        for e in range(n_engines):
            _add_step(steps, servers, knobs, f"tg-engine{e}", "engine", servers[e].hosts, 1,
                      first=e, serves=1, gpus_per_node=z.gpn if gpu else 0)
    engine_urls = [s.url for s in servers]
    start_router = knobs.router if knobs.router is not None else (z.engine == "sglang" and n_engines > 1)
    router_url = ""
    if start_router and engine_urls:
        h = rollout_hosts[0]
        servers.append(Server(name="router", role="router", hosts=[h], addr=addr_of[h],
                              port=port["router"], gpus=0, log=f"{job_dir}/logs/router.log"))
        _add_step(steps, servers, knobs, "tg-router", "router", [h], 1, first=len(servers) - 1,
                  serves=1, overlap=True)
        router_url = servers[-1].url
    return servers, steps, engine_urls, router_url


def _place_judge(cfg: TGConfig, z: _Sizes, knobs: Knobs, judge_hosts: list[str],
                 addr_of: dict[str, str], servers: list[Server], steps: list[Step],
                 blockers: list[str]) -> tuple[str, str, str]:
    """The judge server on its nodes (when the job starts one): its URL, model dir and name."""
    judge_url = knobs.judge_url or cfg.judge.endpoint or ""
    judge_model = knobs.judge_model or ""
    judge_name = knobs.judge_name or cfg.judge.model or (Path(judge_model).name if judge_model else "")
    if z.start_judge:
        gpn, port = z.gpn, knobs.port_base
        jtp = knobs.judge_tp or len(judge_hosts) * gpn
        if jtp > len(judge_hosts) * gpn:
            raise PlanError(f"judge: JUDGE_TP={jtp} needs more than {len(judge_hosts)} judge nodes x {gpn} GPUs")
        h0 = judge_hosts[0]
        servers.append(Server(name="judge", role="judge", hosts=judge_hosts, addr=addr_of[h0],
                              port=port + PORT_OFFSETS["judge"], gpus=jtp,
                              log=f"{knobs.job_dir.rstrip('/')}/logs/judge.log",
                              dist=(f"{addr_of[h0]}:{port + PORT_OFFSETS['judge_dist']}"
                                    if len(judge_hosts) > 1 else "")))
        _add_step(steps, servers, knobs, "tg-judge", "judge", judge_hosts, 1,
                  first=len(servers) - 1, serves=1, gpus_per_node=gpn if z.accel == "gpu" else 0)
        judge_url = servers[-1].url
        if not judge_model:
            blockers.append(f"judge: {z.judge_why}; set JUDGE_MODEL=DIR to serve a judge on "
                            f"{len(judge_hosts)} node(s), or JUDGE_URL=http://HOST:PORT (with JUDGE_NAME) "
                            f"for a running one")
    if z.judge_needed and judge_url and not judge_name and not blockers:
        blockers.append(f"judge: the endpoint {judge_url} needs a model name: set JUDGE_NAME or judge.model")
    return judge_url, judge_model, judge_name


def _place_service(cfg: TGConfig, knobs: Knobs, by_role: dict[str, list[str]],
                   addr_of: dict[str, str], servers: list[Server], steps: list[Step],
                   train_args: list[str], notes: list[str]) -> tuple[str, list[str]]:
    """The rollout service's server and step (when wanted): its URL and command line. It
    shares its node with the engines there (CPU-only, like the router); its arguments are
    the trainer's, so both resolve the same config (checked when they connect)."""
    want = knobs.service if knobs.service is not None else cfg.rollout.service != "in_process"
    if not want:
        return "", []
    h = (by_role["rollout"] or by_role["train"])[0]
    servers.append(Server(name="rollout_service", role="rollout_service", hosts=[h], addr=addr_of[h],
                          port=knobs.port_base + PORT_OFFSETS["rollout_service"], gpus=0,
                          log=f"{knobs.job_dir.rstrip('/')}/logs/rollout_service.log"))
    _add_step(steps, servers, knobs, "tg-rollout-service", "rollout_service", [h], 1,
              first=len(servers) - 1, serves=1, overlap=True)
    r = cfg.rollout
    inflight = r.max_inflight_rollouts or r.buffer_size * r.group_size
    notes.append(f"rollout service on {h}: at most {inflight} rollouts in flight (live environments), "
                 f"{r.buffer_size} finished groups buffered, "
                 + (f"{r.env_workers_per_node}" if r.env_workers_per_node else f"{h}'s CPU count of")
                 + " tool calls at once (rollout.max_inflight_rollouts, buffer_size, env_workers_per_node)")
    # The service runs its side in its own process: in_process there, whatever the recipe says.
    return servers[-1].url, [*train_args, "rollout.service=in_process"]


def _trainer_args(recipe: str, overrides: Sequence[str], z: _Sizes, knobs: Knobs,
                  engine_urls: list[str], judge_url: str, judge_name: str, sync_master: str,
                  router_url: str) -> list[str]:
    """The trainer's command line: the recipe, its overrides and what the plan decided."""
    args = ["--recipe", recipe, *overrides,
            f"parallel.nodes={z.train_nodes}", f"parallel.gpus_per_node={z.gpn}"]
    if engine_urls:
        args.append(f"rollout.server_urls=[{','.join(engine_urls)}]")
    if z.judge_needed and judge_url and (knobs.judge_url or z.start_judge):
        args += [f"judge.endpoint={judge_url}", f"judge.model={judge_name}"]
    if sync_master:
        args.append(f"rollout.sync_master_address={sync_master}")
    if router_url:
        args.append(f"rollout.router_url={router_url}")
    return args


def _memory_check(cfg: TGConfig, world: int, accel: str, checkpoint: dict) -> list[str]:
    """Refuse a recipe that does not fit its GPUs (megatron_tg/launch/memory.py); its time plan
    becomes notes, its checkpoint plan goes to ``checkpoint``. Imported here: it needs torch,
    the rest of the planner does not."""
    from megatron_tg.launch.memory import launch_check

    return launch_check(cfg, world, accel, checkpoint)


def _check_usr1_lead(ckpt: dict, knobs: Knobs) -> None:
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


def engine_flags(r: RolloutConfig, engine: str = "sglang") -> list[str]:
    """Engine-server flags that follow from the rollout config (``engine``: "sglang" or the
    embedded CPU engine, which takes the same flag names where it has the feature).

    * ``rollout.routing_replay``: ``--enable-return-routed-experts``. SGLang returns a
      request's routed experts only when the server was started with it (the embedded engine
      records its routers' choices only then, too).
    * ``rollout.sampling_seed`` set, SGLang only: ``--enable-deterministic-inference``. SGLang
      reads a request's ``sampling_seed`` only in that mode (batch-invariant kernels; without
      it the seed is ignored); the embedded engine honours seeds always and has no such flag.
    """
    flags = []
    if r.routing_replay:
        flags.append("--enable-return-routed-experts")
    if r.sampling_seed is not None and engine == "sglang":
        flags.append("--enable-deterministic-inference")
    return flags


def _judge_needed(cfg: TGConfig) -> tuple[bool, str]:
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

def _csv(text: str) -> tuple[str, ...]:
    return tuple(x for x in text.replace(" ", ",").split(",") if x)


DESCRIPTION = "Resolve a recipe and a node count into the roles of a Slurm job (no Slurm calls)."


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m megatron_tg.launch.plan", description=DESCRIPTION)
    add_arguments(ap)
    return ap


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--recipe", required=True, metavar="FILE", help="the recipe YAML the job trains")
    ap.add_argument("--format", choices=sorted(RENDERERS), default="text",
                    help="text: the table people read; json; env: what slurm/lib.sh sources")
    sizes = ap.add_argument_group("sizes (default: from the recipe)")
    sizes.add_argument("--nodes", type=int, help="nodes in the allocation; the rollout role takes the rest")
    sizes.add_argument("--train-nodes", type=int, help="nodes of the trainer role (default: the recipe's parallel.nodes x gpus_per_node)")
    sizes.add_argument("--rollout-nodes", type=int, help="nodes of the engines (default: what rollout.num_engines x engine_tp needs, or the rest of --nodes)")
    sizes.add_argument("--judge-nodes", type=int, help="nodes of the judge server (default: judge TP / GPUs per node, at least 1; none without an LLM criterion or with --judge-url)")
    sizes.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: parallel.gpus_per_node)")
    sizes.add_argument("--accel", choices=ACCELERATORS, help="gpu (default), or cpu for the tiny CPU twin")
    nodes = ap.add_argument_group("nodes")
    nodes.add_argument("--hosts", type=_csv, help="node names in allocation order (default node1..nodeN)")
    nodes.add_argument("--addrs", type=_csv, help="their addresses, same order (default: the names)")
    servers = ap.add_argument_group("servers")
    servers.add_argument("--engine", choices=ENGINE_SERVERS, help="rollout server: SGLang, or the embedded CPU engine")
    servers.add_argument("--engine-model", help="HF directory the engines serve (default: model.hf_checkpoint)")
    servers.add_argument("--router", type=int, choices=(0, 1), help="put an sglang-router in front of the engines (default: 1 for more than one SGLang engine)")
    servers.add_argument("--judge-model", help="HF directory the judge node serves (an LLM-judged rubric needs it or --judge-url)")
    servers.add_argument("--judge-name", help="model name the judge is asked for (OpenAI API)")
    servers.add_argument("--judge-url", help="an already running judge (then no judge node)")
    servers.add_argument("--judge-tp", type=int, help="tensor-parallel size of the judge server")
    servers.add_argument("--service", type=int, choices=(0, 1),
                         help="the rollout side as its own step (default: as rollout.service says)")
    ap.add_argument("--port-base", type=int, default=DEFAULT_PORT_BASE,
                    help="every port of the job is an offset from this (two jobs on one host stay apart)")
    ap.add_argument("--usr1-lead", type=int, metavar="S",
                    help="seconds before the time limit the job gets USR1 (its --signal=B:USR1@S); "
                         "refused when shorter than one step plus one checkpoint save needs")
    ap.add_argument("--job-dir", default="runs/slurm/JOB", help="per-job dir (default: a placeholder)")
    ap.add_argument("--out-dir", help="also write plan.env, plan.txt and plan.json here (one planning "
                                      "for all three: each Python start costs the batch job ~1 s)")
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides, as for the trainer")


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """``megatron-tg plan`` (the arguments of :func:`add_arguments`)."""
    knobs = Knobs(
        nodes=args.nodes, hosts=args.hosts, addrs=args.addrs, train_nodes=args.train_nodes,
        rollout_nodes=args.rollout_nodes, judge_nodes=args.judge_nodes, gpus_per_node=args.gpus_per_node,
        accel=args.accel, engine=args.engine, engine_model=args.engine_model,
        router=None if args.router is None else bool(args.router), judge_model=args.judge_model,
        judge_name=args.judge_name, judge_url=args.judge_url, judge_tp=args.judge_tp,
        service=None if args.service is None else bool(args.service),
        port_base=args.port_base, job_dir=args.job_dir, usr1_lead_s=args.usr1_lead)
    try:
        plan = make_plan(args.recipe, args.overrides, knobs)
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


if __name__ == "__main__":
    sys.exit(main())
