"""GRPO policy-gradient term with PPO clipping and truncated importance sampling.

Math contract (per assistant token t of rollout i; A_i from ``rewards.group_advantages``):

* Proximal log-prob: ℓ_old = ``old_logprobs`` if the batch carries them; otherwise, with
  ``old_logprobs="student"`` (default), the student's own log π_θ detached (exact when one
  optimizer step consumes the batch, the trainer's schedule: θ is still θ_old, so r_t = 1
  and only the gradient of r_t matters); with ``old_logprobs="behaviour"`` the engine's
  ``behaviour_logprobs`` (and no TIS).
* Ratio r_t = exp(log π_θ(y_t) − ℓ_old,t).
* Clipped surrogate (asymmetric, "clip-higher"):
  ℓ_t = −min(r_t · A_i, clip(r_t, 1 − eps_low, 1 + eps_high) · A_i).
* Importance correction (whenever ℓ_old is the trainer's and tis_cap > 0): the raw weight
  ρ_t = exp(ℓ_old,t − ℓ_behaviour,t) is stop-gradient and multiplies ℓ_t, as
  w_t = min(ρ_t, C) (``tis_mode="truncate"``) or w_t = ρ_t·[1/C ≤ ρ_t ≤ C] (``"mask"``).
  It corrects that the tokens were sampled by the engine (different kernels, MoE routing,
  weights a few versions stale in the async pipeline) and not by the trainer's π_old.
  With ``old_logprobs="behaviour"`` the engine gap is inside r_t and clipped by PPO
  instead; w_t = 1. So with the defaults the per-token gradient is −w_t·A_i·∇log π_θ(y_t).
* Token mask: only assistant tokens of the rollouts' own samples (``loss_mask`` and
  ``pg_mask``); prompt and tool-output rows and KL-only rows (hinted turns) never count.
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


def proximal_logprobs(logp: torch.Tensor, batch: PolicyBatch,
                      cfg: ObjectiveConfig) -> torch.Tensor | None:
    """ℓ_old per row, or None when the ratio is taken against the behaviour log-probs."""
    if batch.old_logprobs is not None:
        return batch.old_logprobs.to(logp.dtype)
    if cfg.old_logprobs == "student":
        return logp.detach()
    return None


def importance_weights(old: torch.Tensor, behaviour: torch.Tensor,
                       cfg: ObjectiveConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(raw ρ, applied weight w, outside-the-cap indicator) per row, all stop-gradient."""
    raw = torch.exp(old - behaviour).detach()
    if cfg.tis_mode == "mask":
        outside = (raw > cfg.tis_cap) | (raw < 1.0 / cfg.tis_cap)
        return raw, torch.where(outside, torch.zeros_like(raw), raw), outside
    return raw, raw.clamp(max=cfg.tis_cap), raw > cfg.tis_cap


def policy_gradient_term(logp: torch.Tensor, batch: PolicyBatch, cfg: ObjectiveConfig,
                         rows: dict[str, torch.Tensor] | None = None
                         ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO loss for this micro-batch and its metrics (detached 0-dim tensors).

    ``rows``, when given, receives ``is_weight`` [N]: the applied importance weight per row
    (1 without correction), for per-turn records."""
    mask = batch.policy_mask().to(logp.dtype)
    adv = batch.advantages.to(logp.dtype)[batch.rollout_index]
    behaviour = batch.behaviour_logprobs.to(logp.dtype)
    proximal = proximal_logprobs(logp, batch, cfg)
    old = behaviour if proximal is None else proximal

    ratio = torch.exp(logp - old)
    clipped = ratio.clamp(1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)

    use_tis = proximal is not None and cfg.tis_cap > 0
    if use_tis:
        raw_w, weight, outside = importance_weights(old, behaviour, cfg)
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

    if rows is not None:
        rows["is_weight"] = weight.detach() if use_tis else torch.ones_like(logp).detach()
    with torch.no_grad():
        metrics = {**_ratio_metrics(ratio, adv, mask, cfg),
                   **(_weight_metrics(raw_w, weight, outside, old - behaviour, mask) if use_tis
                      else _no_weight_metrics(logp))}
    return loss, metrics


def _ratio_metrics(ratio, adv, mask, cfg) -> dict[str, torch.Tensor]:
    n_tok = mask.sum().clamp(min=1.0)
    active = ((adv > 0) & (ratio > 1.0 + cfg.clip_eps_high)) | \
             ((adv < 0) & (ratio < 1.0 - cfg.clip_eps_low))
    return {"pg/clip_frac": (active.to(mask.dtype) * mask).sum() / n_tok,
            "pg/ratio_mean": (ratio * mask).sum() / n_tok}


def _weight_metrics(raw, weight, outside, log_raw, mask) -> dict[str, torch.Tensor]:
    """The distribution of the importance weights over assistant rows (raw ρ unless named
    otherwise). ``_max``/``_min`` keys are maxima/minima, the others means, when the trainer
    combines micro-batches and data-parallel ranks."""
    n_tok = mask.sum().clamp(min=1.0)
    on = mask > 0
    if not bool(on.any()):
        raw, log_raw = raw.new_ones(1), raw.new_zeros(1)
        on = torch.ones(1, dtype=torch.bool, device=raw.device)
    mean = (weight * mask).sum() / n_tok
    return {
        "pg/is_weight_mean": mean,  # the applied (truncated / masked) weight
        "pg/is_weight_std": (((weight - mean) ** 2) * mask).sum().div(n_tok).sqrt(),
        "pg/is_weight_max": raw[on].max(),
        "pg/is_weight_min": raw[on].min(),
        "pg/is_frac_truncated": (outside.to(mask.dtype) * mask).sum() / n_tok,
        # Mean |log ρ| = mean |log π_old − log π_behaviour|: the engine/trainer gap in nats.
        "pg/engine_logprob_gap": (log_raw.abs() * on).sum() / on.sum(),
    }


def _no_weight_metrics(logp) -> dict[str, torch.Tensor]:
    one = logp.new_ones(())
    return {"pg/is_weight_mean": one, "pg/is_weight_std": logp.new_zeros(()),
            "pg/is_weight_max": one, "pg/is_weight_min": one,
            "pg/is_frac_truncated": logp.new_zeros(())}
