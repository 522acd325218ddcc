"""Context parallelism on packed (THD) token sequences: the partitioning megatron-core and
Transformer Engine use, as one object both the GPU path and the CPU attention twin read.

A micro-batch is one packed sequence of segments (each packed sequence, and each row's
padding, is a segment of ``cu_seqlens``; :mod:`megatron_tg.train.batching`). Under CP:

1. every segment is padded at its end to a multiple of ``2·CP`` (TE's
   ``pad_thd_sequences_for_cp``); with sequence parallelism the last segment takes the extra
   padding that makes a rank's share a multiple of TP;
2. every padded segment is cut into ``2·CP`` equal chunks and CP rank ``r`` holds chunks
   ``r`` and ``2·CP−1−r`` of every segment, segment after segment (megatron's
   ``get_thd_batch_on_this_cp_rank`` through TE's ``thd_get_partitioned_indices``): causal
   attention work per rank is then balanced;
3. RoPE positions count from 0 in every padded segment, and a rank's tokens keep the
   positions they have there (megatron's ``_get_thd_freqs_on_this_cp_rank``).

"Real order" below is the packed order before CP padding (the flat ``b·S + s`` index of the
trainer's rows); "padded order" is the same with every segment's pad tail inserted; a
rank's "share" is its tokens in the order of (2). Pad tokens sit at the end of their
segment, so no real token attends to them under causal attention: the pad tail is counted
as part of its segment in :meth:`CPLayout.packed_seq_params` (docs/context-parallel.md).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from megatron_tg.parallel.dims import LayoutError


@dataclass(frozen=True)
class CPLayout:
    """How one packed micro-batch is padded and split over ``cp`` ranks."""

    cp: int
    seqlens: tuple[int, ...]
    """Real length of every segment (packed order)."""
    padded: tuple[int, ...]
    """Length of every segment after its pad tail: a multiple of ``2·cp``."""

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def build(cls, seqlens: Sequence[int], cp: int, *, tp: int = 1,
              max_tokens: int | None = None) -> "CPLayout":
        """Pad every segment of ``seqlens`` to a multiple of ``2·cp``; with ``tp > 1``
        (sequence parallelism splits each rank's share over TP) the last segment grows
        until the share is a multiple of ``tp``. ``max_tokens``: refuse a padded total
        above it (a micro-batch budget)."""
        seqlens = tuple(int(n) for n in seqlens)
        _check_sizes(cp, tp)
        if not seqlens:
            raise LayoutError("CP layout: no segments to partition")
        for i, n in enumerate(seqlens):
            if n <= 0:
                raise LayoutError(f"CP layout: segment {i} has {n} tokens; every segment "
                                  f"needs at least one")
        m = 2 * cp
        padded = [-(-n // m) * m for n in seqlens]
        # The share T_pad / cp must split over TP: T_pad a multiple of cp·tp as well as of
        # 2·cp. The difference is a multiple of 2·cp, so the last segment stays a multiple.
        extra = -sum(padded) % math.lcm(m, cp * tp)
        padded[-1] += extra
        total = sum(padded)
        if max_tokens is not None and total > max_tokens:
            raise LayoutError(
                f"CP layout: {len(seqlens)} segments of {sum(seqlens)} tokens pad to {total} "
                f"for cp={cp} (each a multiple of {m}, the total of {math.lcm(m, cp * tp)}), "
                f"over the budget of {max_tokens} tokens")
        return cls(cp=cp, seqlens=seqlens, padded=tuple(padded))

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens, cp: int, *, tp: int = 1,
                        max_tokens: int | None = None) -> "CPLayout":
        """:meth:`build` from cumulative real lengths (``PackedRows.cu_seqlens``)."""
        return cls.build(_lengths(cu_seqlens, "cu_seqlens"), cp, tp=tp, max_tokens=max_tokens)

    @classmethod
    def from_padded(cls, cu_seqlens_padded, cp: int) -> "CPLayout":
        """The layout whose padded bounds are ``cu_seqlens_padded`` (what a core attention
        receives in ``PackedSeqParams``); the real lengths are taken to be the padded ones."""
        _check_sizes(cp, 1)
        lens = _lengths(cu_seqlens_padded, "cu_seqlens_padded")
        for i, n in enumerate(lens):
            if n <= 0 or n % (2 * cp):
                raise LayoutError(f"CP layout: padded segment {i} has {n} tokens, not a positive "
                                  f"multiple of 2·cp = {2 * cp}")
        return cls(cp=cp, seqlens=tuple(lens), padded=tuple(lens))

    def __post_init__(self) -> None:
        if len(self.seqlens) != len(self.padded) or any(
                p < n or p % (2 * self.cp) for n, p in zip(self.seqlens, self.padded)):
            raise LayoutError(f"CP layout: padded lengths {list(self.padded)} do not cover "
                              f"{list(self.seqlens)} in multiples of 2·cp = {2 * self.cp}")

    # ---- sizes --------------------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        """Real tokens (all ranks)."""
        return sum(self.seqlens)

    @property
    def padded_tokens(self) -> int:
        """Tokens after padding (all ranks)."""
        return sum(self.padded)

    @property
    def local_tokens(self) -> int:
        """Tokens of one rank's share: ``padded_tokens / cp``."""
        return self.padded_tokens // self.cp

    @property
    def max_seqlen(self) -> int:
        """Longest padded segment: megatron sizes the RoPE table by it."""
        return max(self.padded)

    @functools.cached_property
    def starts(self) -> tuple[int, ...]:
        """Start of every segment in padded order."""
        out, s = [], 0
        for p in self.padded:
            out.append(s)
            s += p
        return tuple(out)

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """Cumulative real lengths, int32 (real order)."""
        return _cumulative(self.seqlens)

    @property
    def cu_seqlens_padded(self) -> torch.Tensor:
        """Cumulative padded lengths, int32 (padded order)."""
        return _cumulative(self.padded)

    def packed_seq_params(self, device: torch.device | str | None = None):
        """megatron's ``PackedSeqParams`` for a CP rank: the *global* padded bounds (TE and
        megatron's RoPE divide by CP themselves) as ``cu_seqlens_{q,kv}`` and their
        ``_padded`` twins, one tensor for all four. Passing the padded bounds as the real
        ones keeps TE's ``pad_between_seqs`` false (its flash backends refuse padding between
        sequences); the pad tail ends its segment, so no real token's output changes."""
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = self.cu_seqlens_padded
        cu = cu.to(device) if device is not None else cu
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                               cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu,
                               max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen)

    # ---- index maps ---------------------------------------------------------------------

    @functools.cached_property
    def pad_index(self) -> torch.Tensor:
        """[num_tokens] long: where each real-order token sits in padded order."""
        return torch.cat([torch.arange(s, s + n) for s, n in zip(self.starts, self.seqlens)])

    def rank_index(self, rank: int) -> torch.Tensor:
        """[local_tokens] long: the padded-order tokens of ``rank``'s share, in share order."""
        return self._rank_indices[self._check_rank(rank)]

    @functools.cached_property
    def _rank_indices(self) -> tuple[torch.Tensor, ...]:
        m = 2 * self.cp
        out = []
        for r in range(self.cp):
            parts = []
            for s, p in zip(self.starts, self.padded):
                c = p // m
                for j in (r, m - 1 - r):
                    parts.append(torch.arange(s + j * c, s + (j + 1) * c))
            out.append(torch.cat(parts))
        return tuple(out)

    @functools.cached_property
    def _unshuffle(self) -> torch.Tensor:
        """[padded_tokens] long: position in the concatenated shares of each padded token."""
        return torch.argsort(torch.cat(self._rank_indices))

    @functools.cached_property
    def global_positions(self) -> torch.Tensor:
        """[padded_tokens] long: RoPE position of every padded-order token (0 at each
        segment start, running on through the pad tail)."""
        return torch.cat([torch.arange(p) for p in self.padded])

    def positions(self, rank: int) -> torch.Tensor:
        """[local_tokens] long: RoPE positions of ``rank``'s share."""
        return self.global_positions[self.rank_index(rank)]

    def owner(self, flat: torch.Tensor | Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(CP rank, index in that rank's share) of real-order tokens ``flat``."""
        flat = torch.as_tensor(flat, dtype=torch.long)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_tokens):
            raise LayoutError(f"CP layout: token index outside 0..{self.num_tokens - 1} "
                              f"(got {int(flat.min())}..{int(flat.max())})")
        where = self._unshuffle[self.pad_index[flat]]
        return where // self.local_tokens, where % self.local_tokens

    # ---- moving tokens ------------------------------------------------------------------

    def pad(self, x: torch.Tensor, dim: int = 0, value: float = 0) -> torch.Tensor:
        """Real order -> padded order along ``dim``; pad tokens are ``value``."""
        self._check_len(x, dim, self.num_tokens, "real-order")
        shape = list(x.shape)
        shape[dim] = self.padded_tokens
        idx = self.pad_index.to(x.device)
        return x.new_full(shape, value).index_copy(dim, idx, x)

    def unpad(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Padded order -> real order along ``dim`` (drops the pad tails)."""
        self._check_len(x, dim, self.padded_tokens, "padded-order")
        return x.index_select(dim, self.pad_index.to(x.device))

    def split(self, x: torch.Tensor, rank: int, dim: int = 0) -> torch.Tensor:
        """``rank``'s share of a padded-order tensor."""
        self._check_len(x, dim, self.padded_tokens, "padded-order")
        return x.index_select(dim, self.rank_index(rank).to(x.device))

    def merge(self, shares: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
        """The shares of ranks ``0 .. cp-1`` back in padded order (the inverse of
        :meth:`split`; differentiable)."""
        if len(shares) != self.cp:
            raise LayoutError(f"CP layout: {len(shares)} shares for cp={self.cp}")
        for r, s in enumerate(shares):
            self._check_len(s, dim, self.local_tokens, f"rank {r}'s share")
        joined = torch.cat(list(shares), dim=dim)
        return joined.index_select(dim, self._unshuffle.to(joined.device))

    def gather(self, x: torch.Tensor, group) -> torch.Tensor:
        """Every rank's share of ``x`` (this rank's, first dimension) from all ranks of the
        CP ``group``, in padded order; the backward sends each rank its shares' gradient."""
        self.check_group(group)
        self._check_len(x, 0, self.local_tokens, "this rank's share")
        return self.merge(gather_tokens(x, group).chunk(self.cp, dim=0))

    # ---- checks -------------------------------------------------------------------------

    def check_group(self, group) -> None:
        size = dist.get_world_size(group)
        if size != self.cp:
            raise LayoutError(f"CP layout for cp={self.cp} used on a group of {size} ranks")

    def _check_rank(self, rank: int) -> int:
        if not 0 <= rank < self.cp:
            raise LayoutError(f"CP rank {rank} outside 0..{self.cp - 1}")
        return rank

    def _check_len(self, x: torch.Tensor, dim: int, expected: int, what: str) -> None:
        if x.shape[dim] != expected:
            raise LayoutError(f"CP layout: a {what} tensor has {x.shape[dim]} tokens along dim "
                              f"{dim}, the layout has {expected} (cp={self.cp}, "
                              f"{len(self.padded)} segments, {self.padded_tokens} padded tokens)")


class _GatherTokens(torch.autograd.Function):
    """All-gather along dim 0; backward: reduce-scatter (sum) of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        x = x.contiguous()
        out = x.new_empty((world * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        world = dist.get_world_size(ctx.group)
        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0] // world, *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None


def gather_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """[n, ...] on each of ``world`` ranks -> [world·n, ...] (rank order) on every rank.
    Every rank's copy feeds that rank's computation, so the gradient of a rank's input is
    the sum of all ranks' gradients of its slice (reduce-scatter)."""
    if dist.get_world_size(group) == 1:
        return x
    return _GatherTokens.apply(x, group)


def _check_sizes(cp: int, tp: int) -> None:
    if not isinstance(cp, int) or cp < 1:
        raise LayoutError(f"CP layout: cp={cp!r} must be a positive integer")
    if not isinstance(tp, int) or tp < 1:
        raise LayoutError(f"CP layout: tp={tp!r} must be a positive integer")


def _lengths(cu, what: str) -> list[int]:
    cu = cu.tolist() if torch.is_tensor(cu) else [int(v) for v in cu]
    if len(cu) < 2 or cu[0] != 0:
        raise LayoutError(f"CP layout: {what} must start at 0 and bound at least one segment "
                          f"(got {cu[:4]}{'...' if len(cu) > 4 else ''})")
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    bad = [i for i, n in enumerate(lens) if n < 0]
    if bad:
        raise LayoutError(f"CP layout: {what} decreases at segment {bad[0]} "
                          f"({cu[bad[0]]} -> {cu[bad[0] + 1]})")
    return lens


def _cumulative(lens: Sequence[int]) -> torch.Tensor:
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    return cu
