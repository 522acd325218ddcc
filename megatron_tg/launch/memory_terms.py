"""What the memory plan's roles share (:mod:`megatron_tg.launch.memory`): the GPU's size, the
reserve and headroom assumptions, and :class:`RolePlan`, one role's GPU term by term."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

GIB = 2 ** 30
# nvidia-smi reports 81,559 MiB on an H100 SXM5 80GB; that is what a process can ask for.
H100_MEMORY_GIB = 81_559 / 1024
# Headroom for fragmentation of PyTorch's caching allocator and for estimates that are low:
# a plan must leave 10 % of the GPU free.
USABLE_FRACTION = 0.90
# Assumed, not measured here: CUDA context (~0.5 GiB on H100), NCCL communicator buffers for
# the TP/EP/DP/PP groups and the caching allocator's slack. The first GPU run must measure it.
RUNTIME_RESERVE_GIB = 3.0
# benchmarks/kl_memory.py: the ops' peak extra memory is about 4.3 blocks of chunk x V/TP fp32.
KL_BLOCKS = 4.3
# Expert tokens per rank relative to the balanced mean (dropless routing can exceed it). 1.0 is
# the mean; the first GPU run must measure the peak.
ROUTING_IMBALANCE = 1.0
BF16, FP32 = 2, 4



@dataclass
class RolePlan:
    """The memory terms of one role's GPU, in bytes."""

    role: str
    terms: dict[str, float]
    notes: list[str] = field(default_factory=list)
    capacity_gib: float = H100_MEMORY_GIB
    kv: dict[str, Any] = field(default_factory=dict)
    """Engines only: KV-cache tokens, what the in-flight rollouts need, fit or queue."""
    fixes: dict[str, str] = field(default_factory=dict)
    """Per term, the setting that shrinks it here, where it differs from :data:`FIXES`."""
    host: dict[str, float] = field(default_factory=dict)
    """Bytes per GPU held in host memory (not GPU terms), e.g. parked expert states."""
    usable_fraction: float = USABLE_FRACTION
    """Share of the GPU the terms may take. Engines: 1.0, SGLang's reserve is one of the terms."""

    @property
    def total(self) -> float:
        return sum(self.terms.values())

    def fits(self) -> bool:
        if self.kv and self.kv["rollouts_at_full_context"] < 1:
            return False  # an engine must hold at least one whole rollout
        return self.total <= self.usable_fraction * self.capacity_gib * GIB + 1  # + rounding

    def largest(self) -> str:
        return max(self.terms, key=self.terms.get)

    def as_json(self) -> dict[str, Any]:
        out = {"terms_gib": {k: round(v / GIB, 3) for k, v in self.terms.items()},
               "total_gib": round(self.total / GIB, 3), "fits": self.fits(), "notes": self.notes}
        if self.host:
            out["host_gib"] = {k: round(v / GIB, 3) for k, v in self.host.items()}
        return out
