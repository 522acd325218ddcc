"""Typed configuration of the training objective (GRPO + failure-gated self-distillation).

Only types that OmegaConf structured configs accept are used (str/int/float/bool, Optional,
List, Dict[str, float], nested dataclasses). Enumerations are plain ``str`` fields checked by
:meth:`ObjectiveConfig.validate`, because OmegaConf does not support ``typing.Literal``.

The math that these fields parameterise is written out in the module docstrings of
``megatron_tg/objectives/grpo.py`` and ``megatron_tg/objectives/guidance.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

from megatron_tg.config.base import ConfigError

MODES = ("tg", "grpo", "opsd", "always_on", "no_thinking")
KL_DIRECTIONS = ("reverse", "forward", "jsd")  # = megatron_tg.ops.vocab_parallel's (a test checks)
KL_TOKEN_NORMALIZATIONS = ("rollout_gated", "rollout_assistant", "global")
PG_TOKEN_NORMALIZATIONS = ("rollout", "global")
EXPERTS = ("shared", "frozen", "ema")
EMA_WEIGHTS = ("replicated", "gathered")
EMA_PLACEMENTS = ("device", "host")
EMA_GATHER_SCOPES = ("layer", "step")  # = megatron_tg.train.ema_gather.SCOPES
EXPERT_SEQUENCES = ("shared", "exact")
EXPERT_FEEDBACK = ("failing", "covered", "placebo")
STYLE_REWARDS = ("sum", "primary_gated")
OLD_LOGPROBS = ("student", "behaviour")
TIS_MODES = ("truncate", "mask")


@dataclass
class EntropyGuardConfig:
    """Controller that lowers λ when entropy on gated tokens spikes (paper §5.4)."""

    enabled: bool = False
    """Off by default: the paper found a static, low enough λ stable; the guard is a safety net."""

    rise_threshold: float = 0.05
    """Largest tolerated rise, in nats per step, of the smoothed mean entropy on gated tokens.
    A faster rise is read as the onset of the entropy spike that precedes collapse (paper Fig. 6)."""

    smoothing: float = 0.9
    """EMA factor for the entropy baseline the rise is measured against (0 = no smoothing)."""

    decay_factor: float = 0.5
    """λ is multiplied by this when the guard trips (multiplicative back-off, cut fast)."""

    recover_rate: float = 0.05
    """Fraction of the gap back to the configured λ restored per calm step (restore slowly)."""

    min_coef: float = 0.0
    """Floor for λ while the guard is active, as an absolute value (not a fraction)."""

    def validate(self) -> None:
        if self.rise_threshold <= 0:
            raise ConfigError(f"objective.entropy_guard.rise_threshold must be > 0, got {self.rise_threshold}")
        if not 0.0 <= self.smoothing < 1.0:
            raise ConfigError(f"objective.entropy_guard.smoothing must be in [0, 1), got {self.smoothing}")
        if not 0.0 < self.decay_factor < 1.0:
            raise ConfigError(f"objective.entropy_guard.decay_factor must be in (0, 1), got {self.decay_factor}")
        if not 0.0 < self.recover_rate <= 1.0:
            raise ConfigError(f"objective.entropy_guard.recover_rate must be in (0, 1], got {self.recover_rate}")
        if self.min_coef < 0:
            raise ConfigError(f"objective.entropy_guard.min_coef must be >= 0, got {self.min_coef}")


@dataclass
class ObjectiveConfig:
    """L(θ) = L_GRPO(θ) + λ · mean_rollouts( mean_tokens( gate · KL ) ), switched by ``mode``."""

    mode: str = "tg"
    """One of: "tg" (GRPO + KL on turns that failed ≥1 criterion; the paper's method),
    "grpo" (no KL term), "opsd" (KL on every assistant turn, ungated, and only
    ``primary_criteria`` enter the reward: the style criteria teach through the KL alone; the
    on-policy self-distillation baseline of paper §5.2-5.3 and of the prototype in docs/measurements.md),
    "always_on" (KL on every assistant turn, failing or not; paper §5.3 ablation),
    "no_thinking" (tg, but no KL on thinking tokens; paper §5.4 / Fig. 7 ablation)."""

    kl_coef: float = 0.1
    """λ. The paper sweeps it and reports that large values spike entropy and then collapse the
    pass rate (§5.4, Fig. 6), while a static low value is stable. The KL is averaged per token,
    and a per-token GRPO surrogate is O(|advantage|) ≈ 1, so 0.1 keeps distillation below the
    RL signal by default; recipes should sweep it (in the docs/measurements.md prototype, forward KL learned at
    λ=1, while reverse KL collapsed at 1 and did not move in 80 steps at 0.1-0.3)."""

    kl_direction: str = "reverse"
    """"reverse" = KL(π_θ ‖ sg π_expert), the paper's equation; "forward" = KL(sg π_expert ‖ π_θ)
    (the direction that learned in the prototype where reverse collapsed, see docs/measurements.md);
    "jsd" = generalised Jensen-Shannon with ``jsd_beta`` (β→0 behaves like forward, β→1 like
    reverse; exact convention in ``megatron_tg/ops/vocab_parallel.py``)."""

    jsd_beta: float = 0.5
    """β of the generalised JSD; mixture m = β·p_expert + (1-β)·p_student, loss =
    β·KL(p_expert ‖ m) + (1-β)·KL(p_student ‖ m). Only used when kl_direction == "jsd"."""

    distill_thinking: bool = True
    """Apply the KL on thinking tokens too. The paper finds this crucial against oscillation
    between criteria (§5.4, Fig. 7). mode="no_thinking" forces it off."""

    distill_actions: bool = True
    """Apply the KL on the tokens outside thinking spans (tool calls, answers). False, with
    ``distill_thinking``: the thinking-only KL, the ablation that asks whether distilling
    the plan alone moves the actions (issue 38's H3). False with no thinking distilled
    leaves no KL row: refused (use mode="grpo")."""

    kl_action_weight: float = 1.0
    """Weight of a gated row outside thinking spans (tool calls, answers) relative to a gated
    thinking row, within each rollout, with the rollout's total KL weight kept: 4 makes each
    action row count four times a thinking row, and the thinking rows give up the difference.
    1 (default): every gated row alike. The ablation for issue 38's H2 (the call's closing
    token is one row among many thinking rows)."""

    kl_token_normalization: str = "rollout_gated"
    """Denominator of a rollout's KL average: "rollout_gated" = that rollout's gated tokens
    (default: the mean KL over its failing turns' tokens, so a long failing turn cannot
    outweigh a short one), "rollout_assistant" = all assistant tokens of the rollout (a rollout
    whose failing turn is a small part of it gets a smaller push), "global" = the step's total
    gated tokens (no per-rollout averaging; long rollouts weigh more). The per-rollout means
    are then averaged over *all* rollouts of the step (those without gated tokens count 0), the
    same denominator as the GRPO term, so the KL pressure fades as failures become rare, as the
    paper's Σ_{t∈F} does."""

    pg_token_normalization: str = "rollout"
    """GRPO token aggregation: "rollout" = mean over each rollout's assistant tokens, then mean
    over rollouts (GRPO's 1/|o_i|, the same weighting as the KL term so λ keeps one meaning);
    "global" = sum over all assistant tokens / their count in the step (DAPO token-level)."""

    clip_eps_low: float = 0.2
    """PPO ratio clip, lower side: ratio is clipped to [1 - clip_eps_low, 1 + clip_eps_high]."""

    clip_eps_high: float = 0.28
    """PPO ratio clip, upper side. 0.28 > 0.2 ("clip-higher", DAPO) leaves room for raising
    low-probability tokens, the exploratory direction targeted guidance pushes towards."""

    old_logprobs: str = "student"
    """Where π_old (the PPO ratio's denominator and TIS's numerator) comes from when the batch
    carries no ``old_logprobs``: "student" = the student pass's own log-probs, detached. That
    is exact when one optimizer step consumes the batch (the trainer's only schedule: the
    weights have not moved yet), and costs no extra forward pass; the ratio is then 1 and the
    engine gap is corrected by TIS alone. "behaviour" = no π_old: the ratio is taken against
    the engine's log-probs and TIS is off (the pre-correction behaviour, for ablations)."""

    tis_cap: float = 2.0
    """C of truncated importance sampling: the per-token, stop-gradient weight
    min(exp(logp_old − logp_behaviour), C) corrects the gap between the rollout engine's
    log-probs (behaviour: other kernels, a few weight versions stale) and the trainer's π_old
    (see ``old_logprobs``). <= 0 disables it."""

    tis_mode: str = "truncate"
    """"truncate" = weight min(w, tis_cap) (TIS); "mask" = weight w inside the band
    [1/tis_cap, tis_cap] and 0 outside it (masked IS: tokens whose engine probability is far
    from the trainer's are dropped rather than down-weighted)."""

    advantage_std_norm: bool = True
    """Divide group-centred rewards by the group's std (GRPO). False = Dr.GRPO-style centring only."""

    adv_eps: float = 1e-6
    """Added to the group std before dividing, so an all-equal group gives advantage 0, not NaN."""

    criterion_weights: Dict[str, float] = field(default_factory=dict)
    """Reward weight λ_i per criterion name; R = Σ_i w_i R_i. Criteria not listed weigh 1.0."""

    primary_criteria: List[str] = field(default_factory=list)
    """Criteria that always count in the reward (task success); in mode "opsd" the only ones
    that do. Empty (the default): the rubric's ``primary: true`` criteria. Names given here
    replace the rubric's flags and must be criteria of the rubric."""

    style_reward: str = "sum"
    """How the criteria's scores make the reward: "sum" = Σ w_i R_i (the paper's per-criterion
    reward); "primary_gated" = the non-primary (style) terms count only on rollouts that pass
    every primary criterion, so style reward cannot be earned by giving up the task
    (``megatron_tg/objectives/rewards.py``)."""

    expert: str = "shared"
    """Weights the expert forward runs with: "shared" = the live policy (paper), "frozen" = the
    initial policy, "ema" = an exponential moving average of the policy. On the CPU demo forward
    KL with the shared expert collapsed 3 of 3 seeds and with the EMA expert learned 3 of 3
    (docs/demo.md, the --full grid); the EMA's update, checkpoint and resume are tested
    (tests/train/test_ema.py, test_trainer.py, test_distrib_optim.py), as is "frozen" (test_trainer.py)."""

    ema_decay: float = 0.99
    """Per-step decay of the EMA expert's weights (expert == "ema" only)."""

    ema_weights: str = "replicated"
    """How the EMA expert's forward gets its weights (expert == "ema" only): "replicated" =
    a persistent copy of the rank's parameter shard in the model dtype, refreshed from the
    fp32 average after every update (+2 B / param per GPU for the whole run;
    docs/memory-plan.md has it per recipe); "gathered" = no copy: each layer's weights are
    all-gathered from the DP-sharded fp32 average just before the expert pass runs it and
    freed after (:mod:`megatron_tg.train.ema_gather`; the same values, bit for bit). The GPU
    recipes set "gathered": their EMA expert fits 80 GB only so (``megatron-tg memory``)."""

    ema_placement: str = "device"
    """Where the EMA's fp32 shard lives: "device" (GPU memory, 4 B / param / DP) or "host"
    (pinned host memory; the update and each layer's gather copy it up first, at the host
    link's rate: ``megatron-tg memory`` prints that time). tg_235b needs "host"."""

    ema_gather_scope: str = "layer"
    """With ema_weights = "gathered": "layer" = gather each layer at each micro-batch's
    expert pass (the device holds one layer's weights + its gather buffer + the output
    weight); "step" = gather the whole model once when the step's expert pass starts and free
    it when the pass ends (a full copy for the length of the pass; one model's traffic per
    step instead of one per micro-batch). ``megatron-tg memory`` counts the recipe's choice
    and prints the other's total, so the recipe picks "step" where it fits."""

    expert_sequence: str = "shared"
    """How feedback enters the expert context: "shared" = one expert sequence per rollout with
    every failing turn's feedback inserted right before that turn (one extra forward pass, as
    the paper costs it; later turns also see earlier feedback — a small deviation), "exact" =
    one expert sequence per failing turn holding only that turn's feedback (the paper's
    μ(·|s_t, f_t) exactly; one forward pass per failing turn)."""

    expert_feedback: str = "failing"
    """Which feedback a gated turn's expert context holds: "failing" = the feedback of the
    criteria the turn fails (the paper's f_t); "covered" = the feedback of every criterion that
    covers the turn, passed or failed, on the same gated turns (the gate is unchanged). With
    several criteria and an expert that lags the student (EMA, frozen), "failing" tells the
    expert about one criterion and lets it undo the others the student already meets (the
    expert, lagging, does not meet them unprompted): measured on the paper suite's toy
    environment (README, "the paper suite"). Modes with every turn distilled (opsd,
    always_on) always use every covered criterion's feedback. "placebo" = the same gated
    turns, but the expert context holds ``placebo_feedback`` instead of any criterion's
    feedback: the KL machinery with no information, the control arm that separates what
    the feedback teaches from what distilling towards a perturbed context does (issue 38)."""

    placebo_feedback: str = "Please continue with the task."
    """The neutral sentence ``expert_feedback="placebo"`` puts where the feedback would go
    (framed by ``judge.feedback_framing`` like any feedback)."""

    expert_prefix_reuse: bool = True
    """Shared expert only: run the expert forward on the suffix of each expert sequence (from
    the first inserted feedback on) and take the prefix's keys/values from the student's
    forward, which saw the same tokens under the same weights (exact up to float rounding).
    Saves the expert's compute over the prefix: most of a rollout when the failing turns are
    late. False: the expert runs over whole expert sequences (the paper's naive cost)."""

    hinted_samples: int = 0
    """Per failing turn, this many samples of that turn drawn by the engines with its feedback
    in context (after judging; :mod:`megatron_tg.sampling.hinted`), trained with the KL term only,
    student on its own context and expert on the feedback context. It teaches the expert's
    whole changed span, not only its first token (the branch the student's own turn reaches).
    Costs one generation request per sample and its tokens in both passes. 0: the paper's
    method (KL on the student's own turns only). Measured on the toy (README): pair it with
    an EMA expert; with the shared one and forward KL it collapsed 3 of 3 seeds."""

    logits_chunk_size: int = 1024
    """Tokens per chunk in the vocab-parallel ops: peak extra memory ≈ chunk × V/TP floats."""

    kl_diagnostics: bool = False
    """Log, per step, why the KL can or cannot move the student, on the gated tokens:
    ``kl/rescue_mass`` (the expert's probability on tokens the student gives
    < ``kl_rescue_threshold``), ``kl/grad_norm_reverse`` and ``kl/grad_norm_forward``
    (‖∂KL/∂student logits‖₂ per token of each direction, whichever one the loss uses) and
    ``kl/token_mean`` (the per-token divergence on gated tokens, over the whole step); on the
    gated rows where that mass is ≥ 0.5 ("rescue rows"), ``kl/rescue_grad_reverse_max`` and
    ``kl/rescue_grad_forward_min``, and ``kl/rescue_mass_max``. Costs one
    extra all-reduce per logits chunk of the KL op; off by default."""

    kl_rescue_threshold: float = 1e-4
    """Student probability under which a token counts as unsampleable for ``kl/rescue_mass``."""

    entropy_guard: EntropyGuardConfig = field(default_factory=EntropyGuardConfig)
    """Optional λ back-off controller on entropy spikes (off by default)."""

    def validate(self) -> None:
        """Raise ConfigError (a ValueError) naming the first invalid field."""
        for name, allowed in (("mode", MODES), ("kl_direction", KL_DIRECTIONS),
                              ("kl_token_normalization", KL_TOKEN_NORMALIZATIONS),
                              ("pg_token_normalization", PG_TOKEN_NORMALIZATIONS),
                              ("expert", EXPERTS), ("expert_sequence", EXPERT_SEQUENCES),
                              ("ema_weights", EMA_WEIGHTS), ("ema_placement", EMA_PLACEMENTS),
                              ("ema_gather_scope", EMA_GATHER_SCOPES),
                              ("expert_feedback", EXPERT_FEEDBACK), ("style_reward", STYLE_REWARDS),
                              ("old_logprobs", OLD_LOGPROBS), ("tis_mode", TIS_MODES)):
            value = getattr(self, name)
            if value not in allowed:
                raise ConfigError(f"objective.{name} must be one of {allowed}, got {value!r}")
        if not self.distill_actions and (not self.distill_thinking or self.mode == "no_thinking"):
            raise ConfigError("objective.distill_actions=false with no thinking distilled "
                              f"(distill_thinking={self.distill_thinking}, mode={self.mode!r}) "
                              "leaves the KL no token: use objective.mode=grpo")
        if not self.kl_action_weight > 0:
            raise ConfigError(f"objective.kl_action_weight must be > 0, got {self.kl_action_weight}")
        if self.kl_coef < 0:
            raise ConfigError(f"objective.kl_coef must be >= 0, got {self.kl_coef}")
        if not 0.0 <= self.jsd_beta <= 1.0:
            raise ConfigError(f"objective.jsd_beta must be in [0, 1], got {self.jsd_beta}")
        if not 0.0 <= self.clip_eps_low < 1.0:
            raise ConfigError(f"objective.clip_eps_low must be in [0, 1), got {self.clip_eps_low}")
        if self.clip_eps_high < 0:
            raise ConfigError(f"objective.clip_eps_high must be >= 0, got {self.clip_eps_high}")
        if self.tis_mode == "mask" and not self.tis_cap > 1.0:
            raise ConfigError(f"objective.tis_cap must be > 1 with tis_mode='mask' (the band "
                             f"[1/tis_cap, tis_cap] would be empty), got {self.tis_cap}")
        if self.adv_eps <= 0:
            raise ConfigError(f"objective.adv_eps must be > 0, got {self.adv_eps}")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ConfigError(f"objective.ema_decay must be in [0, 1), got {self.ema_decay}")
        if not 0.0 < self.kl_rescue_threshold < 1.0:
            raise ConfigError(f"objective.kl_rescue_threshold must be in (0, 1), got "
                              f"{self.kl_rescue_threshold}")
        if (isinstance(self.hinted_samples, bool) or not isinstance(self.hinted_samples, int)
                or self.hinted_samples < 0):
            raise ConfigError(f"objective.hinted_samples must be an integer >= 0, got "
                              f"{self.hinted_samples!r}")
        if self.logits_chunk_size < 1:
            raise ConfigError(f"objective.logits_chunk_size must be >= 1, got {self.logits_chunk_size}")
        for name, w in self.criterion_weights.items():
            if not isinstance(w, (int, float)):
                raise ConfigError(f"objective.criterion_weights[{name!r}] must be a number, got {w!r}")
        self.entropy_guard.validate()
