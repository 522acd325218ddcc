"""The chat framing API under its documented name: token segments from the chat template
(:mod:`megatron_tg.chat.template`), turn parsing (:mod:`megatron_tg.chat.parsing`) and feedback
insertion for the expert (:mod:`megatron_tg.chat.feedback`).

Nothing is defined here: every name is the object its owner defines. Code imports from the
owners; this module keeps the former single-module API importable, because ``demo.task`` and
``demo.base_model`` import from it (their source bytes are hashed into the demo's cache key, so
an edit there would invalidate every cached demo model) and so does ``agent.harness``.
"""

from megatron_tg.chat.feedback import (  # noqa: F401 (re-exported)
    EXPERT_MODES,
    FRAMINGS,
    ExpertSequence,
    build_expert_sequences,
    feedback_message_ids,
    insert_feedback,
)
from megatron_tg.chat.parsing import (  # noqa: F401 (re-exported)
    ParsedTurn,
    ToolCall,
    ToolCallError,
    assistant_token_spans,
    parse_assistant,
)
from megatron_tg.chat.template import (  # noqa: F401 (re-exported)
    CALL_CLOSE,
    CALL_OPEN,
    THINK_CLOSE,
    THINK_OPEN,
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
from megatron_tg.rollout.types import FramingError, Rollout, Span  # noqa: F401 (re-exported)
