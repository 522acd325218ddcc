"""Core attention for packed sequences in megatron's THD form (``PackedSeqParams``).

The trainer packs a micro-batch's sequences into one token sequence and describes it with
``PackedSeqParams(qkv_format="thd", cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv)``
(:mod:`megatron_tg.train.batching`). Attention is causal inside each segment and never crosses
one, so no mask tensor exists: memory grows with the tokens, not with their square.

* :class:`PackedDotProductAttention` (the local spec, CPU). megatron-core's local
  ``DotProductAttention`` asserts ``packed_seq_params is None``; this subclass keeps its
  construction (``SelfAttention`` instantiates ``submodules.core_attention`` directly with
  keyword arguments) and, under THD, runs torch SDPA once per segment on ``[T, heads, dim]``
  inputs: ``is_causal=True`` where a segment's query and key lengths are equal (CPU flash
  kernel, memory linear in the segment), bottom-right-aligned causal
  (``torch.nn.attention.bias.causal_lower_right``) where keys outnumber queries. GQA is
  SDPA's ``enable_gqa`` (key group ``h // (heads / groups)`` per query head, as megatron's
  ``repeat_interleave``). Without ``packed_seq_params`` it is megatron's class unchanged
  (plain ``[S, B]`` callers: conversion parity, the weight-sync probe).
* :func:`te_core_attention` (the Transformer-Engine spec, GPU). Megatron maps ``causal`` to
  TE's ``padding_causal`` under THD, which is top-left aligned when a segment has more keys
  than queries; ``AttnMaskType`` has no bottom-right padding variant. The subclass passes
  ``padding_causal_bottom_right`` to TE itself for exactly those calls (the expert's
  prefix-reuse pass, :mod:`megatron_tg.train.prefix_kv`) and is megatron's class otherwise.

Bottom-right alignment: in a segment of ``n`` queries over ``m >= n`` keys, query ``i`` sees
keys ``0 .. i + m - n``: the queries are the last ``n`` positions of the key sequence.

Context parallelism (``context_parallel_size > 1``): each rank holds chunks ``r`` and
``2·CP−1−r`` of every segment (:class:`megatron_tg.parallel.cp.CPLayout`) and
``PackedSeqParams`` carries the *global* padded bounds. On GPU, TE's CP attention
(``cp_comm_type="p2p"``, the one TE accepts for THD across megatron-core 0.16's TE range;
docs/context-parallel.md). The local class is its CPU twin with the same inputs: it
all-gathers keys and values over the CP group (:func:`~megatron_tg.parallel.cp.gather_tokens`,
whose backward reduce-scatters their gradient), puts them in padded order with the same
layout code, and runs each local query chunk against its causal window
(:func:`cp_causal_attention`): chunk ``j`` of a segment sees keys ``0 .. (j+1)·c`` of it,
bottom-right aligned. Same attention as TE's ring, not the same memory (the twin holds the
whole K/V on each rank).
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention

from megatron_tg.parallel.cp import CPLayout, gather_tokens


def kv_extends_q(packed_seq_params) -> bool:
    """Whether the key segments differ from the query segments (prefix-reuse pass): the
    batching code passes one tensor for both otherwise, so this needs no device sync."""
    return packed_seq_params.cu_seqlens_kv is not packed_seq_params.cu_seqlens_q


def varlen_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            cu_seqlens_q, cu_seqlens_kv, *, scale: float,
                            dropout_p: float = 0.0) -> torch.Tensor:
    """``query`` [T, heads, d], ``key``/``value`` [T_kv, groups, d] -> [T, heads, d]:
    causal attention within each segment, bottom-right aligned where the key segment is
    longer. ``cu_seqlens_*``: cumulative segment lengths (tensors or lists)."""
    cq = cu_seqlens_q.tolist() if torch.is_tensor(cu_seqlens_q) else list(cu_seqlens_q)
    ck = cu_seqlens_kv.tolist() if torch.is_tensor(cu_seqlens_kv) else list(cu_seqlens_kv)
    if len(cq) != len(ck) or cq[-1] != query.shape[0] or ck[-1] != key.shape[0]:
        raise ValueError(f"THD attention: cu_seqlens_q ends at {cq[-1]} over {len(cq) - 1} "
                         f"segments for {query.shape[0]} queries, cu_seqlens_kv at {ck[-1]} over "
                         f"{len(ck) - 1} for {key.shape[0]} keys")
    heads, groups = query.shape[1], key.shape[1]
    if heads % groups:
        raise ValueError(f"{heads} query heads do not split into {groups} key/value groups")
    outs = []
    for a, b, c, d in zip(cq[:-1], cq[1:], ck[:-1], ck[1:]):
        n, m = b - a, d - c
        if n == 0:
            continue
        if m < n:
            raise ValueError(f"a THD segment has {n} queries but only {m} keys")
        outs.append(_segment_attention(query[a:b], key[c:d], value[c:d], scale=scale,
                                       dropout_p=dropout_p))
    return torch.cat(outs, dim=0)


def _segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                       dropout_p: float = 0.0) -> torch.Tensor:
    """One segment: ``q`` [n, heads, d] over ``k``/``v`` [m >= n, groups, d], causal,
    bottom-right aligned where ``m > n``."""
    from torch.nn.attention.bias import causal_lower_right

    n, m = q.shape[0], k.shape[0]
    # SDPA wants [batch, heads, L, d]; 4-D inputs select the CPU flash kernel.
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    mask = None if m == n else causal_lower_right(n, m)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                       dropout_p=dropout_p, scale=scale,
                                       enable_gqa=q.shape[1] != k.shape[1])
    return o[0].transpose(0, 1)


def cp_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        layout: CPLayout, rank: int, *, scale: float) -> torch.Tensor:
    """``query`` [local_tokens, heads, d]: CP ``rank``'s share (chunks ``r``, ``2·CP−1−r`` of
    every segment); ``key``/``value`` [padded_tokens, groups, d]: every rank's, in padded
    order. Returns the share's attention output [local_tokens, heads, d]."""
    if query.shape[0] != layout.local_tokens or key.shape[0] != layout.padded_tokens:
        raise ValueError(f"CP attention: {query.shape[0]} queries and {key.shape[0]} keys for a "
                         f"layout of {layout.local_tokens} tokens per rank, "
                         f"{layout.padded_tokens} in all (cp={layout.cp})")
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"{query.shape[1]} query heads do not split into {key.shape[1]} "
                         f"key/value groups")
    m = 2 * layout.cp
    outs, a = [], 0
    for start, length in zip(layout.starts, layout.padded):
        c = length // m
        for j in (rank, m - 1 - rank):  # the share's order: chunk r, then chunk 2·CP−1−r
            end = start + (j + 1) * c   # chunk j's last query sees keys up to its own
            outs.append(_segment_attention(query[a:a + c], key[start:end], value[start:end],
                                           scale=scale))
            a += c
    return torch.cat(outs, dim=0)


class PackedDotProductAttention(DotProductAttention):
    """megatron's local core attention, plus THD packed sequences (see the module doc)."""

    def __init__(self, config, *args, **kwargs) -> None:
        # megatron's local class asserts context_parallel_size == 1 (CP is TE's there); this
        # subclass does CP itself, so the parent is built from a copy that says 1.
        parent_config = config
        if config.context_parallel_size > 1:
            parent_config = copy.copy(config)
            parent_config.context_parallel_size = 1
        super().__init__(parent_config, *args, **kwargs)
        self.config = config
        if self.config.softmax_type != "vanilla":
            raise NotImplementedError(f"THD attention with softmax_type={self.config.softmax_type}")
        if self.config.window_size is not None:
            raise NotImplementedError("THD attention with a sliding window")
        # megatron divides softmax_scale by the layer number under query-key layer scaling
        # and multiplies it back in its softmax; SDPA takes the product.
        coeff = self.layer_number if self.config.apply_query_key_layer_scaling else 1
        self._sdpa_scale = self.softmax_scale * coeff

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias, packed_seq_params)
        if packed_seq_params.qkv_format != "thd":
            raise NotImplementedError(f"packed qkv_format {packed_seq_params.qkv_format!r}")
        if attention_bias is not None:
            raise NotImplementedError("attention bias with THD packed sequences")
        cu_q = packed_seq_params.cu_seqlens_q_padded
        cu_q = packed_seq_params.cu_seqlens_q if cu_q is None else cu_q
        cu_kv = packed_seq_params.cu_seqlens_kv_padded
        cu_kv = packed_seq_params.cu_seqlens_kv if cu_kv is None else cu_kv
        p = self.attention_dropout.p if self.training else 0.0
        if self.config.context_parallel_size > 1:
            out = self._cp_forward(query, key, value, packed_seq_params, cu_q, cu_kv, p)
        elif p and not self.config.sequence_parallel:  # same RNG stream as megatron's dropout
            from megatron.core import tensor_parallel

            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = varlen_causal_attention(query, key, value, cu_q, cu_kv,
                                              scale=self._sdpa_scale, dropout_p=p)
        else:
            out = varlen_causal_attention(query, key, value, cu_q, cu_kv,
                                          scale=self._sdpa_scale, dropout_p=p)
        return out.reshape(out.shape[0], -1)  # [T, heads * d]; SelfAttention adds b=1

    def _cp_forward(self, query, key, value, packed_seq_params, cu_q, cu_kv, dropout_p):
        """CP twin of TE's CP attention (module doc): gather K/V, attend each local chunk."""
        same_bounds = cu_kv is cu_q or torch.equal(cu_kv, cu_q)
        if kv_extends_q(packed_seq_params) or not same_bounds:
            raise NotImplementedError("THD attention with context parallelism needs one set of "
                                      "segment bounds for queries and keys (no prefix reuse)")
        if dropout_p:
            raise NotImplementedError(f"attention dropout {dropout_p} with context parallelism "
                                      f"in the CPU attention")
        group = getattr(self.pg_collection, "cp", None)
        if group is None:
            from megatron.core import parallel_state

            group = parallel_state.get_context_parallel_group()
        cp = self.config.context_parallel_size
        layout = _padded_layout(tuple(cu_q.tolist()), cp)
        layout.check_group(group)
        if query.shape[0] != layout.local_tokens:
            raise ValueError(f"CP attention: {query.shape[0]} local queries, but the padded "
                             f"bounds give {layout.padded_tokens} tokens = {layout.local_tokens} "
                             f"per rank at cp={cp}")
        # One collective for both: [T_local, groups, d_k + d_v].
        kv = layout.gather(torch.cat([key, value], dim=-1), group)
        k, v = kv.split([key.shape[-1], value.shape[-1]], dim=-1)
        rank = torch.distributed.get_rank(group)
        return cp_causal_attention(query, k, v, layout, rank, scale=self._sdpa_scale)


@functools.lru_cache(maxsize=16)
def _padded_layout(cu_padded: tuple[int, ...], cp: int) -> CPLayout:
    """Every layer of a micro-batch sees the same bounds: build their index maps once."""
    return CPLayout.from_padded(cu_padded, cp)


@functools.cache
def te_core_attention() -> type:
    """The TE spec's core attention: megatron's ``TEDotProductAttention``, passing
    ``padding_causal_bottom_right`` to TE when key segments extend the query segments.
    GPU-only code (needs transformer-engine); see the first-GPU-run checklist."""
    import transformer_engine.pytorch as te_pt  # noqa: F401 - fail early without TE
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    class TEPackedDotProductAttention(TEDotProductAttention):
        def forward(self, query, key, value, attention_mask, attn_mask_type,
                    attention_bias=None, packed_seq_params=None, num_splits=None):
            comm = getattr(self, "cp_comm_type", None)
            if packed_seq_params is not None and self.config.context_parallel_size > 1 and (
                    comm != "p2p"):
                # TE 2.9-2.11 (megatron-core 0.16's range) refuse THD on the other CP paths.
                raise NotImplementedError(f"THD attention with cp_comm_type={comm!r}: p2p is "
                                          f"the one TE accepts for THD (docs/context-parallel.md)")
            if packed_seq_params is None or not kv_extends_q(packed_seq_params):
                return super().forward(query, key, value, attention_mask, attn_mask_type,
                                       attention_bias=attention_bias,
                                       packed_seq_params=packed_seq_params,
                                       num_splits=num_splits)
            if packed_seq_params.qkv_format != "thd" or attention_bias is not None:
                raise NotImplementedError("the prefix-reuse pass needs THD without a bias")
            if self.config.context_parallel_size != 1:
                raise NotImplementedError("bottom-right THD attention with context parallelism")
            # Skip megatron's wrapper (it would send ``padding_causal``): TE's own forward.
            return super(TEDotProductAttention, self).forward(
                query, key, value, None, attn_mask_type="padding_causal_bottom_right",
                qkv_format="thd", cu_seqlens_q=packed_seq_params.cu_seqlens_q,
                cu_seqlens_kv=packed_seq_params.cu_seqlens_kv,
                max_seqlen_q=packed_seq_params.max_seqlen_q,
                max_seqlen_kv=packed_seq_params.max_seqlen_kv)

    return TEPackedDotProductAttention
