"""``megatron-tg config``: print the resolved config; ``--dry-run`` adds the parallel layout.

    megatron-tg config --recipe recipes/tg_30b.yaml objective.kl_coef=0.3 --dry-run

Output is YAML: the config, and with ``--dry-run`` a second document (after ``---``) with
the layout and every timeout of the run resolved (``timeouts``: the derived
``rollout_wait_s`` included), so both can be read back with ``yaml.safe_load_all``.
"""

from __future__ import annotations

import argparse
import os

import yaml

from megatron_tg.config.base import ConfigError
from megatron_tg.config.loader import load_config, to_yaml
from megatron_tg.config.schema import TGConfig
from megatron_tg.parallel.dims import Axis

# Rank groups are listed only up to this world size; beyond it they stop being readable.
MAX_LISTED_WORLD = 16

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", metavar="FILE",
                        help="recipe YAML (default: schema defaults only, which need model.hf_config=...)")
    parser.add_argument("--dry-run", action="store_true",
                        help="also print the parallel layout and its rank groups, then exit")
    parser.add_argument("--world-size", type=int, metavar="N",
                        help="ranks to lay out (default: $WORLD_SIZE, else parallel.nodes x "
                             "parallel.gpus_per_node, else the smallest world the layout fits)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted overrides applied after the recipe, e.g. parallel.tp=2")


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.recipe, args.overrides)
    source = args.recipe or "schema defaults"
    if args.overrides:
        source += " + " + " ".join(args.overrides)
    text = f"# megatron-tg config: {source}\n" + to_yaml(cfg)
    if args.dry_run:
        world, origin = _world_size(cfg, args.world_size)
        layout = describe_layout(cfg, world)
        text += (f"---\n# parallel layout for {world} rank{'s' * (world != 1)} ({origin}); "
                 f"megatron-core rank order tp-cp-ep-dp-pp, experts etp-ep-edp-pp\n")
        text += yaml.dump({"layout": layout}, Dumper=_LayoutDumper, sort_keys=False, width=120)
        # every limit of the run, resolved (config/timeouts.py), under the layout
        text += yaml.dump({"timeouts": cfg.timeouts.table(cfg)}, Dumper=_LayoutDumper,
                          sort_keys=False, width=120)
    # Printed only once everything resolved: a layout error leaves no half output behind.
    print(text, end="")
    return 0


class _Row(list):
    """A list dumped on one line, so each axis's rank groups read as one row."""


class _RowMap(dict):
    """A mapping dumped on one line."""


class _LayoutDumper(yaml.SafeDumper):
    pass


_LayoutDumper.add_representer(
    _Row, lambda d, data: d.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True))
_LayoutDumper.add_representer(
    _RowMap, lambda d, data: d.represent_mapping("tag:yaml.org,2002:map", data, flow_style=True))


def _world_size(cfg: TGConfig, flag: int | None) -> tuple[int, str]:
    if flag is not None:
        return flag, "--world-size"
    env = os.environ.get("WORLD_SIZE")
    if env:
        try:
            return int(env), "$WORLD_SIZE"
        except ValueError as exc:
            raise ConfigError(f"WORLD_SIZE: expected an int, got {env!r}") from exc
    if cfg.parallel.nodes is not None:
        return cfg.parallel.default_world_size(), "parallel.nodes x parallel.gpus_per_node"
    return cfg.parallel.default_world_size(), "the smallest world the layout fits"


def describe_layout(cfg: TGConfig, world_size: int) -> dict:
    """Axis sizes, whether the model splits this way, GPU count, and (small worlds) rank groups."""
    dims = cfg.layout(world_size)  # raises ConfigError when the sizes or the model do not fit
    out: dict = {"sizes": _RowMap(dims.describe())}
    out["model_check"] = ("passed" if cfg.model.read_hf_config() is not None
                          else f"skipped: {cfg.model.hf_config_file()} is not on this machine")
    if cfg.rollout.engine == "sglang":
        engines = len(cfg.rollout.server_urls) or cfg.rollout.num_engines
        rollout_gpus = engines * cfg.rollout.engine_tp
        out["gpus"] = _RowMap(train=world_size, rollout=rollout_gpus, total=world_size + rollout_gpus)
    if world_size <= MAX_LISTED_WORLD:
        out["groups"] = {axis.value: _Row(dims.rank_groups(axis)) for axis in
                         (Axis.TP, Axis.CP, Axis.DP, Axis.PP, Axis.EP, Axis.ETP, Axis.EDP)}
    else:
        out["groups"] = f"not listed for world_size > {MAX_LISTED_WORLD}"
    return out
