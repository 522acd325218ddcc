"""CP core attention (the CPU twin of TE's, :class:`PackedDotProductAttention` at
``context_parallel_size=2``) equals the same class at CP 1 on the same packed batch.

Two gloo ranks. CP 1 first (world 2 as two data-parallel replicas): every rank runs the real
packed sequence, unpadded. Then CP 2: each rank gets its share of the CP layout
(:class:`~megatron_tg.parallel.cp.CPLayout`: segments padded to multiples of 4, chunks r and
3−r), pad tokens filled with a large constant so that a leak into a real token shows. The
loss weights are zero on pad tokens. Compared in float64 and float32: the outputs and the
gradients of q, k, v (the K/V gradient comes back through the all-gather's reduce-scatter),
merged from both ranks and unpadded; the pad tokens' gradients must be zero. The batch has
a row-padding segment and sequences shorter than 2·CP (one token of a 4-token padded
segment per chunk, and chunks that are all padding).
"""

from __future__ import annotations

import pytest
import torch

from megatron_tg.parallel.cp import CPLayout
from megatron_tg.testing.distributed import run_distributed

# Every test here under NCCL's rules (tests/conftest.py: comm_rules; plain gloo on request).
pytestmark = pytest.mark.usefixtures("comm_rules")

SEQLENS = [13, 1, 7, 2, 3, 20, 5]  # the last one stands for a row's padding segment
HEADS, GROUPS, DIM = 4, 2, 8
CP = 2
PAD_VALUE = 3.0


def _inputs():
    g = torch.Generator().manual_seed(11)
    t = sum(SEQLENS)
    q = torch.randn(t, HEADS, DIM, generator=g, dtype=torch.float64)
    k = torch.randn(t, GROUPS, DIM, generator=g, dtype=torch.float64)
    v = torch.randn(t, GROUPS, DIM, generator=g, dtype=torch.float64)
    w = torch.randn(t, HEADS * DIM, generator=g, dtype=torch.float64)
    return q, k, v, w


def _attention(cp: int, dtype: torch.dtype):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_tg.models.qwen3_moe.attention import PackedDotProductAttention

    config = TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, kv_channels=DIM, params_dtype=dtype,
                               attention_dropout=0.0, masked_softmax_fusion=False,
                               context_parallel_size=cp)
    return PackedDotProductAttention(config=config, layer_number=1,
                                     attn_mask_type=AttnMaskType.causal, attention_type="self")


def _rank(rank, world, dtype_name):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_tg.parallel.dims import Axis
    from megatron_tg.parallel.state import init_parallel

    dtype = getattr(torch, dtype_name)
    q, k, v, w = _inputs()
    out = {}

    ctx = init_parallel(cp=1)
    attn = _attention(1, dtype)
    cu = CPLayout.build(SEQLENS, 1).cu_seqlens.to(ctx.device)  # real bounds, no CP padding
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max(SEQLENS), max_seqlen_kv=max(SEQLENS))
    xs = [t.to(ctx.device, dtype).requires_grad_() for t in (q, k, v)]
    o = attn(*xs, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=params)
    (o * w.to(ctx.device, dtype)).sum().backward()
    out["cp1"] = dict(out=o.detach(), grads=[x.grad for x in xs])

    ctx = init_parallel(cp=CP)
    r = ctx.rank_in(Axis.CP)
    lay = CPLayout.build(SEQLENS, CP)
    xs = [lay.split(lay.pad(t, value=PAD_VALUE), r).to(ctx.device, dtype).requires_grad_()
          for t in (q, k, v)]
    w_share = lay.split(lay.pad(w, value=0.0), r).to(ctx.device, dtype)
    attn = _attention(CP, dtype)
    o = attn(*xs, None, attn_mask_type=AttnMaskType.causal,
             packed_seq_params=lay.packed_seq_params(ctx.device))
    (o * w_share).sum().backward()
    out["cp2"] = dict(out=o.detach(), grads=[x.grad for x in xs], cp_rank=r,
                      tokens=xs[0].shape[0])
    return out


@pytest.mark.parametrize("dtype_name, tol", [("float64", 1e-12), ("float32", 2e-6)])
def test_cp2_attention_equals_cp1_forward_and_backward(dtype_name, tol):
    results = run_distributed(_rank, 2, dtype_name)
    lay = CPLayout.build(SEQLENS, CP)
    by_rank = sorted((r["cp2"] for r in results), key=lambda r: r["cp_rank"])
    tokens = [r["tokens"] for r in by_rank]
    print(f"\n{dtype_name}: per-rank query tokens {tokens} (real {lay.num_tokens}, "
          f"padded {lay.padded_tokens}, cp={CP})")
    assert tokens == [lay.padded_tokens // CP] * CP  # each rank runs its T/CP share only

    ref = results[0]["cp1"]
    merged = lay.merge([r["out"] for r in by_rank])
    got = lay.unpad(merged).reshape(ref["out"].shape)
    diffs = {"out": (got - ref["out"]).abs().max().item()}
    for name, i in (("dq", 0), ("dk", 1), ("dv", 2)):
        full = lay.merge([r["grads"][i] for r in by_rank])
        diffs[name] = (lay.unpad(full) - ref["grads"][i]).abs().max().item()
        pad_rows = torch.ones(lay.padded_tokens, dtype=torch.bool)
        pad_rows[lay.pad_index] = False
        assert full[pad_rows].abs().max().item() == 0.0, f"{name} of pad tokens"
    print(f"{dtype_name}: max |CP2 - CP1| " + ", ".join(f"{k} {v:.3g}" for k, v in diffs.items()))
    assert max(diffs.values()) <= tol, diffs
    # Not vacuous: the outputs and gradients are of order one.
    assert ref["out"].abs().max() > 0.5 and ref["grads"][1].abs().max() > 0.5
