"""Judging rollouts against a rubric: rewards, per-criterion pass, failing turns + feedback.

Contract with the trainer: a :class:`JudgeResult` with ``judge_error`` set is NOT trainable —
``total_reward`` is ``None`` and :func:`split_trainable` separates such results — because a
rollout whose reward could not be computed must be excluded, never scored as a silent 0 or 1.
(Dropping it changes its GRPO group's size; the group baseline is then computed over the
remaining rollouts, which the advantage code must handle.)
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from megatron_tg.judge.checkers import CheckContext, CheckerError
from megatron_tg.judge.llm import LLMJudgeClient, LLMJudgeError
from megatron_tg.judge.rubric import Criterion, Rubric
from megatron_tg.judge.transcript import Transcript
from megatron_tg.rollout.types import Rollout

FEEDBACK_SOURCES = ("static", "judge")


@dataclass
class CriterionResult:
    name: str
    passed: bool
    weight: float
    primary: bool
    failing_turns: list[int]
    feedback: str | None
    """The feedback to insert before each failing turn (None: this criterion gives no guidance)."""
    detail: str = ""
    """Why it failed (rule checker message); for logs."""
    judge_feedback: str | None = None
    """The LLM judge's own feedback, recorded even when static feedback is used."""

    @property
    def reward(self) -> float:
        return self.weight if self.passed else 0.0


@dataclass
class JudgeResult:
    rollout_id: str
    task_id: str
    group_id: str
    criteria: dict[str, CriterionResult] = field(default_factory=dict)
    judge_error: str | None = None
    """Set when any criterion could not be evaluated; the rollout must not be trained on."""
    llm_reply: str | None = None
    judge_error_kind: str | None = None
    """Why the LLM judge failed (:class:`~megatron_tg.judge.llm.LLMJudgeError` ``kind``)."""
    llm_requests: int = 0
    llm_overflow_retries: int = 0
    """Re-sends with a shorter transcript after the judge answered "context length"."""
    llm_omitted_turns: int = 0
    """Assistant turns cut from the transcript the judge saw (most over the requests)."""

    @property
    def trainable(self) -> bool:
        return self.judge_error is None

    @property
    def rewards(self) -> dict[str, float]:
        """Reward per criterion (0/1 x weight); only criteria that were evaluated."""
        return {n: r.reward for n, r in self.criteria.items()}

    @property
    def total_reward(self) -> float | None:
        """Sum of criterion rewards, or None when judge_error is set (never a partial sum)."""
        if self.judge_error is not None:
            return None
        return sum(r.reward for r in self.criteria.values())

    def reward_sum(self, names: Iterable[str] | None = None) -> float | None:
        """Sum over ``names`` only (e.g. the primary criteria, for an OPSD-style baseline);
        None when judge_error is set or a named criterion was not evaluated."""
        if self.judge_error is not None:
            return None
        names = list(self.criteria) if names is None else list(names)
        if any(n not in self.criteria for n in names):
            return None
        return sum(self.criteria[n].reward for n in names)

    @property
    def passed(self) -> dict[str, bool]:
        return {n: r.passed for n, r in self.criteria.items()}

    def failing_turns(self) -> dict[int, list[tuple[str, str]]]:
        """Assistant turn -> [(criterion, feedback)] for failed criteria that carry feedback."""
        out: dict[int, list[tuple[str, str]]] = {}
        for r in self.criteria.values():
            if r.passed or r.feedback is None:
                continue
            for t in r.failing_turns:
                out.setdefault(t, []).append((r.name, r.feedback))
        return dict(sorted(out.items()))

    def feedback_by_turn(self, separator: str = "\n") -> dict[int, str]:
        """One feedback string per failing turn (criteria in rubric order), ready for
        :func:`megatron_tg.chat.feedback.insert_feedback`. Empty if not trainable."""
        if not self.trainable:
            return {}
        return {t: separator.join(fb for _, fb in items) for t, items in self.failing_turns().items()}

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["total_reward"] = self.total_reward
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "JudgeResult":
        crits = {k: CriterionResult(**v) for k, v in d.get("criteria", {}).items()}
        return cls(d["rollout_id"], d["task_id"], d["group_id"], crits, d.get("judge_error"),
                   d.get("llm_reply"))


def split_trainable(results: Iterable[JudgeResult]) -> tuple[list[JudgeResult], list[JudgeResult]]:
    ok, bad = [], []
    for r in results:
        (ok if r.trainable else bad).append(r)
    return ok, bad


# ---------------------------------------------------------------------- rule evaluation
def _turn_text(turn, which: str, transcript: Transcript) -> str:
    if which == "transcript":
        return transcript.text()
    return {"content": turn.content, "raw": turn.raw, "thinking": turn.thinking}[which]


def evaluate_rule(c: Criterion, transcript: Transcript, task: Any = None) -> tuple[bool, list[int], str]:
    """(passed, failing_turns, detail) for a rule-based criterion; CheckerError propagates."""
    turns = transcript.turns
    which = c.checker.text
    ctx = lambda **kw: CheckContext(scope=c.scope, transcript=transcript, task=task,  # noqa: E731
                                    metadata=transcript.metadata, **kw)
    if c.scope == "rollout":
        last = transcript.last_turn
        if which == "transcript":
            text = transcript.text()
        else:
            text = "\n\n".join(_turn_text(t, which, transcript) for t in turns)
        ok, why = c.checker(text, ctx(turn=last))
        return ok, ([] if ok or last is None else [last.index]), why
    if not turns:
        return False, [], "no assistant turn"
    if c.scope == "final_turn":
        if not transcript.ended_by_agent:
            return False, [], f"no final turn: the rollout ended by {transcript.finish_reason}"
        last = turns[-1]
        ok, why = c.checker(_turn_text(last, which, transcript), ctx(turn=last))
        return ok, ([] if ok else [last.index]), why
    failing, whys = [], []
    for t in turns:
        if c.scope == "every_turn":
            ok, why = c.checker(_turn_text(t, which, transcript), ctx(turn=t))
        else:  # any_tool_call: each parsed call and each malformed call, in text order
            ok, why = True, ""
            for call in sorted(list(t.tool_calls) + list(t.tool_call_errors), key=lambda x: x.start):
                raw = t.raw[call.start:call.end] if t.raw else ""
                ok, why = c.checker(raw, ctx(turn=t, tool_call=call))
                if not ok:
                    break
        if not ok:
            failing.append(t.index)
            whys.append(f"turn {t.index}: {why}")
    return not failing, failing, "; ".join(whys)


# ---------------------------------------------------------------------- judge
class Judge:
    """Evaluates a rubric on rollouts. Rule criteria run locally; all LLM criteria of a
    rollout go to the LLM judge in one request.

    ``feedback_source``: "static" (default; the rubric's vetted strings, as in the paper) or
    "judge" (the LLM judge's feedback when it gives one, else the static string).
    """

    def __init__(self, rubric: Rubric, tokenizer=None, llm: LLMJudgeClient | None = None,
                 feedback_source: str = "static", tool_call_reading: str = "strict"):
        if feedback_source not in FEEDBACK_SOURCES:
            raise ValueError(f"feedback_source must be one of {FEEDBACK_SOURCES}")
        if rubric.llm_criteria() and llm is None:
            raise ValueError(f"rubric {rubric.name!r} has LLM criteria "
                             f"{[c.name for c in rubric.llm_criteria()]} but no LLM client was given")
        self.rubric, self.tokenizer, self.llm = rubric, tokenizer, llm
        self.feedback_source = feedback_source
        self.tool_call_reading = tool_call_reading  # the harness's reading (rollout.tool_call_reading)

    def transcript(self, item: Rollout | Transcript) -> Transcript:
        if isinstance(item, Transcript):
            return item
        if self.tokenizer is None:
            raise ValueError("judging a Rollout needs the tokenizer (to decode its tokens)")
        return Transcript.from_rollout(item, self.tokenizer, self.tool_call_reading)

    async def judge(self, item: Rollout | Transcript, task_info: Any = None) -> JudgeResult:
        tr = self.transcript(item)
        res = JudgeResult(tr.rollout_id, tr.task_id, tr.group_id)
        errors: list[str] = []
        for c in self.rubric.rule_criteria():
            try:
                ok, turns, why = evaluate_rule(c, tr, task_info)
            except CheckerError as e:
                errors.append(f"{c.name}: {e}")
                continue
            except Exception as e:  # a checker bug must not crash the whole batch
                errors.append(f"{c.name}: {type(e).__name__}: {e}")
                continue
            res.criteria[c.name] = CriterionResult(c.name, ok, c.weight, c.primary, turns,
                                                   c.feedback, why)
        llm_crits = self.rubric.llm_criteria()
        if llm_crits and not errors:  # an excluded rollout need not cost a judge call
            await self._judge_llm(llm_crits, tr, task_info, res, errors)
        res.judge_error = "; ".join(errors) or None
        return res

    async def _judge_llm(self, crits: Sequence[Criterion], tr: Transcript, task_info: Any,
                         res: JudgeResult, errors: list[str]) -> None:
        n = len(tr.turns)
        if n == 0:
            for c in crits:
                res.criteria[c.name] = CriterionResult(c.name, False, c.weight, c.primary, [],
                                                       c.feedback, "no assistant turn")
            return
        assert self.llm is not None
        cfg = self.llm.config
        render = lambda budget: tr.render_within(cfg.max_context_chars, budget)  # noqa: E731
        # One request per transcript budget: criteria that need less context share one.
        by_budget: dict[int, list[Criterion]] = {}
        for c in crits:
            by_budget.setdefault(c.judge_budget_chars or cfg.max_transcript_chars, []).append(c)
        verdicts, raws = {}, []
        for budget, group in by_budget.items():
            try:
                got, raw, call = await self.llm.evaluate(group, render, task_info, n,
                                                         budget_chars=budget)
            except LLMJudgeError as e:
                errors.append(f"llm judge: {e}")
                res.judge_error_kind = e.kind
                return
            verdicts.update(got)
            raws.append(raw)
            res.llm_requests += call.requests
            res.llm_overflow_retries += call.overflow_retries
            res.llm_omitted_turns = max(res.llm_omitted_turns, call.omitted_turns)
        raw = raws[0] if len(raws) == 1 else "\n".join(raws)
        res.llm_reply = raw
        for c in crits:
            v = verdicts[c.name]
            if c.scope == "final_turn" and not tr.ended_by_agent:  # see rubric.py: no final turn
                res.criteria[c.name] = CriterionResult(
                    c.name, False, c.weight, c.primary, [], c.feedback,
                    f"no final turn: the rollout ended by {tr.finish_reason}", v.feedback)
                continue
            if v.passed:
                turns = []
            elif c.scope in ("final_turn", "rollout"):
                turns = [n - 1]  # fixed by scope, whatever turn the judge named
            else:
                turns = v.failing_turns
            fb = c.feedback
            if self.feedback_source == "judge" and v.feedback and c.feedback is not None:
                fb = v.feedback
            res.criteria[c.name] = CriterionResult(c.name, v.passed, c.weight, c.primary, turns,
                                                   fb, "" if v.passed else "llm judge: fail",
                                                   v.feedback)

    async def judge_many(self, items: Sequence[Rollout | Transcript],
                         task_infos: Mapping[str, Any] | None = None) -> list[JudgeResult]:
        """Judge concurrently (the LLM client bounds in-flight requests); order preserved."""
        async def one(it):
            tid = it.task_id
            return await self.judge(it, (task_infos or {}).get(tid))
        return list(await asyncio.gather(*(one(it) for it in items)))

    def judge_sync(self, item: Rollout | Transcript, task_info: Any = None) -> JudgeResult:
        """Convenience for rule-only rubrics / scripts (runs its own event loop)."""
        return asyncio.run(self.judge(item, task_info))
