"""The launch plan rendered for people (text), programs (json) and bash (env).

The env form is what slurm/lib.sh sources: scalars and indexed arrays, every value quoted
with :func:`shlex.quote`, so paths and overrides with spaces or quotes survive.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from megatron_tg.launch.spec import Plan


def render_text(plan: Plan) -> str:
    """The plan for people: roles, hosts, GPUs, the layout, every server and the trainer command."""
    unit = "GPUs" if plan.accel == "gpu" else "slots (CPU)"
    lay = plan.layout
    out = [f"# launch plan: {plan.recipe} (run {plan.run_name}), {plan.nodes} nodes x "
           f"{plan.gpus_per_node} {unit}",
           f"{'role':8} {'nodes':>5} {'GPUs':>5}  hosts"]
    for role, key in (("train", "train"), ("rollout", "engine"), ("judge", "judge")):
        hosts = plan.roles[role]
        gpus = plan.gpus("train" if role == "train" else key)
        out.append(f"{role:8} {len(hosts):5d} {gpus:5d}  {_hostlist(hosts) or '-'}")
    total_gpus = sum(plan.gpus(r) for r in ("train", "engine", "judge"))
    out.append(f"{'total':8} {plan.nodes:5d} {total_gpus:5d}")
    out.append(f"layout: world {lay['world_size']} = tp {lay['tp']} x cp {lay['cp']} x pp {lay['pp']} "
               f"x dp {lay['dp']}; experts etp {lay['etp']} x ep {lay['ep']} x edp {lay['edp']}")
    out.append(f"master: {plan.master_addr}:{plan.master_port}"
               + (f"; weight-sync group at {plan.sync_master}" if plan.sync_master else ""))
    if plan.engine:
        out.append(f"engines: {plan.engine}, tp {plan.engine_tp}, model {plan.engine_model}"
                   + (", colocated on the trainer's GPUs" if plan.colocated else "")
                   + (f", flags {' '.join(plan.engine_args)}" if plan.engine_args else ""))
    if plan.router_url:
        out.append(f"router: {plan.router_url}, health flags {' '.join(plan.router_args)}")
    if plan.judge_url:
        where = (f"serving {plan.judge_model}" if plan.judge_model else
                 "needs JUDGE_MODEL" if plan.roles["judge"] else "external")
        out.append(f"judge: {plan.judge_url} model {plan.judge_name or '?'} ({where})")
    if plan.service_url:
        host = next(s.hosts[0] for s in plan.servers if s.role == "rollout_service")
        out.append(f"rollout service: {plan.service_url} on {host} (its own process; the trainer "
                   "pulls batches from it)")
    if plan.key_file:
        out.append(f"auth: every server requires the job's API key, file {plan.key_file} (made at job "
                   "start, mode 0600; passed by file name, never printed)")
    if plan.servers:
        out.append("servers:")
        for s in plan.servers:
            out.append(f"  {s.name:10} {_hostlist(s.hosts):16} {s.gpus:3d} {unit.split()[0]:5} "
                       f"{s.url:28} {s.log}")
    out.append("steps:")
    for st in plan.steps:
        gpus = (f"{st.gpus_per_task} GPUs/task" if st.gpus_per_task else
                f"{st.gpus_per_node} GPUs/node" if st.gpus_per_node else "no GPUs")
        out.append(f"  {st.name:18} {_hostlist(st.hosts):16} {st.ntasks:4d} tasks "
                   f"({st.tasks_per_node}/node), {gpus}{', overlap' if st.overlap else ''}")
    if plan.checkpoint:
        from megatron_tg.launch.timeplan import render_checkpoint

        out.append(render_checkpoint(plan.checkpoint))
    if plan.timeouts:
        out.append("timeouts (s): " + ", ".join(f"{k}={v:g}" for k, v in plan.timeouts.items()))
    out.append("trainer: <TRAINER_CMD> " + " ".join(shlex.quote(a) for a in plan.train_args))
    out += [f"note: {n}" for n in plan.notes]
    out += [f"BLOCKER: {b}" for b in plan.blockers]
    return "\n".join(out) + "\n"


def render_json(plan: Plan) -> str:
    data = dataclasses.asdict(plan)
    for s, d in zip(plan.servers, data["servers"]):
        d["url"] = s.url
    data["nodes"] = plan.nodes
    data["gpus"] = {r: plan.gpus(r) for r in ("train", "engine", "judge")}
    return json.dumps(data, indent=2) + "\n"


def render_env(plan: Plan) -> str:
    """Bash assignments (scalars and indexed arrays) for ``source``/``eval`` in slurm/*.sh.

    Arrays are parallel: ``TG_STEP_*[i]`` describe step i, ``TG_SERVER_*[j]`` server j.
    """
    def scalar(name: str, value) -> str:
        return f"{name}={shlex.quote(str(value))}"

    def array(name: str, values) -> str:
        return f"{name}=(" + " ".join(shlex.quote(str(v)) for v in values) + ")"

    lines = ["# written by megatron-tg plan; one step per srun, one server per HTTP endpoint"]
    lines += [scalar(k, v) for k, v in (
        ("TG_RECIPE", plan.recipe), ("TG_RUN_NAME", plan.run_name), ("TG_ACCEL", plan.accel),
        ("TG_NODES", plan.nodes), ("TG_GPUS_PER_NODE", plan.gpus_per_node),
        ("TG_WORLD_SIZE", plan.layout["world_size"]),
        ("TG_MASTER_ADDR", plan.master_addr), ("TG_MASTER_PORT", plan.master_port),
        ("TG_SYNC_MASTER", plan.sync_master), ("TG_ROUTER_URL", plan.router_url),
        ("TG_JUDGE_URL", plan.judge_url), ("TG_JUDGE_NAME", plan.judge_name),
        ("TG_JUDGE_MODEL", plan.judge_model), ("TG_ENGINE", plan.engine),
        ("TG_ENGINE_MODEL", plan.engine_model), ("TG_SERVICE_URL", plan.service_url),
        ("TG_USR1_LEAD", plan.checkpoint.get("usr1_lead_s", "")),
        ("TG_KEY_FILE", plan.key_file), ("TG_SGLANG_AUTH", plan.sglang_auth),
        ("TG_COLOCATED", int(plan.colocated)))]
    lines.append(array("TG_TRAIN_HOSTS", plan.roles["train"]))
    lines.append(array("TG_ROLLOUT_HOSTS", plan.roles["rollout"]))
    lines.append(array("TG_JUDGE_HOSTS", plan.roles["judge"]))
    lines.append(array("TG_TRAIN_ARGS", plan.train_args))
    lines.append(array("TG_ENGINE_ARGS", plan.engine_args))
    lines.append(array("TG_ROUTER_ARGS", plan.router_args))
    lines.append(array("TG_SERVICE_ARGS", plan.service_args))
    lines.append(array("TG_ENGINE_URLS", [s.url for s in plan.servers if s.role == "engine"]))
    for attr in ("name", "role", "ntasks", "tasks_per_node", "gpus_per_task", "gpus_per_node", "first",
                 "output"):
        lines.append(array(f"TG_STEP_{attr.upper()}", [getattr(s, attr) for s in plan.steps]))
    lines.append(array("TG_STEP_NODELIST", [",".join(s.hosts) for s in plan.steps]))
    lines.append(array("TG_STEP_NNODES", [len(s.hosts) for s in plan.steps]))
    lines.append(array("TG_STEP_OVERLAP", [int(s.overlap) for s in plan.steps]))
    for attr in ("name", "role", "addr", "port", "gpus", "log", "dist", "url", "step", "base_gpu"):
        lines.append(array(f"TG_SERVER_{attr.upper()}", [getattr(s, attr) for s in plan.servers]))
    lines.append(array("TG_SERVER_HOST", [s.hosts[0] for s in plan.servers]))
    lines.append(array("TG_SERVER_NNODES", [len(s.hosts) for s in plan.servers]))
    lines.append(array("TG_NOTES", plan.notes))
    lines.append(array("TG_BLOCKERS", plan.blockers))
    return "\n".join(lines) + "\n"


def _hostlist(hosts: Sequence[str]) -> str:
    """Short form for display: n1,n2,n3,n4 -> n1..n4 when they are many."""
    if len(hosts) <= 3:
        return ",".join(hosts)
    return f"{hosts[0]}..{hosts[-1]} ({len(hosts)})"


RENDERERS = {"text": render_text, "json": render_json, "env": render_env}
