"""GPU twins of the model checks in ``test_batching.py``, on the Transformer-Engine spec.

What only a GPU can check: Transformer Engine's attention honours the trainer's THD
``PackedSeqParams``. The TE spec keeps ``attn_mask_type=causal`` (megatron sends TE
``padding_causal`` under THD); the expert's prefix-reuse pass (more keys than queries per
segment) goes through the TE subclass that sends ``padding_causal_bottom_right``
(``megatron_tg.models.qwen3_moe.attention``).

1. packed rows (one THD sequence, a segment per rollout) give each sequence's plain forward
   log-probs;
2. the prefix-reuse expert pass gives the full expert pass's logits at the gated rows.

CPU twins: ``test_packed_and_unpacked_logprobs_equal_plain_forward`` and
``test_prefix_reuse_expert_equals_the_full_expert_pass`` (same checks, local spec, gloo), and
the ``local`` parametrisation below, which runs this file's own code on the local spec.

bf16 is checked against noise, not a fixed tolerance: packed-row and prefix-reuse log-probs
must be as close to the fp32 reference as the plain bf16 forward is (RMS over every token),
and deliberately leaking segments (one THD segment over the whole packed row) must land far
outside that band, so the check can see a leak. On the local spec (CPU) the plain bf16
forward's RMS error is 0.0209 nats, packed rows 0.0209, the leak 0.4251 (printed by
``pytest tests/train/test_batching_gpu.py -s -k "local and bf16"``).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megatron_tg.config.objective import ObjectiveConfig
from megatron_tg.testing.distributed import run_distributed
from tests.train.common import tiny_policy
from tests.train.test_batching import _samples

TE = pytest.param("te", marks=[
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                       reason="needs transformer-engine (the GPU extra)")])
SPECS = [TE, "local"]


def _rank_fn(rank, world, state, hf_cfg, samples, tok_dir, dtype_name, use_te=True):
    from transformers import AutoTokenizer

    from megatron_tg.models.qwen3_moe import Qwen3Arch, build_model
    from megatron_tg.models.qwen3_moe.mapping import current_layout, load_hf_weights
    from megatron_tg.parallel.state import init_parallel
    import dataclasses

    from megatron_tg.train.batching import build_micro_batch, pack
    from megatron_tg.train.policy import forward_hidden, unwrap
    from megatron_tg.train.prefix_kv import record_kv, reuse_kv
    from megatron_tg.train.step import expert_hidden_states

    tok = AutoTokenizer.from_pretrained(tok_dir)
    ctx = init_parallel()
    dev = ctx.device
    arch = Qwen3Arch.from_hf(hf_cfg)
    dtype = getattr(torch, dtype_name)
    model = build_model(arch, params_dtype=dtype, use_te=use_te).to(dev)
    load_hf_weights(model, state, arch, current_layout())
    model.eval()

    def run(rows):
        with torch.no_grad():
            return forward_hidden(model, rows)

    def logprobs(hidden, weight, ids):
        lp = torch.log_softmax((hidden.float() @ weight.float().t())[:, :arch.vocab_size], -1)
        return lp[:-1].gather(1, torch.tensor(ids[1:], device=dev)[:, None]).squeeze(1).cpu()

    seqs = [s.rollout.token_ids for s in samples]
    longest = max(len(x) for x in seqs)
    out = {"plain": [], "packed": []}
    for ids in seqs:
        rows = pack([ids], len(ids))
        o = run(rows)
        out["plain"].append(logprobs(o.hidden[0, :len(ids)], o.output_weight, ids))
    rows = pack(seqs, sum(len(x) for x in seqs))
    o = run(rows)
    flat = o.hidden.reshape(-1, o.hidden.shape[-1])
    for k, ids in enumerate(seqs):
        idx = torch.tensor([rows.flat(k, p) for p in range(len(ids))], device=dev)
        out["packed"].append(logprobs(flat[idx], o.output_weight, ids))
    # Positive control: the same packed row as one THD segment, i.e. every sequence after
    # the first attends to the ones before it. The packed check must be able to tell this
    # leak from bf16 noise, or its tolerance proves nothing.
    width = rows.tokens.shape[1]
    rows = dataclasses.replace(rows, cu_seqlens=torch.tensor([0, width], dtype=torch.int32),
                               max_seqlen=width)
    o = run(rows)
    flat = o.hidden.reshape(-1, o.hidden.shape[-1])
    out["leaky"] = []
    for k, ids in enumerate(seqs):
        idx = torch.tensor([rows.flat(k, p) for p in range(len(ids))], device=dev)
        out["leaky"].append(logprobs(flat[idx], o.output_weight, ids))

    cfg = ObjectiveConfig(mode="tg")
    full = build_micro_batch(samples, tok, cfg, row_tokens=2 * longest)
    full.expert_rows = full.expert_rows.to(dev)
    eh, ew = expert_hidden_states(model, full)
    out["expert_full"] = (eh.float() @ ew.float().t()).cpu()
    mb = build_micro_batch(samples, tok, cfg, row_tokens=2 * longest, prefix_reuse=True)
    gpt = unwrap(model)
    with torch.no_grad():
        with record_kv(gpt) as store:
            run(mb.student)
        with reuse_kv(gpt, store, mb.expert_prefix):
            o = run(mb.expert)
    rows_h = o.hidden.reshape(-1, o.hidden.shape[-1])[mb.expert_rows.to(dev)]
    out["expert_reuse"] = (rows_h.float() @ o.output_weight.float().t()).cpu()
    return out


def _run(spec, dtype):
    tok, hf_cfg, state = tiny_policy()
    samples, _ = _samples(tok)
    return run_distributed(_rank_fn, 1, state, hf_cfg, samples, tok.name_or_path, dtype,
                           spec == "te", timeout=600)[0]


def _rms(xs, ys) -> float:
    return float(torch.cat([(a - b).flatten() for a, b in zip(xs, ys)]).pow(2).mean().sqrt())


@pytest.mark.parametrize("spec", SPECS)
def test_spec_honours_packing_masks_and_prefix_reuse_fp32(spec):
    out = _run(spec, "float32")
    for k, (packed, plain) in enumerate(zip(out["packed"], out["plain"])):
        torch.testing.assert_close(packed, plain, atol=1e-4, rtol=1e-4, msg=f"rollout {k}")
    torch.testing.assert_close(out["expert_reuse"], out["expert_full"], atol=1e-4, rtol=1e-4)
    assert _rms(out["leaky"][1:], out["plain"][1:]) > 1e-2  # the leak is visible


@pytest.mark.parametrize("spec", SPECS)
def test_spec_honours_packing_masks_and_prefix_reuse_bf16(spec):
    ref, out = _run(spec, "float32"), _run(spec, "bfloat16")
    noise = _rms(out["plain"], ref["plain"])            # what bf16 alone costs
    packed = _rms(out["packed"], ref["plain"])
    leak = _rms(out["leaky"][1:], ref["plain"][1:])
    expert_noise = _rms([out["expert_full"]], [ref["expert_full"]])
    expert_reuse = _rms([out["expert_reuse"]], [ref["expert_full"]])
    print(f"{spec} bf16 RMS vs fp32: plain {noise:.4f}, packed {packed:.4f}, leak {leak:.4f}; "
          f"expert full {expert_noise:.4f}, reuse {expert_reuse:.4f}")
    band = 1.5 * noise + 1e-3
    assert packed <= band, (packed, noise)
    assert expert_reuse <= 1.5 * expert_noise + 1e-3, (expert_reuse, expert_noise)
    assert leak > 5 * band, (leak, band)  # a leaking mask would not pass the check above
