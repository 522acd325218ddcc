"""Token segments from the tokenizer's own chat template: rendering, the per-tokenizer template
facts, and the ids of a prompt, of what follows an assistant turn, of a lone message and of a
generated assistant turn.

Token conventions (shared with :mod:`megatron_tg.rollout.types`):

* An assistant turn is exactly what the engine generated after the generation prompt
  ``G`` (``<|im_start|>assistant\\n`` for Qwen3-Coder) up to and including the stop token
  ``tokenizer.eos_token`` (``<|im_end|>``). ``G`` itself belongs to the *preceding* segment.
* What is appended after a turn (tool results / user message + the next ``G``) is obtained by
  rendering the conversation with the template and taking the text after the last stop token
  of the rendered prefix — so the template's own separator (``\\n`` after ``<|im_end|>``) lands
  in the appended, untrained segment. No template string is hard-coded here except the four
  reasoning / tool-call tags the *model* emits (``THINK_*``, ``CALL_*``), which are the
  Qwen3-Coder output format rather than part of the template.
* Splitting text right after an *added* token is token-exact: HF tokenizers split input at
  added tokens before running BPE, so ``encode(a + b) == encode(a) + encode(b)`` when ``a``
  ends with one. Every cut below is made after the stop token, and we check it is an added token.

Turn parsing is :mod:`megatron_tg.chat.parsing`; feedback insertion for the expert
:mod:`megatron_tg.chat.feedback`.
"""

from __future__ import annotations

import json
import weakref
from typing import Any, Iterable, Mapping, Sequence

from megatron_tg.rollout.types import FramingError

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"

# Neutral context used to render a message in isolation; only text diffs against it are used.
_DUMMY_USER = {"role": "user", "content": "x"}
_DUMMY_ASSISTANT = {"role": "assistant", "content": "y"}


# ---------------------------------------------------------------------- rendering primitives
def normalize_messages(messages: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copy messages, parsing OpenAI-style JSON-string tool-call arguments into dicts (the
    template renders each argument as its own ``<parameter=...>`` block)."""
    out = []
    for i, m in enumerate(messages):
        if "role" not in m:
            raise FramingError(f"message {i} has no role")
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for tc in m["tool_calls"]:
                tc = dict(tc)
                fn = dict(tc["function"]) if "function" in tc else tc
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"]) if fn["arguments"].strip() else {}
                    except json.JSONDecodeError as e:
                        raise FramingError(f"message {i}: tool call arguments are not JSON: {e}") from e
                if "function" in tc:
                    tc["function"] = fn
                calls.append(tc)
            m["tool_calls"] = calls
        out.append(m)
    return out


def render(tokenizer, messages: Sequence[Mapping[str, Any]], *, tools: list | None = None,
           add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(
        normalize_messages(messages), tools=tools or None,
        add_generation_prompt=add_generation_prompt, tokenize=False)


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` with no BOS/EOS added (the template already frames everything)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def stop_token_id(tokenizer) -> int:
    return int(template_info(tokenizer)["eos_id"])


def generation_prompt_ids(tokenizer) -> list[int]:
    """Ids of the generation prompt G (``<|im_start|>assistant\\n``), derived from the template."""
    return list(template_info(tokenizer)["gen_prompt"])


def template_info(tokenizer) -> dict[str, Any]:
    """Per-tokenizer facts derived once from its template (keyed weakly on the tokenizer and on
    the template text, so changing ``chat_template`` invalidates it)."""
    template = tokenizer.chat_template
    cached = _INFO_CACHE.get(tokenizer)
    if cached is not None and cached["template"] == template:
        return cached
    eos = tokenizer.eos_token
    if eos is None:
        raise FramingError("tokenizer has no eos_token (the turn stop token)")
    added = tokenizer.get_added_vocab()
    if eos not in added:
        raise FramingError(f"eos_token {eos!r} is not an added token: cuts after it would not "
                           "be token-exact")
    for tag in (THINK_OPEN, THINK_CLOSE, CALL_OPEN, CALL_CLOSE):
        if tag not in added or encode(tokenizer, tag) != [added[tag]]:
            raise FramingError(f"{tag!r} is not a single added token in this tokenizer")
    head = render(tokenizer, [_DUMMY_USER])
    with_gen = render(tokenizer, [_DUMMY_USER], add_generation_prompt=True)
    if not with_gen.startswith(head) or len(with_gen) == len(head):
        raise FramingError("chat template's generation prompt is not a suffix of the prefix")
    probe = "reasoning-probe-7f3a"
    shown = render(tokenizer, [_DUMMY_USER, {**_DUMMY_ASSISTANT, "reasoning_content": probe}])
    info = {
        "template": template, "eos": eos, "eos_id": added[eos],
        # Qwen3-Coder's own template (a non-thinking model) ignores reasoning_content; a
        # thinking model made from it writes <think> as the start of its turn's content.
        "renders_reasoning": probe in shown,
        "gen_prompt": encode(tokenizer, with_gen[len(head):]),
        "tags": {t: added[t] for t in (THINK_OPEN, THINK_CLOSE, CALL_OPEN, CALL_CLOSE)},
    }
    _INFO_CACHE[tokenizer] = info
    return info


_INFO_CACHE: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def _diff(prefix: str, full: str, what: str) -> str:
    if not full.startswith(prefix):
        raise FramingError(f"chat template is not prefix-stable when {what}")
    return full[len(prefix):]


# ---------------------------------------------------------------------- segments
def prompt_ids(tokenizer, messages: Sequence[Mapping[str, Any]], tools: list | None = None) -> list[int]:
    """The rollout's first segment: the rendered prompt messages + the generation prompt."""
    return encode(tokenizer, render(tokenizer, messages, tools=tools, add_generation_prompt=True))


def continuation_ids(tokenizer, new_messages: Sequence[Mapping[str, Any]], *,
                     history: Sequence[Mapping[str, Any]] | None = None, tools: list | None = None,
                     add_generation_prompt: bool = True) -> list[int]:
    """Ids to append after an assistant turn that ended with the stop token: the template's
    separator after the stop token, ``new_messages`` (tool results / user message) and, by
    default, the next generation prompt.

    ``history`` is the conversation so far (ending with the assistant turn); it only provides
    context (e.g. the template groups consecutive tool results) — its own rendering is cut
    off. Without it a neutral ``[user, assistant]`` context is used.
    """
    info = template_info(tokenizer)
    hist = normalize_messages(history) if history is not None else [_DUMMY_USER, _DUMMY_ASSISTANT]
    if not hist or hist[-1]["role"] != "assistant":
        raise FramingError("history must end with the assistant turn being continued")
    new = normalize_messages(new_messages)
    if not new:
        raise FramingError("no new messages to append")
    head = render(tokenizer, hist, tools=tools)
    cut = head.rfind(info["eos"])
    if cut < 0:
        raise FramingError("rendered history has no stop token after the assistant turn")
    cut += len(info["eos"])
    full = render(tokenizer, hist + new, tools=tools, add_generation_prompt=add_generation_prompt)
    return encode(tokenizer, _diff(head[:cut], full, "appending messages"))


def message_ids(tokenizer, message: Mapping[str, Any]) -> list[int]:
    """A non-assistant message rendered on its own, as it appears between two messages
    (``<|im_start|>{role}\\n{content}<|im_end|>\\n``). Rendered after a neutral user message so
    that a system message is not taken as *the* system prompt."""
    head = render(tokenizer, [_DUMMY_USER])
    return encode(tokenizer, _diff(head, render(tokenizer, [_DUMMY_USER, message]), "adding a message"))


def fold_reasoning(tokenizer, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as a *thinking* model's turns render under this tokenizer's template.

    A template that renders ``reasoning_content`` (the tiny tokenizer's) gets the messages
    unchanged. One that ignores it (Qwen3-Coder's: the stock model does not think) would drop
    the thinking, so each assistant message's reasoning is moved to the start of its content
    as ``<think>\n{reasoning}\n</think>\n\n{content}``, the text a model SFT'd to think
    generates (and what :func:`megatron_tg.chat.parsing.parse_assistant` reads back as thinking)."""
    msgs = normalize_messages(messages)
    if template_info(tokenizer)["renders_reasoning"]:
        return msgs
    out = []
    for m in msgs:
        r = m.get("reasoning_content")
        if m["role"] == "assistant" and isinstance(r, str) and r.strip():
            m = {k: v for k, v in m.items() if k != "reasoning_content"}
            content = m.get("content") if isinstance(m.get("content"), str) else ""
            m["content"] = f"{THINK_OPEN}\n{r.strip()}\n{THINK_CLOSE}\n\n{content.lstrip()}"
        out.append(m)
    return out


def assistant_generation_text(tokenizer, message: Mapping[str, Any]) -> str:
    """The text a model would generate for ``message``: its rendering after the generation
    prompt, up to and including the stop token (reasoning folded into the content where the
    template drops it, :func:`fold_reasoning`). Used to simulate engine output in tests and
    to render SFT transcripts."""
    info = template_info(tokenizer)
    (message,) = fold_reasoning(tokenizer, [message])
    head = render(tokenizer, [_DUMMY_USER], add_generation_prompt=True)
    body = _diff(head, render(tokenizer, [_DUMMY_USER, message]), "rendering an assistant turn")
    cut = body.rfind(info["eos"])
    if cut < 0:
        raise FramingError("rendered assistant message has no stop token")
    return body[:cut + len(info["eos"])]
