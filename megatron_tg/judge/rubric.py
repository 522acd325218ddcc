"""Rubrics: the criteria a rollout is judged on, loaded from YAML.

::

    name: tool_format
    description: optional
    criteria:
      - name: search_lines            # identifier; also the JSON key the LLM judge answers with
        scope: any_tool_call          # final_turn | every_turn | any_tool_call | rollout
        weight: 0.5                   # reward = weight if passed else 0
        primary: false                # true for the task-success criterion(s)
        feedback: "Use the lines= argument of the search tool."   # null: reward only, no guidance
        description: optional, for humans and the LLM judge
        checker:
          type: tool_format           # see megatron_tg.judge.checkers.CHECKERS
          args: {tool: search, parameter: lines}

Scopes and the turns a failure is attributed to (where feedback will be inserted):

* ``final_turn``    — the last assistant turn is checked; fails at that turn. A rollout the
  agent did not end itself (cut by the turn, token or time limit: its last turn may be a
  tool call) has no final turn: the criterion fails with no turn attributed, so it costs
  reward but no feedback is inserted before a turn that was not meant as the final one.
* ``every_turn``    — each assistant turn is checked; fails at each turn that fails.
* ``any_tool_call`` — each tool call is checked (no calls: vacuous pass); fails at each turn
  with a failing call.
* ``rollout``       — the whole rollout is checked; fails at the last assistant turn (the
  last point where the agent could still have acted on feedback).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from megatron_tg.judge.checkers import Checker, build_checker

SCOPES = ("final_turn", "every_turn", "any_tool_call", "rollout")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


class RubricError(ValueError):
    """Invalid rubric; the message names the source file and the criterion/field."""


@dataclass
class Criterion:
    name: str
    scope: str
    weight: float
    primary: bool
    feedback: str | None
    checker_type: str
    checker_args: dict[str, Any]
    checker: Checker
    description: str = ""
    judge_budget_chars: int | None = None
    """LLM criteria only: the most characters of transcript the judge is sent for this
    criterion (the middle is cut with a marker beyond it); None = the judge client's
    ``max_transcript_chars``. Criteria with the same budget share one judge request."""

    @property
    def is_llm(self) -> bool:
        return self.checker.is_llm


@dataclass
class Rubric:
    name: str
    criteria: list[Criterion]
    description: str = ""
    source: str = field(default="<dict>", compare=False)

    def __post_init__(self) -> None:
        names = [c.name for c in self.criteria]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise RubricError(f"{self.source}: duplicate criterion names {dup}")

    def __getitem__(self, name: str) -> Criterion:
        for c in self.criteria:
            if c.name == name:
                return c
        raise KeyError(name)

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.criteria]

    def llm_criteria(self) -> list[Criterion]:
        return [c for c in self.criteria if c.is_llm]

    def rule_criteria(self) -> list[Criterion]:
        return [c for c in self.criteria if not c.is_llm]

    def primary_names(self) -> list[str]:
        return [c.name for c in self.criteria if c.primary]

    def weights(self) -> dict[str, float]:
        return {c.name: c.weight for c in self.criteria}


_TOP_KEYS = {"name", "description", "criteria"}
_CRIT_KEYS = {"name", "scope", "weight", "primary", "feedback", "checker", "description",
              "judge_budget_chars"}


def parse_rubric(obj: Any, source: str = "<dict>") -> Rubric:
    if not isinstance(obj, dict):
        raise RubricError(f"{source}: a rubric is a mapping, got {type(obj).__name__}")
    unknown = sorted(set(obj) - _TOP_KEYS)
    if unknown:
        raise RubricError(f"{source}: unknown top-level key(s) {unknown}")
    crits = obj.get("criteria")
    if not isinstance(crits, list) or not crits:
        raise RubricError(f"{source}: 'criteria' must be a non-empty list")
    criteria = [_parse_criterion(c, f"{source}: criteria[{i}]") for i, c in enumerate(crits)]
    return Rubric(name=str(obj.get("name", os.path.basename(source))), criteria=criteria,
                  description=str(obj.get("description", "")), source=source)


def _parse_criterion(c: Any, where: str) -> Criterion:
    if not isinstance(c, dict):
        raise RubricError(f"{where}: must be a mapping")
    name = c.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise RubricError(f"{where}.name: must be an identifier, got {name!r}")
    where = f"{where} ({name})"
    unknown = sorted(set(c) - _CRIT_KEYS)
    if unknown:
        raise RubricError(f"{where}: unknown key(s) {unknown}")
    scope = c.get("scope")
    if scope not in SCOPES:
        raise RubricError(f"{where}.scope: {scope!r} not one of {SCOPES}")
    weight = c.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
            or weight < 0:
        raise RubricError(f"{where}.weight: must be a finite number >= 0, got {weight!r}")
    primary = c.get("primary", False)
    if not isinstance(primary, bool):
        raise RubricError(f"{where}.primary: must be true/false, got {primary!r}")
    feedback = c.get("feedback")
    if feedback is not None and (not isinstance(feedback, str) or not feedback.strip()):
        raise RubricError(f"{where}.feedback: must be a non-empty string or null")
    spec = c.get("checker")
    if not isinstance(spec, dict) or "type" not in spec:
        raise RubricError(f"{where}.checker: must be a mapping with 'type' (and 'args')")
    extra = sorted(set(spec) - {"type", "args"})
    if extra:
        raise RubricError(f"{where}.checker: unknown key(s) {extra}; put arguments under 'args'")
    args = spec.get("args") or {}
    if not isinstance(args, dict):
        raise RubricError(f"{where}.checker.args: must be a mapping")
    try:
        checker = build_checker(spec["type"], args)
    except Exception as e:  # ValueError, ImportError, AttributeError from a python checker
        raise RubricError(f"{where}.checker: {e}") from e
    budget = c.get("judge_budget_chars")
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1000:
            raise RubricError(f"{where}.judge_budget_chars: must be an integer >= 1000, got {budget!r}")
        if not checker.is_llm:
            raise RubricError(f"{where}.judge_budget_chars: only LLM-judged criteria are sent "
                              f"to a judge (checker {spec['type']!r} is a rule)")
    return Criterion(name=name, scope=scope, weight=float(weight), primary=primary,
                     feedback=feedback.strip() if feedback else None, checker_type=spec["type"],
                     checker_args=dict(args), checker=checker,
                     description=str(c.get("description", "")), judge_budget_chars=budget)


def load_rubric(path: str | os.PathLike) -> Rubric:
    path = os.fspath(path)
    with open(path, encoding="utf-8") as f:
        try:
            obj = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise RubricError(f"{path}: invalid YAML: {e}") from e
    return parse_rubric(obj, source=path)


def primary_criteria(obj, rubric: Rubric) -> list[str]:
    """The task-success criteria: ``objective.primary_criteria`` if set, else the rubric's
    ``primary: true`` criteria. A named criterion the rubric lacks is a config error (it
    would silently weigh nothing), and mode "opsd", which rewards only these, needs one."""
    from megatron_tg.config.base import ConfigError

    names = [c.name for c in rubric.criteria]
    if obj.primary_criteria:
        unknown = [n for n in obj.primary_criteria if n not in names]
        if unknown:
            raise ConfigError(f"objective.primary_criteria: {unknown} are not criteria of the "
                              f"rubric (it has {names}); got {list(obj.primary_criteria)}")
        return list(obj.primary_criteria)
    primary = [c.name for c in rubric.criteria if c.primary]
    if not primary and obj.mode == "opsd":
        raise ConfigError("objective.primary_criteria: mode 'opsd' rewards only the primary "
                          f"criteria, and the rubric marks none primary (criteria: {names}); "
                          "set objective.primary_criteria or a rubric criterion's primary: true")
    return primary
