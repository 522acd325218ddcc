"""Chat framing for Qwen3-Coder-style agents: tiny tokenizer, token segments, turn parsing,
feedback insertion (expert sequences) and turn-by-turn rollout building."""

from megatron_tg.chat.builder import RolloutBuilder, fake_logprobs, simulate_rollout
from megatron_tg.chat.feedback import (
    EXPERT_MODES,
    FRAMINGS,
    ExpertSequence,
    build_expert_sequences,
    feedback_message_ids,
    insert_feedback,
)
from megatron_tg.chat.parsing import (
    ParsedTurn,
    ToolCall,
    ToolCallError,
    assistant_token_spans,
    parse_assistant,
)
from megatron_tg.chat.template import (
    assistant_generation_text,
    continuation_ids,
    encode,
    fold_reasoning,
    generation_prompt_ids,
    message_ids,
    normalize_messages,
    prompt_ids,
    render,
    stop_token_id,
)
from megatron_tg.chat.tokenizer import (
    CHAT_TEMPLATE,
    build_tiny_tokenizer,
    default_corpus,
    get_tiny_tokenizer,
)
from megatron_tg.rollout.types import FramingError

__all__ = [
    "CHAT_TEMPLATE", "EXPERT_MODES", "FRAMINGS", "ExpertSequence", "FramingError", "ParsedTurn",
    "RolloutBuilder", "ToolCall", "ToolCallError", "assistant_generation_text",
    "assistant_token_spans", "build_expert_sequences", "build_tiny_tokenizer",
    "continuation_ids", "default_corpus", "encode", "fake_logprobs", "feedback_message_ids", "fold_reasoning",
    "generation_prompt_ids", "get_tiny_tokenizer", "insert_feedback", "message_ids", "normalize_messages",
    "parse_assistant", "prompt_ids", "render", "simulate_rollout", "stop_token_id",
]
