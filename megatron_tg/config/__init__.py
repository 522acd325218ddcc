"""Typed run configuration: one dataclass per concern, recipes in ``recipes/``, dotted overrides.

    from megatron_tg.config import load_config, save_resolved
    cfg = load_config("recipes/tiny_cpu.yaml", ["objective.kl_coef=0.3", "parallel.tp=2"])
    save_resolved(cfg)                      # -> runs/<run_name>/config.yaml

Every field carries a docstring (the string literal under it) with its meaning and unit.
"""

from megatron_tg.config.base import ConfigError
from megatron_tg.config.evaluation import EvaluationConfig
from megatron_tg.config.loader import load_config, save_resolved, to_yaml
from megatron_tg.config.model import ModelConfig
from megatron_tg.config.objective import ObjectiveConfig
from megatron_tg.config.parallel import ParallelConfig
from megatron_tg.config.rollout import JudgeConfig, RolloutConfig
from megatron_tg.config.schema import TGConfig
from megatron_tg.config.sft import SFTConfig
from megatron_tg.config.timeouts import TimeoutsConfig
from megatron_tg.config.train import CheckpointConfig, LoggingConfig, OptimizerConfig

__all__ = [
    "CheckpointConfig", "ConfigError", "EvaluationConfig", "JudgeConfig", "LoggingConfig", "ModelConfig",
    "ObjectiveConfig", "OptimizerConfig", "ParallelConfig", "RolloutConfig", "SFTConfig", "TGConfig", "TimeoutsConfig",
    "load_config", "save_resolved", "to_yaml",
]
