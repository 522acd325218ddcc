"""What each ``ObjectiveConfig.mode`` switches, in one table (and one place in the code).

===========  =======  =================  ================  ======================
mode         KL term  KL on which turns  thinking tokens   criteria in the reward
===========  =======  =================  ================  ======================
tg           yes      failing turns      distill_thinking  all (weighted)
grpo         no       —                  —                 all (weighted)
opsd         yes      every turn         distill_thinking  primary_criteria only
always_on    yes      every turn         distill_thinking  all (weighted)
no_thinking  yes      failing turns      never             all (weighted)
===========  =======  =================  ================  ======================

``objective.distill_actions=false`` (any KL mode with thinking distilled) keeps the KL on
thinking tokens only.

"opsd" is ungated on purpose: it is the prior-work baseline (global privileged context, no
failure gating) that the paper compares against, as in the prototype in docs/measurements.md.
"always_on" is "opsd" with every criterion in the reward: the paper suite runs it as its OPSD
arm so that every arm has the same reward (docs/claims.md); the main demo's "opsd" row keeps
the paper's task-only reward.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_tg.config.objective import MODES, ObjectiveConfig


@dataclass(frozen=True)
class ModeSwitches:
    kl: bool
    """Whether the loss has a KL term at all."""
    failing_turns_only: bool
    """Gate the KL to turns that failed ≥1 criterion (else every assistant turn)."""
    kl_on_thinking: bool
    """Whether thinking tokens are distilled."""
    kl_on_actions: bool
    """Whether the tokens outside thinking spans are distilled (``distill_actions``)."""
    primary_rewards_only: bool
    """Drop every non-primary criterion from the scalar reward."""


def mode_switches(cfg: ObjectiveConfig) -> ModeSwitches:
    mode = cfg.mode
    if mode not in MODES:
        raise ValueError(f"objective.mode: unknown mode {mode!r}")
    return ModeSwitches(
        kl=mode != "grpo",
        failing_turns_only=mode in ("tg", "no_thinking"),
        kl_on_thinking=cfg.distill_thinking and mode != "no_thinking",
        kl_on_actions=cfg.distill_actions,
        primary_rewards_only=mode == "opsd",
    )
