"""``megatron-tg eval``: the held-out evaluation of a checkpoint, once, on its own.

    megatron-tg eval --recipe R [--checkpoint DIR] [--out FILE] [key=value ...]

Builds the trainer exactly as ``megatron-tg train`` does (``model.*`` initial weights; with
``--checkpoint``, or ``checkpoint.dir`` holding one, the newest trainer checkpoint there is
loaded over them), starts the recipe's rollout side, pushes the trainer's weights to the
engines, and runs the ``evaluation.*`` held-out evaluation the training loop runs: the same
rollouts, judge and metrics (``eval/*``, see :mod:`megatron_tg.eval.heldout`). Writes one JSON
object (metrics plus every rollout's verdict) to ``--out`` (default
``RUN_DIR/eval_step_NNNNNN.json``) and prints the metrics. Launch like ``train`` (one process
per GPU); a plain ``python`` is a world of one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", help="YAML recipe merged over the defaults")
    parser.add_argument("--checkpoint", help="a trainer checkpoint directory (checkpoint.dir of a "
                        "run); its newest step is evaluated. Default: the recipe's checkpoint.dir "
                        "if it holds one, else the model.* initial weights")
    parser.add_argument("--out", help="JSON file to write (default RUN_DIR/eval_step_NNNNNN.json)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")


def evaluate(cfg, make_rollout_side) -> dict | None:
    """Collective over the trainer's ranks; rank 0 returns the record, the others None."""
    import torch.distributed as dist

    from megatron_tg.config.base import ConfigError
    from megatron_tg.eval.heldout import HeldOutEvaluation
    from megatron_tg.train.trainer import Trainer
    from megatron_tg.weight_sync.sync import SyncChecks, sync_to_engines

    if not cfg.evaluation.enabled():
        raise ConfigError("evaluation.tasks: empty, so there is nothing held out to evaluate; "
                          "set evaluation.tasks=FILE.jsonl")
    trainer = Trainer(cfg)
    trainer.resume()
    side = make_rollout_side(trainer) if trainer.ctx.rank == 0 else None
    try:
        # Always push: the engines start on model.hf_checkpoint, which need not be these weights.
        sync_to_engines(trainer, side, SyncChecks.from_config(cfg.rollout), restart=True)
        record = None
        if side is not None:
            ev = next(fn for _, fn in side.probes if isinstance(fn, HeldOutEvaluation))
            metrics = ev.run(trainer.step)
            record = {"step": trainer.step, "checkpoint": cfg.checkpoint.dir if trainer.step else None,
                      **ev.last, "metrics": metrics}
    finally:
        if side is not None:
            side.close()
    dist.barrier()
    dist.destroy_process_group()
    return record


def run(args: argparse.Namespace) -> int:
    from megatron_tg.config import load_config
    from megatron_tg.train.command import default_rollout_side

    overrides = list(args.overrides)
    if args.checkpoint:
        if not (Path(args.checkpoint) / "latest").is_file():
            print(f"megatron-tg eval: error: --checkpoint {args.checkpoint}: no trainer checkpoint "
                  "there (no 'latest' marker; pass a run's checkpoint.dir)", file=sys.stderr)
            return 2
        overrides += [f"checkpoint.dir={args.checkpoint}", "checkpoint.resume=true"]
    cfg = load_config(args.recipe, overrides)
    from megatron_tg.config.base import ConfigError
    from megatron_tg.eval.disjoint import check_recipe

    try:  # before any model is built: held-out tasks that were trained on are refused
        check_recipe(cfg)
    except ConfigError as exc:
        print(f"megatron-tg eval: error: {exc}", file=sys.stderr)
        return 2
    record = evaluate(cfg, default_rollout_side)
    if record is None:
        return 0
    out = Path(args.out or Path(cfg.logging.run_dir) / f"eval_step_{record['step']:06d}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(json.dumps(record["metrics"], sort_keys=True))
    print(f"wrote {out}")
    return 0

