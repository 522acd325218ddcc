"""One battery of op-vs-reference checks, run at TP=1 in-process and at TP=2/4 in one spawned world.

Every rank builds the same full-vocabulary tensors from the same seed, keeps its column shard,
and compares values and its shard's gradients with a float64 single-process reference.
Assertions happen on the rank (a failure names the rank and the case).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_tg.ops import (fused_vocab_parallel_entropy, fused_vocab_parallel_kl,
                             fused_vocab_parallel_kl_loss, fused_vocab_parallel_logprob, vocab_parallel_entropy,
                             vocab_parallel_kl, vocab_parallel_logprob)
from tests.ops.reference import make_logits, ref_entropy, ref_kl, ref_logprob

DIRECTIONS = (("reverse", 0.5), ("forward", 0.5), ("jsd", 0.3))


def _cols(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    vs = x.shape[-1] // world
    return x[..., rank * vs:(rank + 1) * vs]


def _pad_cols(g: torch.Tensor, padded: int) -> torch.Tensor:
    out = torch.zeros(*g.shape[:-1], padded, dtype=g.dtype)
    out[..., :g.shape[-1]] = g
    return out


def _close(name: str, got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float) -> float:
    got, want = got.double(), want.double()
    if not torch.isfinite(got).all():
        raise AssertionError(f"{name}: non-finite values {got}")
    err = (got - want).abs().max().item() if got.numel() else 0.0
    if not torch.allclose(got, want, atol=atol, rtol=rtol):
        raise AssertionError(f"{name}: max abs err {err:.3e} (atol {atol}, rtol {rtol})\n"
                             f"got  {got.flatten()[:8]}\nwant {want.flatten()[:8]}")
    return err


def _ref_grad(fn, z_valid: torch.Tensor, weights: torch.Tensor, *others) -> tuple:
    z = z_valid.detach().clone().requires_grad_(True)
    val = fn(z, *others)
    (val * weights).sum().backward()
    return val.detach(), z.grad


def check_logits_ops(rank: int, world: int, group: Optional[dist.ProcessGroup], *, t: int,
                     vocab: int, padded: int, kind: str, chunk: int, seed: int,
                     dtype: torch.dtype = torch.float64, vocab_size_arg: Optional[int] = -1) -> dict:
    """logprob, entropy and the three KL directions from logits; returns max errors."""
    gen = torch.Generator().manual_seed(seed)
    zs_full = make_logits(t, vocab, padded, kind, gen)
    ze_full = make_logits(t, vocab, padded, "normal" if kind == "equal" else kind, gen)
    if kind == "equal":
        ze_full[1::2, :vocab] = zs_full[1::2, :vocab]  # identical rows: KL must be exactly ~0
    target = torch.randint(0, vocab, (t,), generator=gen)
    weights = torch.rand(t, generator=gen, dtype=torch.float64) + 0.5
    vs_arg = vocab if vocab_size_arg == -1 else vocab_size_arg
    tol = dict(atol=1e-8, rtol=1e-9) if dtype == torch.float64 else dict(atol=2e-3, rtol=1e-4)
    tag = f"[rank {rank}/{world} {kind} T={t} V={vocab}/{padded} chunk={chunk} {dtype}]"
    errs = {}

    def run(name, op, ref_fn, *ref_extra, expert=False):
        z = _cols(zs_full, rank, world).to(dtype).clone().requires_grad_(True)
        args = (z,)
        ze_local = None
        if expert:
            ze_local = _cols(ze_full, rank, world).to(dtype).clone().requires_grad_(True)
            args = (z, ze_local)
        val = op(*args)
        (val.double() * weights).sum().backward()
        want, want_g = _ref_grad(ref_fn, zs_full[:, :vocab], weights, *ref_extra)
        errs[name] = _close(f"{name} value {tag}", val, want, **tol)
        errs[name + "_grad"] = _close(f"{name} grad {tag}", z.grad,
                                      _cols(_pad_cols(want_g, padded), rank, world), **tol)
        if ze_local is not None and ze_local.grad is not None:
            raise AssertionError(f"{name}: expert logits received a gradient {tag}")

    run("logprob", lambda z: vocab_parallel_logprob(z, target, group, vocab_size=vs_arg, chunk_size=chunk),
        ref_logprob, target)
    run("entropy", lambda z: vocab_parallel_entropy(z, group, vocab_size=vs_arg, chunk_size=chunk),
        ref_entropy)
    for direction, beta in DIRECTIONS:
        run(f"kl_{direction}",
            lambda z, ze: vocab_parallel_kl(z, ze, group, vocab_size=vs_arg, direction=direction,
                                            beta=beta, chunk_size=chunk),
            lambda z: ref_kl(z, ze_full[:, :vocab], direction, beta), expert=True)
    return errs


def check_fused_ops(rank: int, world: int, group: Optional[dist.ProcessGroup], *, t: int,
                    vocab: int, padded: int, hidden: int, chunk: int, seed: int,
                    separate_expert_weight: bool = False) -> dict:
    """Fused logprob/entropy/KL from hidden states: values, grad_hidden (TP-summed), grad_W shard."""
    gen = torch.Generator().manual_seed(seed)
    h_full = torch.randn(t, hidden, generator=gen, dtype=torch.float64)
    he_full = torch.randn(t, hidden, generator=gen, dtype=torch.float64)
    w_full = torch.randn(padded, hidden, generator=gen, dtype=torch.float64)
    w_full[vocab:] = 1e6  # padded rows of the output layer: their logits must not count
    we_full = torch.randn(padded, hidden, generator=gen, dtype=torch.float64) if separate_expert_weight else w_full
    target = torch.randint(0, vocab, (t,), generator=gen)
    weights = torch.rand(t, generator=gen, dtype=torch.float64) + 0.5
    tag = f"[rank {rank}/{world} fused T={t} V={vocab}/{padded} H={hidden} chunk={chunk}]"
    vs = padded // world
    errs = {}

    def run(name, op, ref_fn, weighted_loss=False):
        h = h_full.clone().requires_grad_(True)
        w = w_full[rank * vs:(rank + 1) * vs].clone().requires_grad_(True)
        he = he_full.clone().requires_grad_(True)
        if weighted_loss:  # op returns (Σ w·D, D) with the gradient made in forward
            loss, val = op(h, w, he)
            (2.0 * loss).backward()
            errs[name + "_loss"] = _close(f"{name} loss {tag}", loss, (val * weights).sum(), 1e-10, 1e-10)
            if val.requires_grad:
                raise AssertionError(f"{name}: per-token values must be detached {tag}")
            h.grad, w.grad = h.grad / 2, w.grad / 2  # the backward must scale by d(2L)/dL
        else:
            val = op(h, w, he)
            (val * weights).sum().backward()
        hr, wr = h_full.clone().requires_grad_(True), w_full[:vocab].clone().requires_grad_(True)
        ref = ref_fn(hr @ wr.t())
        (ref * weights).sum().backward()
        errs[name] = _close(f"{name} value {tag}", val, ref.detach(), 1e-8, 1e-9)
        errs[name + "_grad_h"] = _close(f"{name} grad_hidden {tag}", h.grad, hr.grad, 1e-8, 1e-9)
        errs[name + "_grad_w"] = _close(f"{name} grad_weight {tag}", w.grad,
                                        _cols(_pad_cols(wr.grad.t(), padded), rank, world).t(),
                                        1e-8, 1e-9)
        if he.grad is not None:
            raise AssertionError(f"{name}: expert hidden received a gradient {tag}")

    run("fused_logprob", lambda h, w, he: fused_vocab_parallel_logprob(
        h, w, target, group, vocab_size=vocab, chunk_size=chunk),
        lambda z: ref_logprob(z, target))
    run("fused_entropy", lambda h, w, he: fused_vocab_parallel_entropy(
        h, w, group, vocab_size=vocab, chunk_size=chunk), ref_entropy)
    we_local = we_full[rank * vs:(rank + 1) * vs]
    ze_ref = he_full @ we_full[:vocab].t()
    for direction, beta in DIRECTIONS:
        run(f"fused_kl_{direction}", lambda h, w, he: fused_vocab_parallel_kl(
            h, he, w, group, vocab_size=vocab, direction=direction, beta=beta, chunk_size=chunk,
            expert_weight_shard=we_local if separate_expert_weight else None),
            lambda z: ref_kl(z, ze_ref, direction, beta))
        run(f"fused_kl_loss_{direction}", lambda h, w, he: fused_vocab_parallel_kl_loss(
            h, he, w, weights, group, vocab_size=vocab, direction=direction, beta=beta,
            chunk_size=chunk, expert_weight_shard=we_local if separate_expert_weight else None),
            lambda z: ref_kl(z, ze_ref, direction, beta), weighted_loss=True)
    return errs


class CollectiveCounter:
    """Counts torch.distributed collectives issued inside a ``with`` block."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._saved: dict[str, object] = {}

    def __enter__(self):
        for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast",
                     "reduce_scatter", "all_to_all"):
            orig = getattr(dist, name)
            self._saved[name] = orig

            def wrapped(*a, _orig=orig, _name=name, **k):
                self.counts[_name] = self.counts.get(_name, 0) + 1
                return _orig(*a, **k)
            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, orig in self._saved.items():
            setattr(dist, name, orig)


def check_collective_budget(rank: int, world: int, group: dist.ProcessGroup) -> dict:
    """Forward: 2 all-reduces per chunk (3 for JSD); backward: none (fused: 1 for grad_h)."""
    t, chunk, vs, hidden = 10, 4, 5, 3
    n_chunks = -(-t // chunk)
    gen = torch.Generator().manual_seed(7)
    zs = torch.randn(t, vs, generator=gen, dtype=torch.float64).requires_grad_(True)
    ze = torch.randn(t, vs, generator=gen, dtype=torch.float64)
    target = torch.randint(0, vs * world, (t,), generator=gen)
    out = {}
    cases = {
        "logprob": (lambda: vocab_parallel_logprob(zs, target, group, chunk_size=chunk), 2, 0),
        "entropy": (lambda: vocab_parallel_entropy(zs, group, chunk_size=chunk), 2, 0),
        "kl_reverse": (lambda: vocab_parallel_kl(zs, ze, group, chunk_size=chunk), 2, 0),
        "kl_forward": (lambda: vocab_parallel_kl(zs, ze, group, direction="forward", chunk_size=chunk), 2, 0),
        "kl_jsd": (lambda: vocab_parallel_kl(zs, ze, group, direction="jsd", chunk_size=chunk), 3, 0),
    }
    h = torch.randn(t, hidden, dtype=torch.float64, requires_grad=True)
    w = torch.randn(vs, hidden, dtype=torch.float64, requires_grad=True)
    cases["fused_kl"] = (lambda: fused_vocab_parallel_kl(h, h.detach() + 1, w, group, chunk_size=chunk), 2, 1)
    # Gradient made in forward: its grad_hidden all-reduce moves into the forward pass.
    cases["fused_kl_loss"] = (lambda: fused_vocab_parallel_kl_loss(
        h, h.detach() + 1, w, torch.ones(t, dtype=torch.float64), group, chunk_size=chunk)[0], 2, 0)
    for name, (fn, fwd_per_chunk, bwd) in cases.items():
        with CollectiveCounter() as fwd:
            val = fn()
        with CollectiveCounter() as back:
            val.sum().backward()
        want_fwd = {"all_reduce": fwd_per_chunk * n_chunks + (name == "fused_kl_loss")}
        want_bwd = {"all_reduce": bwd} if bwd else {}
        if fwd.counts != want_fwd or back.counts != want_bwd:
            raise AssertionError(f"{name} on rank {rank}: collectives forward {fwd.counts} "
                                 f"(want {want_fwd}), backward {back.counts} (want {want_bwd})")
        out[name] = (fwd.counts, back.counts)
    return out
