"""Held-out evaluation: rollouts of tasks the policy never trains on, judged by the run's
rubric, as pass@1 and per-criterion rates with confidence intervals (``eval/*`` metrics)."""

from megatron_tg.eval.heldout import HeldOutEvaluation, attach_evaluation, rates

__all__ = ["HeldOutEvaluation", "attach_evaluation", "rates"]
