"""Float64 single-process references: plain torch on the full, unpadded vocabulary."""

from __future__ import annotations

import math

import torch


def ref_logprob(z: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return z.log_softmax(-1).gather(-1, target[..., None]).squeeze(-1)


def ref_entropy(z: torch.Tensor) -> torch.Tensor:
    lp = z.log_softmax(-1)
    return -(lp.exp() * lp).sum(-1)


def ref_kl(zs: torch.Tensor, ze: torch.Tensor, direction: str, beta: float = 0.5) -> torch.Tensor:
    ls, le = zs.log_softmax(-1), ze.log_softmax(-1)
    if direction == "jsd" and beta == 0.0:
        direction = "forward"
    if direction == "jsd" and beta == 1.0:
        direction = "reverse"
    if direction == "reverse":
        return (ls.exp() * (ls - le)).sum(-1)
    if direction == "forward":
        return (le.exp() * (le - ls)).sum(-1)
    # Mixture in probability space, written independently of the op's logaddexp form.
    # Mixture in log space so every log stays finite under ±1e4 logits (autograd of a
    # probability-space log(m) gives 0·inf = NaN where probabilities underflow).
    lm = torch.logaddexp(le + math.log(beta), ls + math.log1p(-beta))
    kl_e_m = (le.exp() * (le - lm)).sum(-1)
    kl_s_m = (ls.exp() * (ls - lm)).sum(-1)
    return beta * kl_e_m + (1 - beta) * kl_s_m


def make_logits(t: int, vocab: int, padded: int, kind: str, gen: torch.Generator,
                dtype=torch.float64) -> torch.Tensor:
    """[t, padded] logits; columns >= vocab hold garbage that must never leak.

    kind: "normal" (N(0, 3²)), "extreme" (±1e4 mixed with normal values), "equal" (all-equal
    rows, some very large).
    """
    z = torch.randn(t, padded, generator=gen, dtype=torch.float64) * 3
    if kind == "extreme":
        pick = torch.rand(t, padded, generator=gen, dtype=torch.float64)
        z = torch.where(pick < 0.2, torch.full_like(z, 1e4), z)
        z = torch.where(pick > 0.8, torch.full_like(z, -1e4), z)
    elif kind == "equal":
        z = torch.full_like(z, 7.0)
        z[::2] = 1e4
    if padded > vocab:
        z[:, vocab:] = float("nan")
        z[::3, vocab:] = 1e30
    return z.to(dtype)
