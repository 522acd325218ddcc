"""Per-criterion judge scores → scalar reward per rollout → group-relative advantage.

Math contract:

* Reward (paper §3): R(τ) = Σ_i w_i · R_i(τ), R_i ∈ {0, 1} the judge's criteria, w_i from
  ``criterion_weights`` (missing names weigh 1). In mode "opsd" every criterion not in
  ``primary_criteria`` gets w_i = 0 (the style criteria then act only through the KL). The
  config's empty default means "the rubric's primary flags": the trainer resolves it
  (``sampling.rollouts.primary_criteria``) before rewards are combined, and an empty list in
  mode "opsd" is refused here (it would make every reward 0).
* With ``style_reward="primary_gated"`` the non-primary terms count only when every primary
  criterion passes: R(τ) = Σ_{i ∈ P} w_i R_i + (Π_{i ∈ P} R_i) · Σ_{i ∉ P} w_i R_i. A policy
  then cannot buy style reward with the task (on the paper suite's toy environment GRPO, under
  the plain sum, learned to skip the search and write ``Answer: <guess>``: the style criteria
  paid as much as the task). Needs primary criteria, like "opsd".
* Advantage (GRPO): for rollout j of group g,
  A_j = (R_j − mean_g R) / (std_g R + adv_eps)  if ``advantage_std_norm``, else R_j − mean_g R.
  std_g is the *population* std (divide by n, not n−1), so a group of one rollout or a group
  of equal rewards gives A = 0 exactly instead of NaN; adv_eps (default 1e-6) only guards the
  division and is added to the std, not inside the square root.
* The advantage is per rollout and broadcast to all of the rollout's assistant tokens (outcome
  reward; no per-turn credit assignment).
"""

from __future__ import annotations

from typing import Sequence

import torch

from megatron_tg.config.objective import ObjectiveConfig
from megatron_tg.objectives.modes import mode_switches


def criterion_weight_vector(criteria: Sequence[str], cfg: ObjectiveConfig) -> torch.Tensor:
    """w_i for each criterion name, after the mode's switch (opsd: primary criteria only)."""
    primary_only = mode_switches(cfg).primary_rewards_only
    if primary_only and not cfg.primary_criteria:
        raise ValueError("mode 'opsd' rewards only primary criteria, and none are set "
                         "(objective.primary_criteria, resolved from the rubric's primary flags)")
    weights = []
    for name in criteria:
        w = float(cfg.criterion_weights.get(name, 1.0))
        if primary_only and name not in cfg.primary_criteria:
            w = 0.0
        weights.append(w)
    return torch.tensor(weights, dtype=torch.float64)


def combine_rewards(scores: torch.Tensor, criteria: Sequence[str],
                    cfg: ObjectiveConfig) -> torch.Tensor:
    """scores [R, C] (column i = criterion ``criteria[i]``) → R(τ) [R] in float64."""
    if scores.ndim != 2 or scores.shape[1] != len(criteria):
        raise ValueError(f"scores must be [rollouts, {len(criteria)}], got {tuple(scores.shape)}")
    w = criterion_weight_vector(criteria, cfg).to(scores.device)
    s = scores.to(torch.float64)
    if cfg.style_reward == "sum":
        return s @ w
    if not cfg.primary_criteria:
        raise ValueError("objective.style_reward='primary_gated' needs primary criteria "
                         "(objective.primary_criteria, resolved from the rubric's primary flags)")
    missing = [n for n in cfg.primary_criteria if n not in criteria]
    if missing:
        raise ValueError(f"primary criteria {missing} are not among the scored criteria {list(criteria)}")
    is_primary = torch.tensor([n in cfg.primary_criteria for n in criteria], device=scores.device)
    task_passed = s[:, is_primary].prod(dim=1)
    return s[:, is_primary] @ w[is_primary] + task_passed * (s[:, ~is_primary] @ w[~is_primary])


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor,
                     cfg: ObjectiveConfig) -> torch.Tensor:
    """Group-relative advantages [R] (float32) from rewards [R] and any integer group ids."""
    if rewards.shape != group_ids.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids "
                         f"{tuple(group_ids.shape)} must have the same shape")
    r = rewards.to(torch.float64)
    _, inv = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inv.max()) + 1 if inv.numel() else 0
    count = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(0, inv, torch.ones_like(r))
    mean = torch.zeros_like(count).index_add_(0, inv, r) / count
    centred = r - mean[inv]
    if not cfg.advantage_std_norm:
        return centred.float()
    var = torch.zeros_like(count).index_add_(0, inv, centred.square()) / count
    return (centred / (var.sqrt()[inv] + cfg.adv_eps)).float()
