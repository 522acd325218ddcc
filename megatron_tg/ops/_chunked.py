"""Chunked drivers: run a :class:`Kernel` over rows, from logits or from hidden states.

Memory contract (per rank, Vs = V/TP, c = chunk size, T = rows):

* ``ChunkedLogits``: forward keeps only O(T) per-row statistics; temporaries are a few
  c × Vs blocks. Backward recomputes each chunk's softmaxes from the saved *input* logits
  (which the caller holds anyway) and writes the T × Vs gradient, the same size as the input.
* ``ChunkedLinear`` (fused): logits are computed per chunk as ``h @ Wᵀ`` and dropped; backward
  recomputes them, so nothing of size T × Vs exists at any time. Extra memory is a few c × Vs
  blocks plus the gradients of h [T, H] and W [Vs, H].
* ``ChunkedLinearLoss`` (fused, weights known): like ``ChunkedLinear`` but the gradient of
  Σ w_t·value_t is accumulated in forward while the chunk's logits are live; no recompute.

Logits from hidden states are accumulated *and output* in fp32 whatever the input dtype
(:func:`linear_logits`): a bf16 matmul rounds its output to bf16 (±0.0625 at |z| in
[16, 32)), which is pure noise in every per-token log-prob: 0.056 nats RMS (0.137 max) at
logits up to |z| = 46, against 2.25e-6 RMS with fp32 logits (``pytest -s
tests/ops/test_fp32_logits.py``). On CUDA the matmul takes
``out_dtype=float32`` (bf16 inputs, fp32 accumulation and output); elsewhere the weight
shard is upcast once per call (one fp32 [Vs, H] copy, the size of the fp32 weight gradient
backward allocates anyway) and each chunk of hidden states as it is used.

Only the kernels' max/sum all-reduces cross ranks, plus one all-reduce of grad_hidden (in the
fused backward, or at the end of ``ChunkedLinearLoss.forward``) when the hidden states are
replicated over the TP group (see :func:`megatron_tg.ops.fused_vocab_parallel_kl`).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_tg.ops._kernels import Kernel
from megatron_tg.ops._shard import VocabShard, compute_dtype


def _chunks(n: int, size: int):
    for start in range(0, n, size):
        yield start, min(start + size, n)


def _gather_saved(parts: list[tuple[torch.Tensor, ...]]) -> tuple:
    if not parts:
        return ()
    return tuple(torch.cat(cols) for cols in zip(*parts))


def _opt_slice(t: Optional[torch.Tensor], a: int, b: int) -> Optional[torch.Tensor]:
    return None if t is None else t[a:b]


def _mm_out_fp32_supported(device: torch.device) -> bool:
    return device.type == "cuda"


def upcast_weight(w: torch.Tensor) -> torch.Tensor:
    """The weight as :func:`linear_logits` consumes it: unchanged where the matmul can emit
    fp32 from low-precision inputs (CUDA), else an fp32 copy (made once per op call)."""
    if w.dtype == compute_dtype(w.dtype) or _mm_out_fp32_supported(w.device):
        return w
    return w.to(compute_dtype(w.dtype))


def linear_logits(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``h @ wᵀ`` accumulated and returned in ≥ fp32 (``w`` from :func:`upcast_weight`)."""
    cdt = torch.promote_types(compute_dtype(h.dtype), w.dtype)
    if h.dtype == w.dtype != cdt and _mm_out_fp32_supported(h.device):
        return torch.mm(h, w.t(), out_dtype=cdt)  # bf16/fp16 in, fp32 accumulation and out
    return h.to(cdt) @ w.to(cdt).t()


def _linear_grads(gz: torch.Tensor, h: torch.Tensor, w: torch.Tensor, a: int, b: int,
                  grad_h: Optional[torch.Tensor], grad_w: Optional[torch.Tensor]) -> None:
    """Chain one chunk's logit gradient gz [c, n] through z = h @ wᵀ (w = valid weight rows)."""
    gz = gz.to(h.dtype)
    if grad_h is not None:
        grad_h[a:b] = gz @ w
    if grad_w is not None:
        n = w.shape[0]
        # Accumulate in ≥ fp32 (bf16 sums over many chunks drift); addmm_ when dtypes agree.
        if grad_w.dtype == h.dtype:
            grad_w[:n].addmm_(gz.t(), h)
        else:
            grad_w[:n] += (gz.t() @ h).to(grad_w.dtype)


class ChunkedLogits(torch.autograd.Function):
    """Rows of logits [T, Vs] (and optionally expert logits, detached) → per-row value [T]."""

    @staticmethod
    def forward(ctx, kernel: Kernel, shard: VocabShard, chunk: int, student: torch.Tensor,
                expert: Optional[torch.Tensor], aux: Optional[torch.Tensor]) -> torch.Tensor:
        cdt = compute_dtype(student.dtype)
        n, rows = shard.n_valid, student.shape[0]
        out = student.new_empty(rows, dtype=cdt)
        parts = []
        for a, b in _chunks(rows, chunk):
            zs = student[a:b, :n].to(cdt)
            ze = None if expert is None else expert[a:b, :n].to(cdt)
            val, saved = kernel.forward(shard, zs, ze, _opt_slice(aux, a, b))
            out[a:b] = val
            parts.append(saved)
        ctx.kernel, ctx.shard, ctx.chunk = kernel, shard, chunk
        ctx.save_for_backward(student, expert, aux, *_gather_saved(parts))
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        student, expert, aux, *saved = ctx.saved_tensors
        kernel, shard, n = ctx.kernel, ctx.shard, ctx.shard.n_valid
        cdt = compute_dtype(student.dtype)
        # Padded columns (≥ n_valid) have zero probability: their gradient is exactly 0.
        grad = torch.zeros_like(student)
        grad_out = grad_out.to(cdt)
        for a, b in _chunks(student.shape[0], ctx.chunk):
            zs = student[a:b, :n].to(cdt)
            ze = None if expert is None else expert[a:b, :n].to(cdt)
            g = kernel.backward(shard, zs, ze, _opt_slice(aux, a, b),
                                tuple(s[a:b] for s in saved), grad_out[a:b])
            grad[a:b, :n] = g
            del g  # free before the next chunk's temporaries exist
        return None, None, None, grad, None, None


class ChunkedLinear(torch.autograd.Function):
    """Hidden [T, H] @ weight shardᵀ [H, Vs] computed chunk by chunk → per-row value [T].

    ``expert_hidden``/``expert_weight`` are stop-gradient. ``reduce_hidden_grad`` all-reduces
    grad_hidden over the TP group: each rank only sees its vocabulary shard's contribution.
    """

    @staticmethod
    def forward(ctx, kernel: Kernel, shard: VocabShard, chunk: int, reduce_hidden_grad: bool,
                hidden: torch.Tensor, weight: torch.Tensor, expert_hidden: Optional[torch.Tensor],
                expert_weight: Optional[torch.Tensor], aux: Optional[torch.Tensor]) -> torch.Tensor:
        cdt = compute_dtype(hidden.dtype)
        n, rows = shard.n_valid, hidden.shape[0]
        w = upcast_weight(weight[:n])  # padded rows produce padded logits: skip the work
        we = None if expert_weight is None else upcast_weight(expert_weight[:n])
        out = hidden.new_empty(rows, dtype=cdt)
        parts = []
        for a, b in _chunks(rows, chunk):
            zs = linear_logits(hidden[a:b], w)
            ze = None if expert_hidden is None else linear_logits(expert_hidden[a:b], we)
            val, saved = kernel.forward(shard, zs, ze, _opt_slice(aux, a, b))
            out[a:b] = val
            parts.append(saved)
            del zs, ze
        ctx.kernel, ctx.shard, ctx.chunk = kernel, shard, chunk
        ctx.reduce_hidden_grad = reduce_hidden_grad
        ctx.save_for_backward(hidden, weight, expert_hidden, expert_weight, aux,
                              *_gather_saved(parts))
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        hidden, weight, expert_hidden, expert_weight, aux, *saved = ctx.saved_tensors
        kernel, shard, n = ctx.kernel, ctx.shard, ctx.shard.n_valid
        need_h, need_w = ctx.needs_input_grad[4], ctx.needs_input_grad[5]
        cdt = compute_dtype(hidden.dtype)
        w = weight[:n]
        w32 = upcast_weight(w)
        we = None if expert_weight is None else upcast_weight(expert_weight[:n])
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=cdt, device=weight.device) if need_w else None
        grad_out = grad_out.to(cdt)
        for a, b in _chunks(hidden.shape[0], ctx.chunk):
            h = hidden[a:b]
            zs = linear_logits(h, w32)
            ze = None if expert_hidden is None else linear_logits(expert_hidden[a:b], we)
            gz = kernel.backward(shard, zs, ze, _opt_slice(aux, a, b),
                                 tuple(s[a:b] for s in saved), grad_out[a:b])
            del zs, ze
            _linear_grads(gz, h, w, a, b, grad_h, grad_w)
            del gz  # free before the next chunk's logits exist
        if need_h and ctx.reduce_hidden_grad:
            grad_h = shard.all_sum(grad_h)
        if need_w:
            grad_w = grad_w.to(weight.dtype)
        return None, None, None, None, grad_h, grad_w, None, None, None


class ChunkedLinearLoss(torch.autograd.Function):
    """Σ_t w_t · value_t from hidden states, with the gradient computed *during* forward.

    When the per-token loss weights ``w`` are known up front (the objective's normalisation
    does not depend on the KL), the gradient of the weighted sum can be accumulated chunk by
    chunk while the logits are live, so backward only rescales it: 4 matmuls per chunk
    instead of 6 (no recompute) and the same memory. Returns (loss, detached per-row values).
    """

    @staticmethod
    def forward(ctx, kernel: Kernel, shard: VocabShard, chunk: int, reduce_hidden_grad: bool,
                hidden: torch.Tensor, weight: torch.Tensor, expert_hidden: Optional[torch.Tensor],
                expert_weight: Optional[torch.Tensor], token_weights: torch.Tensor,
                grad_enabled: bool):
        # needs_input_grad ignores torch.no_grad(); the caller passes the grad mode in.
        need_h = grad_enabled and ctx.needs_input_grad[4]
        need_w = grad_enabled and ctx.needs_input_grad[5]
        cdt = compute_dtype(hidden.dtype)
        n, rows = shard.n_valid, hidden.shape[0]
        w = weight[:n]
        w32 = upcast_weight(w)
        we = None if expert_weight is None else upcast_weight(expert_weight[:n])
        tw = token_weights.to(cdt)
        out = hidden.new_empty(rows, dtype=cdt)
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=cdt, device=weight.device) if need_w else None
        for a, b in _chunks(rows, chunk):
            h = hidden[a:b]
            zs = linear_logits(h, w32)
            ze = None if expert_hidden is None else linear_logits(expert_hidden[a:b], we)
            val, saved = kernel.forward(shard, zs, ze, None)
            out[a:b] = val
            if need_h or need_w:
                gz = kernel.backward(shard, zs, ze, None, saved, tw[a:b])
                del zs, ze
                _linear_grads(gz, h, w, a, b, grad_h, grad_w)
                del gz
            else:
                del zs, ze
        if need_h and reduce_hidden_grad:
            grad_h = shard.all_sum(grad_h)
        # Kept on ctx, not via save_for_backward: they are intermediates, and backward scales
        # them in place (a copy of grad_W is [Vs, H], often the largest buffer of the op).
        ctx.grads = (grad_h, None if grad_w is None else grad_w.to(weight.dtype))
        ctx.mark_non_differentiable(out)
        return (out * tw).sum(), out

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, _grad_values: Optional[torch.Tensor]):
        if ctx.grads is None:
            raise RuntimeError("fused_vocab_parallel_kl_loss: backward can run only once "
                               "(its gradients are precomputed and scaled in place)")
        grad_h, grad_w = ctx.grads
        ctx.grads = None
        for g in (grad_h, grad_w):
            if g is not None:
                g.mul_(grad_loss.to(g.dtype))
        return None, None, None, None, grad_h, grad_w, None, None, None, None
