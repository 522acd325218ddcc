"""megatron-tg: targeted guidance (GRPO + failure-gated self-distillation) on Megatron-core."""

__version__ = "0.1.0"
