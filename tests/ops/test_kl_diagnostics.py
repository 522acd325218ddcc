"""The KL ops' diagnostics (rescue mass, both directions' logit-gradient norms) against plain
torch: softmaxes and autograd on the full, unpadded vocabulary in float64, at TP=1 and TP=2."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from megatron_tg.ops import fused_vocab_parallel_kl, fused_vocab_parallel_kl_loss, vocab_parallel_kl
from megatron_tg.testing.distributed import run_distributed
from tests.ops.checks import CollectiveCounter
from tests.ops.reference import make_logits, ref_kl

THR = 1e-4


def reference(zs: torch.Tensor, ze: torch.Tensor, threshold: float = THR) -> dict[str, torch.Tensor]:
    """Independent per-row reference: the gradient norms come from autograd of the two KLs."""
    ps, pe = zs.softmax(-1), ze.softmax(-1)
    out = {"rescue_mass": torch.where(ps < threshold, pe, 0.0).sum(-1)}
    for name, direction in (("grad_norm_reverse", "reverse"), ("grad_norm_forward", "forward")):
        z = zs.detach().clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(ref_kl(z, ze, direction).sum(), z)  # rows independent
        out[name] = grad.norm(dim=-1)
    return out


def _assert_matches(got: dict, want: dict, rtol: float = 1e-7, atol: float = 1e-9) -> None:
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k].double(), want[k], rtol=rtol, atol=atol, msg=k)


def _case(t=7, vocab=11, padded=12, seed=0, kind="normal"):
    gen = torch.Generator().manual_seed(seed)
    zs, ze = make_logits(t, vocab, padded, kind, gen), make_logits(t, vocab, padded, kind, gen)
    # Rows with tokens the student all but excludes (p < 1e-4) and the expert prefers.
    zs[0, :vocab] = torch.linspace(-12.0, 3.0, vocab, dtype=torch.float64)
    ze[0, :vocab] = zs[0, :vocab].flip(0)
    zs[1, 2] = -20.0
    ze[1, 2] = 12.0
    return zs, ze


@pytest.mark.parametrize("direction", ["reverse", "forward", "jsd"])
@pytest.mark.parametrize("kind", ["normal", "extreme"])
def test_logits_op_diagnostics_match_torch(direction, kind):
    vocab = 11
    zs, ze = _case(kind=kind)
    want = reference(zs[:, :vocab], ze[:, :vocab])
    plain = vocab_parallel_kl(zs, ze, vocab_size=vocab, direction=direction, beta=0.3, chunk_size=3)
    diag: dict = {}
    z = zs.clone().requires_grad_(True)
    val = vocab_parallel_kl(z, ze, vocab_size=vocab, direction=direction, beta=0.3, chunk_size=3,
                            diagnostics=diag)
    # ±1e4 logits: KL ~1e4, so the norm's expansion S3 − 2K·S2 + K²·S4 loses ~1e-16·K².
    _assert_matches(diag, want, **(dict(rtol=1e-7, atol=1e-6) if kind == "extreme" else dict(atol=1e-9)))
    assert want["rescue_mass"][1] > 0.9  # the case holds a rescue row (the check can fail)
    # the diagnostics change neither the value nor its gradient
    torch.testing.assert_close(val, plain, rtol=0, atol=0)
    val.sum().backward()
    z2 = zs.clone().requires_grad_(True)
    vocab_parallel_kl(z2, ze, vocab_size=vocab, direction=direction, beta=0.3, chunk_size=3).sum().backward()
    torch.testing.assert_close(z.grad, z2.grad, rtol=0, atol=0)


def test_rescue_case_reverse_gradient_vanishes_forward_does_not():
    """The reason this metric exists: the expert puts half its mass on a token the student
    gives ~1e-6; the forward KL's logit gradient sees it, the reverse KL's hardly does."""
    v = 6
    zs = torch.zeros(1, v, dtype=torch.float64)
    zs[0, 0] = 10.0
    zs[0, 1] = -4.0  # p_s ≈ 4e-7
    ze = torch.zeros(1, v, dtype=torch.float64)
    ze[0, 0], ze[0, 1] = 5.0, 5.0
    diag: dict = {}
    vocab_parallel_kl(zs, ze, direction="reverse", diagnostics=diag)
    _assert_matches(diag, reference(zs, ze))
    assert diag["rescue_mass"].item() == pytest.approx(0.5, abs=0.01)
    assert diag["grad_norm_forward"].item() > 0.6
    assert diag["grad_norm_reverse"].item() < 0.01


def test_fused_ops_diagnostics_match_torch():
    vocab, padded, hidden = 9, 10, 5
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(8, hidden, generator=gen, dtype=torch.float64) * 2
    he = torch.randn(8, hidden, generator=gen, dtype=torch.float64) * 2
    w = torch.randn(padded, hidden, generator=gen, dtype=torch.float64) * 2
    we = torch.randn(padded, hidden, generator=gen, dtype=torch.float64) * 2
    want = reference(h @ w[:vocab].t(), he @ we[:vocab].t())
    assert (want["rescue_mass"] > 0).any()
    for direction in ("reverse", "forward"):
        d1: dict = {}
        fused_vocab_parallel_kl(h, he, w, vocab_size=vocab, direction=direction, chunk_size=3,
                                expert_weight_shard=we, diagnostics=d1)
        _assert_matches(d1, want)
        d2: dict = {}
        hg = h.clone().requires_grad_(True)
        fused_vocab_parallel_kl_loss(hg, he, w, torch.ones(8, dtype=torch.float64), vocab_size=vocab,
                                     direction=direction, chunk_size=3, expert_weight_shard=we,
                                     diagnostics=d2)[0].backward()
        _assert_matches(d2, want)
        assert hg.grad is not None


def test_fp32_inputs_are_close_to_the_float64_reference():
    zs, ze = _case(seed=5)
    want = reference(zs[:, :11], ze[:, :11])
    diag: dict = {}
    vocab_parallel_kl(zs.float(), ze.float(), vocab_size=11, diagnostics=diag)
    assert all(v.dtype == torch.float32 for v in diag.values())
    _assert_matches(diag, want, rtol=1e-4, atol=1e-5)


def test_bad_threshold_is_named():
    zs, ze = _case()
    with pytest.raises(ValueError, match="rescue threshold"):
        vocab_parallel_kl(zs, ze, vocab_size=11, diagnostics={}, rescue_threshold=0.0)


def tp_world(rank: int, world: int) -> dict:
    vocab, padded = 11, 12
    vs = padded // world
    cols = slice(rank * vs, (rank + 1) * vs)
    zs, ze = _case(vocab=vocab, padded=padded)
    want = reference(zs[:, :vocab], ze[:, :vocab])
    for direction in ("reverse", "forward", "jsd"):
        diag: dict = {}
        with CollectiveCounter() as c:
            vocab_parallel_kl(zs[:, cols].clone(), ze[:, cols].clone(), dist.group.WORLD,
                              vocab_size=vocab, direction=direction, chunk_size=3, diagnostics=diag)
        n_chunks = math.ceil(zs.shape[0] / 3)
        base = 3 if direction == "jsd" else 2
        # exactly one extra all-reduce per chunk
        assert c.counts == {"all_reduce": (base + 1) * n_chunks}, (direction, c.counts)
        _assert_matches(diag, want, atol=1e-9)
    # fused, sharded output weight
    gen = torch.Generator().manual_seed(9)
    h = torch.randn(5, 4, generator=gen, dtype=torch.float64) * 2
    he = torch.randn(5, 4, generator=gen, dtype=torch.float64) * 2
    w = torch.randn(padded, 4, generator=gen, dtype=torch.float64) * 2
    want = reference(h @ w[:vocab].t(), he @ w[:vocab].t())
    diag = {}
    fused_vocab_parallel_kl_loss(h.clone().requires_grad_(True), he, w[cols].clone(),
                                 torch.ones(5, dtype=torch.float64), dist.group.WORLD,
                                 vocab_size=vocab, chunk_size=2, diagnostics=diag)
    _assert_matches(diag, want)
    return {k: v.clone() for k, v in diag.items()}


def test_tp2_diagnostics_match_single_process():
    results = run_distributed(tp_world, 2)
    assert len(results) == 2
    for k in results[0]:
        torch.testing.assert_close(results[0][k], results[1][k], rtol=0, atol=0)
