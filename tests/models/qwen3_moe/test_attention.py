"""THD core attention (:mod:`megatron_tg.models.qwen3_moe.attention`) against a dense reference.

The reference is written out here: per segment, scores ``q·kᵀ·scale`` masked to keys
``<= i + (m - n)`` (bottom-right causal; plain causal when ``m == n``), softmax in float64,
GQA by repeating each key group over its query heads. Cases: equal query/key segments (the
packed rows) and key segments longer than the query segments (the prefix-reuse pass), with
padding as a segment of its own.

The core-attention classes run in one spawned rank (they need megatron's parallel state):
``local`` is the CPU twin of the GPU-marked ``te`` case, the same code on the TE subclass.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from megatron_tg.models.qwen3_moe.attention import varlen_causal_attention
from megatron_tg.testing.distributed import run_distributed

HEADS, GROUPS, DIM = 8, 2, 32
Q_LENS = [5, 9, 3]          # two sequences + a padding segment
KV_LENS = [5 + 7, 9 + 4, 3]  # the same with 7 and 4 prefix keys in front


def _cu(lens):
    return torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32)


def _inputs(kv_lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(Q_LENS), HEADS, DIM, generator=g)
    k = torch.randn(sum(kv_lens), GROUPS, DIM, generator=g)
    v = torch.randn(sum(kv_lens), GROUPS, DIM, generator=g)
    return q, k, v


def _reference(q, k, v, q_lens, kv_lens, bottom_right=True):
    out, a, c = [], 0, 0
    rep = HEADS // GROUPS
    for n, m in zip(q_lens, kv_lens):
        qs = q[a:a + n].double().transpose(0, 1)                           # [h, n, d]
        ks = k[c:c + m].double().repeat_interleave(rep, dim=1).transpose(0, 1)
        vs = v[c:c + m].double().repeat_interleave(rep, dim=1).transpose(0, 1)
        scores = qs @ ks.transpose(1, 2) / math.sqrt(DIM)
        allowed = torch.arange(m)[None, :] <= torch.arange(n)[:, None] + (m - n if bottom_right else 0)
        scores = scores.masked_fill(~allowed, float("-inf"))
        out.append((scores.softmax(-1) @ vs).transpose(0, 1))
        a, c = a + n, c + m
    return torch.cat(out).float()


@pytest.mark.parametrize("kv_lens", [Q_LENS, KV_LENS], ids=["causal", "bottom_right"])
def test_varlen_attention_and_its_gradient_equal_dense_reference(kv_lens):
    q, k, v = (x.requires_grad_() for x in _inputs(kv_lens))
    got = varlen_causal_attention(q, k, v, _cu(Q_LENS), _cu(kv_lens), scale=DIM ** -0.5)
    q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, k, v))
    ref = _reference(q2, k2, v2, Q_LENS, kv_lens)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    w = torch.randn_like(ref)
    (got * w).sum().backward()
    (ref * w).sum().backward()
    for a, b in ((q, q2), (k, k2), (v, v2)):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)
    # The case can fail: top-left alignment (TE's plain padding_causal) is another answer.
    if kv_lens != Q_LENS:
        top_left = _reference(q2, k2, v2, Q_LENS, kv_lens, bottom_right=False)
        assert (top_left - got).abs().max() > 1e-1


def test_varlen_attention_rejects_mismatched_segments():
    q, k, v = _inputs(Q_LENS)
    with pytest.raises(ValueError, match="cu_seqlens_kv"):
        varlen_causal_attention(q, k, v, _cu(Q_LENS), _cu(Q_LENS[:2]), scale=1.0)
    with pytest.raises(ValueError, match="9 queries but only 6 keys"):
        varlen_causal_attention(q, k[:14], v[:14], _cu(Q_LENS), _cu([5, 6, 3]), scale=1.0)


def _rank(rank, world, use_te, dtype_name):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_tg.models.qwen3_moe.attention import PackedDotProductAttention, te_core_attention
    from megatron_tg.parallel.state import init_parallel

    ctx = init_parallel()
    dtype = getattr(torch, dtype_name)
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, kv_channels=DIM, params_dtype=dtype,
                               bf16=dtype == torch.bfloat16, attention_dropout=0.0,
                               masked_softmax_fusion=False)
    cls = te_core_attention() if use_te else PackedDotProductAttention
    attn = cls(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
               attention_type="self", cp_comm_type="p2p").to(ctx.device)
    out = {}
    for name, kv_lens in (("causal", Q_LENS), ("bottom_right", KV_LENS)):
        q, k, v = (x.to(ctx.device, dtype) for x in _inputs(kv_lens))
        cu_q = _cu(Q_LENS).to(ctx.device)
        cu_kv = cu_q if kv_lens is Q_LENS else _cu(kv_lens).to(ctx.device)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv,
                                 max_seqlen_q=max(Q_LENS), max_seqlen_kv=max(kv_lens))
        with torch.no_grad():
            o = attn(q, k, v, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=params)
        out[name] = o.float().reshape(sum(Q_LENS), HEADS, DIM).cpu()
    return out


TE = pytest.param(True, id="te", marks=[
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                       reason="needs transformer-engine (the GPU extra)")])


@pytest.mark.parametrize("use_te", [TE, pytest.param(False, id="local")])
def test_core_attention_class_honours_packed_seq_params(use_te):
    dtype = "bfloat16" if use_te else "float32"
    out = run_distributed(_rank, 1, use_te, dtype)[0]
    tol = dict(atol=2e-2, rtol=2e-2) if use_te else dict(atol=1e-5, rtol=1e-5)
    for name, kv_lens in (("causal", Q_LENS), ("bottom_right", KV_LENS)):
        q, k, v = _inputs(kv_lens)
        torch.testing.assert_close(out[name], _reference(q, k, v, Q_LENS, kv_lens), **tol,
                                   msg=f"{name}")
