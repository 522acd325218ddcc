"""The fused ops' logits are fp32 from bf16 hidden states: log-probs and KL match a reference
built from fp32 logits of the *same* bf16 hidden states and weights (float64 here), while a
bf16 matmul upcast afterwards (the ops before this fix) misses it by ~0.04 nats RMS at
realistic logit scales. Comparing two layouts of the same bf16 computation would prove
nothing: they agree to rounding either way."""

from __future__ import annotations

import pytest
import torch

from megatron_tg.ops import (fused_vocab_parallel_entropy, fused_vocab_parallel_kl,
                             fused_vocab_parallel_kl_loss, fused_vocab_parallel_logprob)
from tests.ops.reference import ref_entropy, ref_kl, ref_logprob

T, H, V = 256, 256, 2048


def _inputs(seed: int = 0):
    """bf16 hidden states and weight whose logits reach |z| ≈ 30 (LLM-like scales, where the
    bf16 output spacing is 0.125); the expert's hidden states differ at bf16 level."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g).bfloat16()
    w = (torch.randn(V, H, generator=g) * 10 / H ** 0.5).bfloat16()
    he = (h.float() + 0.02 * torch.randn(T, H, generator=g)).bfloat16()
    target = torch.randint(0, V, (T,), generator=g)
    return h, he, w, target


def _rms(x: torch.Tensor) -> float:
    return x.double().pow(2).mean().sqrt().item()


DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


@pytest.mark.parametrize("device", DEVICES)  # cuda: bf16 matmul with out_dtype=float32
def test_logprob_and_kl_match_fp32_logit_reference(device):
    h, he, w, target = (t.to(device) for t in _inputs())
    zs, ze = h.double() @ w.double().t(), he.double() @ w.double().t()
    assert zs.abs().max() > 16  # the regime where bf16 logits are rounded by ≥ 0.0625
    lp_ref = ref_logprob(zs, target)
    lp = fused_vocab_parallel_logprob(h, w, target, chunk_size=100)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp.double(), lp_ref, rtol=0, atol=2e-5)
    # The test has power: the bf16-output matmul misses the same reference by far more.
    bf16_out = ref_logprob((h @ w.t()).double(), target)
    err_bf16, err = bf16_out - lp_ref, lp.double() - lp_ref
    print(f"{device}: max |z| {zs.abs().max().item():.1f}; log-prob error vs fp32 logits: "
          f"bf16 matmul {_rms(err_bf16):.3g} RMS ({err_bf16.abs().max().item():.3g} max), "
          f"fused {_rms(err):.3g} RMS ({err.abs().max().item():.3g} max)")
    assert _rms(err_bf16) > 1e-2 > 100 * _rms(err)

    torch.testing.assert_close(fused_vocab_parallel_entropy(h, w, chunk_size=100).double(),
                               ref_entropy(zs), rtol=0, atol=2e-5)
    for direction in ("reverse", "forward", "jsd"):
        kl_ref = ref_kl(zs, ze, direction)
        kl = fused_vocab_parallel_kl(h, he, w, direction=direction, chunk_size=100)
        torch.testing.assert_close(kl.double(), kl_ref, rtol=1e-4, atol=2e-6, msg=direction)
        weights = torch.rand(T, generator=torch.Generator().manual_seed(1)).to(device)
        loss, per_token = fused_vocab_parallel_kl_loss(h, he, w, weights, direction=direction,
                                                       chunk_size=100)
        torch.testing.assert_close(per_token.double(), kl_ref, rtol=1e-4, atol=2e-6)
        torch.testing.assert_close(loss.double(), (weights.double() * kl_ref).sum(),
                                   rtol=1e-4, atol=1e-5)
    # The KL floor of an expert that differs at bf16 level: with bf16 logits it is set by
    # their rounding, not by the hidden states.
    kl_bf16 = ref_kl((h @ w.t()).double(), (he @ w.t()).double(), "reverse")
    kl_fp32 = ref_kl(zs, ze, "reverse")
    kl_fused = fused_vocab_parallel_kl(h, he, w).double()
    print(f"{device}: reverse KL to a bf16-level expert: fp32 logits {kl_fp32.mean().item():.4g}, "
          f"bf16 logits {kl_bf16.mean().item():.4g}, fused {kl_fused.mean().item():.4g} per token")
    assert (kl_bf16 - kl_fp32).abs().mean() > 1e-4


@pytest.mark.parametrize("device", DEVICES)
def test_fp32_logit_gradients_match_reference(device):
    h, he, w, target = (t.to(device) for t in _inputs(seed=2))
    hr, wr = h.double().requires_grad_(True), w.double().requires_grad_(True)
    (ref_logprob(hr @ wr.t(), target).sum() + ref_kl(hr @ wr.t(), (he.double() @ wr.t()).detach(),
                                                     "reverse").sum()).backward()
    hb, wb = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    (fused_vocab_parallel_logprob(hb, wb, target, chunk_size=64).sum()
     + fused_vocab_parallel_kl(hb, he, wb, chunk_size=64).sum()).backward()
    # Gradients are returned in the parameters' dtype (bf16): bf16-level agreement.
    assert hb.grad.dtype == torch.bfloat16 and wb.grad.dtype == torch.bfloat16
    torch.testing.assert_close(hb.grad.double(), hr.grad, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(wb.grad.double(), wr.grad, rtol=2e-2, atol=2e-2)
