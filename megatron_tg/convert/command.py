"""``megatron-tg convert {hf-to-megatron,megatron-to-hf} ...``: the two converters under one
subcommand (``tools/convert_*.py`` are thin wrappers over the same modules)."""

from __future__ import annotations

import argparse
import importlib

DIRECTIONS = {
    "hf-to-megatron": ("megatron_tg.convert.hf_to_megatron",
                       "HF safetensors -> megatron torch_dist (loads at any TP/EP/PP)"),
    "megatron-to-hf": ("megatron_tg.convert.megatron_to_hf",
                       "megatron torch_dist (converted or trained) -> HF safetensors"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="direction", metavar="DIRECTION", required=True)
    for name, (module, help_) in DIRECTIONS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        mod = importlib.import_module(module)
        mod.add_arguments(p)
        p.set_defaults(_convert=mod.run)


def run(args: argparse.Namespace) -> int:
    return int(args._convert(args) or 0)
