"""GRPO policy-gradient term with PPO clipping and truncated importance sampling.

Math contract (per assistant token t of rollout i; A_i from ``rewards.group_advantages``):

* Proximal log-prob: ℓ_old = ``old_logprobs`` (trainer recompute of the weights at the start
  of the step) if given, else ``behaviour_logprobs`` (the rollout engine's).
* Ratio r_t = exp(log π_θ(y_t) − ℓ_old,t).
* Clipped surrogate (asymmetric, "clip-higher"):
  ℓ_t = −min(r_t · A_i, clip(r_t, 1 − eps_low, 1 + eps_high) · A_i).
* Truncated importance sampling (only when ``old_logprobs`` is given and tis_cap > 0):
  w_t = min(exp(ℓ_old,t − ℓ_behaviour,t), C), stop-gradient, multiplies ℓ_t. It corrects
  that the tokens were sampled by the engine (different kernels, weights a few versions
  stale in the async pipeline) and not by the trainer's π_old. Without ``old_logprobs`` the
  engine gap is inside r_t and clipped by PPO instead; w_t = 1.
* Token mask: only assistant tokens (``loss_mask``); prompt and tool-output rows never count.
* Aggregation, ``pg_token_normalization``:
  "rollout": L = (1/N_rollouts) Σ_i (1/|o_i|) Σ_{t∈o_i} ℓ_t, |o_i| = assistant tokens of i;
  "global":  L = Σ_t ℓ_t / (assistant tokens in the step).

Deviations from the paper: the paper says "GRPO" without details; clip-higher, TIS and the
choice of aggregation are this project's (all configurable). No KL-to-reference term.
"""

from __future__ import annotations

import torch

from megatron_tg.config.objective import ObjectiveConfig
from megatron_tg.objectives.batch import PolicyBatch


def per_rollout_sum(values: torch.Tensor, rollout_index: torch.Tensor, num: int) -> torch.Tensor:
    """Σ of per-row values into their rollout; [N] → [num] (differentiable)."""
    return values.new_zeros(num).index_add(0, rollout_index, values)


def policy_gradient_term(logp: torch.Tensor, batch: PolicyBatch,
                         cfg: ObjectiveConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO loss for this micro-batch and its metrics (detached 0-dim tensors)."""
    mask = batch.loss_mask.to(logp.dtype)
    adv = batch.advantages.to(logp.dtype)[batch.rollout_index]
    behaviour = batch.behaviour_logprobs.to(logp.dtype)
    old = behaviour if batch.old_logprobs is None else batch.old_logprobs.to(logp.dtype)

    ratio = torch.exp(logp - old)
    clipped = ratio.clamp(1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)

    use_tis = batch.old_logprobs is not None and cfg.tis_cap > 0
    if use_tis:
        raw_w = torch.exp(old - behaviour).detach()
        weight = raw_w.clamp(max=cfg.tis_cap)
        per_token = per_token * weight
    per_token = per_token * mask

    num_rollouts = batch.advantages.shape[0]
    if cfg.pg_token_normalization == "rollout":
        if batch.rollout_assistant_tokens is not None:
            lengths = batch.rollout_assistant_tokens.to(logp.dtype)
        else:
            lengths = per_rollout_sum(mask, batch.rollout_index, num_rollouts)
        denom_rollouts = float(batch.num_rollouts or num_rollouts)
        sums = per_rollout_sum(per_token, batch.rollout_index, num_rollouts)
        loss = (sums / lengths.clamp(min=1.0)).sum() / max(denom_rollouts, 1.0)
    else:
        total = batch.num_assistant_tokens if batch.num_assistant_tokens is not None else mask.sum()
        loss = per_token.sum() / torch.as_tensor(total, dtype=logp.dtype).clamp(min=1.0)

    with torch.no_grad():
        n_tok = mask.sum().clamp(min=1.0)
        active = ((adv > 0) & (ratio > 1.0 + cfg.clip_eps_high)) | \
                 ((adv < 0) & (ratio < 1.0 - cfg.clip_eps_low))
        metrics = {
            "pg/clip_frac": (active.to(mask.dtype) * mask).sum() / n_tok,
            "pg/ratio_mean": (ratio * mask).sum() / n_tok,
        }
        if use_tis:
            metrics["pg/is_weight_mean"] = (weight * mask).sum() / n_tok
            # Raw (untruncated) max over assistant rows; weights are > 0, so masked rows → 0.
            metrics["pg/is_weight_max"] = (raw_w * mask).max() if raw_w.numel() else raw_w.new_zeros(())
            metrics["pg/is_frac_truncated"] = ((raw_w > cfg.tis_cap).to(mask.dtype) * mask).sum() / n_tok
        else:
            one = logp.new_ones(())
            metrics.update({"pg/is_weight_mean": one, "pg/is_weight_max": one,
                            "pg/is_frac_truncated": logp.new_zeros(())})
    return loss, metrics
