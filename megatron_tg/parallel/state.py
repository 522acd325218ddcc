"""The one place that sets up torch.distributed and megatron-core's parallel state.

Order matters and is fixed here:
  1. read rank/world from the launcher (torchrun: RANK/WORLD_SIZE/LOCAL_RANK; srun:
     SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID) and pick the backend (NCCL on GPU, gloo on CPU);
  2. on CPU, apply :mod:`megatron_tg.parallel.cpu_patches` *before* megatron builds anything;
  3. ``torch.distributed.init_process_group`` (skipped if the caller already did it);
  4. ``parallel_state.initialize_model_parallel`` with the sizes of :class:`ParallelDims`;
  5. seed megatron's RNG tracker (per-TP/EP-rank streams) and the global RNG identically
     on every rank, so CPU initialisation gives identical master weights everywhere.

Everything else asks :class:`ParallelContext` for groups by :class:`Axis`.
"""

from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_tg.parallel.dims import Axis, ParallelDims


@dataclass(frozen=True)
class LaunchEnv:
    """Rank information read from the launcher's environment."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "LaunchEnv":
        env = dict(os.environ if env is None else env)
        if "RANK" in env and "WORLD_SIZE" in env:  # torchrun, or our own spawner
            rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
            local = int(env.get("LOCAL_RANK", rank))
        elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:  # srun, one task per GPU
            rank, world = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
            local = int(env.get("SLURM_LOCALID", 0))
        else:  # a plain `python` process: a world of one
            rank, world, local = 0, 1, 0
        return cls(rank=rank, world_size=world, local_rank=local,
                   master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                   master_port=int(env.get("MASTER_PORT", "29500")))


@dataclass
class ParallelContext:
    """Handles to the process groups of every named axis, plus this rank's coordinates."""

    dims: ParallelDims
    rank: int
    backend: str
    device: torch.device
    groups: dict[Axis, object] = field(default_factory=dict)

    def group(self, axis: Axis):
        return self.groups[axis]

    def rank_in(self, axis: Axis) -> int:
        return dist.get_rank(self.groups[axis])


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_parallel(dims: ParallelDims | None = None, *, tp: int = 1, pp: int = 1, cp: int = 1,
                  ep: int = 1, etp: int | None = None, seed: int = 1234, backend: str = "auto",
                  timeout_s: float = 1800.0) -> ParallelContext:
    """Initialise distributed + megatron parallel state; idempotent per process.

    ``dims`` wins over the keyword sizes; without it the world size comes from the launcher.
    """
    launch = LaunchEnv.from_env()
    backend = default_backend() if backend == "auto" else backend
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        from megatron_tg.parallel.cpu_patches import apply_cpu_patches

        apply_cpu_patches()
        if os.environ.get("MEGATRON_TG_COMM_RULES") == "nccl":
            # The CPU test policy with NCCL's rules (megatron_tg/testing/nccl_rules.py), for
            # trainer processes that tests start through a launcher, not run_distributed.
            from megatron_tg.testing import nccl_rules

            nccl_rules.enable()
    if on_gpu:
        torch.cuda.set_device(launch.local_rank)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", launch.master_addr)
        os.environ.setdefault("MASTER_PORT", str(launch.master_port))
        dist.init_process_group(backend=backend, rank=launch.rank, world_size=launch.world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    world = dist.get_world_size()
    dims = dims or ParallelDims(world_size=world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp)
    if dims.world_size != world:
        raise ValueError(f"layout is for world_size={dims.world_size} but {world} ranks were launched")

    from megatron.core import parallel_state as mps
    from megatron.core import tensor_parallel

    if mps.model_parallel_is_initialized():
        mps.destroy_model_parallel()
    mps.initialize_model_parallel(
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        context_parallel_size=dims.cp,
        expert_model_parallel_size=dims.ep,
        expert_tensor_parallel_size=dims.etp,
        # megatron's own groups (and their gloo twins) get the same limit as the default group
        distributed_timeout_minutes=max(1, math.ceil(timeout_s / 60)),
    )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    groups = {
        Axis.TP: mps.get_tensor_model_parallel_group(),
        Axis.PP: mps.get_pipeline_model_parallel_group(),
        Axis.CP: mps.get_context_parallel_group(),
        Axis.DP: mps.get_data_parallel_group(),
        Axis.EP: mps.get_expert_model_parallel_group(),
        Axis.ETP: mps.get_expert_tensor_parallel_group(),
        Axis.EDP: mps.get_expert_data_parallel_group(),
    }
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    return ParallelContext(dims=dims, rank=dist.get_rank(), backend=backend, device=device,
                           groups=groups)


def destroy_parallel(destroy_process_group: bool = False) -> None:
    """Tear down megatron's groups (and optionally the default process group)."""
    from megatron.core import parallel_state as mps

    if mps.model_parallel_is_initialized():
        mps.destroy_model_parallel()
    if destroy_process_group and dist.is_initialized():
        dist.destroy_process_group()
