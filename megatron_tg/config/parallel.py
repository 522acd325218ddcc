"""How the training ranks split the model. The arithmetic lives in :mod:`megatron_tg.parallel.dims`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_tg.config.base import ConfigError, check_choice, check_range
from megatron_tg.parallel.dims import ParallelDims

BACKENDS = ("auto", "gloo", "nccl")


@dataclass
class ParallelConfig:
    """Sizes of the parallel axes of the training job (the rollout engines are sized apart)."""

    tp: int = 1
    """Tensor parallel size: splits attention heads, MLP columns and the vocabulary."""

    pp: int = 1
    """Pipeline parallel size: splits the layers into this many stages."""

    cp: int = 1
    """Context parallel size: splits each sequence along its tokens."""

    ep: int = 1
    """Expert parallel size: splits the routed experts of every MoE layer."""

    etp: Optional[int] = None
    """Tensor parallel size inside each expert (megatron's expert_tensor_parallel_size);
    None = same as tp, megatron's default. MoE recipes usually set 1: experts are narrow, and
    splitting them over EP alone avoids a TP all-reduce per expert. With ep = 1 it must equal tp."""

    sequence_parallel: bool = False
    """Shard the norm/dropout activations along the sequence over the TP group. Megatron-core
    requires it for MoE models with tp > 1, so validation refuses that combination without it."""

    backend: str = "auto"
    """torch.distributed backend: "gloo" (CPU), "nccl" (GPU), "auto" = nccl when CUDA is available."""

    use_distributed_optimizer: bool = False
    """Shard the fp32 master weights and Adam moments over the data-parallel ranks (ZeRO-1):
    megatron's DistributedOptimizer over DDP's sharded grad buffers, on GPU and on CPU (gloo).
    False: megatron's unsharded optimizer on GPU, a plain AdamW on the same grad buffers on CPU.
    Its checkpoints (megatron's ``dp_reshardable`` format) resume at another DP size, not at
    another TP/PP/EP layout."""

    nodes: Optional[int] = None
    """Training nodes this recipe is sized for; None = whatever world the launcher starts.
    Only the dry-run (world size) and the cluster planner read it."""

    gpus_per_node: int = 8
    """Accelerators per training node (one rank each)."""

    interconnect_gbps_per_gpu: float = 50.0
    """GB/s one GPU's data-parallel collectives move, for the time plan only (``megatron-tg
    memory`` / ``plan``: the gathered EMA expert's all-gathers). 50 = one 400 Gb/s
    InfiniBand NIC per H100, the usual DP group spanning nodes; NVLink inside a node is
    faster. An assumption until the first GPU run measures it."""

    host_link_gbps_per_gpu: float = 25.0
    """GB/s of one GPU's host-to-device copies (PCIe Gen5 x16 is ~64 GB/s per direction,
    shared by two GPUs per switch on common H100 nodes, hence ~25 effective), for the time
    plan of the EMA's host placement (objective.ema_placement = "host"). An assumption."""

    @property
    def expert_tp(self) -> int:
        """``etp`` with its default applied (:class:`ParallelDims` owns the rule)."""
        return ParallelDims.resolve_etp(self.tp, self.etp)

    def validate(self) -> None:
        for name in ("tp", "pp", "cp", "ep", "gpus_per_node"):
            check_range(f"parallel.{name}", getattr(self, name), ge=1)
        if self.etp is not None:
            check_range("parallel.etp", self.etp, ge=1)
        check_choice("parallel.backend", self.backend, BACKENDS)
        for name in ("interconnect_gbps_per_gpu", "host_link_gbps_per_gpu"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"parallel.{name} must be > 0, got {getattr(self, name)}")
        if self.nodes is None:
            # The smallest world the sizes fit in exists by construction, so this checks only
            # the rules that hold for every world size (e.g. ep = 1 needs etp = tp).
            self.dims(self.default_world_size())
            return
        check_range("parallel.nodes", self.nodes, ge=1)
        # Fail at config time rather than at launch when the recipe's nodes cannot hold its layout.
        try:
            self.dims(self.default_world_size())
        except ConfigError as exc:
            raise ConfigError(f"parallel.nodes: {self.nodes} nodes x {self.gpus_per_node} "
                              f"GPUs do not fit the layout ({exc})") from exc

    def default_world_size(self) -> int:
        """World size of the recipe's nodes, else the smallest world the layout fits in."""
        if self.nodes is not None:
            return self.nodes * self.gpus_per_node
        return ParallelDims.smallest_world(tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep,
                                           etp=self.etp)

    def dims(self, world_size: int) -> ParallelDims:
        """The layout for ``world_size`` ranks; a layout that does not divide is a ConfigError."""
        try:
            return ParallelDims(world_size, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep,
                                etp=self.etp)
        except ValueError as exc:  # LayoutError
            raise ConfigError(f"parallel: {exc}") from exc
