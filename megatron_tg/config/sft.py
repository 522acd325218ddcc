"""Supervised warm start (``megatron-tg sft``): the policy SFT'd on agent transcripts."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_tg.config.base import ConfigError, check_range


@dataclass
class SFTConfig:
    """SFT on JSONL agent transcripts (conversations with thinking and tool calls), through the
    trainer's megatron model, optimizer (``optimizer.*``) and checkpoints (``checkpoint.*``):
    the route from the stock, non-thinking Qwen3-Coder checkpoint to the paper's thinking
    base. Only assistant tokens (thinking, content, tool calls, the stop token) carry loss."""

    data: str = ""
    """JSONL, one transcript per line: ``{"messages": [...], "tools": [...]}`` (``tools``
    optional). Messages are OpenAI-style; an assistant message may carry
    ``reasoning_content`` (its thinking) and ``tool_calls``."""

    epochs: int = 1
    """Passes over the transcripts. Optimizer steps = ceil(epochs * transcripts / batch_size)."""

    batch_size: int = 8
    """Transcripts per optimizer step (over all data-parallel ranks)."""

    shuffle: bool = True
    """Shuffle the transcripts every epoch (seeded by ``seed`` and the epoch)."""

    def validate(self) -> None:
        check_range("sft.epochs", self.epochs, ge=1)
        check_range("sft.batch_size", self.batch_size, ge=1)
        if not isinstance(self.data, str):
            raise ConfigError(f"sft.data: must be a path string; got {self.data!r}")
