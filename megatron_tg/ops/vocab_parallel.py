"""Per-token log-prob, entropy and KL over a vocabulary sharded across tensor-parallel ranks.

Layout: ``logits`` is this rank's shard ``[..., Vs]`` (Vs = padded V / TP) and rank r of
``group`` owns global ids ``[r·Vs, (r+1)·Vs)``: megatron's ``ColumnParallelLinear`` output layer
with ``parallel_output=True``. ``vocab_size`` is the true vocabulary; columns at or beyond it are
padding and get probability exactly 0 whatever they contain. ``group=None`` = no TP (the local
logits are the whole vocabulary; no ``torch.distributed`` needed).

The vocabulary is never gathered: each chunk of tokens costs one all-reduce(MAX) of the row
maxima and one all-reduce(SUM) of [rows, ≤3] partial sums (the JSD needs a second SUM; the
KL ops' optional ``diagnostics`` one more).
Backward passes issue no collective (the fused ones: one all-reduce of grad_hidden, see
:func:`fused_vocab_parallel_kl`). Results are per token, in ≥ fp32, shaped like the leading
dims of the input; they are the same on every rank of the group.

Chunking bounds the extra memory to a few ``chunk_size × Vs`` blocks: with Qwen3's V=151,936
at TP=4 and the default 1,024-token chunk, one fp32 block is 155 MB, against 4.98 GB for a
gathered fp32 [8192, V] tensor.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_tg.ops._chunked import ChunkedLinear, ChunkedLinearLoss, ChunkedLogits
from megatron_tg.ops._kernels import (RESCUE_THRESHOLD, DiagnosticKL, EntropyKernel, Kernel,
                                      LogProbKernel, kl_kernel)
from megatron_tg.ops._shard import VocabShard

DEFAULT_CHUNK_SIZE = 1024
KL_DIRECTIONS = ("reverse", "forward", "jsd")
Group = Optional[dist.ProcessGroup]


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _check_chunk(chunk_size: int) -> int:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return int(chunk_size)


def _kl_kernel(direction: str, beta: float, diagnostics: Optional[dict],
               rescue_threshold: float) -> Kernel:
    kernel = kl_kernel(direction, beta)
    return kernel if diagnostics is None else DiagnosticKL(kernel, rescue_threshold)


def _fill_diagnostics(diagnostics: Optional[dict], kernel: Kernel, lead: torch.Size) -> None:
    if diagnostics is not None:
        diagnostics.update({k: v.reshape(lead) for k, v in kernel.result().items()})


def _check_pair(student: torch.Tensor, expert: torch.Tensor, what: str) -> None:
    if student.shape != expert.shape:
        raise ValueError(f"student and expert {what} shapes differ: "
                         f"{tuple(student.shape)} vs {tuple(expert.shape)}")


def vocab_parallel_logprob(logits: torch.Tensor, target_ids: torch.Tensor, group: Group = None,
                           *, vocab_size: Optional[int] = None,
                           chunk_size: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    """log π(target_ids) per token from vocab-sharded ``logits [..., Vs]``; differentiable.

    ``target_ids [...]`` are global ids. An id outside ``[0, vocab_size)`` (e.g. an ignore
    index at a masked position) gives a meaningless value (``max − logsumexp``) and no target
    term in the gradient: mask such rows out of the loss.
    """
    lead = logits.shape[:-1]
    if target_ids.shape != lead:
        raise ValueError(f"target_ids shape {tuple(target_ids.shape)} != logits' leading {tuple(lead)}")
    shard = VocabShard.build(logits.shape[-1], group, vocab_size)
    out = ChunkedLogits.apply(LogProbKernel(), shard, _check_chunk(chunk_size), _rows(logits),
                              None, target_ids.reshape(-1).long())
    return out.reshape(lead)


def vocab_parallel_entropy(logits: torch.Tensor, group: Group = None, *,
                           vocab_size: Optional[int] = None,
                           chunk_size: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    """Entropy −Σ p log p per token (nats) from vocab-sharded logits; differentiable."""
    shard = VocabShard.build(logits.shape[-1], group, vocab_size)
    out = ChunkedLogits.apply(EntropyKernel(), shard, _check_chunk(chunk_size), _rows(logits),
                              None, None)
    return out.reshape(logits.shape[:-1])


def vocab_parallel_kl(student_logits: torch.Tensor, expert_logits: torch.Tensor,
                      group: Group = None, *, vocab_size: Optional[int] = None,
                      direction: str = "reverse", beta: float = 0.5,
                      chunk_size: int = DEFAULT_CHUNK_SIZE, diagnostics: Optional[dict] = None,
                      rescue_threshold: float = RESCUE_THRESHOLD) -> torch.Tensor:
    """Full-vocabulary divergence per token between student and (stop-gradient) expert.

    ``direction``:
      * ``"reverse"``: KL(π_s ‖ π_e), the paper's equation (mode-seeking);
      * ``"forward"``: KL(π_e ‖ π_s) (mass-covering);
      * ``"jsd"``: β·KL(π_e ‖ m) + (1−β)·KL(π_s ‖ m) with m = β·π_e + (1−β)·π_s.
        β→0 behaves like forward KL (JSD/β → KL(π_e ‖ π_s)), β→1 like reverse; β = 0 and
        β = 1 are dispatched to exactly forward / reverse KL (not to the vanishing limit).

    Only ``student_logits`` receives a gradient; ``expert_logits`` is detached here.

    ``diagnostics``: a dict to receive, per token and detached, ``rescue_mass`` (the expert's
    probability on tokens the student gives < ``rescue_threshold``), ``grad_norm_reverse``
    and ``grad_norm_forward`` (‖∂KL/∂z_student‖₂ of each KL direction, whatever ``direction``
    the value is); costs one extra all-reduce per chunk (:class:`~._kernels.DiagnosticKL`).
    None (default): nothing extra is computed.
    """
    _check_pair(student_logits, expert_logits, "logits")
    shard = VocabShard.build(student_logits.shape[-1], group, vocab_size)
    kernel = _kl_kernel(direction, beta, diagnostics, rescue_threshold)
    out = ChunkedLogits.apply(kernel, shard, _check_chunk(chunk_size),
                              _rows(student_logits), _rows(expert_logits.detach()), None)
    _fill_diagnostics(diagnostics, kernel, student_logits.shape[:-1])
    return out.reshape(student_logits.shape[:-1])


_FUSED_GRAD_NOTE = """
    Gradient of the hidden states under tensor parallelism. Each rank only holds Vs of the
    output layer's rows, so its grad_hidden is a partial sum; the true gradient is the sum
    over the TP group. With ``reduce_hidden_grad=True`` (default) this op all-reduces it in
    backward, which is right when ``hidden`` is the *replicated* output-layer input (no
    sequence parallelism: the final norm's output, identical on all TP ranks). Do not also
    wrap it in megatron's ``copy_to_tensor_model_parallel_region`` (that would reduce twice).
    With sequence parallelism, gather the sequence-sharded hidden states with
    ``gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True)`` (whose
    backward reduce-scatters, i.e. already sums over TP) and pass
    ``reduce_hidden_grad=False``. The weight gradient is per shard and never reduced over TP.
"""


def fused_vocab_parallel_logprob(hidden: torch.Tensor, weight_shard: torch.Tensor,
                                 target_ids: torch.Tensor, group: Group = None, *,
                                 vocab_size: Optional[int] = None,
                                 chunk_size: int = DEFAULT_CHUNK_SIZE,
                                 reduce_hidden_grad: bool = True) -> torch.Tensor:
    """log π(target) from ``hidden [..., H]`` and the output weight shard ``[Vs, H]``.

    Logits are formed chunk by chunk and recomputed in backward; grads flow to ``hidden``
    and ``weight_shard``.
    """
    lead = hidden.shape[:-1]
    if target_ids.shape != lead:
        raise ValueError(f"target_ids shape {tuple(target_ids.shape)} != hidden's leading {tuple(lead)}")
    shard = VocabShard.build(weight_shard.shape[0], group, vocab_size)
    out = ChunkedLinear.apply(LogProbKernel(), shard, _check_chunk(chunk_size), reduce_hidden_grad,
                              _rows(hidden), weight_shard, None, None,
                              target_ids.reshape(-1).long())
    return out.reshape(lead)


def fused_vocab_parallel_entropy(hidden: torch.Tensor, weight_shard: torch.Tensor,
                                 group: Group = None, *, vocab_size: Optional[int] = None,
                                 chunk_size: int = DEFAULT_CHUNK_SIZE,
                                 reduce_hidden_grad: bool = True) -> torch.Tensor:
    """Entropy per token from hidden states and the output weight shard (see the logprob)."""
    shard = VocabShard.build(weight_shard.shape[0], group, vocab_size)
    out = ChunkedLinear.apply(EntropyKernel(), shard, _check_chunk(chunk_size), reduce_hidden_grad,
                              _rows(hidden), weight_shard, None, None, None)
    return out.reshape(hidden.shape[:-1])


def _kl_setup(weight_shard, expert_weight_shard, group, vocab_size, direction, beta,
              diagnostics, rescue_threshold):
    """What both fused KL entry points start with: the expert's output weights (the
    student's own unless given, same shape), the vocabulary shard and the KL kernel."""
    expert_w = weight_shard if expert_weight_shard is None else expert_weight_shard
    if expert_w.shape != weight_shard.shape:
        raise ValueError(f"expert_weight_shard shape {tuple(expert_w.shape)} != "
                         f"weight_shard {tuple(weight_shard.shape)}")
    shard = VocabShard.build(weight_shard.shape[0], group, vocab_size)
    return expert_w, shard, _kl_kernel(direction, beta, diagnostics, rescue_threshold)


def fused_vocab_parallel_kl(student_hidden: torch.Tensor, expert_hidden: torch.Tensor,
                            weight_shard: torch.Tensor, group: Group = None, *,
                            vocab_size: Optional[int] = None, direction: str = "reverse",
                            beta: float = 0.5, chunk_size: int = DEFAULT_CHUNK_SIZE,
                            expert_weight_shard: Optional[torch.Tensor] = None,
                            reduce_hidden_grad: bool = True, diagnostics: Optional[dict] = None,
                            rescue_threshold: float = RESCUE_THRESHOLD) -> torch.Tensor:
    """:func:`vocab_parallel_kl` from hidden states ``[..., H]``, never materialising [T, Vs].

    The expert's logits are ``expert_hidden @ expert_weight_shardᵀ`` (default: the student's
    ``weight_shard``, the paper's shared-weight expert); both are stop-gradient. Grads flow
    to ``student_hidden`` and ``weight_shard`` only. ``diagnostics``: as in
    :func:`vocab_parallel_kl`.
    """
    _check_pair(student_hidden, expert_hidden, "hidden")
    expert_w, shard, kernel = _kl_setup(weight_shard, expert_weight_shard, group, vocab_size,
                                        direction, beta, diagnostics, rescue_threshold)
    out = ChunkedLinear.apply(kernel, shard, _check_chunk(chunk_size),
                              reduce_hidden_grad, _rows(student_hidden), weight_shard,
                              _rows(expert_hidden.detach()), expert_w.detach(), None)
    _fill_diagnostics(diagnostics, kernel, student_hidden.shape[:-1])
    return out.reshape(student_hidden.shape[:-1])


def fused_vocab_parallel_kl_loss(student_hidden: torch.Tensor, expert_hidden: torch.Tensor,
                                 weight_shard: torch.Tensor, token_weights: torch.Tensor,
                                 group: Group = None, *, vocab_size: Optional[int] = None,
                                 direction: str = "reverse", beta: float = 0.5,
                                 chunk_size: int = DEFAULT_CHUNK_SIZE,
                                 expert_weight_shard: Optional[torch.Tensor] = None,
                                 reduce_hidden_grad: bool = True,
                                 diagnostics: Optional[dict] = None,
                                 rescue_threshold: float = RESCUE_THRESHOLD
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Σ_t token_weights_t · D_t, D.detach())`` for per-token weights known before the call.

    Same divergence and layout as :func:`fused_vocab_parallel_kl`, but the gradient of the
    weighted sum is accumulated during forward while each chunk's logits are live, so backward
    does not recompute them (4 output-layer matmuls per chunk instead of 6). ``token_weights``
    is treated as a constant (no gradient). When the model is not in a grad-requiring context
    no gradient work is done. ``diagnostics``: as in :func:`vocab_parallel_kl`.
    """
    _check_pair(student_hidden, expert_hidden, "hidden")
    rows = _rows(student_hidden)
    if token_weights.shape != student_hidden.shape[:-1]:
        raise ValueError(f"token_weights shape {tuple(token_weights.shape)} != hidden's leading "
                         f"{tuple(student_hidden.shape[:-1])}")
    expert_w, shard, kernel = _kl_setup(weight_shard, expert_weight_shard, group, vocab_size,
                                        direction, beta, diagnostics, rescue_threshold)
    loss, values = ChunkedLinearLoss.apply(
        kernel, shard, _check_chunk(chunk_size), reduce_hidden_grad, rows,
        weight_shard, _rows(expert_hidden.detach()), expert_w.detach(),
        token_weights.detach().reshape(-1), torch.is_grad_enabled())
    _fill_diagnostics(diagnostics, kernel, student_hidden.shape[:-1])
    return loss, values.reshape(student_hidden.shape[:-1])


for _fn in (fused_vocab_parallel_logprob, fused_vocab_parallel_entropy, fused_vocab_parallel_kl,
            fused_vocab_parallel_kl_loss):
    _fn.__doc__ = (_fn.__doc__ or "") + _FUSED_GRAD_NOTE
