"""Who runs where in a Slurm job: a recipe plus a node list resolved into roles, GPUs and ports.

    megatron-tg plan --recipe recipes/tg_30b.yaml --format text
    megatron-tg plan --recipe recipes/tg_30b.yaml --nodes 7 --format json
    python -m megatron_tg.cli plan --recipe R --hosts n1,n2 --format env   # slurm/lib.sh

(the command line is :mod:`megatron_tg.launch.command`)

Roles, in the order they take nodes from the allocation (the first node runs the batch
script, so it is the first trainer node and MASTER_ADDR is local to it):

* ``train``:  ``parallel.nodes`` nodes, one rank per GPU (``--ntasks-per-node=gpus_per_node``).
* ``engine``: rollout servers of ``rollout.engine_tp`` GPUs each, packed ``gpus_per_node //
  engine_tp`` to a node; an engine wider than a node spans ``engine_tp // gpus_per_node``
  nodes (multi-node SGLang). Only when the recipe wants servers (``rollout.engine: sglang``
  and no ``rollout.server_urls``). With ``rollout.placement: colocated`` they take no nodes
  of their own: they run on the trainer's nodes, sharing its GPUs (``srun --overlap`` for
  both steps; engine ``k`` of a node on local GPUs ``k * engine_tp ..``).
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

from pathlib import Path
from typing import Sequence

from megatron_tg.auth import KEY_NAME, SGLANG_CONFIG_NAME
from megatron_tg.config import RolloutConfig, TGConfig, load_config
from megatron_tg.launch.router_health import router_health
from megatron_tg.launch.sizing import Sizes, check_usr1_lead, size_roles
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



# --------------------------------------------------------------------------- planning

def make_plan(recipe: str, overrides: Sequence[str] = (), knobs: Knobs = Knobs()) -> Plan:
    """Resolve ``recipe`` + ``overrides`` and the launcher's ``knobs`` into a :class:`Plan`.
    Raises :class:`ConfigError` (bad recipe) or :class:`PlanError` (sizes that do not fit)."""
    cfg = load_config(recipe, overrides)
    notes: list[str] = []
    blockers: list[str] = []
    z = size_roles(cfg, knobs, notes)                                  # how many nodes each
    check_usr1_lead(z.checkpoint, knobs)                               # a warning long enough
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
              gpus_per_node=z.gpn if z.accel == "gpu" else 0, overlap=z.colocated)
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
        timeouts=cfg.timeouts.table(cfg), checkpoint=z.checkpoint, colocated=z.colocated)


def _assign_hosts(z: Sizes, knobs: Knobs) -> tuple[list[str], list[str], dict[str, list[str]]]:
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


def _place_rollout(cfg: TGConfig, z: Sizes, knobs: Knobs, by_role: dict[str, list[str]],
                   addr_of: dict[str, str], notes: list[str]
                   ) -> tuple[list[Server], list[Step], list[str], str]:
    """The engines on the rollout nodes and the router in front of them."""
    servers: list[Server] = []
    steps: list[Step] = []
    engine_urls: list[str] = []
    if not z.want_engines:
        return servers, steps, engine_urls, ""
    r, tp, per_node, span = cfg.rollout, cfg.rollout.engine_tp, z.per_node, z.span
    # colocated: the engines take turns with the trainer on its nodes' GPUs
    rollout_hosts = by_role["train"] if z.colocated else by_role["rollout"]
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
                              dist=f"{addr_of[eh[0]]}:{port['engine_dist'] + 10 * e}" if span > 1 else "",
                              base_gpu=(e % per_node) * tp if z.colocated else 0))
    if per_node and z.colocated:
        # Each task sees every GPU of its node (--gpus-per-node), shared with the trainer's step
        # (--overlap), and starts at its base GPU: engine k's TP rank r on local GPU k*tp + r,
        # the GPU of the trainer rank that writes that rank's weights (docs/colocated.md).
        for k, h in enumerate(rollout_hosts):
            _add_step(steps, servers, knobs, f"tg-engines-{h}", "engine", [h], per_node,
                      first=k * per_node, serves=per_node, gpus_per_node=z.gpn if gpu else 0,
                      overlap=True)
    elif per_node:
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


def _place_judge(cfg: TGConfig, z: Sizes, knobs: Knobs, judge_hosts: list[str],
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


def _trainer_args(recipe: str, overrides: Sequence[str], z: Sizes, knobs: Knobs,
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


def engine_flags(r: RolloutConfig, engine: str = "sglang") -> list[str]:
    """Engine-server flags that follow from the rollout config (``engine``: "sglang" or the
    embedded CPU engine, which takes the same flag names where it has the feature).

    * ``rollout.routing_replay``: ``--enable-return-routed-experts``. SGLang returns a
      request's routed experts only when the server was started with it (the embedded engine
      records its routers' choices only then, too).
    * ``rollout.sampling_seed`` set, SGLang only: ``--enable-deterministic-inference``. SGLang
      reads a request's ``sampling_seed`` only in that mode (batch-invariant kernels; without
      it the seed is ignored); the embedded engine honours seeds always and has no such flag.
    * ``rollout.placement="colocated"``: ``--enable-memory-saver`` (release/resume), and for
      SGLang ``--mem-fraction-static`` of :func:`~megatron_tg.launch.colocated_memory.colocated_mem_fraction`.
    """
    flags = []
    if r.routing_replay:
        flags.append("--enable-return-routed-experts")
    if r.sampling_seed is not None and engine == "sglang":
        flags.append("--enable-deterministic-inference")
    if r.placement == "colocated":  # release/resume need the memory saver; the pool leaves the trainer room
        flags.append("--enable-memory-saver")
        if engine == "sglang":
            from megatron_tg.launch.colocated_memory import colocated_mem_fraction

            flags += ["--mem-fraction-static", str(colocated_mem_fraction(r))]
    return flags


