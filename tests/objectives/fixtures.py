"""Tiny hand-built micro-batches for the objective tests."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from megatron_tg.config.objective import ObjectiveConfig
from megatron_tg.objectives import PolicyBatch, build_gate


def logits_as_hidden(logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """``hidden`` and ``output_weight`` of a batch whose logits are ``logits`` [N, V]: the output
    weight is the identity, so the loss's fused ops compute exactly ``logits`` (x·1 + 0s) and
    the gradient on ``hidden`` is the logits' gradient. Tests state logits this way."""
    return dict(hidden=logits, output_weight=torch.eye(logits.shape[-1], dtype=logits.dtype))


def rollout_batch(lengths: Sequence[int], *, vocab: int = 7, seed: int = 0,
                  failed: Optional[Sequence[Sequence[int]]] = None,
                  thinking: Optional[Sequence[Sequence[int]]] = None,
                  prompt_rows: Sequence[int] = (), advantages: Optional[Sequence[float]] = None,
                  cfg: Optional[ObjectiveConfig] = None, dtype=torch.float64,
                  logits: Optional[torch.Tensor] = None,
                  expert_logits_full: Optional[torch.Tensor] = None) -> PolicyBatch:
    """Rollout i has ``lengths[i]`` rows; ``failed[i]`` / ``thinking[i]`` list row offsets in it.

    ``prompt_rows`` are global row numbers that are not assistant tokens. The logits are the
    batch's ``hidden`` through an identity output weight (:func:`logits_as_hidden`); the
    expert's are compacted to the gated rows, as the trainer would hand them over.
    """
    cfg = cfg or ObjectiveConfig()
    gen = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    rollout_index = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    failed_mask = torch.zeros(n, dtype=torch.bool)
    thinking_mask = torch.zeros(n, dtype=torch.bool)
    for i, rows in enumerate(failed or []):
        failed_mask[[starts[i] + r for r in rows]] = True
    for i, rows in enumerate(thinking or []):
        thinking_mask[[starts[i] + r for r in rows]] = True
    loss_mask = torch.ones(n, dtype=torch.bool)
    loss_mask[list(prompt_rows)] = False
    if logits is None:
        logits = torch.randn(n, vocab, generator=gen, dtype=dtype) * 2
    if expert_logits_full is None:
        expert_logits_full = torch.randn(n, vocab, generator=gen, dtype=dtype) * 2
    target = torch.randint(0, vocab, (n,), generator=gen)
    behaviour = logits.log_softmax(-1).gather(1, target[:, None]).squeeze(1) + \
        0.1 * torch.randn(n, generator=gen, dtype=dtype)
    adv = torch.tensor(advantages if advantages is not None
                       else torch.randn(len(lengths), generator=gen).tolist(), dtype=dtype)
    gate = build_gate(loss_mask, failed_mask, thinking_mask, cfg)
    gate_index = (gate > 0).nonzero().squeeze(1)
    return PolicyBatch(
        target_ids=target, behaviour_logprobs=behaviour, loss_mask=loss_mask,
        rollout_index=rollout_index, advantages=adv, gate=gate,
        **logits_as_hidden(logits.clone().requires_grad_(True)), gate_index=gate_index,
        expert_hidden=expert_logits_full[gate_index].clone(), vocab_size=vocab,
        thinking_mask=thinking_mask if thinking else None,
    )
