"""Parallel layout arithmetic: named axes and the sizes of each, with no torch.distributed.

Megatron-core orders ranks as TP fastest, then CP, then DP, then PP for the dense part of
the model; the MoE layers re-fold the same ranks as expert-TP x EP x expert-DP x PP, with
EP carved out of the DP x CP ranks. This module only does the arithmetic and validation
so that the dry-run, the Slurm planner and the launcher agree on one layout before any
process group exists; :mod:`megatron_tg.parallel.state` turns it into process groups.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Axis(str, enum.Enum):
    """Named parallel axes. Code refers to these, never to bare strings."""

    TP = "tp"    # tensor parallel: splits attention heads, MLP columns and the vocabulary
    CP = "cp"    # context parallel: splits the sequence
    EP = "ep"    # expert parallel: splits the experts of each MoE layer
    PP = "pp"    # pipeline parallel: splits the layers
    DP = "dp"    # data parallel: replicas of the dense part
    ETP = "etp"  # tensor parallel inside each expert
    EDP = "edp"  # data parallel of the expert weights


class LayoutError(ValueError):
    """A parallel layout that cannot be built; the message names the offending sizes."""


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of every axis for one world size. ``dp`` and ``edp`` are derived."""

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None  # None: same as tp (megatron's default)

    def __post_init__(self) -> None:
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        for name in ("world_size", "tp", "pp", "cp", "ep", "etp"):
            if getattr(self, name) < 1:
                raise LayoutError(f"{name} must be >= 1, got {getattr(self, name)}")
        model = self.tp * self.cp * self.pp
        if self.world_size % model:
            raise LayoutError(
                f"world_size={self.world_size} is not divisible by tp*cp*pp="
                f"{self.tp}*{self.cp}*{self.pp}={model}")
        if self.ep == 1 and self.etp != self.tp:
            # megatron marks expert weights "allreduce" (dense) when ep == 1, so their grads
            # would be reduced over the dense DP group, not the expert-DP group: wrong sums.
            raise LayoutError(f"ep=1 requires etp == tp (got etp={self.etp}, tp={self.tp})")
        expert_model = self.etp * self.ep * self.pp
        if self.world_size % expert_model:
            raise LayoutError(
                f"world_size={self.world_size} is not divisible by etp*ep*pp="
                f"{self.etp}*{self.ep}*{self.pp}={expert_model}")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def edp(self) -> int:
        return self.world_size // (self.etp * self.ep * self.pp)

    def size(self, axis: Axis) -> int:
        return getattr(self, axis.value)

    def check_model(self, *, num_layers: int, num_attention_heads: int,
                    num_query_groups: int, num_experts: int | None) -> None:
        """Raise :class:`LayoutError` when the model cannot be split this way."""
        if num_attention_heads % self.tp:
            raise LayoutError(f"num_attention_heads={num_attention_heads} not divisible by tp={self.tp}")
        if num_query_groups % self.tp and self.tp % num_query_groups:
            raise LayoutError(f"num_query_groups={num_query_groups} and tp={self.tp} do not divide")
        if num_layers % self.pp:
            raise LayoutError(f"num_layers={num_layers} not divisible by pp={self.pp}")
        if num_experts is not None and num_experts % self.ep:
            raise LayoutError(f"num_experts={num_experts} not divisible by ep={self.ep}")
        if num_experts is None and self.ep > 1:
            raise LayoutError(f"ep={self.ep} but the model has no experts")

    def describe(self) -> dict[str, int]:
        """Every axis size, for printing and for the saved run config."""
        return {"world_size": self.world_size, **{a.value: self.size(a) for a in Axis}}
