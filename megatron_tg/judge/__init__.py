"""Criteria and judging: YAML rubrics, rule-based checkers, an async LLM judge client, and
per-rollout results (rewards, failing turns with feedback, explicit judge errors)."""

from megatron_tg.judge.checkers import CHECKERS, CheckContext, Checker, CheckerError, build_checker
from megatron_tg.judge.judge import (
    CriterionResult,
    Judge,
    JudgeResult,
    evaluate_rule,
    split_trainable,
)
from megatron_tg.judge.llm import LLMJudgeClient, LLMJudgeConfig, LLMJudgeError, LLMVerdict
from megatron_tg.judge.rubric import SCOPES, Criterion, Rubric, RubricError, load_rubric, parse_rubric
from megatron_tg.judge.transcript import Transcript, TurnView

__all__ = [
    "CHECKERS", "CheckContext", "Checker", "CheckerError", "Criterion", "CriterionResult", "Judge",
    "JudgeResult", "LLMJudgeClient", "LLMJudgeConfig", "LLMJudgeError", "LLMVerdict", "Rubric",
    "RubricError", "SCOPES", "Transcript", "TurnView", "build_checker", "evaluate_rule",
    "load_rubric", "parse_rubric", "split_trainable",
]
