"""The megatron Qwen3-MoE policy under TP=2, EP=2 and TP=2 x EP=2 equals the single-process model.

Reference: Hugging Face ``Qwen3MoeForCausalLM`` (the ground truth the checkpoints come from)
and megatron at TP=1 in a single process. Compared: logits, and the gradients of a scalar
loss after megatron's DDP + ``finalize_model_grads`` (the real training path: TP all-reduce
of sequence-parallel norm grads, DP/EP gradient averaging). Each DP rank gets a different
batch, so the test also checks that expert gradients are averaged like dense ones.
The router is biased towards one expert so tokens per expert are uneven.
"""

from __future__ import annotations

import pytest
import torch

from megatron_tg.testing.distributed import run_distributed
from tests.models.qwen3_moe.common import (
    VOCAB,
    hf_reference,
    megatron_rank_fn,
    tiny_hf_model,
)

LAYOUTS_W2 = [(2, 1, 2), (1, 2, 1)]  # (tp, ep, etp) on two ranks
LAYOUTS_W4 = [(2, 2, 1), (2, 2, 2)]


@pytest.fixture(scope="module")
def setup():
    cfg, model, state = tiny_hf_model()
    g = torch.Generator().manual_seed(7)
    # Four different batches: one per DP rank at world 4 with tp=2 -> dp=2, ... we always
    # take the first `dp` of them.
    batches = [torch.randint(0, VOCAB, (2, 12), generator=g) for _ in range(4)]  # SP: seq % tp == 0
    loss_w = torch.randn(2, 12, VOCAB, generator=g)
    return cfg, model, state, batches, loss_w


def _check(results, ref_logits, ref_grads, tp, dp):
    # Logits: TP ranks hold vocab shards; concatenate rank 0..tp-1 (DP rank 0).
    for d in range(dp):
        by_tp = [r for r in results if r["dp_rank"] == d]
        by_tp.sort(key=lambda r: r["tp_rank"])
        full = torch.cat([r["logits"] for r in by_tp], dim=-1)[..., :VOCAB]
        torch.testing.assert_close(full, ref_logits[d], atol=2e-5, rtol=1e-4)
    grads: dict[str, torch.Tensor] = {}
    for r in results:
        for name, g in r["grads"].items():
            if name in grads:  # replicated across ranks: must agree exactly enough
                torch.testing.assert_close(g, grads[name], atol=1e-6, rtol=1e-5)
            grads[name] = g
    assert set(grads) == set(ref_grads), set(grads) ^ set(ref_grads)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, atol=5e-5, rtol=1e-3, msg=name)


def test_uneven_routing_is_exercised(setup):
    cfg, model, state, batches, _ = setup
    with torch.no_grad():
        out = model(batches[0], output_router_logits=True)
    top = torch.stack(out.router_logits).topk(cfg.num_experts_per_tok, dim=-1).indices
    counts = torch.bincount(top.flatten(), minlength=cfg.num_local_experts)
    assert counts.max() >= 2 * counts.min() + 2, counts


@pytest.mark.parametrize("world,layouts", [(1, [(1, 1, 1)]), (2, LAYOUTS_W2), (4, LAYOUTS_W4)],
                         ids=["tp1", "tp2-ep2", "tp2xep2"])
def test_logits_and_grads_match_reference(setup, world, layouts):
    cfg, model, state, batches, loss_w = setup
    results = run_distributed(megatron_rank_fn, world, layouts, state, cfg.to_dict(), batches,
                              loss_w)
    for i, (tp, ep, etp) in enumerate(layouts):
        dp = world // tp
        ref_logits, ref_grads = hf_reference(model, batches[:dp], loss_w)
        _check([r[i] for r in results], ref_logits, ref_grads, tp, dp)
