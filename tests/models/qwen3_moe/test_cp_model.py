"""The whole policy (megatron ``GPTModel`` through :func:`build_model`, local spec, MoE) at
``context_parallel_size=2`` equals CP 1 on the same packed batch.

Two gloo ranks. CP 1: each rank (a data-parallel replica) runs the real packed sequence
with its real bounds. CP 2: each rank runs only its share of the
:class:`~megatron_tg.parallel.cp.CPLayout` (token ids, RoPE positions, ``PackedSeqParams``
with the global padded bounds); megatron's THD RoPE, the CPU CP attention and the MoE layers
see that share only. Compared: the per-token log-probs of the next token (gathered from both
ranks, unpadded) and the gradients of ``sum(w · log p)`` after summing over the CP group
(what megatron's DDP does over DP × CP). A forward pre-hook on the decoder asserts that each
rank's decoder input holds T_pad / CP tokens, so a path that ran the full sequence everywhere
would fail here.
"""

from __future__ import annotations

import pytest
import torch

from megatron_tg.parallel.cp import CPLayout
from megatron_tg.testing.distributed import run_distributed
from tests.models.qwen3_moe.common import VOCAB, tiny_hf_model

# Every test here under NCCL's rules (tests/conftest.py: comm_rules; plain gloo on request).
pytestmark = pytest.mark.usefixtures("comm_rules")

SEQLENS = [11, 2, 17, 3, 6]  # the last one stands for a row's padding segment
CP = 2


def _batch():
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (sum(SEQLENS),), generator=g)
    # Next-token targets within each segment; a segment's last token has none.
    targets = torch.roll(tokens, -1)
    mask = torch.ones(sum(SEQLENS), dtype=torch.bool)
    mask[torch.tensor(SEQLENS).cumsum(0) - 1] = False
    w = torch.rand(sum(SEQLENS), generator=g) * mask
    return tokens, targets, mask, w


def _run(model, ids, pos, params, targets, w, device):
    seen = []

    def record(_module, _args, kwargs):
        seen.append(kwargs["hidden_states"].shape[0])

    hook = model.decoder.register_forward_pre_hook(record, with_kwargs=True)
    try:
        logits = model(ids[None].to(device), pos[None].to(device), None,
                       packed_seq_params=params)  # [1, T, V_pad]
    finally:
        hook.remove()
    logp = torch.log_softmax(logits[0, :, :VOCAB].float(), dim=-1)
    logp = logp.gather(-1, targets.to(device)[:, None])[:, 0]
    model.zero_grad(set_to_none=True)
    (logp * w.to(device)).sum().backward()
    return logp.detach(), seen


def _rank(rank, world, state, hf_cfg):
    from megatron_tg.models.qwen3_moe import Qwen3Arch, build_model
    from megatron_tg.models.qwen3_moe.mapping import current_layout, load_hf_weights
    from megatron_tg.parallel.dims import Axis
    from megatron_tg.parallel.state import init_parallel

    tokens, targets, _, w = _batch()
    arch = Qwen3Arch.from_hf(hf_cfg)
    out = {}
    for cp in (1, CP):
        ctx = init_parallel(cp=cp)
        model = build_model(arch, cp=cp)
        load_hf_weights(model, state, arch, current_layout())
        if cp == 1:
            from megatron.core.packed_seq_params import PackedSeqParams

            cu = CPLayout.build(SEQLENS, 1).cu_seqlens.to(ctx.device)  # real bounds
            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                     max_seqlen_q=max(SEQLENS), max_seqlen_kv=max(SEQLENS))
            pos = torch.cat([torch.arange(n) for n in SEQLENS])
            logp, seen = _run(model, tokens, pos, params, targets, w, ctx.device)
            r = 0
        else:
            lay = CPLayout.build(SEQLENS, cp)
            r = ctx.rank_in(Axis.CP)
            share = [lay.split(lay.pad(t, value=0), r) for t in (tokens, targets, w)]
            logp, seen = _run(model, share[0], lay.positions(r),
                              lay.packed_seq_params(ctx.device), share[1], share[2], ctx.device)
        grads = {}
        for name, p in model.named_parameters():
            g = p.grad.detach().clone()
            if cp > 1:  # each rank's grads are its tokens' part: DDP sums them over CP
                torch.distributed.all_reduce(g, group=ctx.group(Axis.CP))
            grads[name] = g
        out[cp] = dict(logp=logp, grads=grads, decoder_tokens=seen, cp_rank=r,
                       activation_bytes=seen[0] * arch.hidden_size * 4)
    return out


@pytest.fixture(scope="module")
def results():
    cfg, _model, state = tiny_hf_model()
    return run_distributed(_rank, 2, state, cfg)


def test_cp2_model_logprobs_and_grads_equal_cp1(results):
    tokens, _, mask, _ = _batch()
    lay = CPLayout.build(SEQLENS, CP)
    by_rank = sorted((r[CP] for r in results), key=lambda r: r["cp_rank"])
    counts = [r["decoder_tokens"] for r in by_rank]
    print(f"\ndecoder input tokens per CP rank: {counts} (CP 1: {results[0][1]['decoder_tokens']}; "
          f"real {lay.num_tokens}, padded {lay.padded_tokens}); activation bytes per layer input "
          f"per rank: {[r['activation_bytes'] for r in by_rank]} vs CP 1 "
          f"{results[0][1]['activation_bytes']}")
    assert counts == [[lay.padded_tokens // CP]] * CP
    assert results[0][1]["decoder_tokens"] == [lay.num_tokens]

    ref = results[0][1]
    got = lay.unpad(lay.merge([r["logp"] for r in by_rank]))
    d_logp = (got - ref["logp"])[mask].abs().max().item()
    grads = by_rank[0]["grads"]
    assert set(grads) == set(ref["grads"])
    d_grad = {n: (grads[n] - g).abs().max().item() for n, g in ref["grads"].items()}
    worst = max(d_grad, key=d_grad.get)
    scale = max(g.abs().max().item() for g in ref["grads"].values())
    print(f"max |CP2 - CP1|: log-probs {d_logp:.3g} over {int(mask.sum())} tokens; grads "
          f"{d_grad[worst]:.3g} ({worst}; largest grad {scale:.3g})")
    assert d_logp < 1e-4
    for n, g in ref["grads"].items():
        torch.testing.assert_close(grads[n], g, atol=1e-5, rtol=1e-4, msg=n)
    # Both CP ranks hold the same summed grads.
    for n, g in by_rank[1]["grads"].items():
        torch.testing.assert_close(g, grads[n], atol=0, rtol=0, msg=n)
    assert ref["logp"][mask].std() > 0.1  # real log-probs, not a constant
