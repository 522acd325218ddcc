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

Node counts come from the recipe unless given. With ``--nodes`` (the allocation) and no
``--rollout-nodes``, the rollout role takes the nodes the others leave: generation is
what an async RL job usually runs short of. A count that cannot hold the layout is a
:class:`PlanError` naming the role, the sizes and a count that would work.

The plan is pure arithmetic on the config (no Slurm calls, no torch), so the dry-run on a
laptop and the batch script on the cluster print the same plan for the same node count.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from megatron_tg.config import ConfigError, RolloutConfig, TGConfig, load_config
from megatron_tg.launch.render import RENDERERS

ACCELERATORS = ("gpu", "cpu")
ENGINE_SERVERS = ("sglang", "embedded")
REPO_ROOT = Path(__file__).resolve().parents[2]

# Offsets from --port-base. One knob moves every port, so two jobs sharing a machine (the
# emulated test cluster, where every "node" is 127.0.0.1) stay apart; within a job every
# server gets its own port even across nodes for the same reason. Engine e serves HTTP on
# engine + e; a node-spanning engine's ranks meet on engine_dist + 10 e (multi-node SGLang
# also takes the few ports after its --dist-init-addr port).
PORT_OFFSETS = {"master": 0, "router": 500, "judge": 600, "judge_dist": 700,
                "engine": 1500, "engine_dist": 2500}
DEFAULT_PORT_BASE = 29500  # torch's usual MASTER_PORT


class PlanError(ConfigError):
    """A node count, GPU count or knob that cannot hold the recipe's layout."""


@dataclass(frozen=True)
class Knobs:
    """What the launcher may set on top of the recipe; None = derive it from the recipe."""

    nodes: Optional[int] = None
    """Nodes in the allocation (``$SLURM_JOB_NUM_NODES``); None = the sum the roles need."""
    hosts: Optional[tuple[str, ...]] = None
    """Node names in allocation order (``scontrol show hostnames``); None = node1..nodeN."""
    addrs: Optional[tuple[str, ...]] = None
    """Address to reach each host by (Slurm's NodeAddr); None = the host names."""
    train_nodes: Optional[int] = None
    rollout_nodes: Optional[int] = None
    judge_nodes: Optional[int] = None
    gpus_per_node: Optional[int] = None
    """GPUs per node (CPU mode: trainer ranks and engine slots per node); None = recipe's."""
    accel: Optional[str] = None
    """"gpu" or "cpu" (no GPU requests at all); None = cpu when the recipe's backend is gloo."""
    engine: Optional[str] = None
    """Program behind the rollout servers: "sglang" or "embedded" (the CPU engine)."""
    engine_model: Optional[str] = None
    """Weights the engines serve; None = the recipe's model.hf_checkpoint (else hf_config)."""
    router: Optional[bool] = None
    """Start an sglang-router; None = when there is more than one SGLang engine."""
    judge_model: Optional[str] = None
    """Model directory for a judge server started in the job."""
    judge_name: Optional[str] = None
    """Model name the judge serves and the trainer asks for; None = judge.model, else the
    model directory's name."""
    judge_url: Optional[str] = None
    """An already running judge endpoint; no judge role then."""
    judge_tp: Optional[int] = None
    """Tensor-parallel size of the judge server; None = every GPU of its nodes."""
    port_base: int = DEFAULT_PORT_BASE
    job_dir: str = "runs/slurm/JOB"
    """Per-job directory: plan files and one log per server (``logs/``)."""


@dataclass
class Server:
    """One HTTP server of the job: an engine, the router or the judge."""

    name: str
    role: str
    hosts: list[str]
    addr: str
    port: int
    gpus: int
    log: str
    dist: str = ""
    """host:port where the ranks of a multi-node server meet (SGLang --dist-init-addr)."""
    step: int = -1
    """Index of the step that runs it (whose death means it will never become healthy)."""

    @property
    def url(self) -> str:
        return f"http://{self.addr}:{self.port}"


@dataclass
class Step:
    """One ``srun`` step. Task ``t`` of a server step runs server ``first + SLURM_LOCALID``
    with node rank ``SLURM_NODEID``."""

    name: str
    role: str
    hosts: list[str]
    ntasks: int
    tasks_per_node: int
    gpus_per_task: int = 0
    gpus_per_node: int = 0
    overlap: bool = False
    """Shares its node with another step (CPU-only helpers). Slurm 22.05's --overlap also
    shares GPUs, so GPU steps never use it and never share a node."""
    first: int = 0
    output: str = ""


@dataclass
class Plan:
    recipe: str
    overrides: list[str]
    run_name: str
    accel: str
    gpus_per_node: int
    hosts: list[str]
    addrs: list[str]
    roles: dict[str, list[str]]
    layout: dict[str, int]
    master_addr: str
    master_port: int
    sync_master: str
    """Address the engines reach trainer rank 0 at for weight sync (it picks the port)."""
    engine: str
    engine_model: str
    engine_tp: int
    judge_model: str
    judge_name: str
    judge_url: str
    router_url: str
    servers: list[Server]
    steps: list[Step]
    train_args: list[str]
    notes: list[str] = field(default_factory=list)
    blockers: list[str] = field(default_factory=list)
    """Problems that stop a launch but not a dry-run (e.g. no judge model given)."""
    engine_flags: list[str] = field(default_factory=list)
    """Flags every engine server gets from the config (routing replay:
    ``--enable-return-routed-experts``, which SGLang needs to return routed experts)."""

    @property
    def nodes(self) -> int:
        return len(self.hosts)

    def gpus(self, role: str) -> int:
        if self.accel != "gpu":
            return 0
        if role == "train":
            return len(self.roles["train"]) * self.gpus_per_node
        return sum(s.gpus for s in self.servers if s.role == role and role != "router")


# --------------------------------------------------------------------------- planning

def make_plan(recipe: str, overrides: Sequence[str] = (), knobs: Knobs = Knobs()) -> Plan:
    """Resolve ``recipe`` + ``overrides`` and the launcher's ``knobs`` into a :class:`Plan`.
    Raises :class:`ConfigError` (bad recipe) or :class:`PlanError` (sizes that do not fit)."""
    cfg = load_config(recipe, overrides)
    p = cfg.parallel
    gpn = _positive("gpus_per_node", knobs.gpus_per_node, p.gpus_per_node)
    accel = knobs.accel or ("cpu" if p.backend == "gloo" else "gpu")
    _choice("accel", accel, ACCELERATORS)
    notes: list[str] = []
    blockers: list[str] = []

    # ---- sizes per role
    min_world = math.lcm(p.tp * p.cp * p.pp, p.expert_tp * p.ep * p.pp)
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

    # ---- hosts
    hosts = list(knobs.hosts) if knobs.hosts else [f"node{i + 1}" for i in range(total)]
    addrs = list(knobs.addrs) if knobs.addrs else list(hosts)
    if len(hosts) != total or len(addrs) != len(hosts):
        raise PlanError(f"hosts: {len(hosts)} hosts and {len(addrs)} addresses given for {total} nodes")
    addr_of = dict(zip(hosts, addrs))
    train_hosts = hosts[:train_nodes]
    rollout_hosts = hosts[train_nodes:train_nodes + rollout_nodes]
    judge_hosts = hosts[train_nodes + rollout_nodes:]
    port = {k: knobs.port_base + off for k, off in PORT_OFFSETS.items()}
    job_dir = knobs.job_dir.rstrip("/")
    gpu = accel == "gpu"

    servers: list[Server] = []
    steps: list[Step] = []

    def add_step(name: str, role: str, step_hosts: list[str], tasks_per_node: int, first: int = 0,
                 serves: int = 0, **kw) -> None:
        """A step whose tasks run servers ``first .. first + serves - 1`` (none for the trainer)."""
        steps.append(Step(name=name, role=role, hosts=step_hosts, ntasks=len(step_hosts) * tasks_per_node,
                          tasks_per_node=tasks_per_node, first=first,
                          output=f"{job_dir}/logs/step-{name}.log", **kw))
        for server in servers[first:first + serves]:
            server.step = len(steps) - 1

    # ---- engines
    engine_urls: list[str] = []
    if want_engines:
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
                add_step(f"tg-engines-{h}", "engine", [h], per_node, first=k * per_node, serves=per_node,
                         gpus_per_task=tp if gpu else 0)
        else:
            for e in range(n_engines):
                add_step(f"tg-engine{e}", "engine", servers[e].hosts, 1, first=e, serves=1,
                         gpus_per_node=gpn if gpu else 0)
        engine_urls = [s.url for s in servers]

    router_url = ""
    start_router = knobs.router if knobs.router is not None else (engine == "sglang" and len(engine_urls) > 1)
    if start_router and engine_urls:
        h = rollout_hosts[0]
        servers.append(Server(name="router", role="router", hosts=[h], addr=addr_of[h],
                              port=port["router"], gpus=0, log=f"{job_dir}/logs/router.log"))
        add_step("tg-router", "router", [h], 1, first=len(servers) - 1, serves=1, overlap=True)
        router_url = servers[-1].url

    # ---- judge
    judge_url = knobs.judge_url or cfg.judge.endpoint or ""
    judge_model = knobs.judge_model or ""
    judge_name = knobs.judge_name or cfg.judge.model or (Path(judge_model).name if judge_model else "")
    if start_judge:
        jtp = knobs.judge_tp or len(judge_hosts) * gpn
        if jtp > len(judge_hosts) * gpn:
            raise PlanError(f"judge: JUDGE_TP={jtp} needs more than {len(judge_hosts)} judge nodes x {gpn} GPUs")
        h0 = judge_hosts[0]
        servers.append(Server(name="judge", role="judge", hosts=judge_hosts, addr=addr_of[h0],
                              port=port["judge"], gpus=jtp, log=f"{job_dir}/logs/judge.log",
                              dist=f"{addr_of[h0]}:{port['judge_dist']}" if len(judge_hosts) > 1 else ""))
        add_step("tg-judge", "judge", judge_hosts, 1, first=len(servers) - 1, serves=1,
                 gpus_per_node=gpn if gpu else 0)
        judge_url = servers[-1].url
        if not judge_model:
            blockers.append(f"judge: {judge_why}; set JUDGE_MODEL=DIR to serve a judge on "
                            f"{len(judge_hosts)} node(s), or JUDGE_URL=http://HOST:PORT (with JUDGE_NAME) "
                            f"for a running one")
    if judge_needed and judge_url and not judge_name and not blockers:
        blockers.append(f"judge: the endpoint {judge_url} needs a model name: set JUDGE_NAME or judge.model")

    # ---- trainer
    master_addr = addr_of[train_hosts[0]]
    sync_master = master_addr if engine_urls else ""
    add_step("tg-train", "train", train_hosts, gpn, gpus_per_node=gpn if gpu else 0)
    train_args = ["--recipe", recipe, *overrides,
                  f"parallel.nodes={train_nodes}", f"parallel.gpus_per_node={gpn}"]
    if engine_urls:
        train_args.append(f"rollout.server_urls=[{','.join(engine_urls)}]")
    if judge_needed and judge_url and (knobs.judge_url or start_judge):
        train_args += [f"judge.endpoint={judge_url}", f"judge.model={judge_name}"]
    # Fields the launcher has values for but the schema may not have yet: passed when it
    # does, else left to the environment (TG_SYNC_MASTER, TG_ROUTER_URL) and said so.
    for name, value, env in (("sync_master_address", sync_master, "TG_SYNC_MASTER"),
                             ("router_url", router_url, "TG_ROUTER_URL")):
        if not value:
            continue
        if name in {f.name for f in dataclasses.fields(RolloutConfig)}:
            train_args.append(f"rollout.{name}={value}")
        else:
            notes.append(f"rollout.{name} is not a config field yet: {value} is exported to the "
                         f"trainer as ${env} only")

    return Plan(
        recipe=recipe, overrides=list(overrides), run_name=cfg.run_name, accel=accel, gpus_per_node=gpn,
        hosts=hosts, addrs=addrs,
        roles={"train": train_hosts, "rollout": rollout_hosts, "judge": judge_hosts},
        layout=dims.describe(), master_addr=master_addr, master_port=port["master"],
        sync_master=sync_master, engine=engine if want_engines else "",
        engine_model=(knobs.engine_model or cfg.model.hf_checkpoint or cfg.model.hf_config) if want_engines else "",
        engine_tp=tp if want_engines else 0, judge_model=judge_model if start_judge else "",
        judge_name=judge_name if judge_url else "", judge_url=judge_url, router_url=router_url,
        servers=servers, steps=steps, train_args=train_args, notes=notes, blockers=blockers,
        engine_flags=["--enable-return-routed-experts"]
        if want_engines and cfg.rollout.routing_replay else [])


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


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m megatron_tg.launch.plan",
        description="Resolve a recipe and a node count into the roles of a Slurm job (no Slurm calls).")
    ap.add_argument("--recipe", required=True, metavar="FILE")
    ap.add_argument("--format", choices=sorted(RENDERERS), default="text")
    sizes = ap.add_argument_group("sizes (default: from the recipe)")
    sizes.add_argument("--nodes", type=int, help="nodes in the allocation; the rollout role takes the rest")
    sizes.add_argument("--train-nodes", type=int)
    sizes.add_argument("--rollout-nodes", type=int)
    sizes.add_argument("--judge-nodes", type=int)
    sizes.add_argument("--gpus-per-node", type=int)
    sizes.add_argument("--accel", choices=ACCELERATORS)
    nodes = ap.add_argument_group("nodes")
    nodes.add_argument("--hosts", type=_csv, help="node names in allocation order (default node1..nodeN)")
    nodes.add_argument("--addrs", type=_csv, help="their addresses, same order (default: the names)")
    servers = ap.add_argument_group("servers")
    servers.add_argument("--engine", choices=ENGINE_SERVERS)
    servers.add_argument("--engine-model")
    servers.add_argument("--router", type=int, choices=(0, 1))
    servers.add_argument("--judge-model")
    servers.add_argument("--judge-name")
    servers.add_argument("--judge-url")
    servers.add_argument("--judge-tp", type=int)
    ap.add_argument("--port-base", type=int, default=DEFAULT_PORT_BASE)
    ap.add_argument("--job-dir", default="runs/slurm/JOB", help="per-job dir (default: a placeholder)")
    ap.add_argument("--out-dir", help="also write plan.env, plan.txt and plan.json here (one planning "
                                      "for all three: each Python start costs the batch job ~1 s)")
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides, as for the trainer")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    knobs = Knobs(
        nodes=args.nodes, hosts=args.hosts, addrs=args.addrs, train_nodes=args.train_nodes,
        rollout_nodes=args.rollout_nodes, judge_nodes=args.judge_nodes, gpus_per_node=args.gpus_per_node,
        accel=args.accel, engine=args.engine, engine_model=args.engine_model,
        router=None if args.router is None else bool(args.router), judge_model=args.judge_model,
        judge_name=args.judge_name, judge_url=args.judge_url, judge_tp=args.judge_tp,
        port_base=args.port_base, job_dir=args.job_dir)
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
