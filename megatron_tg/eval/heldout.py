"""Held-out evaluation on the engines' current weights.

:class:`HeldOutEvaluation` is a probe of the rollout side (:class:`~megatron_tg.train.rollouts.
RolloutSide`): the loop runs the side's probes after each weight sync and once before the
first step, so the evaluation sees step 0 (the base policy), every ``evaluation.every``-th
step and the last step. It rolls out ``evaluation.samples`` rollouts per held-out task with
the run's own rollout function (the harness, or the demo's agent) through the same client
and version gate as training rollouts, judges them with the run's judge and returns:

* ``eval/pass@1``: the fraction of judged rollouts whose primary criteria all pass (the
  rubric's ``primary`` criteria or ``objective.primary_criteria``; every criterion when none
  is primary). With one sample per task this is pass@1 over tasks; with more it is the mean
  of each task's per-sample pass rate (every task has the same number of samples);
* ``eval/criteria/<name>``: each criterion's pass rate;
* ``..._lo`` / ``..._hi``: Wilson score intervals at ``evaluation.confidence`` (rollouts taken
  as independent draws; with several samples per task they are correlated within a task,
  so the interval is then somewhat narrower than the truth);
* ``eval/n`` (judged rollouts), ``eval/tasks``, ``eval/rollout_errors`` (rollouts that
  raised, e.g. an engine error: excluded, counted), ``eval/judge_errors`` (excluded, counted),
  ``eval/seconds``, and the run's task-specific rollout metrics under ``eval/``.

Nothing here is trained on: the rollouts never reach the manager's buffer.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from statistics import NormalDist
from typing import Any, Callable, Mapping, Sequence

from megatron_tg.rollout.context import RolloutContext, request_seed
from megatron_tg.rollout.types import Rollout

log = logging.getLogger(__name__)

EVAL_SEED = 7_340_033
"""Mixed into the request seeds of held-out rollouts (when ``rollout.sampling_seed`` is set),
so they never reuse a training rollout's seed."""


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a binomial rate; (0, 1) when there is no observation."""
    if n <= 0:
        return 0.0, 1.0
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in [0, n={n}], got {successes}")
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def rates(passed: Sequence[Mapping[str, bool]], criteria: Sequence[str], primary: Sequence[str],
          confidence: float = 0.95, prefix: str = "eval/") -> dict[str, float]:
    """pass@1 and per-criterion rates with intervals from judged rollouts' ``passed`` maps."""
    n = len(passed)
    out: dict[str, float] = {f"{prefix}n": float(n)}

    def put(key: str, k: int) -> None:
        lo, hi = wilson_interval(k, n, confidence)
        out[key] = k / n if n else float("nan")
        out[f"{key}_lo"], out[f"{key}_hi"] = lo, hi

    gate = list(primary) or list(criteria)
    put(f"{prefix}pass@1", sum(1 for p in passed if all(p.get(c, False) for c in gate)))
    for c in criteria:
        put(f"{prefix}criteria/{c}", sum(1 for p in passed if p.get(c, False)))
    return out


class HeldOutEvaluation:
    """``fn(step) -> metrics`` for :attr:`RolloutSide.probes` (registered by
    :func:`attach_evaluation`); returns ``{}`` at steps that are not due."""

    def __init__(self, side, rollout_fn: Callable[[RolloutContext], Any], tasks: Sequence[Any],
                 cfg, *, rollout_metrics: Callable[[Sequence[Rollout]], dict[str, float]] | None = None,
                 task_info: Callable[[Any], Any] | None = None) -> None:
        from megatron_tg.judge.rubric import primary_criteria

        ev = cfg.evaluation
        self.side, self.rollout_fn, self.cfg = side, rollout_fn, cfg
        self.tasks = list(tasks)[: ev.num_tasks or None]
        if not self.tasks:
            raise ValueError("evaluation: no held-out tasks (evaluation.tasks / evaluation.num_tasks)")
        self.rollout_metrics = rollout_metrics
        # What the judge gets as a task's privileged info; the training side passes the task.
        self.task_info = task_info or (lambda t: t)
        self.criteria = [c.name for c in side.rubric.criteria]
        self.primary = primary_criteria(cfg.objective, side.rubric)
        self.last: dict[str, Any] = {}
        """The latest evaluation's per-rollout records (task, rollout id, passed, error)."""

    def due(self, step: int) -> bool:
        every = self.cfg.evaluation.every
        return step == 0 or step == self.cfg.steps or (every > 0 and step % every == 0)

    def __call__(self, step: int) -> dict[str, float]:
        return self.run(step) if self.due(step) else {}

    def run(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        rollouts, errors = self.side.call(self._generate(step))
        infos = {ro.task_id: self.task_info(task) for task, ro in rollouts}
        results = self.side.call(self.side.judge.judge_many([ro for _, ro in rollouts],
                                                            task_infos=infos))
        judged = [(ro, res) for (_, ro), res in zip(rollouts, results) if res.trainable]
        out = rates([res.passed for _, res in judged], self.criteria, self.primary,
                    self.cfg.evaluation.confidence)
        out.update({"eval/tasks": float(len(self.tasks)), "eval/rollout_errors": float(len(errors)),
                    "eval/judge_errors": float(len(results) - len(judged))})
        if self.rollout_metrics is not None and rollouts:
            out.update({f"eval/{k}": v for k, v in self.rollout_metrics([ro for _, ro in rollouts]).items()})
        out["eval/seconds"] = time.perf_counter() - t0
        self.last = {"step": step, "metrics": out, "rollouts": [
            {"task_id": ro.task_id, "rollout_id": ro.rollout_id, "passed": dict(res.passed),
             "judge_error": res.judge_error} for (_, ro), res in zip(rollouts, results)],
            "errors": errors}
        return out

    async def _generate(self, step: int) -> tuple[list[tuple[Any, Rollout]], list[str]]:
        r, ev, manager = self.cfg.rollout, self.cfg.evaluation, self.side.manager
        params = {**manager.sampling_params, "temperature": ev.temperature}
        limit = asyncio.Semaphore(manager.max_inflight_rollouts)

        async def one(ti: int, task: Any, i: int) -> Rollout:
            tid = getattr(task, "id", None) or f"task{ti}"
            ctx = RolloutContext(
                self.side.client, task, group_id=f"eval{step}/{tid}", rollout_id=f"eval{step}/{tid}/{i}",
                index=i, gate=manager.gate, sampling_params=params, max_aborts=r.max_retries,
                vocab_size=manager.vocab_size,
                seed=None if r.sampling_seed is None else request_seed(r.sampling_seed, EVAL_SEED, step, ti, i))
            async with limit:
                ro = await self.rollout_fn(ctx)
            ro.rollout_id = ro.rollout_id or ctx.rollout_id
            return ro.validate(manager.vocab_size)

        jobs = [(task, one(ti, task, i)) for ti, task in enumerate(self.tasks) for i in range(ev.samples)]
        done = await asyncio.gather(*(j for _, j in jobs), return_exceptions=True)
        ok, errors = [], []
        for (task, _), res in zip(jobs, done):
            if isinstance(res, BaseException):
                log.warning("held-out rollout failed: %s: %s", type(res).__name__, res)
                errors.append(f"{type(res).__name__}: {res}")
            else:
                ok.append((task, res))
        return ok, errors


def disjoint_tasks(held_out: Sequence[Any], train: Sequence[Any], source: str) -> list[Any]:
    """``held_out``, refused if any of its task ids is also a training task: a held-out number
    on tasks the policy trains on would measure memorisation, not generalisation."""
    from megatron_tg.config.base import ConfigError

    shared = sorted({t.id for t in held_out} & {t.id for t in train})
    if shared:
        raise ConfigError(f"evaluation.tasks: {len(shared)} task id(s) of {source} are also "
                          f"training tasks (rollout.tasks): {shared[:5]}")
    return list(held_out)


def attach_evaluation(side, rollout_fn, tasks: Sequence[Any], cfg, **kw) -> HeldOutEvaluation:
    """Register a held-out evaluation as a probe of ``side`` (checked every step; it decides
    which steps are due)."""
    ev = HeldOutEvaluation(side, rollout_fn, tasks, cfg, **kw)
    side.probes.append((1, ev))
    return ev
