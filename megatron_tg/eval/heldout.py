"""Held-out evaluation on the engines' current weights.

:class:`HeldOutEvaluation` is a probe of the rollout side (:class:`~megatron_tg.sampling.rollouts.
RolloutSide`): the loop runs the side's probes after each weight sync and once before the
first step, so the evaluation sees step 0 (the base policy), every ``evaluation.every``-th
step and the last step. It rolls out ``evaluation.samples`` rollouts per held-out task with
the run's own rollout function (the harness, or the demo's agent) through the same client
and version gate as training rollouts, judges them with the run's judge and returns:

* ``eval/pass@k`` for every k in 1..``evaluation.samples``: the unbiased estimator of
  Chen et al. (2021) per task (``c`` of ``n`` samples pass every primary criterion: the
  rubric's ``primary`` criteria or ``objective.primary_criteria``; every criterion when none
  is primary), averaged over tasks (:mod:`megatron_tg.eval.passk`). pass@1 is then the mean
  of each task's pass rate;
* ``eval/criteria/<name>``: each criterion's pass rate (the mean of the tasks' rates);
* ``..._lo`` / ``..._hi``: intervals at ``evaluation.confidence`` clustered by task (a
  Wilson interval at the effective sample size of the tasks' values: samples of one task are
  correlated, the tasks are the independent units; :func:`~megatron_tg.eval.passk.
  clustered_interval`). With one sample per task it is the Wilson interval over tasks;
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
from typing import Any, Callable, Mapping, Sequence

from megatron_tg.rollout.context import RolloutContext, request_seed
from megatron_tg.rollout.types import Rollout

log = logging.getLogger(__name__)

EVAL_SEED = 7_340_033
"""Mixed into the request seeds of held-out rollouts (when ``rollout.sampling_seed`` is set),
so they never reuse a training rollout's seed."""


def rates(passed: Sequence[Mapping[str, bool]], criteria: Sequence[str], primary: Sequence[str],
          confidence: float = 0.95, prefix: str = "eval/",
          task_ids: Sequence[str] | None = None) -> dict[str, float]:
    """pass@k (k = 1..the fewest samples of a task) and per-criterion rates, with intervals
    clustered by task, from judged rollouts' ``passed`` maps. ``task_ids[i]`` names the task
    of rollout ``i``; None: every rollout is its own task (one sample per task)."""
    from megatron_tg.eval.passk import by_task, clustered_interval, pass_at_k_table

    n = len(passed)
    ids = list(task_ids) if task_ids is not None else [str(i) for i in range(n)]
    out: dict[str, float] = {f"{prefix}n": float(n)}
    gate = list(primary) or list(criteria)
    ok = [all(p.get(c, False) for c in gate) for p in passed]
    table = pass_at_k_table(by_task(ids, ok), confidence)
    if not table:
        table = {1: (math.nan, 0.0, 1.0)}
    for k, (mean, lo, hi) in table.items():
        out[f"{prefix}pass@{k}"], out[f"{prefix}pass@{k}_lo"], out[f"{prefix}pass@{k}_hi"] = \
            mean, lo, hi
    for c in criteria:
        counts = by_task(ids, [p.get(c, False) for p in passed])
        mean, lo, hi = clustered_interval([k / m for m, k in counts.values()],
                                          [m for m, _ in counts.values()], confidence)
        key = f"{prefix}criteria/{c}"
        out[key], out[f"{key}_lo"], out[f"{key}_hi"] = mean, lo, hi
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
        # Samples are clustered by the task they came from (its position in the list: ids
        # of generated tasks need not be unique or set).
        index = {id(t): i for i, t in enumerate(self.tasks)}
        judged = [(str(index[id(task)]), res) for (task, _), res in zip(rollouts, results)
                  if res.trainable]
        out = rates([res.passed for _, res in judged], self.criteria, self.primary,
                    self.cfg.evaluation.confidence, task_ids=[k for k, _ in judged])
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


def disjoint_tasks(held_out: Sequence[Any], train: Sequence[Any], source: str,
                   transcripts: str | None = None) -> list[Any]:
    """``held_out``, refused if any task is also a training task (by id, by content: text,
    tests, SWE repository) or its text is a user turn of the SFT transcripts
    (:mod:`megatron_tg.eval.disjoint`)."""
    from megatron_tg.eval.disjoint import check_disjoint

    return check_disjoint(held_out, train=train, transcripts_path=transcripts,
                          source=f"evaluation.tasks ({source})")


def attach_evaluation(side, rollout_fn, tasks: Sequence[Any], cfg, **kw) -> HeldOutEvaluation:
    """Register a held-out evaluation as a probe of ``side`` (checked every step; it decides
    which steps are due)."""
    ev = HeldOutEvaluation(side, rollout_fn, tasks, cfg, **kw)
    side.probes.append((1, ev))
    return ev
