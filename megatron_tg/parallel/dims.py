"""Parallel layout arithmetic: named axes and the sizes of each, with no torch.distributed.

Megatron-core orders ranks as TP fastest, then CP, then DP, then PP for the dense part of
the model; the MoE layers re-fold the same ranks as expert-TP x EP x expert-DP x PP, with
EP carved out of the DP x CP ranks. This module only does the arithmetic and validation
so that the dry-run, the Slurm planner and the launcher agree on one layout before any
process group exists; :mod:`megatron_tg.parallel.state` turns it into process groups.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Protocol


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


class ModelShape(Protocol):
    """What a layout must divide (``Qwen3Arch`` has these fields)."""

    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    num_experts: int | None


# megatron-core's default rank order (``order="tp-cp-ep-dp-pp"``): dense groups fold the
# ranks as TP (fastest), CP, DP, PP; expert groups as expert-TP, EP, expert-DP, PP.
DENSE_ORDER = (Axis.TP, Axis.CP, Axis.DP, Axis.PP)
EXPERT_ORDER = (Axis.ETP, Axis.EP, Axis.EDP, Axis.PP)


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of every axis for one world size. ``dp`` and ``edp`` are derived."""

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None  # None: same as tp (megatron's default)

    @staticmethod
    def resolve_etp(tp: int, etp: int | None) -> int:
        """Expert-TP with megatron's default applied: unset means the dense TP size."""
        return tp if etp is None else etp

    def __post_init__(self) -> None:
        object.__setattr__(self, "etp", self.resolve_etp(self.tp, self.etp))
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

    @staticmethod
    def smallest_world(*, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                       etp: int | None = None) -> int:
        """The fewest ranks on which both the dense (tp x cp x pp) and the expert
        (etp x ep x pp) decompositions tile the world."""
        return math.lcm(tp * cp * pp, ParallelDims.resolve_etp(tp, etp) * ep * pp)

    @classmethod
    def smallest(cls, *, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                 etp: int | None = None) -> "ParallelDims":
        """The layout on :meth:`smallest_world` ranks (e.g. a converter's workers)."""
        world = cls.smallest_world(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp)
        return cls(world_size=world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp)

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def edp(self) -> int:
        return self.world_size // (self.etp * self.ep * self.pp)

    def size(self, axis: Axis) -> int:
        return getattr(self, axis.value)

    def check_model(self, *, num_layers: int, num_attention_heads: int,
                    num_query_groups: int, num_experts: int | None,
                    tied_embeddings: bool = False) -> None:
        """Raise :class:`LayoutError` when the model cannot be split this way (or this layout
        is one the trainer does not run)."""
        if tied_embeddings and self.pp > 1:
            # megatron keeps a copy of a tied output weight on the last stage; the HF mapping,
            # weight sync and export know only the first stage's embedding (Qwen3-MoE
            # checkpoints are untied).
            raise LayoutError(f"pp={self.pp} with tied word embeddings is not supported "
                              "(tie_word_embeddings=true in the model's config); use pp=1")
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

    def check_arch(self, arch: ModelShape) -> None:
        """:meth:`check_model` for a model architecture (e.g. ``Qwen3Arch``)."""
        self.check_model(num_layers=arch.num_layers, num_attention_heads=arch.num_attention_heads,
                         num_query_groups=arch.num_key_value_heads, num_experts=arch.num_experts,
                         tied_embeddings=bool(getattr(arch, "tie_word_embeddings", False)))

    def rank_groups(self, axis: Axis) -> list[list[int]]:
        """The ranks of every ``axis`` group, as megatron-core forms them in its default order."""
        order = DENSE_ORDER if axis in DENSE_ORDER else EXPERT_ORDER
        sizes = [self.size(a) for a in order]
        i = order.index(axis)
        stride, size = math.prod(sizes[:i]), sizes[i]
        return [[base + k * stride for k in range(size)]
                for base in range(self.world_size) if (base // stride) % size == 0]

    def describe(self) -> dict[str, int]:
        """Every axis size, for printing and for the saved run config."""
        return {"world_size": self.world_size, **{a.value: self.size(a) for a in Axis}}

    def sizes(self) -> dict[str, int]:
        """The set sizes (etp resolved) and the world: what a converter records as its layout."""
        return {"tp": self.tp, "ep": self.ep, "pp": self.pp, "etp": self.etp,
                "world_size": self.world_size}
