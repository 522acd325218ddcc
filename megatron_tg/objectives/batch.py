"""The loss's input: one packed micro-batch, flattened to the positions that carry a loss.

Layout. The loss never sees logits: it takes the hidden states ``[N, H]`` that enter the
output layer at the loss rows and this TP rank's output-weight shard ``[Vs, H]`` (Vs = padded
vocabulary / TP), and the fused vocab-parallel ops compute the logits chunk by chunk. Position
s predicts the token at s+1. The loss only needs rows whose *predicted* token is an assistant
token (thinking or tool call); those N rows are selected once, flattening the first two dims
in whatever layout the tensor has (row i·D1 + j of a ``[D0, D1, *]`` tensor; for a contiguous
tensor that reshape is a view, so selecting rows is one gather). The mask must be in the same
layout as the tensor:

    rows = flat_positions(predicts_assistant_mask)   # [N] long, from a [S, B] (or [B, S]) mask
    hidden = select_rows(hidden_sbh, rows)            # [N, H]
    target_ids = select_rows(next_tokens, rows)       # [N]: the token each position predicts

Every per-token field below is indexed by those N rows. Rollouts are numbered 0..R-1 within
the micro-batch; ``rollout_index`` maps a row to its rollout, ``advantages`` is per rollout.

Expert. The expert is needed only where ``gate > 0``: ``gate_index`` lists those G rows (in
increasing order) and ``expert_hidden`` holds the expert's output-layer input at them,
compacted to ``[G, H]``. The expert sequence differs from
the student's (feedback inserted), so the trainer maps each gated student row to the expert
position predicting the same token; that mapping is the trainer's, not the loss's.

Normalisation across micro-batches. Rollout means and the rollout average must use counts of
the whole optimizer step. When a rollout is split across micro-batches, or gradients are
accumulated, pass ``rollout_assistant_tokens`` / ``rollout_gated_tokens`` (per local rollout,
over the whole rollout), ``num_rollouts`` (rollouts in the accumulation window on this data-
parallel rank) and the ``num_*_tokens`` totals; by default they are counted in this batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


def flat_positions(mask: torch.Tensor) -> torch.Tensor:
    """Flat indices ``i·D1 + j`` of the True entries of a [D0, D1] mask."""
    return mask.reshape(-1).nonzero().squeeze(1)


def select_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows of a ``[D0, D1, *]`` tensor at flat positions ``rows`` (differentiable)."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])[rows]


@dataclass
class PolicyBatch:
    """One micro-batch in the flat N-row layout described in the module docstring."""

    target_ids: torch.Tensor
    """[N] long: the token each row predicts (global vocabulary id)."""
    behaviour_logprobs: torch.Tensor
    """[N]: log-prob of target_ids under the rollout engine's policy when it sampled."""
    loss_mask: torch.Tensor
    """[N] bool: assistant tokens (thinking + tool calls). Prompt/tool-output rows must be False."""
    rollout_index: torch.Tensor
    """[N] long in [0, R): the rollout of each row."""
    advantages: torch.Tensor
    """[R]: group-relative advantage per rollout (see ``rewards.group_advantages``)."""
    gate: torch.Tensor
    """[N] float: 1 where the KL applies (``guidance.build_gate``), else 0."""

    hidden: Optional[torch.Tensor] = None
    """[N, H]: student output-layer input (the logits are never materialised). None until the
    step's forward pass: the micro-batch builder makes the rest of the batch before it."""
    output_weight: Optional[torch.Tensor] = None
    """[Vs, H]: output-layer weight shard, this TP rank's vocabulary shard."""

    gate_index: Optional[torch.Tensor] = None
    """[G] long: rows with gate > 0, increasing. Derived from ``gate`` when None."""
    expert_hidden: Optional[torch.Tensor] = None
    """[G, H]: expert output-layer input at ``gate_index`` (stop-gradient)."""
    expert_output_weight: Optional[torch.Tensor] = None
    """[Vs, H]: the expert's output weight when it is not the student's (frozen/EMA expert)."""

    old_logprobs: Optional[torch.Tensor] = None
    """[N]: log-probs of the pre-update weights, when the caller computed them (e.g. a batch
    consumed by several optimizer steps). None: ``ObjectiveConfig.old_logprobs`` decides (by
    default the student's own log-probs, detached: exact for one optimizer step per batch)."""
    vocab_size: Optional[int] = None
    """True vocabulary size (columns beyond it are padding)."""

    rollout_assistant_tokens: Optional[torch.Tensor] = None
    """[R]: assistant tokens of each rollout over the whole step (default: counted here)."""
    rollout_gated_tokens: Optional[torch.Tensor] = None
    """[R]: Σ gate of each rollout over the whole step (default: counted here)."""
    num_rollouts: Optional[float] = None
    """Denominator of the rollout average (default: R)."""
    num_assistant_tokens: Optional[float] = None
    """Step total of assistant tokens, for token-level ("global") GRPO (default: counted here)."""
    num_gated_tokens: Optional[float] = None
    """Step total of Σ gate, for kl_token_normalization="global" (default: counted here)."""
    pg_mask: Optional[torch.Tensor] = None
    """[N] bool: rows of the rollouts' own samples, the only ones the GRPO term and the policy
    metrics see (False on KL-only rows, e.g. hinted turns). None: every ``loss_mask`` row."""

    thinking_mask: Optional[torch.Tensor] = None
    """[N] bool: rows predicting a thinking token. Read only by the KL's metrics (its split
    between thinking and action rows); None: not split."""

    def policy_mask(self) -> torch.Tensor:
        """``loss_mask`` restricted to ``pg_mask``: the rows the GRPO term averages over."""
        return self.loss_mask if self.pg_mask is None else self.loss_mask & self.pg_mask

    @property
    def num_rows(self) -> int:
        return int(self.target_ids.shape[0])

    def resolved_gate_index(self) -> torch.Tensor:
        if self.gate_index is not None:
            return self.gate_index
        return (self.gate > 0).nonzero().squeeze(1)

    def validate(self) -> None:
        """Shape checks that catch layout mistakes early (cheap; no device sync beyond sizes)."""
        n = self.num_rows
        for name in ("behaviour_logprobs", "loss_mask", "rollout_index", "gate") + (
                ("pg_mask",) if self.pg_mask is not None else ()) + (
                ("thinking_mask",) if self.thinking_mask is not None else ()):
            t = getattr(self, name)
            if t.shape != (n,):
                raise ValueError(f"PolicyBatch.{name} must be [{n}], got {tuple(t.shape)}")
        if self.old_logprobs is not None and self.old_logprobs.shape != (n,):
            raise ValueError(f"PolicyBatch.old_logprobs must be [{n}], got {tuple(self.old_logprobs.shape)}")
        if self.hidden is None:
            raise ValueError("PolicyBatch needs the student's hidden states")
        if self.output_weight is None:
            raise ValueError("PolicyBatch.hidden needs output_weight")
        if self.hidden.shape[0] != n:
            raise ValueError(f"PolicyBatch student rows {self.hidden.shape[0]} != target_ids {n}")
        if self.advantages.ndim != 1:
            raise ValueError(f"PolicyBatch.advantages must be [R], got {tuple(self.advantages.shape)}")
