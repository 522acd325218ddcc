"""``python -m megatron_tg.train`` / ``megatron-tg train``: run the TG loop from a recipe.

The default rollout side is the agentic coding harness over ``rollout.tasks`` (a JSONL
task file; the built-in Python tasks when unset), judged by ``judge.rubric``. Launch one
process per GPU (torchrun locally, srun on Slurm); a plain ``python`` is a world of one.
"""

from __future__ import annotations

import argparse
import os
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", help="YAML recipe merged over the defaults")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")


def default_rollout_side(trainer):
    """Rank 0's rollout machinery for a recipe: harness + tasks + rubric + engines."""
    from megatron_tg.agent.harness import AgentHarness
    from megatron_tg.agent.tasks import builtin_tasks, load_tasks
    from megatron_tg.judge import LLMJudgeClient, LLMJudgeConfig, load_rubric
    from megatron_tg.sampling.rollouts import RolloutSide

    cfg = trainer.cfg
    if not cfg.judge.rubric:
        raise ValueError("judge.rubric must name a rubric YAML (e.g. recipes/rubrics/tool_format.yaml)")
    rubric = load_rubric(cfg.judge.rubric)
    llm = None
    if rubric.llm_criteria():
        if not cfg.judge.endpoint:
            raise ValueError(f"rubric {rubric.name!r} has LLM-judged criteria: set judge.endpoint")
        j = cfg.judge
        llm = LLMJudgeClient(LLMJudgeConfig(base_url=j.endpoint, model=j.model or "judge",
                                            timeout_s=j.timeout_s, max_attempts=j.max_retries + 1,
                                            max_concurrency=j.max_concurrency,
                                            max_transcript_chars=j.max_transcript_chars,
                                            overflow_retries=j.overflow_retries,
                                            api_key_file=j.api_key_file))
    tasks = load_tasks(cfg.rollout.tasks, repos_root=cfg.rollout.repos_root) if cfg.rollout.tasks else builtin_tasks()
    harness = AgentHarness(trainer.tokenizer, cfg.rollout)
    side = RolloutSide(cfg, trainer.tokenizer, harness, tasks, rubric,
                       engine_model_dir=cfg.model.hf_checkpoint, log_dir=cfg.logging.run_dir,
                       version=0, llm=llm)  # engines start on the base weights: version 0
    if cfg.evaluation.tasks:
        from megatron_tg.eval.heldout import attach_evaluation, disjoint_tasks

        held_out = disjoint_tasks(load_tasks(cfg.evaluation.tasks), tasks, cfg.evaluation.tasks,
                                  transcripts=cfg.sft.data or None)
        attach_evaluation(side, harness, held_out, cfg)
    return side


def check_task_file(path: str | None) -> None:
    """Refuse a missing task file before any model is built (minutes on a cluster)."""
    if path is not None and not os.path.isfile(path):
        raise SystemExit(f"rollout.tasks: task file {os.path.abspath(path)} does not exist "
                         "(the README's agent section says how to build one)")


def run(args: argparse.Namespace) -> int:
    from megatron_tg.config import load_config, save_resolved
    from megatron_tg.train.signals import dump_stacks_on_signal

    dump_stacks_on_signal()  # kill -USR2 <pid>: every thread's stack, for a hung rank
    from megatron_tg.train.loop import run as run_loop

    cfg = load_config(args.recipe, list(args.overrides))
    check_task_file(cfg.rollout.tasks)
    from megatron_tg.eval.disjoint import check_recipe

    check_recipe(cfg)  # held-out tasks overlapping the training data: refused before any model
    from megatron_tg.parallel.state import LaunchEnv

    if LaunchEnv.from_env().rank == 0:  # the one reading of torchrun / srun ranks
        save_resolved(cfg)
    from megatron_tg.sampling.service.client import rollout_source
    from megatron_tg.sampling.service.server import FactorySpec

    # rollout.service: in rank 0's process, or a service process (docs/rollout-service.md)
    return run_loop(cfg, make_rollout_side=rollout_source(FactorySpec(
        "megatron_tg.train.command:default_rollout_side")))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_tg.train", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
