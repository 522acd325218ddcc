"""What a launch plan is made of: the launcher's knobs, the servers and ``srun`` steps it
starts, and the plan itself. :mod:`megatron_tg.launch.plan` builds a :class:`Plan`;
:mod:`megatron_tg.launch.render` prints one. Pure data: no torch, no Slurm."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_tg.config import ConfigError

ACCELERATORS = ("gpu", "cpu")
ENGINE_SERVERS = ("sglang", "embedded")

# Offsets from --port-base. One knob moves every port, so two jobs sharing a machine (the
# emulated test cluster, where every "node" is 127.0.0.1) stay apart; within a job every
# server gets its own port even across nodes for the same reason. Engine e serves HTTP on
# engine + e; a node-spanning engine's ranks meet on engine_dist + 10 e (multi-node SGLang
# also takes the few ports after its --dist-init-addr port).
PORT_OFFSETS = {"master": 0, "router": 500, "judge": 600, "judge_dist": 700,
                "rollout_service": 800, "engine": 1500, "engine_dist": 2500}
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
    service: Optional[bool] = None
    """Run the rollout side as its own step (the rollout service, docs/rollout-service.md)
    on the first rollout node (the first trainer node when there is none); None = when the
    recipe's rollout.service is not "in_process"."""
    judge_tp: Optional[int] = None
    """Tensor-parallel size of the judge server; None = every GPU of its nodes."""
    port_base: int = DEFAULT_PORT_BASE
    usr1_lead_s: Optional[int] = None
    """Seconds before the time limit that Slurm sends USR1 (``--signal=B:USR1@N``); a plan whose
    step plus checkpoint save needs longer is refused. None = not checked."""
    job_dir: str = "runs/slurm/JOB"
    """Per-job directory: plan files and one log per server (``logs/``)."""


@dataclass
class Server:
    """One HTTP server of the job: an engine, the router, the judge or the rollout service."""

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
    base_gpu: int = 0
    """Its first GPU among those its task sees (SGLang ``--base-gpu-id``): 0 when Slurm binds
    the engine's own GPUs to its task; colocated engines see the whole node, and engine ``k``
    of a node starts at ``k * engine_tp``, the GPUs of the trainer ranks that write it."""

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
    """Shares its node with another step: CPU-only helpers, and colocated engines and trainer,
    which share the node's GPUs on purpose (Slurm 22.05's --overlap shares GPUs too, so
    disaggregated GPU steps never use it)."""
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
    engine_args: list[str]
    """Engine-server flags the recipe itself requires (before ENGINE_ARGS); see
    :func:`megatron_tg.launch.plan.engine_flags`."""
    judge_model: str
    judge_name: str
    judge_url: str
    router_url: str
    router_args: list[str]
    """The router's health-check flags (before ROUTER_ARGS); see
    :mod:`megatron_tg.launch.router_health`."""
    service_url: str
    """The rollout service the trainer pulls batches from ("" = the side runs in rank 0)."""
    service_args: list[str]
    """The service's command line (the trainer's recipe, overrides and server URLs)."""
    servers: list[Server]
    steps: list[Step]
    train_args: list[str]
    notes: list[str] = field(default_factory=list)
    blockers: list[str] = field(default_factory=list)
    """Problems that stop a launch but not a dry-run (e.g. no judge model given)."""
    timeouts: dict[str, float] = field(default_factory=dict)
    """Every limit of the run, resolved (:meth:`TimeoutsConfig.table`), by config path."""
    checkpoint: dict = field(default_factory=dict)
    """Checkpoint size, expected save and step time and the USR1 lead time they need
    (``timeplan.checkpoint_plan``); empty for CPU plans."""
    key_file: str = ""
    """The job's API key file (``JOB_DIR/secret/api_key``, written at job start, mode 0600):
    every server requires its key; only this path appears in arguments and logs."""
    sglang_auth: str = ""
    """The same key as SGLang's ``--config`` YAML (``api-key: ...``), for SGLang servers."""
    colocated: bool = False
    """The engines share the trainer's nodes and GPUs (``rollout.placement="colocated"``):
    their GPUs are the trainer's, not more of them."""

    @property
    def nodes(self) -> int:
        return len(self.hosts)

    def gpus(self, role: str) -> int:
        if self.accel != "gpu":
            return 0
        if role == "train":
            return len(self.roles["train"]) * self.gpus_per_node
        if role == "engine" and self.colocated:  # the trainer's GPUs, counted there
            return 0
        return sum(s.gpus for s in self.servers if s.role == role and role != "router")
