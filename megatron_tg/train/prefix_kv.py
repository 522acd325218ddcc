"""Expert prefix reuse: the shared-weight expert computes only what differs from the student.

An expert sequence is the student's rollout with feedback messages inserted; everything
before the first insertion (the prefix, often most of a long agent rollout) is the same
tokens at the same positions under the same weights as the student's. Its keys and values
in every layer are therefore the student's, which the student forward has just computed.
So, for the ``shared`` expert (the paper's: the live weights), the trainer

1. runs the student forward (with autograd) while :func:`record_kv` keeps each layer's
   post-RoPE keys and values (detached);
2. runs the expert forward under ``no_grad`` on the suffixes only (inserted feedback and
   everything after it), while :func:`reuse_kv` makes each layer's attention attend to
   [the sequence's prefix keys/values from step 1 ; the suffix's own keys/values].

Both passes run in megatron's THD form (:mod:`megatron_tg.train.batching`). The expert pass
is given its suffixes' own ``PackedSeqParams`` (so RoPE rotates its queries and keys per
suffix segment); its core attention then receives [prefix ; suffix] keys per segment with
``cu_seqlens_kv`` ≠ ``cu_seqlens_q``, causal and bottom-right aligned (a suffix's queries are
the last positions of its key segment): on CPU per-segment SDPA with
``causal_lower_right``, on TE ``padding_causal_bottom_right``
(:mod:`megatron_tg.models.qwen3_moe.attention`). Nothing is O(tokens²) but the CPU path's
per-segment ``[suffix, prefix + suffix]`` boolean mask.

RoPE: THD restarts rotary positions at 0 in every segment, so a prefix key ``p`` was rotated
by ``p`` in the student pass and a suffix query ``j`` by ``j`` in the expert pass. Scores
depend only on query minus key rotation, so each cached prefix key is rotated further by
``-P`` (``P``: the prefix length): the query then sees it at distance ``P + j - p``, exactly
its distance in the full expert sequence. Rotations compose, so this is exact up to float
rounding.

Cost: the expert pass shrinks from (prefix + suffix) tokens to suffix tokens (its attention
reads prefix keys); memory: one step's keys and values per layer, kept until the expert pass
ends. Not for ``frozen``/``ema`` experts (other weights: other keys).

Recompute, routing replay, pipeline stages (docs/micro-batch.md §3): keys are recorded in the
student's forward only (a recomputed forward in backward runs after the swap is undone and
records nothing); the reuse pass is ``no_grad``, so recompute never touches it. Under routing
replay the recorded prefix keys come from the replayed (engine) routing, which is what the
student scored, and the suffix routes freely. The store is per decoder layer of this model
chunk, so under pipeline parallelism each stage records and reuses its own layers' keys.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch


@dataclass
class PrefixPlan:
    """Where the expert pass's prefix keys come from, for one micro-batch (THD layout)."""

    src: torch.Tensor       # [P] long: flat student index (b·S + s) of each prefix key slot
    shift: torch.Tensor     # [P] long: extra RoPE rotation (positions) for that cached key
    kv_index: torch.Tensor  # [T_kv] long: the key sequence, as indices into [suffix ; prefix]
    cu_seqlens_kv: torch.Tensor  # [segments + 1] int32: key segments, aligned with the suffix's
    max_seqlen_kv: int
    num_queries: int        # B_e·S_e: the suffix rows' flat length


def build_prefix_plan(student, suffix, prefixes: Sequence[tuple[int, int, int]]) -> PrefixPlan:
    """``student`` / ``suffix``: the packed student rows and expert-suffix rows
    (:class:`~megatron_tg.train.batching.PackedRows`); ``prefixes[e] = (student sequence,
    prefix length, suffix length)`` of suffix sequence ``e``. Key segment ``i`` is query
    segment ``i`` (an expert suffix, or padding) preceded by that suffix's prefix keys."""
    t_e = suffix.tokens.numel()
    starts = {suffix.flat(e, 0): e for e in range(len(prefixes))}
    cu = suffix.cu_seqlens.tolist()
    src, shift, kv_index, seglens = [], [], [], []
    for a, b in zip(cu[:-1], cu[1:]):
        e = starts.get(a)
        plen = 0
        if e is not None:
            k, plen, n = prefixes[e]
            if n != b - a:
                raise ValueError(f"expert suffix {e}: {n} tokens, its segment has {b - a}")
            kv_index.extend(range(t_e + len(src), t_e + len(src) + plen))
            src.extend(student.flat(k, p) for p in range(plen))
            shift.extend([-plen] * plen)
        kv_index.extend(range(a, b))
        seglens.append(plen + b - a)
    cu_kv = torch.zeros(len(seglens) + 1, dtype=torch.int32)
    cu_kv[1:] = torch.tensor(seglens).cumsum(0)
    return PrefixPlan(src=torch.tensor(src, dtype=torch.long),
                      shift=torch.tensor(shift, dtype=torch.long),
                      kv_index=torch.tensor(kv_index, dtype=torch.long), cu_seqlens_kv=cu_kv,
                      max_seqlen_kv=max(seglens), num_queries=t_e)


class _Store:
    def __init__(self, inv_freq: torch.Tensor, interleaved: bool) -> None:
        if interleaved:
            raise NotImplementedError("prefix reuse supports non-interleaved RoPE (Qwen3's)")
        self.inv_freq = inv_freq.detach().float()
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.plan: PrefixPlan | None = None
        self._ready: tuple | None = None  # the plan on the keys' device, with its RoPE tables

    def _prepared(self, device: torch.device):
        """(src, cos, sin, kv_index, cu_seqlens_kv) on ``device``: built once per expert
        pass, shared by all layers (the shifts, hence the rotation tables, are the same)."""
        if self._ready is None or self._ready[0].device != device:
            plan = self.plan
            ang = plan.shift.to(device, torch.float32)[:, None] * self.inv_freq.to(device)
            ang = torch.cat((ang, ang), dim=-1)[:, None, :]       # [P, 1, rot]
            self._ready = (plan.src.to(device), ang.cos(), ang.sin(),
                           plan.kv_index.to(device), plan.cu_seqlens_kv.to(device))
        return self._ready

    def extended(self, layer: int, key: torch.Tensor, value: torch.Tensor, params):
        """This layer's [prefix ; suffix] keys and values per segment, ``[T_kv, groups, d]``,
        and the ``PackedSeqParams`` that pairs them with the suffix queries."""
        plan = self.plan
        if params is None or params.qkv_format != "thd" or key.dim() != 3:
            raise ValueError("prefix reuse needs both passes on packed rows (THD)")
        if key.shape[0] != plan.num_queries:
            raise ValueError(f"the expert pass has {key.shape[0]} tokens, its prefix plan "
                             f"{plan.num_queries}: not the micro-batch the plan was built for")
        src, cos, sin, kv_index, cu_kv = self._prepared(key.device)
        pk = _rotate(self.keys[layer][src], cos, sin).to(key.dtype)   # [P, g, d]
        pv = self.values[layer][src].to(value.dtype)
        k = torch.cat((key, pk))[kv_index]
        v = torch.cat((value, pv))[kv_index]
        return k, v, dataclasses.replace(params, cu_seqlens_kv=cu_kv,
                                         max_seqlen_kv=plan.max_seqlen_kv)

    def clear(self) -> None:
        self.keys.clear()
        self.values.clear()
        self.plan, self._ready = None, None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate already-rotated keys ``x`` [P, g, d] further: ``cos``/``sin`` [P, 1, rot] are
    the tables of each key's extra shift (non-interleaved RoPE, megatron's layout)."""
    rot = cos.shape[-1]
    t, rest = x[..., :rot].float(), x[..., rot:]
    t1, t2 = t.chunk(2, dim=-1)
    out = t * cos + torch.cat((-t2, t1), dim=-1) * sin
    return torch.cat((out.to(x.dtype), rest), dim=-1)


class _Attend(torch.nn.Module):
    """Stands in for a layer's core attention while recording or reusing."""

    def __init__(self, inner: torch.nn.Module, store: _Store, layer: int, mode: str) -> None:
        super().__init__()
        self.inner, self.store, self.layer, self.mode = inner, store, layer, mode

    def forward(self, query, key, value, attention_mask, packed_seq_params=None, **kwargs):
        if self.mode == "record":
            if packed_seq_params is None or key.dim() != 3:
                raise ValueError("prefix reuse needs both passes on packed rows (THD)")
            self.store.keys[self.layer] = key.detach()
            self.store.values[self.layer] = value.detach()
            return self.inner(query, key, value, attention_mask,
                              packed_seq_params=packed_seq_params, **kwargs)
        k, v, params = self.store.extended(self.layer, key, value, packed_seq_params)
        return self.inner(query, k, v, None, packed_seq_params=params, **kwargs)


def _attentions(gpt) -> list[torch.nn.Module]:
    return [layer.self_attention for layer in gpt.decoder.layers]


@contextlib.contextmanager
def _swapped(gpt, store: _Store, mode: str) -> Iterator[_Store]:
    attns = _attentions(gpt)
    originals = [a.core_attention for a in attns]
    try:
        for i, a in enumerate(attns):
            a.core_attention = _Attend(originals[i], store, i, mode)
        yield store
    finally:
        for a, orig in zip(attns, originals):
            a.core_attention = orig


@contextlib.contextmanager
def record_kv(gpt) -> Iterator[_Store]:
    """Keep every layer's keys/values of the forward passes run inside (the student's)."""
    if gpt.config.context_parallel_size != 1:
        raise NotImplementedError("prefix reuse with context parallelism")
    store = _Store(gpt.rotary_pos_emb.inv_freq, bool(gpt.config.rotary_interleaved))
    with _swapped(gpt, store, "record"):
        yield store


@contextlib.contextmanager
def reuse_kv(gpt, store: _Store, plan: PrefixPlan) -> Iterator[_Store]:
    """Forward passes inside attend to ``plan``'s prefix keys/values from ``store`` first;
    the store is emptied on exit."""
    store.plan = plan
    try:
        with _swapped(gpt, store, "reuse"):
            yield store
    finally:
        store.clear()
