"""``megatron-tg``: one console script, one module per subcommand.

A subcommand is a module with two functions:

    def add_arguments(parser: argparse.ArgumentParser) -> None: ...
    def run(args: argparse.Namespace) -> int: ...           # the exit status

and one line in :data:`SUBCOMMANDS`. A positional named ``overrides`` (nargs="*") also
collects ``key=value`` words given after options. Only the chosen subcommand's module is imported, so
``megatron-tg --help`` stays fast and never imports torch or megatron.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NamedTuple, Sequence

from megatron_tg import __version__


class Subcommand(NamedTuple):
    module: str
    """Dotted module path providing ``add_arguments`` and ``run``."""
    help: str
    """One line for ``megatron-tg --help``."""
    attr: str = ""
    """When a module holds several subcommands: the attribute that is this one (an object with
    ``add_arguments`` and ``run``); empty: the module itself."""


SUBCOMMANDS: dict[str, Subcommand] = {
    "config": Subcommand("megatron_tg.config.command",
                         "resolve a recipe plus overrides and print the config "
                         "(--dry-run: also the parallel layout)"),
    "train": Subcommand("megatron_tg.train.command",
                        "run the TG loop from a recipe (one process per GPU via torchrun/srun)"),
    "sft": Subcommand("megatron_tg.sft.command",
                      "supervised warm start on agent transcripts (JSONL; thinking and tool "
                      "calls) through the trainer's model and checkpoints"),
    "eval": Subcommand("megatron_tg.eval.command",
                       "held-out evaluation of a checkpoint: pass@1 and every criterion's rate "
                       "with confidence intervals (evaluation.*)"),
    "describe": Subcommand("megatron_tg.models.command",
                           "parameter counts and per-rank shard sizes of an HF Qwen3(-MoE) "
                           "config, built on the meta device"),
    "memory": Subcommand("megatron_tg.launch.command",
                         "per-GPU memory plan of a recipe, term by term per role, and its time "
                         "per step; exit 1 when it does not fit", attr="memory"),
    "plan": Subcommand("megatron_tg.launch.command",
                       "who runs where in a Slurm job: roles, GPUs, ports, servers, the trainer "
                       "command (no Slurm calls)", attr="plan"),
    "convert": Subcommand("megatron_tg.convert.command",
                          "convert checkpoints: hf-to-megatron or megatron-to-hf"),
    "vet": Subcommand("megatron_tg.judge.command",
                      "vet a rubric's feedback strings: does the model with the feedback "
                      "beat the model without it?"),
    "demo": Subcommand("megatron_tg.demo.command",
                       "the didactic main job on CPU: base model, GRPO / OPSD / TG, report"),
    "plot": Subcommand("megatron_tg.plot.command",
                       "draw runs' curves side by side (criterion rates, pass rate, entropy, KL)"),
}


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-tg",
        description="Targeted guidance (GRPO + failure-gated self-distillation) on Megatron-core.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    # The top-level parser has no options that take a value, so the first bare word is
    # the subcommand; only its module is imported.
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, spec in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=spec.help, description=spec.help)
        if name == chosen:
            module = importlib.import_module(spec.module)
            entry = getattr(module, spec.attr) if spec.attr else module
            entry.add_arguments(p)
            p.set_defaults(_run=entry.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    # argparse gives a nargs="*" positional only its first run of words, so in
    # `config a=1 --dry-run b=2` the b=2 comes back unparsed; it belongs with the overrides.
    if extra:
        if any(a.startswith("-") for a in extra) or not isinstance(getattr(args, "overrides", None), list):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides.extend(extra)
    try:
        return int(args._run(args) or 0)
    except ValueError as exc:
        # Bad input (ConfigError, LayoutError) is the user's to fix: one line, no traceback.
        from megatron_tg.config.base import ConfigError
        from megatron_tg.parallel.dims import LayoutError

        if isinstance(exc, (ConfigError, LayoutError)):
            print(f"megatron-tg {args.command}: error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
