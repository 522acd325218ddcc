"""Activation recompute (``model.recompute``) changes memory, not math: at TP=2 (sequence
parallel, gloo ranks) the loss and every gradient with ``selective`` and ``full`` equal the
run without recompute, while the bytes autograd keeps for backward shrink (so a mapping that
silently turned recompute off would fail here). The settings given to megatron are
checked against its own ``TransformerConfig`` validation.
"""

from __future__ import annotations

import pytest
import torch

from megatron_tg.config.model import RECOMPUTE_MODES
from megatron_tg.testing.distributed import run_distributed
from tests.models.qwen3_moe.common import VOCAB, tiny_hf_model

MODES = ("none", "selective", "full")


def _rank_fn(rank, world, state, hf_cfg, tokens, labels, modes):
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig, finalize_model_grads)
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron_tg.models.qwen3_moe import Qwen3Arch, build_model
    from megatron_tg.models.qwen3_moe.mapping import current_layout, load_hf_weights
    from megatron_tg.parallel.state import init_parallel

    init_parallel(tp=2)
    arch = Qwen3Arch.from_hf(hf_cfg)
    out = {}
    for mode in modes:
        model = build_model(arch, tp=2, recompute=mode)
        load_hf_weights(model, state, arch, current_layout())
        ddp = DistributedDataParallel(
            config=model.config, module=model,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True))
        ddp.zero_grad_buffer()
        pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        saved = [0]

        def pack(t):
            saved[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = ddp(tokens, pos, attention_mask=None)  # [b, s, V_pad / tp]
            loss = vocab_parallel_cross_entropy(logits.transpose(0, 1).float().contiguous(),
                                                labels.t().contiguous()).mean()
        loss.backward()
        finalize_model_grads([ddp])
        grads = {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}
        out[mode] = dict(loss=loss.detach(), grads=grads, saved_bytes=saved[0],
                         granularity=model.config.recompute_granularity,
                         modules=list(model.config.recompute_modules or []))
    return out


@pytest.fixture(scope="module")
def results():
    cfg, _, state = tiny_hf_model()
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=g)  # SP: seq % tp == 0
    labels = torch.randint(0, VOCAB, (2, 16), generator=g)
    return run_distributed(_rank_fn, 2, state, cfg.to_dict(), tokens, labels, MODES)


def test_modes_are_the_config_choices():
    from megatron_tg.models.qwen3_moe.config import RECOMPUTE_MODES as MODEL_MODES

    assert tuple(MODEL_MODES) == tuple(RECOMPUTE_MODES) == MODES


def test_recompute_gives_equal_loss_and_grads_at_tp2(results):
    for rank_out in results:
        ref = rank_out["none"]
        assert ref["granularity"] is None
        for mode in ("selective", "full"):
            got = rank_out[mode]
            assert got["granularity"] == mode
            torch.testing.assert_close(got["loss"], ref["loss"], atol=1e-6, rtol=1e-6)
            assert got["grads"].keys() == ref["grads"].keys()
            for name, g in ref["grads"].items():
                torch.testing.assert_close(got["grads"][name], g, atol=1e-6, rtol=1e-5,
                                           msg=f"{mode}: {name}")
    # the test has teeth: some gradient is nonzero on every rank
    assert all(max(g.abs().max().item() for g in r["none"]["grads"].values()) > 1e-4
               for r in results)


def test_recompute_keeps_fewer_activations(results):
    for r in results:
        none, sel, full = (r[m]["saved_bytes"] for m in MODES)
        assert full < sel < none, (none, sel, full)
        assert "moe" in r["selective"]["modules"] and "core_attn" in r["selective"]["modules"]


def test_bad_mode_names_the_value():
    from megatron_tg.config.base import ConfigError
    from megatron_tg.config.model import ModelConfig
    from megatron_tg.models.qwen3_moe.config import UnsupportedConfigError, recompute_kwargs

    with pytest.raises(ConfigError, match=r"model\.recompute.*'partial'"):
        ModelConfig(hf_config="x.json", recompute="partial").validate()
    with pytest.raises(UnsupportedConfigError, match="recompute='block'"):
        recompute_kwargs("block", is_moe=True, grouped_gemm=False)
