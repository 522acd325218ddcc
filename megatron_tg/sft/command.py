"""``megatron-tg sft``: supervised warm start of the policy on agent transcripts.

    megatron-tg sft --recipe R sft.data=transcripts.jsonl [key=value ...]

The same trainer as ``megatron-tg train`` (model, parallel layout, optimizer, checkpoints);
only the loss differs (see :mod:`megatron_tg.sft.train`). Launch one process per GPU
(torchrun / srun); a plain ``python`` is a world of one. The result is a trainer checkpoint
under ``checkpoint.dir`` (resumable) and the policy alone in ``RUN_DIR/model``: RL starts
from it with ``model.megatron_checkpoint=RUN_DIR/model``.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", help="YAML recipe merged over the defaults")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides (sft.data=FILE ...)")


def run(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from megatron_tg.config import load_config, save_resolved
    from megatron_tg.parallel.state import LaunchEnv
    from megatron_tg.sft.train import run_sft

    cfg = load_config(args.recipe, list(args.overrides))
    rank0 = LaunchEnv.from_env().rank == 0
    if rank0:
        save_resolved(cfg)
    metrics = run_sft(cfg)
    dist.barrier()
    dist.destroy_process_group()
    if rank0:
        print(f"[sft] done: loss {metrics.get('sft/loss', float('nan')):.4f}, policy in "
              f"{cfg.logging.run_dir}/model (model.megatron_checkpoint=...)", flush=True)
    return 0

