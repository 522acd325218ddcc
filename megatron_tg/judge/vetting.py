"""Feedback vetting (paper §4): keep a feedback string only if the model *with* it beats the
model *without* it.

The expert of targeted guidance is the policy itself with the feedback message inserted right
before a failing turn. It is only a useful teacher if that context really raises the criterion's
pass rate (the expert must have higher expected reward, paper eq. 1) without hurting the task.
Vetting measures this by generation: for each criterion that has a feedback string, sample
agent rollouts WITH the feedback inserted and WITHOUT it, judge both with the rubric, and
compare.

Where the feedback goes (the agent loop runs unchanged;
:class:`~megatron_tg.judge.feedback_context.FeedbackContext` wraps the rollout context so that
each engine request carries the student context with the framed feedback message F inserted
right before the generation prompt of the scoped turn(s), exactly where
:func:`megatron_tg.chat.feedback.insert_feedback` puts it for the expert; the rollout that is
recorded and judged is the student's, without F):

* ``every_turn`` / ``any_tool_call``: which turns will fail (or will call a tool) is unknown
  before they are generated, so F is inserted before EVERY turn (fresh rollouts).
* ``final_turn`` / ``rollout``: the trainer inserts F before the last turn, which is only known
  afterwards. Each WITHOUT rollout is therefore branched: its turns before the last one are
  replayed verbatim (the recorded tokens are returned instead of calling the engine; tool calls
  re-run in a fresh workspace, and any tool output that differs from the recording is counted
  in ``replay_mismatches``), then the last turn is regenerated with F before it. If the
  regenerated turn calls tools and the episode goes on, F is inserted before every further turn
  too, since any of them may turn out to be the final one.

With several turns carrying F, ``feedback_context="shared"`` keeps every earlier turn's F in
the context (the trainer's default ``expert_sequence: shared``); ``"exact"`` keeps only the F
of the turn being generated (``expert_sequence: exact``). The message is the criterion's
feedback in ``template`` (default: the config's ``judge.feedback_framing``), rendered by the
chat template as a ``framing``-role message (:func:`~megatron_tg.chat.feedback.feedback_message_ids`).
F does not count against the harness's ``max_context_tokens`` (it is not part of the rollout).

The statistics, the verdict and the printed report are :mod:`megatron_tg.judge.vet_report`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping, Sequence

from megatron_tg.chat.feedback import feedback_message_ids
from megatron_tg.chat.template import generation_prompt_ids
from megatron_tg.judge.feedback_context import FeedbackContext, replay_turns
from megatron_tg.judge.intervals import z_value
from megatron_tg.judge.judge import Judge
from megatron_tg.judge.rubric import Criterion, Rubric
from megatron_tg.judge.vet_report import CI_METHOD, criterion_report, tally_arm
from megatron_tg.rollout.context import RolloutContext
from megatron_tg.rollout.types import Rollout

FEEDBACK_CONTEXTS = ("shared", "exact")
BRANCH_SCOPES = ("final_turn", "rollout")


@dataclass
class VetConfig:
    samples: int = 8
    """Rollouts per task and arm."""
    confidence: float = 0.95
    min_improvement: float = 0.0
    """keep needs the criterion's pass-rate difference CI lower bound above this."""
    max_primary_drop: float = 0.05
    """keep needs the primary pass rate to drop by at most this (point estimate)."""
    feedback_context: str = "shared"
    framing: str = "user"
    """Role of the inserted feedback message (the trainer's ``judge.feedback_role``)."""
    template: str | None = None
    """Message text with ``{feedback}``; None = the config's ``judge.feedback_framing``."""
    concurrency: int = 8
    """Rollouts in flight at once."""

    def validate(self) -> None:
        if self.samples < 1:
            raise ValueError(f"samples must be >= 1, got {self.samples}")
        z_value(self.confidence)
        if self.feedback_context not in FEEDBACK_CONTEXTS:
            raise ValueError(f"feedback_context must be one of {FEEDBACK_CONTEXTS}")
        if self.max_primary_drop < 0:
            raise ValueError("max_primary_drop must be >= 0")
        if self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if "{feedback}" not in self.message_template():
            raise ValueError(f"template must contain {{feedback}}, got {self.template!r}")

    def message_template(self) -> str:
        if self.template is not None:
            return self.template
        from megatron_tg.config.rollout import JudgeConfig

        return JudgeConfig.feedback_framing


def feedback_text(feedback: str, template: str) -> str:
    return template.replace("{feedback}", feedback)


# ---------------------------------------------------------------------- the procedure
RolloutFn = Callable[[Any], Awaitable[Rollout]]
"""``rollout_fn(ctx) -> Rollout``: the agent loop (an :class:`~megatron_tg.agent.AgentHarness`
instance fits); ``ctx`` has ``task``, ``group_id``, ``rollout_id`` and ``generate``."""


async def vet_feedback(rubric: Rubric, tasks: Sequence[Any], tokenizer, client,
                       rollout_fn: RolloutFn, judge: Judge, cfg: VetConfig | None = None, *,
                       sampling_params: Mapping[str, Any] | None = None,
                       criteria: Sequence[str] | None = None,
                       feedback_overrides: Mapping[str, str] | None = None,
                       log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the vetting procedure; returns the JSON-able report (see :func:`format_report`)."""
    cfg = cfg or VetConfig()
    cfg.validate()
    overrides = dict(feedback_overrides or {})
    unknown = sorted(n for n in set(overrides) | set(criteria or ()) if n not in rubric.names)
    if unknown:
        raise ValueError(f"unknown criteria {unknown}; rubric {rubric.name!r} has {rubric.names}")
    targets: list[tuple[Criterion, str]] = []
    for c in rubric.criteria:
        fb = overrides.get(c.name, c.feedback)
        if fb and (criteria is None or c.name in criteria):
            targets.append((c, fb))
    if not targets:
        raise ValueError("no criterion with a feedback string to vet")
    say = log or (lambda _msg: None)
    gen = generation_prompt_ids(tokenizer)
    template = cfg.message_template()
    primary = rubric.primary_names()
    infos = {t.id: t for t in tasks}
    sem = asyncio.Semaphore(cfg.concurrency)
    params = dict(sampling_params or {})

    errors: list[str] = []

    async def one(task, rid: str, wrap: Callable[[Any], Any] | None):
        ctx = RolloutContext(client, task, group_id=f"vet/{task.id}", rollout_id=rid,
                             sampling_params=params, vocab_size=len(tokenizer))
        ctx = wrap(ctx) if wrap is not None else ctx
        async with sem:
            try:
                return await rollout_fn(ctx), ctx
            except Exception as e:  # one broken rollout must not sink the whole report
                errors.append(f"rollout {rid} failed: {type(e).__name__}: {e}")
                say(errors[-1])
                return None, ctx

    async def judged(items):
        ok = [(ro, ctx) for ro, ctx in items if ro is not None]
        results = await judge.judge_many([ro for ro, _ in ok], task_infos=infos)
        return [(ro, ctx, res) for (ro, ctx), res in zip(ok, results)], len(items) - len(ok)

    say(f"baseline: {len(tasks)} task(s) x {cfg.samples} rollout(s) without feedback")
    base_items = await asyncio.gather(*(one(t, f"without/{t.id}/{i}", None)
                                        for t in tasks for i in range(cfg.samples)))
    base, base_failed = await judged(base_items)
    if not base:  # e.g. no sandbox, engine down: a setup problem, not a verdict
        raise RuntimeError(f"every baseline rollout failed; first error: {errors[0]}")

    persist = cfg.feedback_context == "shared"

    def arm_coros(c: Criterion, fb: str) -> tuple[str, list]:
        f_ids = feedback_message_ids(tokenizer, feedback_text(fb, template), cfg.framing)
        if c.scope in BRANCH_SCOPES:
            say(f"{c.name}: regenerating the last turn of {len(base)} rollout(s) with feedback")
            coros = []
            for ro, base_ctx, _ in base:
                k = max(ro.num_turns - 1, 0)
                wrap = (lambda ctx, k=k, ro=ro: FeedbackContext(
                    ctx, f_ids, gen, start_turn=k, persist=persist, replay=replay_turns(ro, k)))
                coros.append(one(base_ctx.task, f"with/{c.name}/{ro.rollout_id}", wrap))
            return "branch_final_turn", coros
        say(f"{c.name}: {len(tasks)} task(s) x {cfg.samples} rollout(s) with feedback "
            "before every turn")
        wrap = lambda ctx: FeedbackContext(ctx, f_ids, gen, persist=persist)  # noqa: E731
        return "fresh", [one(t, f"with/{c.name}/{t.id}/{i}", wrap)
                         for t in tasks for i in range(cfg.samples)]

    # All criteria's arms run concurrently (the semaphore bounds the load), then are judged.
    plans = [arm_coros(c, fb) for c, fb in targets]
    flat = await asyncio.gather(*(co for _, coros in plans for co in coros))
    reports, pos = [], 0
    for (c, fb), (design, coros) in zip(targets, plans):
        items = flat[pos:pos + len(coros)]
        pos += len(coros)
        with_, with_failed = await judged(items)
        mismatches = sum(getattr(ctx, "replay_mismatches", 0) for _, ctx in items)
        reports.append(criterion_report(
            c, fb, design, tally_arm(base, base_failed, c.name, primary),
            tally_arm(with_, with_failed, c.name, primary), primary, confidence=cfg.confidence,
            min_improvement=cfg.min_improvement, max_primary_drop=cfg.max_primary_drop,
            mismatches=mismatches))
    return {
        "rubric": rubric.name, "rubric_source": rubric.source,
        "tasks": [t.id for t in tasks], "samples_per_task": cfg.samples,
        "sampling_params": params, "confidence": cfg.confidence, "ci_method": CI_METHOD,
        "thresholds": {"min_improvement": cfg.min_improvement,
                       "max_primary_drop": cfg.max_primary_drop},
        "feedback_context": cfg.feedback_context, "framing": cfg.framing,
        "template": template, "primary_criteria": primary,
        "criteria": [r.to_dict() for r in reports],
    }
