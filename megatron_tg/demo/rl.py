"""One RL run of the didactic demo through the project's real TG loop.

    python -m megatron_tg.demo.rl --recipe recipes/demo_cpu.yaml [key=value ...]

Everything but the task is the production path of :mod:`megatron_tg.train.loop`: the trainer
(megatron-core Qwen3-MoE, gloo) loads the converted base model, the embedded engine serves
it over SGLang's HTTP API, the :class:`~megatron_tg.rollout.manager.RolloutManager` runs
:class:`~megatron_tg.demo.agent.DemoAgent` episodes asynchronously, the judge scores them
with the demo rubric (``answer`` + ``search_lines``), and the trainer's GRPO + gated-KL step,
weight sync, checkpoint and metrics follow. The demo driver (``python -m megatron_tg.demo``)
launches one such process per method and seed.

Per step, besides the trainer's metrics, ``demo/*`` are the episode verdicts over every
rollout of the batch: ``demo/new_format`` (every search call used ``lines=``, at least one
call: the criterion the table reports), ``demo/success`` (the task), ``demo/both``,
``demo/search_calls``, and what goes wrong when the task fails: ``demo/malformed`` (rollouts
with a tool call that does not parse), ``demo/tool_error`` (a call the tool answered with an
error, e.g. a bad ``lines=``), ``demo/no_answer`` (the episode ended without a final answer
turn: cut off or out of turns), ``demo/turns`` (assistant turns per rollout).
With ``evaluation.num_tasks=N`` the held-out evaluation (:mod:`megatron_tg.eval`) rolls out N
tasks of the ``eval`` split at step 0, every ``evaluation.every`` steps and the last step:
``eval/criteria/*`` (the judge's, with intervals) and ``eval/demo/*`` (the episode verdicts).
With ``--probe-every N`` the expert is probed too: every N steps a few prompts are sampled
WITH the hint before the tool-call turn on the current weights, i.e. the expert's own
behaviour (``probe/new_format``, ``probe/success``), so a degrading expert is visible.
With ``--env paper --call-probe-every N`` the served policy's probabilities at the two tokens
that decide a ``lines`` call are read every N steps (:mod:`.call_probe`: ``probe/p_branch``,
``probe/p_close``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Sequence

from megatron_tg.demo import episodes as E
from megatron_tg.demo import task as T
from megatron_tg.rollout.types import Rollout

RL_TASKS = 4096
"""Prompts in the RL stream (split ``rl``; disjoint from SFT and evaluation tasks). A run of
60 steps x 8 prompts uses 480 of them: single-epoch, like the paper."""


HELD_OUT_START = 10_000
"""First index of the held-out evaluation's tasks in the ``eval`` split (the expert probe uses
the first ones): never trained on, the same tasks for every method of a seed."""


def episode_rates(rollouts: Sequence[Rollout]) -> dict[str, float]:
    """``demo/*`` metrics from the rollouts' episode verdicts (metadata set by DemoAgent)."""
    if not rollouts:
        return {}
    n = len(rollouts)
    md = [r.metadata for r in rollouts]
    return {"demo/new_format": sum(bool(m.get("new_format")) for m in md) / n,
            "demo/success": sum(bool(m.get("success")) for m in md) / n,
            "demo/both": sum(bool(m.get("success")) and bool(m.get("new_format")) for m in md) / n,
            "demo/search_calls": sum(int(m.get("n_search_calls", 0)) for m in md) / n,
            "demo/malformed": sum(int(m.get("n_malformed_calls", 0)) > 0 for m in md) / n,
            "demo/tool_error": sum(int(m.get("n_tool_errors", 0)) > 0 for m in md) / n,
            "demo/no_answer": sum(m.get("finish_reason", "stop") != "stop" for m in md) / n,
            "demo/turns": sum(int(m.get("n_turns", 0)) for m in md) / n,
            **_paper_rates(md)}


def _paper_rates(md: Sequence[dict]) -> dict[str, float]:
    """The paper suite environment's verdicts (:func:`.paper_env.episode_metrics`), when there."""
    if not md or "answer_style" not in md[0]:
        return {}
    n = len(md)
    return {"demo/answer_style": sum(bool(m.get("answer_style")) for m in md) / n,
            "demo/brief_thinking": sum(bool(m.get("brief_thinking")) for m in md) / n,
            "demo/thinking_words": sum(float(m.get("thinking_words", 0.0)) for m in md) / n,
            "demo/all_criteria": sum(bool(m.get("all_criteria")) for m in md) / n}


class ExpertProbe:
    """Sample ``n`` hinted episodes on the engine's current weights (the expert's behaviour).

    Runs on the rollout side's event loop with the same client; the hint is the trainer's
    framed feedback, where the trainer inserts it (right before the tool-call turn)."""

    def __init__(self, side, tokenizer, cfg, n: int, seed: int) -> None:
        self.side, self.tok, self.n = side, tokenizer, n
        self.tasks = T.make_tasks(n, seed=seed, split="eval")
        self.hint = T.hint_text(T.FEEDBACK, cfg.judge.feedback_framing)
        self.role = cfg.judge.feedback_role
        self.max_turns, self.max_new = cfg.rollout.max_turns, cfg.rollout.max_new_tokens

    def __call__(self, step: int) -> dict[str, float]:
        client = self.side.client

        async def one(ids: list[int], i: int) -> list[int]:
            res = await client.generate(ids, {"temperature": 1.0, "max_new_tokens": self.max_new,
                                              "sampling_seed": 7919 * step + i},
                                        return_logprob=False, rid=f"probe/{step}/{i}/{len(ids)}")
            return list(res.output_ids)

        def batch(inputs: list[list[int]]):
            async def all_():
                return await asyncio.gather(*(one(x, i) for i, x in enumerate(inputs)))
            return self.side.call(all_())

        eps = E.run_episodes(self.tasks, batch, self.tok, hint=self.hint, hint_role=self.role,
                             max_turns=self.max_turns)
        return {"probe/new_format": E.rate(eps, "new_format"), "probe/success": E.rate(eps, "success")}


ENVS = ("main", "paper")
"""``main``: the key lookup with the tool-format criterion (:mod:`.task`); ``paper``: the same
task with a thinking span and four criteria (:mod:`.paper_env`, the paper suite's)."""


def make_rollout_side(probe_every: int = 0, probe_n: int = 32, env: str = "main",
                      call_probe_every: int = 0, call_probe_n: int = 16):
    if env not in ENVS:
        raise ValueError(f"env must be one of {ENVS}, got {env!r}")
    if env == "paper" and probe_every > 0:
        raise ValueError("the expert probe samples the main environment's hint: use it with env=main")
    if env != "paper" and call_probe_every > 0:
        raise ValueError("the call probe reads the paper environment's reference calls: use it with env=paper")

    def factory(trainer):
        from megatron_tg.demo import paper_env as P
        from megatron_tg.demo.agent import DemoAgent
        from megatron_tg.sampling.rollouts import RolloutSide

        cfg = trainer.cfg
        agent = DemoAgent(trainer.tokenizer, max_turns=cfg.rollout.max_turns,
                          max_new_tokens=cfg.rollout.max_new_tokens,
                          max_context_tokens=cfg.rollout.max_context_tokens,
                          metrics_fn=P.episode_metrics if env == "paper" else T.episode_metrics)
        tasks = T.make_tasks(RL_TASKS, seed=cfg.seed, split="rl")
        rubric = P.rubric() if env == "paper" else T.rubric()
        side = RolloutSide(cfg, trainer.tokenizer, agent, tasks, rubric,
                           engine_model_dir=cfg.model.hf_checkpoint, log_dir=cfg.logging.run_dir,
                           version=0, rollout_metrics=episode_rates)
        if probe_every > 0:
            side.probes.append((probe_every, ExpertProbe(side, trainer.tokenizer, cfg, probe_n,
                                                         cfg.seed)))
        if call_probe_every > 0:
            from megatron_tg.demo.call_probe import CallProbe

            side.probes.append((call_probe_every, CallProbe(side, trainer.tokenizer, call_probe_n,
                                                            cfg.seed, HELD_OUT_START)))
        if cfg.evaluation.tasks:
            from megatron_tg.config.base import ConfigError

            raise ConfigError(f"evaluation.tasks: the demo's held-out tasks are its generator's "
                              f"eval split; set evaluation.num_tasks instead (got {cfg.evaluation.tasks!r})")
        if cfg.evaluation.num_tasks > 0:
            from megatron_tg.eval.heldout import attach_evaluation

            held_out = T.make_tasks(cfg.evaluation.num_tasks, seed=cfg.seed, start=HELD_OUT_START,
                                    split="eval")
            attach_evaluation(side, agent, held_out, cfg, rollout_metrics=episode_rates)
        return side
    return factory


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_tg.demo.rl", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="recipes/demo_cpu.yaml")
    ap.add_argument("--probe-every", type=int, default=0,
                    help="probe the expert (hinted episodes) every N steps; 0: never")
    ap.add_argument("--probe-n", type=int, default=32, help="episodes per probe")
    ap.add_argument("--call-probe-every", type=int, default=0,
                    help="env=paper: every N steps, the served policy's teacher-forced P(lines "
                         "branch) and P(</parameter> after the lines value) (demo/call_probe.py)")
    ap.add_argument("--call-probe-n", type=int, default=16, help="held-out tasks per call probe")
    ap.add_argument("--env", choices=ENVS, default="main",
                    help="main: the key lookup, one style criterion; paper: with thinking and "
                         "four criteria (the paper suite's environment)")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    a = ap.parse_args(argv)
    from megatron_tg.config import load_config, save_resolved
    from megatron_tg.train.loop import run

    cfg = load_config(a.recipe, list(a.overrides))
    from megatron_tg.parallel.state import LaunchEnv

    if LaunchEnv.from_env().rank == 0:  # the one reading of torchrun / srun ranks
        save_resolved(cfg)
    from megatron_tg.sampling.service.client import rollout_source
    from megatron_tg.sampling.service.server import FactorySpec

    # recipes/demo_cpu.yaml: rollout.service=local, the side in its own process beside the
    # trainer; the factory is named so that process can build the same side.
    return run(cfg, make_rollout_side=rollout_source(FactorySpec(
        "megatron_tg.demo.rl:make_rollout_side",
        {"probe_every": a.probe_every, "probe_n": a.probe_n, "env": a.env,
         "call_probe_every": a.call_probe_every, "call_probe_n": a.call_probe_n})))


if __name__ == "__main__":
    sys.exit(main())
