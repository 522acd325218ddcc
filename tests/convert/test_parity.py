"""Logit parity: HF ``Qwen3MoeForCausalLM`` vs the megatron model loaded from the converted
checkpoints at several reading layouts (torch_dist reshards on load).

One 4-rank spawn does everything: checkpoint A (written at TP=2 x EP=2) is loaded at TP=1,
TP=2, EP=2 and TP=2 x EP=2; checkpoint B (written at PP=2 from a sharded source) at
TP=2 x EP=2; and loading A into models of the wrong depth is refused, naming the tensors.
"""

from __future__ import annotations

import pytest
import torch

from megatron_tg.testing.distributed import run_distributed
from tests.models.qwen3_moe.common import VOCAB

# Spawns gloo workers (conversions, exports, a 4-rank load): minutes on 2 shared cores.
pytestmark = pytest.mark.slow

READ_LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (tp, ep) on 4 ranks; the rest is DP


def _rank_fn(rank, world, jobs, bad_configs, tokens):
    from megatron.core import parallel_state as mps

    from megatron_tg.convert import ConversionError, load_megatron_checkpoint
    from megatron_tg.models.qwen3_moe import Qwen3Arch, build_model
    from megatron_tg.parallel.state import init_parallel

    out = []
    for ckpt, cfg, tp, ep in jobs:
        init_parallel(tp=tp, ep=ep)
        model = build_model(Qwen3Arch.from_hf(cfg), tp=tp, ep=ep, perform_initialization=False)
        load_megatron_checkpoint(model, ckpt)
        model.eval()
        pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        with torch.no_grad():
            logits = model(tokens, pos, attention_mask=None)  # [b, s, V_pad / tp]
        out.append({"logits": logits, "tp_rank": mps.get_tensor_model_parallel_rank()})
    errors = []
    for ckpt, cfg in bad_configs:
        init_parallel(tp=1, ep=1)
        model = build_model(Qwen3Arch.from_hf(cfg), perform_initialization=False)
        try:
            load_megatron_checkpoint(model, ckpt)
            errors.append(None)
        except ConversionError as exc:
            errors.append(str(exc))
    return {"logits": out, "errors": errors}


@pytest.fixture(scope="module")
def parity(model_a, model_b, ckpt_a, ckpt_b):
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    cfg_a, cfg_b = model_a.cfg.to_dict(), model_b.cfg.to_dict()
    jobs = [(str(ckpt_a.dir), cfg_a, tp, ep) for tp, ep in READ_LAYOUTS]
    jobs.append((str(ckpt_b.dir), cfg_b, 2, 2))
    bad = [(str(ckpt_a.dir), {**cfg_a, "num_hidden_layers": 4}),
           (str(ckpt_a.dir), {**cfg_a, "num_hidden_layers": 2})]
    results = run_distributed(_rank_fn, 4, jobs, bad, tokens)
    with torch.no_grad():
        ref = {"a": model_a.model(tokens).logits, "b": model_b.model(tokens).logits}
    return jobs, results, ref


def _full_logits(results, i, tp):
    # With DP replicas every group of tp consecutive ranks holds the whole vocabulary.
    shards = sorted((r["logits"][i] for r in results[:tp]), key=lambda x: x["tp_rank"])
    return torch.cat([s["logits"] for s in shards], dim=-1)[..., :VOCAB]


@pytest.mark.parametrize("i", range(len(READ_LAYOUTS) + 1),
                         ids=[f"A-tp{tp}-ep{ep}" for tp, ep in READ_LAYOUTS] + ["B-tp2-ep2"])
def test_logits_match_hf(parity, i):
    jobs, results, ref = parity
    ckpt, _, tp, _ = jobs[i]
    want = ref["b" if ckpt.endswith("mg_b") else "a"]
    got = _full_logits(results, i, tp)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    diff = (got - want).abs().max().item()
    assert diff < 2e-5, diff


def test_checkpoint_mismatch_is_named(parity):
    _, results, _ = parity
    deeper, shallower = results[0]["errors"]
    assert all(r["errors"] == results[0]["errors"] for r in results)  # every rank agrees
    assert "missing tensor(s)" in deeper and "decoder.layers.3.mlp.experts.experts" in deeper
    assert "unexpected tensor(s)" in shallower and "decoder.layers.2." in shallower
