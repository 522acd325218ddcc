"""``megatron-tg describe``: parameter counts and per-rank shard sizes of an HF Qwen3(-MoE)
config (:mod:`megatron_tg.models.describe`), printed for people, then as one JSON line."""

from __future__ import annotations

import argparse
import json

from megatron_tg.models import describe as D


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hf-config", required=True,
                        help="an HF config.json, or a model directory containing one")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    parser.add_argument("--etp", type=int, default=None, help="expert tensor-parallel size "
                        "(default: same as --tp)")


def _fmt(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))


def run(args: argparse.Namespace) -> int:
    info = D.describe(args.hf_config, tp=args.tp, ep=args.ep, pp=args.pp, etp=args.etp)
    lay = info["layout"]
    print(f"model: {info['model_type']}  experts: {info['num_experts']}  "
          f"layout: tp={lay['tp']} ep={lay['ep']} etp={lay['etp']} pp={lay['pp']}")
    print(f"total parameters:  {_fmt(info['total_params'])} ({info['total_params']:,})")
    print(f"active per token:  {_fmt(info['active_params'])} ({info['active_params']:,})")
    for s in info["per_rank"]:
        print(f"pp stage {s['pp_stage']}: per rank {_fmt(s['params'])} params "
              f"(dense {_fmt(s['dense_params'])}, experts {_fmt(s['expert_params'])}), "
              f"{s['tensors']} tensors, {s['bytes'] / 2**30:.2f} GiB in bf16")
    print(json.dumps(info))
    return 0
