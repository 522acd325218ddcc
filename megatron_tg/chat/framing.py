"""Chat framing: token segments from the tokenizer's own chat template, turn parsing, and
feedback insertion for the targeted-guidance expert.

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

Feedback insertion (the expert context, paper §4): the feedback must come *before* the
failing turn's assistant header, so that the failing turn's tokens still follow ``G``::

    student: ... <|im_end|>\\n  [G = <|im_start|>assistant\\n]  turn_k ... <|im_end|>
    expert:  ... <|im_end|>\\n  [F = <|im_start|>user\\n{feedback}<|im_end|>\\n]  [G]  turn_k ...

i.e. ``F`` (the feedback message as the template renders it, role "user" or "system") is
inserted between the preceding segment's body and its trailing ``G``. Equivalently, the
student's ``G`` is replaced by ``F + G``. Consequently, for every assistant token ``i`` the
token before it is the same in both sequences (``pos[i] - 1 == pos[i - 1]``), so
"logits that predict token i" are at ``i - 1`` (student) and ``pos[i] - 1`` (expert).
``F`` is tokenised on its own; it starts with an added token and ends right after the stop
token plus the separator, so the expert ids equal the tokenisation of the rendered
conversation with the feedback message inserted (checked in tests/chat).
"""

from __future__ import annotations

import json
import re
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from megatron_tg.chat.tool_reading import AMBIGUOUS_IN_VALUE, READINGS, sglang_read
from megatron_tg.rollout.types import FramingError, Rollout, Span  # noqa: F401 (re-exported)

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FRAMINGS = ("user", "system")
EXPERT_MODES = ("shared", "exact")

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
    return int(_info(tokenizer)["eos_id"])


def generation_prompt_ids(tokenizer) -> list[int]:
    """Ids of the generation prompt G (``<|im_start|>assistant\\n``), derived from the template."""
    return list(_info(tokenizer)["gen_prompt"])


def _info(tokenizer) -> dict[str, Any]:
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
    info = _info(tokenizer)
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
    generates (and what :func:`parse_assistant` reads back as thinking)."""
    msgs = normalize_messages(messages)
    if _info(tokenizer)["renders_reasoning"]:
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
    info = _info(tokenizer)
    (message,) = fold_reasoning(tokenizer, [message])
    head = render(tokenizer, [_DUMMY_USER], add_generation_prompt=True)
    body = _diff(head, render(tokenizer, [_DUMMY_USER, message]), "rendering an assistant turn")
    cut = body.rfind(info["eos"])
    if cut < 0:
        raise FramingError("rendered assistant message has no stop token")
    return body[:cut + len(info["eos"])]


# ---------------------------------------------------------------------- parsing a turn
@dataclass
class ToolCall:
    name: str
    arguments: dict[str, str | None]
    """Parameter values as the raw strings between the tags (one leading/trailing newline
    removed); typing them against the tool schema is the harness's job. Under the "sglang"
    reading a value the model wrote as ``null`` is None, as SGLang reads it."""
    start: int
    end: int  # character offsets of <tool_call>...</tool_call> in the parsed text

    def to_message(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "arguments": dict(self.arguments)}}


@dataclass
class ToolCallError:
    message: str
    raw: str
    start: int
    end: int
    name: str | None = None  # the function name, when it could be read


@dataclass
class ParsedTurn:
    thinking: str | None
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[ToolCallError] = field(default_factory=list)
    terminated: bool = True
    """False when the text lacks the stop token (generation cut by a length limit)."""

    def to_message(self) -> dict[str, Any]:
        m: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.thinking is not None:
            m["reasoning_content"] = self.thinking
        if self.tool_calls:
            m["tool_calls"] = [c.to_message() for c in self.tool_calls]
        return m


_FUNC_RE = re.compile(r"\s*<function=([^>\n]*)>(.*?)</function>\s*\Z", re.S)
_OPEN_FUNC_RE = re.compile(r"\s*<function=([^>\n]*)>")
"""The opening tag of a call's function (its name read even when the call never closes)."""
_PARAM_RE = re.compile(r"<parameter=([^>\n]*)>(.*?)</parameter>", re.S)
_NAME_RE = re.compile(r"[A-Za-z_][\w.\-]*\Z")


def parse_assistant(text: str, stop_tokens: Sequence[str] = ("<|im_end|>", "<|endoftext|>"),
                    *, reading: str = "strict") -> ParsedTurn:
    """Split a generated turn into thinking / content / Qwen3-Coder XML tool calls.

    Never raises: malformed or unterminated calls become :class:`ToolCallError` entries (their
    text is not part of ``content``). ``<think>`` is recognised only at the start of the turn;
    a ``</think>`` without an opening tag is also accepted (templates that pre-fill ``<think>``).
    ``reading``: "strict" or "sglang", see :mod:`megatron_tg.chat.tool_reading`.
    """
    if reading not in READINGS:
        raise ValueError(f"reading must be one of {READINGS}, got {reading!r}")
    terminated = False
    for st in stop_tokens:
        if text.endswith(st):
            text, terminated = text[: -len(st)], True
            break
    thinking, body_start = None, 0
    errors: list[ToolCallError] = []
    stripped = text.lstrip()
    if stripped.startswith(THINK_OPEN):
        open_at = len(text) - len(stripped)
        close = text.find(THINK_CLOSE, open_at)
        if close < 0:
            thinking, body_start = text[open_at + len(THINK_OPEN):].strip(), len(text)
        else:
            thinking = text[open_at + len(THINK_OPEN):close].strip()
            body_start = close + len(THINK_CLOSE)
    elif THINK_CLOSE in text and CALL_OPEN not in text[: text.find(THINK_CLOSE)]:
        close = text.find(THINK_CLOSE)
        thinking, body_start = text[:close].strip(), close + len(THINK_CLOSE)

    if reading == "sglang":
        return _sglang_turn(text, body_start, thinking, terminated)
    calls: list[ToolCall] = []
    content_parts: list[str] = []
    pos = body_start
    while True:
        o = text.find(CALL_OPEN, pos)
        stray = text.find(CALL_CLOSE, pos)
        if stray >= 0 and (o < 0 or stray < o):  # a closing tag with no opening tag
            content_parts.append(text[pos:stray])
            errors.append(ToolCallError(f"{CALL_CLOSE} without {CALL_OPEN}", CALL_CLOSE, stray,
                                        stray + len(CALL_CLOSE)))
            pos = stray + len(CALL_CLOSE)
            continue
        if o < 0:
            content_parts.append(text[pos:])
            break
        content_parts.append(text[pos:o])
        c = text.find(CALL_CLOSE, o + len(CALL_OPEN))
        nxt = text.find(CALL_OPEN, o + len(CALL_OPEN))
        if c < 0 or (0 <= nxt < c):
            end = nxt if nxt >= 0 else len(text)  # an unterminated call ends at the next one
            # The function name, when the call got that far: a call cut by the token limit is
            # still a (failed) call to that tool, and a judge's format criterion must see it.
            m = _OPEN_FUNC_RE.match(text, o + len(CALL_OPEN), end)
            name = m.group(1).strip() if m and _NAME_RE.match(m.group(1).strip()) else None
            errors.append(ToolCallError(f"unterminated {CALL_OPEN}", text[o:end], o, end, name))
            pos = end
            if end == len(text):
                break
            continue
        end = c + len(CALL_CLOSE)
        call = _parse_call(text[o + len(CALL_OPEN):c], o, end)
        (calls if isinstance(call, ToolCall) else errors).append(call)
        pos = end
    content = "".join(content_parts).strip()
    return ParsedTurn(thinking, content, calls, errors, terminated)


def _sglang_turn(text: str, body_start: int, thinking: str | None, terminated: bool) -> ParsedTurn:
    content, read, unread = sglang_read(text[body_start:])
    calls = [ToolCall(name, args, body_start + s, body_start + e) for name, args, s, e in read]
    errors = [ToolCallError("SGLang's qwen3_coder detector reads no call from this block",
                            text[body_start + s:body_start + e], body_start + s, body_start + e)
              for s, e in unread]
    return ParsedTurn(thinking, content, calls, errors, terminated)


def _parse_call(inner: str, start: int, end: int) -> ToolCall | ToolCallError:
    raw = CALL_OPEN + inner + CALL_CLOSE
    m = _FUNC_RE.match(inner)
    if not m:
        return ToolCallError("expected <function=NAME>...</function> inside <tool_call>", raw, start, end)
    name, body = m.group(1).strip(), m.group(2)
    if not _NAME_RE.match(name):
        return ToolCallError(f"invalid function name {name!r}", raw, start, end)
    args: dict[str, str] = {}
    last = 0
    for pm in _PARAM_RE.finditer(body):
        gap = body[last:pm.start()]
        if gap.strip():
            return ToolCallError(f"unexpected text {gap.strip()[:40]!r} between parameters",
                                 raw, start, end, name)
        pname = pm.group(1).strip()
        if not _NAME_RE.match(pname):
            return ToolCallError(f"invalid parameter name {pname!r}", raw, start, end, name)
        if pname in args:
            return ToolCallError(f"duplicate parameter {pname!r}", raw, start, end, name)
        value = pm.group(2)
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        markup = next((m for m in AMBIGUOUS_IN_VALUE if m in value), None)
        if markup is not None:  # SGLang would read it as structure: not one meaning
            return ToolCallError(f"value of parameter {pname!r} contains {markup!r}, which "
                                 "SGLang's parser reads as a new tag", raw, start, end, name)
        args[pname] = value
        last = pm.end()
    tail = body[last:]
    if tail.strip():
        return ToolCallError(f"unexpected text {tail.strip()[:40]!r} after parameters",
                             raw, start, end, name)
    return ToolCall(name, args, start, end)


def assistant_token_spans(tokenizer, ids: Sequence[int], offset: int = 0) -> tuple[Span | None, list[Span]]:
    """Token spans of the thinking block and of each tool call in a generated turn.

    Spans include the tags and are shifted by ``offset`` (the turn's start in the rollout).
    Mirrors :func:`parse_assistant`: thinking only at the start of the turn; tool calls only
    after it; an unterminated block runs to the end of the turn (before the stop token).
    """
    info = _info(tokenizer)
    t = info["tags"]
    ids = list(ids)
    n = len(ids) - 1 if ids and ids[-1] == info["eos_id"] else len(ids)
    thinking = None
    pos = 0
    first_real = 0
    while first_real < n and not tokenizer.decode([ids[first_real]]).strip():
        first_real += 1  # leading whitespace tokens before <think>
    if first_real < n and ids[first_real] == t[THINK_OPEN]:
        close = _index(ids, t[THINK_CLOSE], first_real + 1, n)
        end = n if close < 0 else close + 1
        thinking, pos = Span(offset + first_real, offset + end), end
    else:
        close = _index(ids, t[THINK_CLOSE], 0, n)
        if close >= 0 and _index(ids, t[CALL_OPEN], 0, close) < 0:
            thinking, pos = Span(offset, offset + close + 1), close + 1
    calls: list[Span] = []
    while True:
        o = _index(ids, t[CALL_OPEN], pos, n)
        if o < 0:
            break
        c = _index(ids, t[CALL_CLOSE], o + 1, n)
        nxt = _index(ids, t[CALL_OPEN], o + 1, n)
        end = (n if nxt < 0 else nxt) if c < 0 or (0 <= nxt < c) else c + 1
        calls.append(Span(offset + o, offset + end))
        pos = end
    return thinking, calls


def _index(ids: list[int], tok: int, lo: int, hi: int) -> int:
    for i in range(lo, hi):
        if ids[i] == tok:
            return i
    return -1


# ---------------------------------------------------------------------- feedback / expert
@dataclass
class ExpertSequence:
    """One expert (feedback-conditioned) context for a student rollout."""

    token_ids: list[int]
    position_map: list[int]
    """For every student position i: its position in ``token_ids``, or -1 if truncated away."""
    turns: list[int]
    """Failing assistant turns whose feedback this sequence holds; the KL targets."""
    kl_mask: list[int]
    """Per student token: 1 on the tokens of ``turns`` (where this sequence is the teacher)."""
    feedback_spans: list[Span]
    """Where each inserted feedback message (F) sits in ``token_ids``, in turn order."""


def feedback_message_ids(tokenizer, feedback: str, framing: str = "user") -> list[int]:
    """F: the feedback as a complete message of role ``framing``, rendered by the template."""
    if framing not in FRAMINGS:
        raise ValueError(f"framing must be one of {FRAMINGS}, got {framing!r}")
    if not isinstance(feedback, str) or not feedback.strip():
        raise ValueError(f"feedback must be a non-empty string, got {feedback!r}")
    return message_ids(tokenizer, {"role": framing, "content": feedback})


def insert_feedback(rollout: Rollout, feedback_by_turn: Mapping[int, str], tokenizer,
                    framing: str = "user", *, truncate: bool = True) -> ExpertSequence:
    """Build the ``shared`` expert sequence: every failing turn's feedback inserted right
    before that turn's assistant header (see module docstring), truncated after the last
    failing turn (later tokens get no KL, so the expert forward pass need not see them)."""
    if not feedback_by_turn:
        raise ValueError("feedback_by_turn is empty: a rollout with no failing turn has no expert")
    turns = rollout.assistant_turns()
    for k in feedback_by_turn:
        if not isinstance(k, int) or not 0 <= k < len(turns):
            raise ValueError(f"feedback turn {k!r} out of range: rollout has {len(turns)} turns")
    gen = generation_prompt_ids(tokenizer)
    seg_index = {id(s): i for i, s in enumerate(rollout.segments)}
    inserts: dict[int, list[int]] = {}  # student position -> F ids inserted before it
    for k in sorted(feedback_by_turn):
        seg = turns[k]
        i = seg_index[id(seg)]
        prev = rollout.segments[i - 1]
        g_at = seg.start - len(gen)
        if prev.kind == "assistant" or g_at < prev.start or rollout.token_ids[g_at:seg.start] != gen:
            raise FramingError(f"assistant turn {k} is not preceded by the generation prompt "
                               f"{gen} in segment {i - 1} ({prev.kind})")
        inserts[g_at] = feedback_message_ids(tokenizer, feedback_by_turn[k], framing)
    last = turns[max(feedback_by_turn)]
    n_keep = last.end if truncate else len(rollout.token_ids)

    ids: list[int] = []
    pmap = [-1] * len(rollout.token_ids)
    spans: list[Span] = []
    prev_pos = 0
    for pos in sorted(inserts) + [n_keep]:
        for j in range(prev_pos, pos):
            pmap[j] = len(ids) + (j - prev_pos)
        ids.extend(rollout.token_ids[prev_pos:pos])
        if pos in inserts:
            spans.append(Span(len(ids), len(ids) + len(inserts[pos])))
            ids.extend(inserts[pos])
        prev_pos = pos
    kl_mask = [0] * len(rollout.token_ids)
    for k in feedback_by_turn:
        kl_mask[turns[k].start:turns[k].end] = [1] * (turns[k].end - turns[k].start)
    return ExpertSequence(ids, pmap, sorted(feedback_by_turn), kl_mask, spans)


def build_expert_sequences(rollout: Rollout, feedback_by_turn: Mapping[int, str], tokenizer,
                           mode: str = "shared", framing: str = "user") -> list[ExpertSequence]:
    """``shared``: one sequence with all failing turns' feedback (one extra forward pass; later
    failing turns also see earlier feedback). ``exact``: one sequence per failing turn holding
    only its own feedback, truncated after that turn (the paper's mu(.|s_t, f_t) exactly)."""
    if mode not in EXPERT_MODES:
        raise ValueError(f"mode must be one of {EXPERT_MODES}, got {mode!r}")
    if not feedback_by_turn:
        return []
    if mode == "shared":
        return [insert_feedback(rollout, feedback_by_turn, tokenizer, framing)]
    return [insert_feedback(rollout, {k: feedback_by_turn[k]}, tokenizer, framing)
            for k in sorted(feedback_by_turn)]
