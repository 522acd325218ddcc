"""Feedback vetting (paper §4): keep a feedback string only if the model *with* it beats the
model *without* it.

The expert of targeted guidance is the policy itself with the feedback message inserted right
before a failing turn. It is only a useful teacher if that context really raises the criterion's
pass rate (the expert must have higher expected reward, paper eq. 1) without hurting the task.
Vetting measures this by generation: for each criterion that has a feedback string, sample
agent rollouts WITH the feedback inserted and WITHOUT it, judge both with the rubric, and
compare.

Where the feedback goes (the agent loop runs unchanged; :class:`FeedbackContext` wraps the
rollout context so that each engine request carries the student context with the framed
feedback message F inserted right before the generation prompt of the scoped turn(s), exactly
where :func:`megatron_tg.chat.feedback.insert_feedback` puts it for the expert; the rollout that
is recorded and judged is the student's, without F):

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

Statistics, per criterion (rollouts whose judging failed are excluded from both arms):

* pass rate without (p0 = k0/n0), with (p1 = k1/n1), and d = p1 − p0 with Newcombe's hybrid
  score interval (Newcombe 1998, method 10: built from the two Wilson score intervals). It
  treats the arms as independent samples; for the branched final-turn design the arms share
  their prefixes (positively correlated), which makes the interval conservative.
* the primary criterion (all of the rubric's ``primary`` criteria pass) the same way, plus the
  mean weighted primary reward of each arm.
* verdict ``keep`` iff the criterion's CI lower bound > ``min_improvement`` (default 0) AND the
  primary pass rate does not drop by more than ``max_primary_drop`` (point estimate: with a
  few dozen samples the CI of a drop is too wide to demand its bound). No multiple-comparison
  correction across criteria. A rubric without a primary criterion skips the primary check.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Awaitable, Callable, Mapping, Sequence

from megatron_tg.chat.feedback import feedback_message_ids
from megatron_tg.chat.template import generation_prompt_ids
from megatron_tg.judge.intervals import newcombe_interval, z_value
from megatron_tg.judge.judge import Judge, JudgeResult
from megatron_tg.judge.rubric import Criterion, Rubric
from megatron_tg.rollout.context import RolloutContext, TurnOutput
from megatron_tg.rollout.types import FramingError, Rollout

FEEDBACK_CONTEXTS = ("shared", "exact")
BRANCH_SCOPES = ("final_turn", "rollout")
CI_METHOD = "newcombe-hybrid-score (Wilson), independent arms"


# ---------------------------------------------------------------------- feedback in the loop
class FeedbackContext:
    """A rollout context whose engine requests carry the feedback message.

    The agent loop calls ``generate(ids)`` with its own (student) context, which always ends
    with the generation prompt G of the turn to generate and always extends the previous
    request plus its output. Turn k's insertion point is just before that G. Turns before
    ``start_turn`` are not targeted; turns listed in ``replay`` are answered from the
    recording (no engine call). Everything else is delegated to ``inner``.
    """

    def __init__(self, inner, feedback_ids: Sequence[int], gen_prompt_ids: Sequence[int], *,
                 start_turn: int = 0, persist: bool = True,
                 replay: Sequence[tuple[list[int], TurnOutput]] = ()):
        self.inner = inner
        self.feedback_ids = list(feedback_ids)
        self.gen = list(gen_prompt_ids)
        self.start_turn = int(start_turn)
        self.persist = bool(persist)
        self.replay = list(replay)
        self.points: list[int] = []     # insertion point of each turn so far (student positions)
        self.requests: list[list[int]] = []  # what the engine was sent (diagnostics, tests)
        self.replay_mismatches = 0
        self._prev: list[int] | None = None

    def __getattr__(self, name: str) -> Any:  # task, group_id, rollout_id, version, ...
        if name == "inner":  # not set yet (e.g. during copy): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def engine_context(self, ids: Sequence[int], turn: int) -> list[int]:
        """``ids`` with F inserted at the insertion points of the targeted turns <= ``turn``."""
        active = [p for j, p in enumerate(self.points[:turn + 1])
                  if j >= self.start_turn and (self.persist or j == turn)]
        out: list[int] = []
        prev = 0
        for p in active:
            out += list(ids[prev:p]) + self.feedback_ids
            prev = p
        return out + list(ids[prev:])

    async def generate(self, input_ids: Sequence[int], max_new_tokens: int | None = None,
                       **kw: Any) -> TurnOutput:
        ids = [int(t) for t in input_ids]
        if len(ids) < len(self.gen) or ids[len(ids) - len(self.gen):] != self.gen:
            raise FramingError("the agent loop's context does not end with the generation prompt")
        if self._prev is not None and ids[:len(self._prev)] != self._prev:
            raise FramingError("the agent loop's context does not extend the previous turn")
        turn = len(self.points)
        self.points.append(len(ids) - len(self.gen))
        if turn < len(self.replay):
            expected, out = self.replay[turn]
            if ids != expected:  # e.g. a tool whose output is not deterministic
                self.replay_mismatches += 1
            self._prev = ids + list(out.ids)
            return out
        ctx = self.engine_context(ids, turn)
        self.requests.append(ctx)
        out = await self.inner.generate(ctx, max_new_tokens=max_new_tokens, **kw)
        self._prev = ids + list(out.ids)
        return out


def replay_turns(rollout: Rollout, n: int) -> list[tuple[list[int], TurnOutput]]:
    """The first ``n`` assistant turns of ``rollout`` as recorded engine answers, each with the
    context it was generated from."""
    out = []
    for seg in rollout.assistant_turns()[:n]:
        v = int(seg.policy_version or 0)
        out.append((rollout.token_ids[:seg.start],
                    TurnOutput(rollout.token_ids[seg.start:seg.end], list(seg.logprobs or []), v,
                               [v], str(seg.meta.get("finish", "stop")))))
    return out


# ---------------------------------------------------------------------- report types
@dataclass
class Arm:
    """One condition (with / without feedback) of one criterion."""

    rollouts: int = 0        # generated
    rollout_errors: int = 0  # the rollout itself failed (engine / harness exception)
    judge_errors: int = 0    # judged with an error: excluded (never a silent pass or fail)
    n: int = 0               # judged without error: the denominator
    passed: int = 0          # criterion passed
    primary_passed: int | None = None   # every primary criterion passed (None: rubric has none)
    primary_reward: float | None = None  # mean weighted reward of the primary criteria

    @property
    def rate(self) -> float:
        return self.passed / self.n if self.n else math.nan

    @property
    def primary_rate(self) -> float | None:
        if self.primary_passed is None:
            return None
        return self.primary_passed / self.n if self.n else math.nan

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["rate"] = _num(self.rate)
        d["primary_rate"] = _num(self.primary_rate)
        return d


@dataclass
class CriterionReport:
    name: str
    scope: str
    feedback: str
    design: str
    """"fresh": independent rollouts with F before every turn; "branch_final_turn": each
    without-rollout's last turn regenerated with F (see module docstring)."""
    without: Arm
    with_: Arm
    diff: float
    ci: tuple[float, float]
    primary_diff: float | None
    primary_ci: tuple[float, float] | None
    verdict: str
    reasons: list[str] = field(default_factory=list)
    replay_mismatches: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "scope": self.scope, "feedback": self.feedback,
                "design": self.design, "without": self.without.to_dict(),
                "with": self.with_.to_dict(), "diff": _num(self.diff),
                "ci": [_num(x) for x in self.ci], "primary_diff": _num(self.primary_diff),
                "primary_ci": None if self.primary_ci is None else [_num(x) for x in self.primary_ci],
                "verdict": self.verdict, "reasons": list(self.reasons),
                "replay_mismatches": self.replay_mismatches}


def _num(x: float | None) -> float | None:
    """JSON-safe number (NaN -> None, so the report stays strict JSON)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return None
    return float(x)


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
        reports.append(_criterion_report(c, fb, design, base, base_failed, with_, with_failed,
                                         primary, cfg, mismatches))
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


def _arm(results: Sequence[tuple[Rollout, Any, JudgeResult]], failed: int, name: str,
         primary: Sequence[str]) -> Arm:
    arm = Arm(rollouts=len(results) + failed, rollout_errors=failed)
    good = [res for _, _, res in results if res.trainable and name in res.criteria]
    arm.judge_errors = len(results) - len(good)
    arm.n = len(good)
    arm.passed = sum(res.criteria[name].passed for res in good)
    if primary:
        arm.primary_passed = sum(all(res.criteria[p].passed for p in primary if p in res.criteria)
                                 for res in good)
        rewards = [res.reward_sum(primary) for res in good]
        rewards = [r for r in rewards if r is not None]
        arm.primary_reward = sum(rewards) / len(rewards) if rewards else None
    return arm


def _criterion_report(c: Criterion, fb: str, design: str, base, base_failed, with_, with_failed,
                      primary: Sequence[str], cfg: VetConfig, mismatches: int) -> CriterionReport:
    a0 = _arm(base, base_failed, c.name, primary)
    a1 = _arm(with_, with_failed, c.name, primary)
    d, lo, hi = newcombe_interval(a1.passed, a1.n, a0.passed, a0.n, cfg.confidence)
    reasons = []
    if a0.n == 0 or a1.n == 0:
        reasons.append("no judged rollouts in one arm")
    elif not lo > cfg.min_improvement:
        reasons.append(f"pass-rate gain not significant: CI lower bound {lo:+.3f} <= "
                       f"{cfg.min_improvement:+.3f}")
    pd = pci = None
    if primary and a0.n and a1.n:
        pd, plo, phi = newcombe_interval(a1.primary_passed, a1.n, a0.primary_passed, a0.n,
                                         cfg.confidence)
        pci = (plo, phi)
        if pd < -cfg.max_primary_drop - 1e-12:
            reasons.append(f"primary pass rate drops by {-pd:.3f} > {cfg.max_primary_drop:.3f}")
    return CriterionReport(c.name, c.scope, fb, design, a0, a1, d, (lo, hi), pd, pci,
                           "reject" if reasons else "keep", reasons, mismatches)


# ---------------------------------------------------------------------- printing
def format_report(report: Mapping[str, Any]) -> str:
    conf = int(round(100 * report["confidence"]))
    lines = [f"rubric {report['rubric']!r}: {len(report['tasks'])} task(s) x "
             f"{report['samples_per_task']} sample(s) per arm; {conf}% CI: {report['ci_method']}; "
             f"keep if CI low > {report['thresholds']['min_improvement']:+.2f} and primary drop "
             f"<= {report['thresholds']['max_primary_drop']:.2f}",
             ""]
    hdr = (f"{'criterion':<24} {'scope':<13} {'without':>12} {'with':>12} {'diff [CI]':>24} "
           f"{'primary pass w/o -> with':>28}  verdict")
    lines.append(hdr)

    def rate(arm):
        return f"{arm['passed']}/{arm['n']} {_fmt(arm['rate'])}"

    for r in report["criteria"]:
        ci = f"{_fmt(r['diff'], True)} [{_fmt(r['ci'][0], True)}, {_fmt(r['ci'][1], True)}]"
        if r["primary_diff"] is None:
            prim = "-"
        else:
            prim = (f"{_fmt(r['without']['primary_rate'])} -> {_fmt(r['with']['primary_rate'])} "
                    f"({_fmt(r['primary_diff'], True)})")
        lines.append(f"{r['name']:<24} {r['scope']:<13} {rate(r['without']):>12} "
                     f"{rate(r['with']):>12} {ci:>24} {prim:>28}  {r['verdict']}")
        for why in r["reasons"]:
            lines.append(f"    {why}")
        errs = sum(r[a][k] for a in ("without", "with") for k in ("rollout_errors", "judge_errors"))
        if errs or r["replay_mismatches"]:
            lines.append(f"    excluded: {errs} rollout(s) with rollout/judge errors; "
                         f"replay mismatches: {r['replay_mismatches']}")
    return "\n".join(lines)


def _fmt(x: float | None, signed: bool = False) -> str:
    if x is None:
        return "n/a"
    return f"{x:+.2f}" if signed else f"{x:.2f}"
