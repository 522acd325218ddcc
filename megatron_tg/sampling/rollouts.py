"""Global rank 0's rollout side: engines, client, manager and judge on a background event loop.

Generation never waits for training (PipelineRL-style): the manager keeps producing groups
on the background loop while the trainer's main thread trains; the main thread only blocks
in :meth:`RolloutSide.next_batch` (for judged groups) and in :meth:`RolloutSide.run_sync`
(the weight push, :func:`megatron_tg.weight_sync.sync.sync_to_engines`). The loop sees only
the :class:`~megatron_tg.sampling.protocols.RolloutSource` interface.

Rewards and feedback (what the objective receives):
- each rubric criterion is a 0/1 score; the scalar reward is Σ_c w_c · score_c with the
  rubric's weights, unless ``objective.criterion_weights`` names a criterion (then that
  weight wins); mode ``opsd`` keeps only primary criteria (rubric ``primary: true`` or
  ``objective.primary_criteria``). Advantages are group-relative over the rollouts of a
  group that were judged without error;
- a rollout whose judging failed is excluded and reported to the manager as dropped
  (``judge_error``) when its whole group is lost; never counted as a pass or a fail;
- feedback: the judge's failing turns in ``tg``/``no_thinking`` (with
  ``objective.expert_feedback="covered"`` each failing turn's text names every criterion
  covering it); in ``always_on``/``opsd`` every assistant turn a criterion covers gets that
  criterion's feedback, failing or not.
  The text is framed by ``judge.feedback_framing`` (``{feedback}`` replaced) before it is
  inserted as a message, exactly as the vetting tool and the demo's SFT data frame it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import statistics
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

import torch

from megatron_tg.auth import KEY_FILE_ENV, read_key, write_key_dir
from megatron_tg.config.schema import TGConfig
from megatron_tg.judge import Judge
from megatron_tg.judge.rubric import Rubric, primary_criteria
from megatron_tg.objectives import combine_rewards, group_advantages, mode_switches
from megatron_tg.rollout.client import SGLangClient
from megatron_tg.rollout.group_producer import RolloutGroup
from megatron_tg.rollout.manager import RolloutManager
from megatron_tg.rollout.types import Rollout
from megatron_tg.sampling.protocols import WeightTarget
from megatron_tg.sampling.train_sample import TrainSample
from megatron_tg.weight_sync.engine_loss import form_target
from megatron_tg.weight_sync.sync import SyncStats

log = logging.getLogger(__name__)


def _covered_turns(rollout: Rollout, scope: str) -> list[int]:
    n = rollout.num_turns
    if n == 0:
        return []
    if scope == "final_turn":  # a rollout cut by a limit has no final turn (judge/rubric.py)
        return [n - 1] if rollout.finish_reason == "stop" else []
    if scope == "rollout":
        return [n - 1]
    if scope == "any_tool_call":
        return [k for k, seg in enumerate(rollout.assistant_turns()) if seg.tool_calls]
    return list(range(n))  # every_turn


def feedback_for(rollout: Rollout, result, rubric: Rubric, always: bool,
                 covered: bool = False) -> dict[int, str]:
    """Turn -> feedback text: failing turns (``always=False``) or every covered turn; with
    ``covered`` (``objective.expert_feedback="covered"``) a failing turn's text holds every
    criterion covering it, not only the failed ones."""
    if not always:
        failing = result.feedback_by_turn()
        if not covered or not failing:
            return failing
        # a turn's failed criteria (the judge's text) plus the passed ones that cover it (the
        # rubric's text), in rubric order; the failed ones come from the judge, not from the
        # scopes, so a failing turn is never left without its own feedback
        fails = {k: dict(v) for k, v in result.failing_turns().items()}
        text: dict[int, list[str]] = {k: [] for k in failing}
        for c in rubric.criteria:
            if not c.feedback:
                continue
            covers = _covered_turns(rollout, c.scope)
            for k in text:
                if c.name in fails.get(k, {}):
                    text[k].append(fails[k][c.name])  # the judge's text for what failed
                elif k in covers:
                    text[k].append(c.feedback)
        return {k: "\n".join(v) for k, v in text.items()}
    out: dict[int, list[str]] = {}
    for c in rubric.criteria:
        if c.feedback:
            for k in _covered_turns(rollout, c.scope):
                out.setdefault(k, []).append(c.feedback)
    return {k: "\n".join(v) for k, v in out.items()}


def judge_drop_metrics(judged: Sequence[tuple[Rollout, Any]]) -> dict[str, float]:
    """Judge errors by rollout length, so a judge that drops the longest rollouts (the bias
    a context limit causes) shows up: the error rate of the shortest, middle and longest
    third of the batch by tokens, and the judge's overflow re-sends and transcript cuts."""
    if not judged:
        return {}
    order = sorted(judged, key=lambda x: len(x[0].token_ids))
    n = len(order)
    out: dict[str, float] = {}
    for name, part in (("short", order[: n // 3]), ("mid", order[n // 3: n - n // 3]),
                       ("long", order[n - n // 3:])):
        if part:
            out[f"judge/error_rate_{name}"] = sum(not r.trainable for _, r in part) / len(part)
    out["judge/overflow_errors"] = float(sum(r.judge_error_kind == "overflow" for _, r in judged))
    out["judge/overflow_retries"] = float(sum(r.llm_overflow_retries for _, r in judged))
    out["judge/truncated"] = float(sum(r.llm_omitted_turns > 0 for _, r in judged)) / n
    return out


def judged_samples(groups: Sequence[RolloutGroup], results, rubric: Rubric, cfg: TGConfig
                   ) -> tuple[list[TrainSample], list[str], dict[str, float]]:
    """TrainSamples with group-relative advantages; ids of groups lost to judge errors; metrics."""
    names = [c.name for c in rubric.criteria]
    obj = cfg.objective
    weights = {**rubric.weights(), **dict(obj.criterion_weights)}
    primary = primary_criteria(obj, rubric)
    obj_cfg = replace(obj, criterion_weights=weights, primary_criteria=primary)
    always = not mode_switches(obj).failing_turns_only
    covered = obj.expert_feedback == "covered"
    placebo = obj.expert_feedback == "placebo"
    flat = [(g, ro, res) for g, rs in zip(groups, results) for ro, res in zip(g.rollouts, rs)]
    # A rollout with no assistant token (its prompt alone filled rollout.max_context_tokens)
    # carries no training signal: excluded and counted, like a judge error.
    empty = sum(1 for _, ro, _ in flat if not ro.assistant_turns())
    ok = [(g, ro, res) for g, ro, res in flat if res.trainable and ro.assistant_turns()]
    lost = sorted({g.group_id for g in groups} - {g.group_id for g, _, _ in ok})
    metrics: dict[str, float] = {
        "rollout/judge_errors": float(sum(1 for _, _, res in flat if not res.trainable)),
        "rollout/empty": float(empty), "rollout/groups_lost": float(len(lost)),
        **judge_drop_metrics([(ro, res) for _, ro, res in flat])}
    if not ok:
        return [], lost, metrics
    scores = torch.tensor([[1.0 if res.passed.get(n, False) else 0.0 for n in names]
                           for _, _, res in ok])
    rewards = combine_rewards(scores, names, obj_cfg)
    position = {id(g): i for i, g in enumerate(groups)}
    gids = torch.tensor([position[id(g)] for g, _, _ in ok])
    adv = group_advantages(rewards, gids, obj_cfg)
    frame = cfg.judge.feedback_framing
    samples = [TrainSample(ro, float(a), {k: frame.replace("{feedback}", obj.placebo_feedback if placebo else text)
                                          for k, text in feedback_for(ro, res, rubric, always, covered).items()},
                           reward=float(r))
               for (g, ro, res), a, r in zip(ok, adv.tolist(), rewards.tolist())]
    for i, n in enumerate(names):
        metrics[f"criteria/{n}"] = float(scores[:, i].mean())
    if primary:
        idx = [names.index(n) for n in primary]
        metrics["criteria/primary"] = float(scores[:, idx].min(dim=1).values.mean())
    metrics["reward/mean"] = float(rewards.mean())
    metrics["reward/std"] = float(rewards.std()) if len(ok) > 1 else 0.0
    lengths = [sum(seg.end - seg.start for seg in s.rollout.assistant_turns()) for s in samples]
    metrics["rollout/response_tokens"] = float(statistics.mean(lengths))
    metrics["rollout/turns"] = float(statistics.mean(s.rollout.num_turns for s in samples))
    return samples, lost, metrics


def routing_spec(cfg: TGConfig) -> dict[str, Any] | None:
    """The MoE layout the rollouts' routed experts are collected for, when routing replay is
    on for a MoE policy (arguments of RoutedExpertsBuilder); else None."""
    if not cfg.rollout.routing_replay:
        return None
    from megatron_tg.models.qwen3_moe import Qwen3Arch

    arch = Qwen3Arch.from_hf(cfg.model.hf_config)
    if not arch.is_moe:
        return None
    return dict(moe_layers=arch.moe_layers, num_layers=arch.num_layers,
                top_k=arch.num_experts_per_tok, num_experts=arch.num_experts)


async def _on_loop(fn):
    """``fn()`` on the side's event loop (state the loop's tasks mutate is read there)."""
    return fn()


class RolloutSide:
    """Engines + client + manager + judge, driven from the trainer's main thread."""

    def __init__(self, cfg: TGConfig, tokenizer, rollout_fn: Callable, tasks: Sequence[Any],
                 rubric: Rubric, *, engine_model_dir: str | None, log_dir: str | Path,
                 version: int = 0, llm=None,
                 rollout_metrics: Callable[[Sequence[Rollout]], dict[str, float]] | None = None
                 ) -> None:
        self.cfg, self.rubric, self.tokenizer = cfg, rubric, tokenizer
        primary_criteria(cfg.objective, rubric)  # a bad name fails here, not at the first batch
        if cfg.rollout.tool_call_reading == "sglang":  # no sglang: fail now, not per rollout
            from megatron_tg.chat.tool_reading import require_sglang

            require_sglang()
        # Task-specific per-step metrics over every rollout of the batch (e.g. the demo's
        # episode verdicts), logged beside the judge's criteria.
        self.rollout_metrics = rollout_metrics
        # (every, fn): fn(step) -> metrics, run after the weight sync of every ``every``-th
        # step on the engines' new weights (e.g. the demo's expert probe).
        self.probes: list[tuple[int, Callable[[int], dict[str, float]]]] = []
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="rollouts", daemon=True)
        self._thread.start()
        self.engines = []
        key_file = cfg.rollout.api_key_file or os.environ.get(KEY_FILE_ENV) or None
        if cfg.rollout.engine == "embedded":
            from megatron_tg.rollout.engine.launch import start_engines

            if engine_model_dir is None:
                raise ValueError("the embedded engine needs an HF model directory to serve")
            if key_file is None:  # engines of our own, on a port anyone on this host can reach
                key_file = str(write_key_dir(Path(log_dir) / "engines" / "secret")[0])
            extra = ["--enable-return-routed-experts"] if routing_spec(cfg) else []
            if cfg.rollout.placement == "colocated":  # release/resume free and restore memory
                # and one from-tensor payload per engine TP rank, from the trainer rank on its GPU
                extra += ["--enable-memory-saver", "--tp-size", str(cfg.rollout.engine_tp)]
            self.engines = start_engines([Path(engine_model_dir)] * cfg.rollout.num_engines,
                                         Path(log_dir) / "engines", extra_args=extra,
                                         api_key_file=key_file)
            urls = [e.url for e in self.engines]
        else:
            urls = list(cfg.rollout.server_urls)
            if not urls:
                raise ValueError("rollout.server_urls is empty (needed when rollout.engine=sglang)")
        r, t = cfg.rollout, cfg.timeouts
        limits = dict(timeout_s=r.request_timeout_s, max_retries=r.max_retries,
                      admin_timeout_s=t.http_admin_s, connect_timeout_s=t.http_connect_s,
                      probe_interval_s=t.health_interval_s, health_timeout_s=t.health_s,
                      api_key=read_key(key_file) if key_file else None)
        # Generation via the router (when there is one); admin calls to every engine directly.
        self.client = (SGLangClient([r.router_url], admin_urls=urls, **limits) if r.router_url
                       else SGLangClient(urls, **limits))
        self.manager = RolloutManager(self.client, rollout_fn, tasks, r, epochs=None,
                                      vocab_size=len(tokenizer), initial_version=version,
                                      routing=routing_spec(cfg))
        self.judge = Judge(rubric, tokenizer, llm=llm, tool_call_reading=r.tool_call_reading)
        self.weight_target_: WeightTarget | None = None
        self.last_judged: list[tuple[Rollout, Any]] = []

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def weight_target(self) -> WeightTarget:
        """The engines' client and the weight-update group, formed on first use: on the
        trainer's host for embedded engines, else ``rollout.sync_master_address`` or this
        host's name; NCCL for SGLang engines when the trainer has a GPU (``sync_backend``)."""
        if self.weight_target_ is None:
            r = self.cfg.rollout
            host = r.sync_master_address or ("127.0.0.1" if self.engines else socket.gethostname())
            backend = r.sync_backend if r.sync_backend != "auto" else (
                "nccl" if r.engine == "sglang" and torch.cuda.is_available() else "gloo")
            # one target for the run: a lost or returned engine replaces its group in place
            self.weight_target_ = form_target(self.call, self.client, host, backend,
                                              self.cfg.timeouts.weight_sync_s, r.router_url)
        return self.weight_target_

    def run_sync(self, push: Callable[[], Awaitable[SyncStats]], version: int, *,
                 restart: bool = False) -> SyncStats:
        """``push`` with generation paused (the manager's pause mode), then serve ``version``;
        ``restart``: right after the engines started, so straight to the engines."""
        if restart:
            stats = self.call(push())
            self.call(_on_loop(lambda: self.manager.adopt_version(version)))
            return stats
        return self.call(self.manager.update_weights(push, version=version))

    def next_batch(self, version: int) -> tuple[list[TrainSample], dict[str, float]]:
        groups = self.call(self.manager.get_batch(version))
        infos = {g.rollouts[0].task_id: g.task for g in groups if g.rollouts}
        results = self.call(self.judge.judge_many([ro for g in groups for ro in g.rollouts],
                                                  task_infos=infos))
        it = iter(results)
        per_group = [[next(it) for _ in g.rollouts] for g in groups]
        samples, lost, metrics = judged_samples(groups, per_group, self.rubric, self.cfg)
        obj = self.cfg.objective
        if obj.hinted_samples and mode_switches(obj).kl and samples:
            from megatron_tg.sampling.hinted import add_hinted_turns

            metrics.update(self.call(add_hinted_turns(
                self.client, samples, self.tokenizer, n=obj.hinted_samples,
                framing=self.cfg.judge.feedback_role, sampling_params=self.manager.sampling_params,
                seed=self.cfg.rollout.sampling_seed, routing=self.manager.routing,
                vocab_size=len(self.tokenizer))))
        # Every rollout with its verdict, judge errors included, for the per-sample records.
        self.last_judged = [(ro, res) for g, rs in zip(groups, per_group)
                            for ro, res in zip(g.rollouts, rs)]
        if self.rollout_metrics is not None:
            metrics.update(self.rollout_metrics([ro for g in groups for ro in g.rollouts]))
        for gid in lost:
            self.manager.report_dropped(gid, "judge_error")
        metrics["rollout/staleness_max"] = float(max((g.staleness(version) for g in groups),
                                                    default=0))
        metrics["rollout/gen_seconds"] = float(sum(g.gen_seconds for g in groups))
        metrics.update({f"manager/{k}": float(v) for k, v in self.manager.counters().items()
                        if isinstance(v, (int, float))})
        metrics.update(self.call(_on_loop(self.manager.capacity_metrics)))
        return samples, metrics

    def probe_metrics(self, step: int) -> dict[str, float]:
        """The probes due at ``step``. A probe is a measurement, not training: one that fails
        (e.g. an engine error) is logged and counted in ``probe/errors``, and training goes on."""
        out: dict[str, float] = {}
        for every, fn in self.probes:
            if every > 0 and step % every == 0:
                try:
                    out.update(fn(step))
                except Exception:
                    log.warning("probe %r failed at step %d", fn, step, exc_info=True)
                    out["probe/errors"] = out.get("probe/errors", 0.0) + 1.0
        return out

    def identity(self) -> dict[str, Any]:
        """The judge and the engines as the run manifest records them (see
        :mod:`megatron_tg.train.manifest`); an engine that does not answer is recorded so."""
        from megatron_tg.train.manifest import judge_identity

        keep = ("version", "model_path", "tp_size", "dp_size", "weight_version",
                "enable_deterministic_inference", "served_model_name")
        try:
            infos = self.call(self.client.get_server_info())
        except Exception as exc:  # noqa: BLE001 - the manifest says what it could not learn
            infos, error = {}, f"{type(exc).__name__}: {exc}"
        else:
            error = "no reply"
        engines = [{"url": u, **({k: infos[u].get(k) for k in keep if k in infos[u]}
                                  if isinstance(infos.get(u), dict) else {"error": error})}
                   for u in self.client.admin_urls]
        return {"judge": judge_identity(self.cfg, self.cfg.judge.rubric), "engines": engines}

    def state_dict(self) -> dict[str, Any]:
        return self.manager.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.manager.load_state_dict(state)

    def close(self) -> None:
        try:
            self.call(self.manager.stop())
            if self.weight_target_ is not None:
                self.call(self.client.destroy_weights_update_group(self.weight_target_.group))
            self.call(self.client.close())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
            for e in self.engines:
                e.stop()
