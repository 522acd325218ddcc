"""Training objective: GRPO + failure-gated full-vocabulary self-distillation (targeted guidance).

Modules (each opens with its math contract):

* :mod:`.batch`         — :class:`PolicyBatch`, the flat per-row input layout;
* :mod:`.rewards`       — criteria → reward → group-relative advantages;
* :mod:`.grpo`          — the clipped, TIS-corrected policy-gradient term;
* :mod:`.guidance`      — the gate and the gated KL term;
* :mod:`.modes`         — what each ``ObjectiveConfig.mode`` switches;
* :mod:`.entropy_guard` — optional λ controller on entropy spikes;
* :mod:`.loss`          — :class:`TGObjective`, the sum of named terms.
"""

from megatron_tg.objectives.batch import PolicyBatch, flat_positions, select_rows
from megatron_tg.objectives.entropy_guard import EntropyGuard, GuardEvent
from megatron_tg.objectives.grpo import policy_gradient_term
from megatron_tg.objectives.guidance import build_gate, gated_kl_term, kl_token_weights
from megatron_tg.objectives.loss import LossOutput, TGObjective
from megatron_tg.objectives.modes import ModeSwitches, mode_switches
from megatron_tg.objectives.rewards import combine_rewards, criterion_weight_vector, group_advantages

__all__ = [
    "EntropyGuard",
    "GuardEvent",
    "LossOutput",
    "ModeSwitches",
    "PolicyBatch",
    "TGObjective",
    "build_gate",
    "combine_rewards",
    "criterion_weight_vector",
    "flat_positions",
    "gated_kl_term",
    "group_advantages",
    "kl_token_weights",
    "mode_switches",
    "policy_gradient_term",
    "select_rows",
]
