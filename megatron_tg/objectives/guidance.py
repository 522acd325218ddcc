"""Failure-gated full-vocabulary KL to the feedback-conditioned expert (targeted guidance).

Math contract (paper §4, eq. for L(θ)):

* Estimator: per assistant token t, the exact full-vocabulary divergence
  D_t = D(π_θ(·|s_t), sg π_e(·|s_t, f)) computed on the sharded vocabulary
  (:func:`megatron_tg.ops.fused_vocab_parallel_kl_loss`), D = KL(π_θ ‖ π_e) ("reverse", the paper's),
  KL(π_e ‖ π_θ) ("forward") or the β-JSD ("jsd"); ``kl_direction``. No sampling estimator.
  The expert is stop-gradient: its logits are detached and receive no gradient. The loss is
  written as Σ_t w_t D_t with weights from :func:`kl_token_weights`; the fused op works from
  the hidden states, folds w into its gradient and never materialises logits.
* Gate g_t ∈ {0, 1} (:func:`build_gate`): 1 on assistant tokens of turns that failed ≥1
  criterion (mode "tg"); of every assistant turn ("always_on", "opsd"); thinking tokens get
  0 unless thinking is distilled (``distill_thinking`` and mode != "no_thinking"); the other
  tokens get 0 when ``distill_actions`` is off (the thinking-only KL).
* Token normalisation, ``kl_token_normalization`` (default "rollout_gated"):
  per rollout i, K_i = Σ_{t∈i} g_t D_t / n_i with n_i = Σ_{t∈i} g_t ("rollout_gated") or
  n_i = |assistant tokens of i| ("rollout_assistant"); K_i = 0 when n_i = 0. Then
  L_KL = (1/N_rollouts) Σ_i K_i over *all* rollouts (the GRPO term's denominator).
  "global": L_KL = Σ_t g_t D_t / Σ_t g_t over the step (no per-rollout averaging).
* ``kl_action_weight`` a ≠ 1: within each rollout, a gated action row (outside thinking)
  weighs a times a gated thinking row, the rollout's Σ w_t unchanged.
* The term enters the loss as λ · L_KL (λ = ``kl_coef``, possibly lowered by the entropy
  guard). When no token is gated the term is *absent* (not 0·something), so the loss equals
  the GRPO loss bitwise, as the paper's unbiasedness argument requires.

Deviations from the paper: the paper sums over failing turns t ∈ F; here each rollout's sum is
divided by its (gated) token count so a long failing turn cannot dominate, then averaged over
rollouts; the expert context may carry earlier turns' feedback too (``expert_sequence``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_tg.config.objective import ObjectiveConfig
from megatron_tg.objectives.batch import PolicyBatch
from megatron_tg.objectives.grpo import per_rollout_sum
from megatron_tg.objectives.modes import mode_switches
from megatron_tg.ops import fused_vocab_parallel_kl_loss


def build_gate(loss_mask: torch.Tensor, failed_turn_mask: torch.Tensor,
               thinking_mask: Optional[torch.Tensor], cfg: ObjectiveConfig) -> torch.Tensor:
    """Per-row KL gate (float 0/1) from the rollout's structure and the mode.

    ``failed_turn_mask`` marks rows of agent turns that failed ≥1 criterion; ``thinking_mask``
    marks thinking-token rows (None = no thinking tokens). The trainer calls this before the
    expert forward pass, so the expert is only evaluated where the gate is 1.
    """
    sw = mode_switches(cfg)
    gate = loss_mask.bool()
    if not sw.kl:
        gate = torch.zeros_like(gate)
    elif sw.failing_turns_only:
        gate = gate & failed_turn_mask.bool()
    if thinking_mask is not None and not sw.kl_on_thinking:
        gate = gate & ~thinking_mask.bool()
    if not sw.kl_on_actions:  # thinking-only KL: no thinking mask means no thinking row
        gate = gate & (thinking_mask.bool() if thinking_mask is not None else torch.zeros_like(gate))
    return gate.float()


def kl_token_weights(batch: PolicyBatch, cfg: ObjectiveConfig, gate_index: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    """w_t for the G gated rows such that L_KL = Σ_t w_t D_t (the normalisation above).

    The weights do not depend on D, so the fused op can fold them into its gradient.
    """
    mask = batch.loss_mask.to(dtype)
    # Gate re-masked by loss_mask: a gate on a non-assistant row is a caller bug that must
    # not leak prompt/tool-output tokens into the loss.
    gate = batch.gate.to(dtype) * mask
    num_rollouts = batch.advantages.shape[0]
    if cfg.kl_token_normalization == "global":
        total = batch.num_gated_tokens if batch.num_gated_tokens is not None else gate.sum()
        return _action_weighted(batch, cfg, gate_index,
                                gate[gate_index] / torch.as_tensor(total, dtype=dtype).clamp(min=1e-12))
    if cfg.kl_token_normalization == "rollout_gated":
        denom = batch.rollout_gated_tokens
        if denom is None:
            denom = per_rollout_sum(gate, batch.rollout_index, num_rollouts)
    else:
        denom = batch.rollout_assistant_tokens
        if denom is None:  # the rollout's own assistant tokens (not its hinted turns')
            denom = per_rollout_sum(batch.policy_mask().to(dtype), batch.rollout_index, num_rollouts)
    denom = denom.to(dtype)[batch.rollout_index[gate_index]]
    rollouts = float(max(batch.num_rollouts or num_rollouts, 1))
    # A gated row implies its rollout's count is > 0; the clamp only guards bad step totals.
    return _action_weighted(batch, cfg, gate_index,
                            gate[gate_index] / denom.clamp(min=1e-12) / rollouts)


def _action_weighted(batch: PolicyBatch, cfg: ObjectiveConfig, gate_index: torch.Tensor,
                     w: torch.Tensor) -> torch.Tensor:
    """``kl_action_weight`` a: action rows' weights times a, then each rollout's weights scaled
    back to their sum before (a rollout's rows are all in one micro-batch, so this is exact)."""
    a = cfg.kl_action_weight
    if a == 1.0 or batch.thinking_mask is None:
        return w
    mult = torch.where(batch.thinking_mask[gate_index], 1.0, a).to(w.dtype)
    r = batch.rollout_index[gate_index]
    n = batch.advantages.shape[0]
    before = torch.zeros(n, dtype=w.dtype, device=w.device).index_add_(0, r, w)
    after = torch.zeros(n, dtype=w.dtype, device=w.device).index_add_(0, r, w * mult)
    return w * mult * (before / after.clamp(min=1e-30))[r]


def _step_token_mean(batch: PolicyBatch, gate_w: torch.Tensor):
    """x [G] -> a micro-batch value whose rollout-weighted mean over the step's micro-batches
    (the trainer's aggregation: Σ_mb v·R_mb / R_step) is the mean of x over the step's gated
    tokens. Without step totals: the mean over this batch's gated rows."""
    local_r = batch.advantages.shape[0]
    if batch.num_gated_tokens is not None and batch.num_rollouts is not None and local_r > 0:
        scale = float(batch.num_rollouts) / local_r / max(float(batch.num_gated_tokens), 1e-12)
    else:
        scale = 1.0 / max(float(gate_w.sum()), 1e-12)
    return lambda x: (x.detach() * gate_w).sum() * scale


def _thinking_split(kl: torch.Tensor, gate_w: torch.Tensor, weights: torch.Tensor,
                    thinking: torch.Tensor) -> dict[str, torch.Tensor]:
    """Where the KL sits: on the gated rows predicting thinking tokens vs the others (the
    actions: tool calls, answers). ``kl/weight_frac_thinking`` is the share of the term's
    weight Σ w_t on thinking rows, i.e. of the gradient's budget before the divergence's own
    size; ``kl/frac_gated_thinking`` the share of gated rows; the two means are per row."""
    th = thinking.to(gate_w.dtype) * gate_w
    act = (1 - thinking.to(gate_w.dtype)) * gate_w
    out = {"kl/frac_gated_thinking": th.sum() / gate_w.sum().clamp(min=1e-12),
           "kl/weight_frac_thinking": (weights * th).sum() / (weights * gate_w).sum().clamp(min=1e-30)}
    if bool(th.sum() > 0):
        out["kl/mean_gated_thinking"] = (kl * th).sum() / th.sum()
    if bool(act.sum() > 0):
        out["kl/mean_gated_action"] = (kl * act).sum() / act.sum()
    return out


RESCUE_ROW = 0.5
"""A gated row "needs rescue" when the expert puts at least this much mass on tokens the
student gives < ``kl_rescue_threshold``."""


def _rescue_extrema(diag: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """On the rows that need rescue: the largest reverse-KL and the smallest forward-KL
    logit-gradient norm (extrema, so the trainer combines micro-batches by max / min), and
    the largest rescue mass of the batch. Absent (rescue rows) / NaN-free by construction."""
    mass = diag["rescue_mass"]
    out = {"kl/rescue_mass_max": mass.max()}
    rescue = mass >= RESCUE_ROW
    if bool(rescue.any()):
        out["kl/rescue_grad_reverse_max"] = diag["grad_norm_reverse"][rescue].max()
        out["kl/rescue_grad_forward_min"] = diag["grad_norm_forward"][rescue].min()
    return out


def gated_kl_term(batch: PolicyBatch, cfg: ObjectiveConfig, group: Optional[dist.ProcessGroup] = None,
                  *, reduce_hidden_grad: bool = True,
                  rows: Optional[dict[str, torch.Tensor]] = None
                  ) -> tuple[Optional[torch.Tensor], dict[str, torch.Tensor]]:
    """(L_KL or None when no row is gated, metrics). λ is applied by the caller.

    ``rows``, when given, receives ``kl`` [N]: the divergence of each gated row (0 elsewhere),
    detached, for per-turn records."""
    gate_index = batch.resolved_gate_index()
    dtype = torch.promote_types(batch.hidden.dtype, torch.float32)
    own = batch.policy_mask().to(dtype)  # the rollouts' own rows (hinted rows are all gated)
    metrics = {"kl/frac_gated": (batch.gate.to(dtype) * own).sum() / own.sum().clamp(min=1.0)}
    g = gate_index.numel()
    if g == 0:
        metrics["kl/mean_gated"] = torch.zeros((), dtype=dtype)
        return None, metrics

    weights = kl_token_weights(batch, cfg, gate_index, dtype)
    diag: Optional[dict[str, torch.Tensor]] = {} if cfg.kl_diagnostics else None
    kw = dict(vocab_size=batch.vocab_size, direction=cfg.kl_direction, beta=cfg.jsd_beta,
              chunk_size=cfg.logits_chunk_size, diagnostics=diag,
              rescue_threshold=cfg.kl_rescue_threshold)
    if batch.expert_hidden is None or batch.expert_hidden.shape[0] != g:
        raise ValueError(f"expert_hidden must hold the {g} gated rows, got "
                         f"{None if batch.expert_hidden is None else tuple(batch.expert_hidden.shape)}")
    # Weights are known before the divergence: the fused op computes the gradient in its
    # forward pass and never recomputes the logits.
    term, kl = fused_vocab_parallel_kl_loss(
        batch.hidden[gate_index], batch.expert_hidden, batch.output_weight, weights, group,
        expert_weight_shard=batch.expert_output_weight, reduce_hidden_grad=reduce_hidden_grad,
        **kw)

    with torch.no_grad():
        gate_w = (batch.gate.to(dtype) * batch.loss_mask.to(dtype))[gate_index]
        metrics["kl/mean_gated"] = (kl * gate_w).sum() / gate_w.sum().clamp(min=1e-12)
        if batch.thinking_mask is not None:
            metrics.update(_thinking_split(kl, gate_w, weights, batch.thinking_mask[gate_index]))
        if diag is not None:
            step_mean = _step_token_mean(batch, gate_w)
            metrics["kl/token_mean"] = step_mean(kl)
            metrics.update({f"kl/{k}": step_mean(v) for k, v in diag.items()})
            metrics.update(_rescue_extrema(diag))
        if rows is not None:
            rows["kl"] = kl.new_zeros(batch.num_rows).index_copy(0, gate_index, kl.detach())
    return term, metrics
