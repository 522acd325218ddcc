"""Which forward passes run, per micro-batch, on every rank: the one place that decides it.

Why a plan: with expert parallelism the MoE all-to-alls of a pass span the ranks of the
expert-parallel group (which are data-parallel ranks with different samples), so every
rank of the group must run the same number of micro-batches and, per micro-batch, the same
passes in the same order, whatever its own data. Under pipeline parallelism the stages of
one pipeline hold the same samples and agree by construction; the plan still fixes how
many micro-batches each schedule runs.

Per micro-batch index the plan says

* ``source``: which of this rank's micro-batches it trains on, or None for a *padding*
  micro-batch (this rank ran out of data; it repeats its first micro-batch at zero loss
  weight, only to take part in the collectives);
* ``expert``: ``REAL`` (this rank has gated rows: an expert pass on its expert sequences),
  ``DUMMY`` (another rank of the group has an expert pass here: this rank forwards its
  student rows through the expert and discards the result) or ``NONE``.

Without expert parallelism nothing is communicated and there are no dummy passes or padding.
The schedule (:mod:`megatron_tg.train.step`) reads only this plan.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist


class ExpertPass(str, enum.Enum):
    NONE = "none"
    REAL = "real"
    DUMMY = "dummy"


@dataclass(frozen=True)
class Passes:
    """The passes of one micro-batch index."""

    source: int | None
    """Index into this rank's micro-batches; None: a zero-weight padding micro-batch."""
    expert: ExpertPass

    @property
    def padding(self) -> bool:
        return self.source is None


@dataclass(frozen=True)
class PassPlan:
    """The passes of every micro-batch of one optimizer step (the same length on every rank
    of an expert-parallel group)."""

    passes: tuple[Passes, ...]

    def __len__(self) -> int:
        return len(self.passes)

    def __iter__(self):
        return iter(self.passes)

    @property
    def expert_passes(self) -> list[int]:
        """Micro-batch indices that run an expert pass (real or dummy), in order."""
        return [i for i, p in enumerate(self.passes) if p.expert is not ExpertPass.NONE]


def has_expert(mb) -> bool:
    """Whether a micro-batch has gated rows, i.e. needs a real expert pass."""
    return mb.expert is not None and mb.expert_rows.numel() > 0


def build_pass_plan(batches: Sequence, *, ep: int, group=None) -> PassPlan:
    """The plan for this rank's ``batches`` (:class:`~megatron_tg.train.batching.MicroBatch`).

    ``ep > 1``: collective over ``group`` (default: the world), which must contain the
    expert-parallel group: the micro-batch count is the maximum over the ranks, and a
    micro-batch index runs an expert pass wherever any rank has one."""
    if not batches:
        raise ValueError("a pass plan needs at least one micro-batch on every rank")
    own = [has_expert(mb) for mb in batches]
    if ep == 1:
        return PassPlan(tuple(Passes(i, ExpertPass.REAL if e else ExpertPass.NONE)
                              for i, e in enumerate(own)))
    # On the device: the group is NCCL on GPU, which refuses host tensors.
    device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
              else torch.device("cpu"))
    n = torch.tensor([len(batches)], dtype=torch.long, device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MAX, group=group)
    flags = torch.zeros(int(n), dtype=torch.long, device=device)
    flags[: len(own)] = torch.tensor(own, dtype=torch.long, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    passes = []
    for i, anyone in enumerate(flags.tolist()):
        mine = i < len(own) and own[i]
        kind = ExpertPass.REAL if mine else ExpertPass.DUMMY if anyone else ExpertPass.NONE
        passes.append(Passes(i if i < len(batches) else None, kind))
    return PassPlan(tuple(passes))
