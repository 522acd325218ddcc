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

RoPE: megatron rotates a key by its column in its packed row. Attention scores depend only
on query position minus key position, so a cached prefix key (rotated at its student column
``s + p``) is rotated further by ``delta = c - s - P`` (``c``: the suffix's column in its
expert row, ``P``: the prefix length): a suffix query at column ``c + j`` then sees it at
distance ``P + j - p``, exactly its distance in the full expert sequence. Rotations compose,
so this is exact up to float rounding.

Cost: the expert pass shrinks from (prefix + suffix) tokens to suffix tokens (its attention
reads prefix keys); memory: one step's keys and values per layer, kept until the expert pass
ends. Not for ``frozen``/``ema`` experts (other weights: other keys).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch


@dataclass
class PrefixPlan:
    """Where each expert row's prefix keys come from, for one micro-batch."""

    src: torch.Tensor    # [B_e, P] long: flat student index (row * S + col) of each prefix slot
    shift: torch.Tensor  # [B_e, P] long: extra RoPE rotation (positions) for that cached key
    mask: torch.Tensor   # [B_e, 1, S_e, P + S_e] bool, True = masked (megatron's convention)


def build_prefix_plan(student, suffix, prefixes: Sequence[tuple[int, int, int]]) -> PrefixPlan:
    """``student`` / ``suffix``: the packed student rows and expert-suffix rows
    (:class:`~megatron_tg.train.batching.PackedRows`); ``prefixes[e] = (student sequence,
    prefix length, suffix length)`` of suffix sequence ``e``."""
    b_e, s_e = suffix.tokens.shape
    s_s = student.tokens.shape[1]
    members: list[list[int]] = [[] for _ in range(b_e)]
    for e, (row, _col) in enumerate(suffix.offsets):
        members[row].append(e)
    width = max([sum(prefixes[e][1] for e in m) for m in members] + [0])
    src = torch.zeros((b_e, width), dtype=torch.long)
    shift = torch.zeros((b_e, width), dtype=torch.long)
    allowed = torch.zeros((b_e, s_e, width + s_e), dtype=torch.bool)
    # Suffix-to-suffix: the expert rows' own block-diagonal causal mask (padding included).
    allowed[:, :, width:] = ~suffix.attention_mask[:, 0]
    for r, m in enumerate(members):
        slot = 0
        for e in m:
            k, plen, n = prefixes[e]
            s_row, s_col = student.offsets[k]
            c = suffix.offsets[e][1]
            src[r, slot:slot + plen] = s_row * s_s + s_col + torch.arange(plen)
            shift[r, slot:slot + plen] = c - s_col - plen
            allowed[r, c:c + n, slot:slot + plen] = True
            slot += plen
    return PrefixPlan(src=src, shift=shift, mask=~allowed.unsqueeze(1))


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
        """(src, cos, sin, mask) on ``device``: built once per expert pass, shared by all
        layers (the shifts, hence the rotation tables, are the same in every layer)."""
        if self._ready is None or self._ready[0].device != device:
            plan = self.plan
            ang = plan.shift.to(device, torch.float32)[..., None] * self.inv_freq.to(device)
            ang = torch.cat((ang, ang), dim=-1)[:, :, None, :]      # [B_e, P, 1, rot]
            self._ready = (plan.src.to(device), ang.cos(), ang.sin(), plan.mask.to(device))
        return self._ready

    def prefix(self, layer: int, like: torch.Tensor):
        """This layer's prefix keys (re-rotated) and values, ``[P, B_e, groups, head_dim]``,
        and the attention mask over [prefix ; suffix] keys."""
        k, v = self.keys[layer], self.values[layer]   # [S_s, B_s, g, d]
        src, cos, sin, mask = self._prepared(k.device)
        flat_k = k.transpose(0, 1).reshape(-1, *k.shape[2:])
        flat_v = v.transpose(0, 1).reshape(-1, *v.shape[2:])
        pk = _rotate(flat_k[src], cos, sin)                     # [B_e, P, g, d]
        pv = flat_v[src]
        return (pk.transpose(0, 1).to(like.dtype).contiguous(),
                pv.transpose(0, 1).to(like.dtype).contiguous(), mask)

    def clear(self) -> None:
        self.keys.clear()
        self.values.clear()
        self.plan, self._ready = None, None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate already-rotated keys ``x`` [B, P, g, d] further: ``cos``/``sin`` [B, P, 1, rot]
    are the tables of each key's extra shift (non-interleaved RoPE, megatron's layout)."""
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

    def forward(self, query, key, value, attention_mask, **kwargs):
        if self.mode == "record":
            self.store.keys[self.layer] = key.detach()
            self.store.values[self.layer] = value.detach()
            return self.inner(query, key, value, attention_mask, **kwargs)
        pk, pv, mask = self.store.prefix(self.layer, key)
        return self.inner(query, torch.cat((pk, key)), torch.cat((pv, value)), mask, **kwargs)


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
