"""The root config of a run: every group, and the checks that span groups."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from megatron_tg.config.base import ConfigError, check_range
from megatron_tg.config.evaluation import EvaluationConfig
from megatron_tg.config.model import ModelConfig
from megatron_tg.config.objective import ObjectiveConfig
from megatron_tg.config.parallel import ParallelConfig
from megatron_tg.config.rollout import JudgeConfig, RolloutConfig
from megatron_tg.config.sft import SFTConfig
from megatron_tg.config.timeouts import TimeoutsConfig
from megatron_tg.config.train import CheckpointConfig, LoggingConfig, OptimizerConfig
from megatron_tg.parallel.dims import ParallelDims

# run_name becomes a directory name under runs/; keep it to one portable path component.
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=+-]*$")


@dataclass
class TGConfig:
    """A training run: generate -> judge -> train -> sync -> checkpoint/log, ``steps`` times."""

    run_name: str = "tg"
    """Name of the run; the default run dir is ``runs/<run_name>``."""

    seed: int = 0
    """Seed of every RNG (model init, sampling, data order); each rank derives its own from it."""

    steps: int = 200
    """Optimizer steps to train (paper: 200)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout of the trainer."""

    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout generation."""

    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """Rubric scoring and feedback."""

    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    """The loss: GRPO plus the failure-gated self-distillation KL."""

    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer and micro-batching."""

    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Saving and resuming."""

    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics sinks."""

    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    """Held-out evaluation (never trained on): step 0, every N steps, the last step."""

    sft: SFTConfig = field(default_factory=SFTConfig)
    """The supervised warm start (``megatron-tg sft``); unused by RL runs."""

    timeouts: TimeoutsConfig = field(default_factory=TimeoutsConfig)
    """Limits of collectives, the weight-update group, HTTP calls, health probes and the
    wait for rollouts."""

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first invalid field and its value."""
        if not _RUN_NAME.match(self.run_name):
            raise ConfigError(f"run_name: must be one path component of letters, digits and ._=+-; "
                              f"got {self.run_name!r}")
        check_range("seed", self.seed, ge=0)
        check_range("steps", self.steps, ge=1)
        for group in (self.model, self.parallel, self.rollout, self.judge, self.optimizer,
                      self.checkpoint, self.logging, self.evaluation, self.sft, self.timeouts,
                      self.objective):
            group.validate()
        self._validate_across_groups()

    def _validate_across_groups(self) -> None:
        if self.rollout.max_context_tokens > self.model.seq_length:
            raise ConfigError(f"rollout.max_context_tokens: a whole rollout must fit "
                              f"model.seq_length={self.model.seq_length}; got {self.rollout.max_context_tokens}")
        if self.optimizer.micro_batch_tokens < self.model.seq_length:
            raise ConfigError(f"optimizer.micro_batch_tokens: must hold one model.seq_length="
                              f"{self.model.seq_length} sequence; got {self.optimizer.micro_batch_tokens}")
        p = self.parallel
        if p.tp > 1 and not p.sequence_parallel and self.is_moe():
            raise ConfigError(f"parallel.sequence_parallel: megatron-core requires it for MoE models "
                              f"with parallel.tp={p.tp} > 1; got {p.sequence_parallel}")

    def is_moe(self) -> bool:
        """Whether the model has routed experts: ep > 1 says so, else the HF config does.
        False when neither tells (the HF config is not on this machine and ep = 1)."""
        return self.parallel.ep > 1 or bool(self.model.num_experts())

    def layout(self, world_size: int) -> ParallelDims:
        """The parallel layout for ``world_size`` ranks, checked against the model's shape when
        its HF config is on this machine. Raises :class:`ConfigError`."""
        dims = self.parallel.dims(world_size)
        hf = self.model.read_hf_config()
        if hf is not None:
            heads = hf.get("num_attention_heads")
            layers = hf.get("num_hidden_layers")
            if heads is None or layers is None:
                raise ConfigError(f"model.hf_config: {str(self.model.hf_config_file())!r} lacks "
                                  f"num_attention_heads/num_hidden_layers; got keys {sorted(hf)}")
            try:
                dims.check_model(num_layers=layers, num_attention_heads=heads,
                                 num_query_groups=hf.get("num_key_value_heads") or heads,
                                 num_experts=self.model.num_experts() or None,
                                 tied_embeddings=bool(hf.get("tie_word_embeddings", False)))
            except ValueError as exc:  # LayoutError
                raise ConfigError(f"parallel: {exc} (model {self.model.hf_config})") from exc
        return dims
