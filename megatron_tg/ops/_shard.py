"""Where this rank's vocabulary shard sits, and the only collectives the ops may issue.

Megatron splits the output layer's vocabulary in contiguous blocks: TP rank r owns ids
[r·Vs, (r+1)·Vs). The padded vocabulary Vs·TP may exceed the true ``vocab_size``; the padding
is always at the end, so on every rank the real columns are a *prefix* of the shard
(possibly empty on the last ranks). The ops slice that prefix instead of masking with -inf:
the padded columns are then never read (garbage, even NaN, cannot leak) and their gradient
is exactly zero.

``group=None`` means "no tensor parallelism": the local logits are the whole (padded)
vocabulary and nothing is communicated, so the ops work without ``torch.distributed``.
(This deliberately differs from ``torch.distributed``'s convention, where ``None`` is the
world group: a loss op must never reduce over data-parallel ranks by accident.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice of the vocabulary and the group to reduce over."""

    group: Optional[dist.ProcessGroup]
    rank: int
    world: int
    shard_size: int
    """Vs: columns of the local logits, padding included."""
    vocab_start: int
    """Global id of local column 0."""
    n_valid: int
    """Leading local columns that are real vocabulary entries (0 ≤ n_valid ≤ Vs)."""

    @classmethod
    def build(cls, shard_size: int, group: Optional[dist.ProcessGroup],
              vocab_size: Optional[int]) -> "VocabShard":
        if group is None:
            rank, world = 0, 1
        else:
            rank, world = dist.get_rank(group), dist.get_world_size(group)
        padded = shard_size * world
        if vocab_size is None:
            vocab_size = padded
        if not 0 < vocab_size <= padded:
            raise ValueError(f"vocab_size={vocab_size} must be in (0, {padded}] "
                             f"(local shard {shard_size} x {world} ranks)")
        start = rank * shard_size
        n_valid = max(0, min(shard_size, vocab_size - start))
        return cls(group, rank, world, shard_size, start, n_valid)

    # --- the only cross-rank traffic: maxima and (partial) sums, never vocabulary columns ---

    def all_max(self, t: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(t, dist.ReduceOp.MAX)

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(t, dist.ReduceOp.SUM)

    def _all_reduce(self, t: torch.Tensor, op: dist.ReduceOp) -> torch.Tensor:
        if self.world == 1:
            return t
        # gloo silently returns wrong data for non-contiguous tensors (docs/measurements.md).
        t = t.contiguous()
        dist.all_reduce(t, op=op, group=self.group)
        return t

    def local_max(self, z: torch.Tensor) -> torch.Tensor:
        """Row max over the valid columns; -inf when this shard holds only padding."""
        if self.n_valid == 0:
            return z.new_full(z.shape[:1], float("-inf"))
        return z.amax(dim=-1)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics in at least fp32 (bf16 logits lose the tail of the distribution)."""
    return torch.promote_types(dtype, torch.float32)
