"""Single-process properties of the ops: shapes, dtypes, limits, memory contract, bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_tg.ops import (fused_vocab_parallel_kl, fused_vocab_parallel_kl_loss,
                             fused_vocab_parallel_logprob,
                             vocab_parallel_entropy, vocab_parallel_kl, vocab_parallel_logprob)
from tests.ops.reference import make_logits, ref_entropy, ref_kl, ref_logprob


def _pair(t=6, v=9, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, v, generator=g, dtype=dtype) * 2,
            torch.randn(t, v, generator=g, dtype=dtype) * 2)


def test_leading_dims_sequence_first_layout():
    zs, ze = _pair(t=12)
    zs3, ze3 = zs.reshape(4, 3, 9), ze.reshape(4, 3, 9)  # [S, B, V] as megatron returns it
    tgt = torch.arange(12) % 9
    assert vocab_parallel_kl(zs3, ze3).shape == (4, 3)
    torch.testing.assert_close(vocab_parallel_kl(zs3, ze3).reshape(-1), vocab_parallel_kl(zs, ze))
    torch.testing.assert_close(vocab_parallel_logprob(zs3, tgt.reshape(4, 3)).reshape(-1),
                               ref_logprob(zs, tgt))
    torch.testing.assert_close(vocab_parallel_entropy(zs3).reshape(-1), ref_entropy(zs))


def test_expert_gets_no_gradient_and_is_not_kept_in_graph():
    zs, ze = _pair()
    zs.requires_grad_(True)
    ze.requires_grad_(True)
    for direction in ("reverse", "forward", "jsd"):
        vocab_parallel_kl(zs, ze * 1.0, direction=direction).sum().backward()
    assert ze.grad is None
    assert zs.grad is not None and zs.grad.abs().sum() > 0


def test_jsd_limits_and_endpoints():
    zs, ze = _pair(seed=3)
    fwd, rev = ref_kl(zs, ze, "forward"), ref_kl(zs, ze, "reverse")
    torch.testing.assert_close(vocab_parallel_kl(zs, ze, direction="jsd", beta=0.0), fwd)
    torch.testing.assert_close(vocab_parallel_kl(zs, ze, direction="jsd", beta=1.0), rev)
    # β→0 behaves like forward KL, β→1 like reverse (after dividing out the vanishing scale).
    b = 1e-6  # the next-order term is O(b · p_s/p_e): small b keeps it below the tolerance
    torch.testing.assert_close(vocab_parallel_kl(zs, ze, direction="jsd", beta=b) / b, fwd,
                               rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(vocab_parallel_kl(zs, ze, direction="jsd", beta=1 - b) / b, rev,
                               rtol=1e-3, atol=1e-5)


def test_bf16_inputs_compute_in_fp32():
    zs, ze = _pair(t=5, v=40, seed=4, dtype=torch.float32)
    zb = zs.bfloat16().requires_grad_(True)
    kl = vocab_parallel_kl(zb, ze.bfloat16())
    assert kl.dtype == torch.float32
    torch.testing.assert_close(kl, ref_kl(zs.bfloat16().double(), ze.bfloat16().double(), "reverse").float(),
                               rtol=1e-4, atol=1e-5)
    kl.sum().backward()
    assert zb.grad.dtype == torch.bfloat16 and torch.isfinite(zb.grad.float()).all()


def test_masked_minus_inf_logits_stay_finite():
    zs, ze = _pair(seed=5)
    zs[:, 0] = float("-inf")
    zs.requires_grad_(True)
    for direction in ("reverse", "jsd"):
        kl = vocab_parallel_kl(zs, ze, direction=direction)
        kl.sum().backward()
        assert torch.isfinite(kl).all() and torch.isfinite(zs.grad).all()
    assert torch.isfinite(vocab_parallel_entropy(zs)).all()
    # forward KL is +inf when the student forbids a token the expert allows: correct, not a bug.
    assert torch.isinf(vocab_parallel_kl(zs, ze, direction="forward")).all()


def test_chunked_forward_saves_no_vocab_sized_activation():
    """Memory contract: backward recomputes softmaxes; only O(T) statistics are saved."""
    t, v, h = 64, 50, 8
    zs, ze = _pair(t=t, v=v)
    zs.requires_grad_(True)
    hid = torch.randn(t, h, dtype=torch.float64, requires_grad=True)
    w = torch.randn(v, h, dtype=torch.float64, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
        vocab_parallel_kl(zs, ze, chunk_size=8, direction="jsd")
        n_inputs = 2
        fused_vocab_parallel_kl(hid, hid.detach() * 0.5, w, chunk_size=8)
    big = [tuple(x.shape) for x in saved if x.numel() >= t * v]
    # Only the two input logits tensors of the unfused op are [T, V]; the fused op keeps none.
    assert len(big) == n_inputs, big
    assert all(x.numel() <= max(t, v * h, t * h) for x in saved if tuple(x.shape) not in big)


def test_bad_input_is_named():
    zs, ze = _pair()
    with pytest.raises(ValueError, match="direction"):
        vocab_parallel_kl(zs, ze, direction="sideways")
    with pytest.raises(ValueError, match="vocab_size"):
        vocab_parallel_kl(zs, ze, vocab_size=10)
    with pytest.raises(ValueError, match="shapes differ"):
        vocab_parallel_kl(zs, ze[:, :5])
    with pytest.raises(ValueError, match="chunk_size"):
        vocab_parallel_entropy(zs, chunk_size=0)
    with pytest.raises(ValueError, match="target_ids"):
        vocab_parallel_logprob(zs, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="beta"):
        vocab_parallel_kl(zs, ze, direction="jsd", beta=1.5)


@settings(max_examples=30, deadline=None)
@given(t=st.integers(0, 9), vocab=st.integers(1, 17), pad=st.integers(0, 4), chunk=st.integers(1, 10),
       kind=st.sampled_from(["normal", "extreme", "equal"]),
       direction=st.sampled_from(["reverse", "forward", "jsd"]), beta=st.floats(0.05, 0.95),
       seed=st.integers(0, 2**16))
def test_property_logits_ops_match_reference(t, vocab, pad, chunk, kind, direction, beta, seed):
    gen = torch.Generator().manual_seed(seed)
    zs = make_logits(t, vocab, vocab + pad, kind, gen).requires_grad_(True)
    ze = make_logits(t, vocab, vocab + pad, "normal", gen)
    tgt = torch.randint(0, vocab, (t,), generator=gen)
    w = torch.rand(t, generator=gen, dtype=torch.float64)
    for op, ref in (
        (lambda z: vocab_parallel_kl(z, ze, vocab_size=vocab, direction=direction, beta=beta,
                                     chunk_size=chunk),
         lambda z: ref_kl(z, ze[:, :vocab], direction, beta)),
        (lambda z: vocab_parallel_logprob(z, tgt, vocab_size=vocab, chunk_size=chunk),
         lambda z: ref_logprob(z, tgt)),
        (lambda z: vocab_parallel_entropy(z, vocab_size=vocab, chunk_size=chunk), ref_entropy),
    ):
        zs.grad = None
        got = op(zs)
        (got * w).sum().backward()
        zr = zs.detach()[:, :vocab].clone().requires_grad_(True)
        want = ref(zr)
        (want * w).sum().backward()
        torch.testing.assert_close(got, want.detach(), atol=1e-8, rtol=1e-9)
        torch.testing.assert_close(zs.grad[:, :vocab], zr.grad, atol=1e-8, rtol=1e-9)
        assert (zs.grad[:, vocab:] == 0).all()


@settings(max_examples=15, deadline=None)
@given(t=st.integers(1, 8), vocab=st.integers(2, 12), hidden=st.integers(1, 6),
       chunk=st.integers(1, 9), direction=st.sampled_from(["reverse", "forward", "jsd"]),
       seed=st.integers(0, 2**16))
def test_property_fused_equals_unfused(t, vocab, hidden, chunk, direction, seed):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(t, hidden, generator=gen, dtype=torch.float64, requires_grad=True)
    he = torch.randn(t, hidden, generator=gen, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64, requires_grad=True)
    tgt = torch.randint(0, vocab, (t,), generator=gen)
    got = fused_vocab_parallel_kl(h, he, w, direction=direction, chunk_size=chunk) + \
        fused_vocab_parallel_logprob(h, w, tgt, chunk_size=chunk)
    got.sum().backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    z = h @ w.t()
    want = vocab_parallel_kl(z, he @ w.t(), direction=direction) + vocab_parallel_logprob(z, tgt)
    want.sum().backward()
    torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(gh, h.grad, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(gw, w.grad, atol=1e-9, rtol=1e-9)


def test_weighted_fused_loss_does_no_gradient_work_without_grad(monkeypatch):
    """Under no_grad the op must not compute gradients (needs_input_grad ignores no_grad)."""
    from megatron_tg.ops import _kernels
    calls = []
    orig = _kernels.KLKernel.backward
    monkeypatch.setattr(_kernels.KLKernel, "backward", lambda self, *a: calls.append(1) or orig(self, *a))
    h = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        loss, kl = fused_vocab_parallel_kl_loss(h, h * 0.5, w, torch.ones(5, dtype=torch.float64))
    assert not loss.requires_grad and calls == []
    torch.testing.assert_close(loss, fused_vocab_parallel_kl(h, h * 0.5, w).sum().detach())
    fused_vocab_parallel_kl_loss(h, h * 0.5, w, torch.ones(5, dtype=torch.float64), chunk_size=2)
    assert len(calls) == 3  # with grad: one gradient pass per chunk, inside forward
    with pytest.raises(ValueError, match="token_weights"):
        fused_vocab_parallel_kl_loss(h, h, w, torch.ones(4))


def test_weighted_fused_loss_refuses_a_second_backward():
    """Its gradients are precomputed and scaled in place: a retained second pass must fail loudly."""
    h = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    loss, _ = fused_vocab_parallel_kl_loss(h, h.detach() * 2, w, torch.ones(4, dtype=torch.float64))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="only once"):
        loss.backward()
