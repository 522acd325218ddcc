"""A tiny, locally built HF tokenizer with Qwen3-Coder's chat framing.

Real Qwen3-Coder weights/tokenizers cannot be downloaded on the CI machines, yet everything that
touches tokens (rollouts, expert sequences, judges, tiny test models) must run against the same
*framing* as Qwen3-Coder: ChatML turns, Qwen's special tokens as single ids, tool calls in
Qwen3-Coder's XML format. :func:`build_tiny_tokenizer` trains a byte-level BPE (the same model
family as Qwen's tokenizer) on a small synthetic corpus of code / agent text and attaches
Qwen3-Coder's current chat template (the 2025-09 release), rewritten (:data:`CHAT_TEMPLATE`).

Deliberate differences from the real Qwen tokenizer, all in favour of exactness in tests:

* no NFC normaliser: ``decode(encode(x)) == x`` for *any* str (Qwen NFC-normalises input);
* the vocabulary is tiny (default 1024 ids incl. special tokens) so tiny models stay tiny;
* the template keeps ``<think>`` reasoning of *every* assistant turn (the released Coder
  template drops reasoning) -- its one difference from the release, tested as such
  (``tests/chat/test_chat_tokenizer.py``). The demo's thinking criteria, its KL on thinking
  tokens and the ``no_thinking`` arm need the thinking in the tokens; token-exact rollouts
  never re-render history, so "render the whole conversation" equals "concatenate the turns".
"""

from __future__ import annotations

import json
import os
import random
from typing import Iterable, Iterator

# Special tokens, in Qwen3's id order. Qwen marks the ChatML/eos tokens "special" (skipped by
# decode(skip_special_tokens=True)) but not the reasoning / tool tags, which are plain added
# tokens that survive decoding; we mirror that split.
SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TAG_TOKENS: tuple[str, ...] = (
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
)
ALL_ADDED_TOKENS: tuple[str, ...] = SPECIAL_TOKENS + TAG_TOKENS

EOS_TOKEN = "<|im_end|>"      # what an instruct model emits to end its turn (generation stop)
PAD_TOKEN = "<|endoftext|>"   # Qwen pads with <|endoftext|>

# Qwen2/Qwen3 pre-tokenisation regex: single digits, letters with one optional leading
# non-letter, punctuation runs, newline runs. Keeps merges from crossing word/line boundaries.
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# The chat template: Qwen3-Coder's current release (the 2025-09 ``chat_template.jinja`` in
# tests/fixtures/qwen3_coder/), written again here, with ONE intended difference: an assistant
# turn's ``reasoning_content`` is kept as "<think>\n{reasoning}\n</think>\n" right after the
# role line (the release drops reasoning; the demo's thinking criteria, its thinking-token KL
# and the ``no_thinking`` arm need it). Otherwise it renders what the release renders, byte for
# byte (tests/chat/test_chat_tokenizer.py compares the two on every case below): the release's
# system prompt when tools come without a system message; the ``# Tools`` block with every
# extra key of a parameter, of ``parameters`` and of the function (mappings and lists as JSON);
# argument values as the release writes them (mappings and lists as JSON, everything else
# Python's ``str()``: ``True``, ``None``, ``2.5``); a turn without calls as its content,
# untrimmed; consecutive tool results grouped into one user message of <tool_response>
# blocks (a tool result that is the first message after the system prompt opens no user turn,
# as in the release). Two guards the release lacks, neither of which changes a rendering the
# release can produce: an empty conversation or a ``None`` content renders instead of raising,
# and arguments that are not a mapping raise a clear error (parse JSON strings first).
CHAT_TEMPLATE = r"""{#- Qwen3-Coder's chat template (2025-09 release) keeping reasoning (megatron-tg tiny tokenizer). -#}
{%- macro render_extra_keys(json_dict, handled_keys) -%}
  {%- if json_dict is mapping -%}
    {%- for json_key in json_dict if json_key not in handled_keys -%}
      {%- if json_dict[json_key] is mapping or (json_dict[json_key] is sequence and json_dict[json_key] is not string) -%}
        {{- '\n<' ~ json_key ~ '>' ~ (json_dict[json_key] | tojson | safe) ~ '</' ~ json_key ~ '>' -}}
      {%- else -%}
        {{- '\n<' ~ json_key ~ '>' ~ (json_dict[json_key] | string) ~ '</' ~ json_key ~ '>' -}}
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- macro text(v) -%}{%- if v is string -%}{{- v -}}{%- endif -%}{%- endmacro -%}
{%- if messages and messages[0].role == 'system' -%}
  {%- set system_message = text(messages[0].content) -%}
  {%- set loop_messages = messages[1:] -%}
{%- else -%}
  {%- set loop_messages = messages -%}
{%- endif -%}
{%- set has_tools = tools is defined and tools is not none and tools is iterable and tools | length > 0 -%}
{%- if system_message is defined -%}
  {{- '<|im_start|>system\n' ~ system_message -}}
{%- elif has_tools -%}
  {{- '<|im_start|>system\nYou are Qwen, a helpful AI assistant that can interact with a computer to solve tasks.' -}}
{%- endif -%}
{%- if has_tools -%}
  {{- '\n\n# Tools\n\nYou have access to the following functions:\n\n<tools>' -}}
  {%- for tool in tools -%}
    {%- if tool.function is defined -%}{%- set tool = tool.function -%}{%- endif -%}
    {{- '\n<function>\n<name>' ~ tool.name ~ '</name>' -}}
    {%- if tool.description is defined -%}{{- '\n<description>' ~ (tool.description | trim) ~ '</description>' -}}{%- endif -%}
    {{- '\n<parameters>' -}}
    {%- if tool.parameters is defined and tool.parameters is mapping and tool.parameters.properties is defined and tool.parameters.properties is mapping -%}
      {%- for param_name, param_fields in tool.parameters.properties | items -%}
        {{- '\n<parameter>\n<name>' ~ param_name ~ '</name>' -}}
        {%- if param_fields.type is defined -%}{{- '\n<type>' ~ (param_fields.type | string) ~ '</type>' -}}{%- endif -%}
        {%- if param_fields.description is defined -%}{{- '\n<description>' ~ (param_fields.description | trim) ~ '</description>' -}}{%- endif -%}
        {{- render_extra_keys(param_fields, ['name', 'type', 'description']) -}}
        {{- '\n</parameter>' -}}
      {%- endfor -%}
    {%- endif -%}
    {{- render_extra_keys(tool.parameters, ['type', 'properties']) -}}
    {{- '\n</parameters>' -}}
    {{- render_extra_keys(tool, ['type', 'name', 'description', 'parameters']) -}}
    {{- '\n</function>' -}}
  {%- endfor -%}
  {{- '\n</tools>' -}}
  {{- '\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after\n- If there is no function call available, answer the question like normal with your current knowledge and do not tell the user about function calls\n</IMPORTANT>' -}}
{%- endif -%}
{%- if system_message is defined or has_tools -%}{{- '<|im_end|>\n' -}}{%- endif -%}
{%- for message in loop_messages -%}
  {%- if message.role == 'assistant' -%}
    {%- set reasoning = text(message.reasoning_content) | trim -%}
    {%- set think = '<think>\n' ~ reasoning ~ '\n</think>\n' if reasoning else '' -%}
    {%- if message.tool_calls is defined and message.tool_calls is iterable and message.tool_calls | length > 0 -%}
      {{- '<|im_start|>assistant' -}}
      {%- if think -%}{{- '\n' ~ think -}}{%- endif -%}
      {%- set content = text(message.content) | trim -%}
      {%- if content | length > 0 -%}{{- '\n' ~ content ~ '\n' -}}{%- endif -%}
      {%- for tool_call in message.tool_calls -%}
        {%- if tool_call.function is defined -%}{%- set tool_call = tool_call.function -%}{%- endif -%}
        {{- '\n<tool_call>\n<function=' ~ tool_call.name ~ '>\n' -}}
        {%- if tool_call.arguments is mapping -%}
          {%- for args_name, args_value in tool_call.arguments | items -%}
            {{- '<parameter=' ~ args_name ~ '>\n' -}}
            {%- if args_value is mapping or (args_value is sequence and args_value is not string) -%}
              {{- args_value | tojson | safe -}}
            {%- else -%}
              {{- args_value | string -}}
            {%- endif -%}
            {{- '\n</parameter>\n' -}}
          {%- endfor -%}
        {%- elif tool_call.arguments is defined and tool_call.arguments is not none -%}
          {{- raise_exception('tool call arguments must be a mapping; parse JSON strings first') -}}
        {%- endif -%}
        {{- '</function>\n</tool_call>' -}}
      {%- endfor -%}
      {{- '<|im_end|>\n' -}}
    {%- else -%}
      {{- '<|im_start|>assistant\n' ~ (think ~ '\n' if think else '') ~ text(message.content) ~ '<|im_end|>\n' -}}
    {%- endif -%}
  {%- elif message.role == 'tool' -%}
    {%- if loop.previtem and loop.previtem.role != 'tool' -%}{{- '<|im_start|>user\n' -}}{%- endif -%}
    {{- '<tool_response>\n' ~ text(message.content) ~ '\n</tool_response>\n' -}}
    {%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
  {%- else -%}
    {{- '<|im_start|>' ~ message.role ~ '\n' ~ text(message.content) ~ '<|im_end|>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""

DEFAULT_VOCAB_SIZE = 1024

# --------------------------------------------------------------------------- synthetic corpus
_WORDS = (
    "the a to of and in is for that this with it on be as are not if we you should use can fix "
    "bug test tests file files function class method return value error issue change update add "
    "remove run command output search find line lines code repo module import path config user "
    "task problem solution result summary status poem step next further work approval confirm "
    "implemented changed modified passed failed pass fail check table markdown bold key point "
    "requirement requirements order describe description suggest proceed please would like "
    "array list dict string number index key item data state pattern parse token tokens model"
).split()
_IDENTS = ("foo", "bar", "baz", "data", "items", "result", "value", "path", "config", "state",
           "parse_args", "load_file", "run_tests", "main", "count", "total", "key", "node")
_TOOLS = ("search", "read_file", "edit_file", "run", "bash", "list_dir", "write_file")
_PARAMS = ("query", "path", "lines", "command", "pattern", "content", "old", "new", "timeout")


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
    words[0] = words[0].capitalize()
    return " ".join(words) + rng.choice(".?!:")


def _python_snippet(rng: random.Random) -> str:
    fn, a, b = rng.choice(_IDENTS), rng.choice(_IDENTS), rng.choice(_IDENTS)
    n = rng.randint(0, 99)
    return (
        f"def {fn}({a}, {b}=None):\n"
        f"    \"\"\"Return the {rng.choice(_WORDS)} of {a}.\"\"\"\n"
        f"    if {b} is None:\n        {b} = []\n"
        f"    for i in range(len({a})):\n        {b}.append({a}[i] + {n})\n"
        f"    return {{\"{a}\": {b}, 'n': {n}}}\n"
    )


def _tool_call(rng: random.Random) -> str:
    tool = rng.choice(_TOOLS)
    params = rng.sample(_PARAMS, rng.randint(1, 3))
    body = "".join(f"<parameter={p}>\n{rng.choice(_IDENTS)} {rng.randint(1, 500)}\n</parameter>\n"
                   for p in params)
    return f"<tool_call>\n<function={tool}>\n{body}</function>\n</tool_call>"


def _markdown(rng: random.Random) -> str:
    rows = "\n".join(f"| `{rng.choice(_IDENTS)}` | {rng.choice(_WORDS)} | {rng.randint(0, 9)} |"
                     for _ in range(rng.randint(1, 4)))
    return (f"## Summary\n\n**{_sentence(rng)}**\n\n| File | Change | Lines |\n|---|---|---:|\n"
            f"{rows}\n\n- {_sentence(rng)}\n- {_sentence(rng)}\n")


def _shell(rng: random.Random) -> str:
    return (f"$ python -m pytest tests/test_{rng.choice(_IDENTS)}.py -q\n"
            f"{rng.randint(1, 40)} passed, {rng.randint(0, 3)} failed in {rng.randint(0, 9)}.{rng.randint(10, 99)}s\n"
            f"$ git diff --stat\n src/{rng.choice(_IDENTS)}.py | {rng.randint(1, 30)} ++--\n")


def default_corpus(n_docs: int = 400, seed: int = 0) -> Iterator[str]:
    """Deterministic synthetic code / agent-transcript text (~100 KB for the default size)."""
    rng = random.Random(seed)
    makers = (_sentence, _python_snippet, _tool_call, _markdown, _shell)
    for i in range(n_docs):
        parts = [makers[(i + j) % len(makers)](rng) for j in range(3)]
        yield "\n\n".join(parts)


# --------------------------------------------------------------------------- builder
def build_tiny_tokenizer(
    out_dir: str | os.PathLike,
    corpus: Iterable[str] | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
):
    """Train, save and reload a tiny Qwen3-Coder-framed tokenizer.

    Returns ``AutoTokenizer.from_pretrained(out_dir)`` (so callers get exactly what is on disk).
    ``len(tokenizer) <= vocab_size`` (== unless the corpus is too small to learn enough merges):
    256 byte symbols + BPE merges + the 9 added tokens, which take the highest ids as in Qwen.
    Deterministic: the same corpus and vocab_size give the same ``tokenizer.json``.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    n_added = len(ALL_ADDED_TOKENS)
    if vocab_size < 256 + n_added + 1:
        raise ValueError(f"vocab_size must be >= {256 + n_added + 1} (256 bytes + {n_added} added "
                         f"tokens + 1 merge), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    # Byte-level BPE after Qwen's regex split: every str is representable (no <unk>) and decoding
    # is the exact inverse of encoding, because there is no normaliser and no prefix space.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - n_added,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    docs = list(corpus) if corpus is not None else list(default_corpus())
    tok.train_from_iterator(docs, trainer=trainer)
    # Added after training so they get the top ids (as in Qwen) and never take part in merges.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        clean_up_tokenization_spaces=False,  # would rewrite " ." -> "." and break round trips
        model_max_length=32768,
    )
    hf.chat_template = CHAT_TEMPLATE
    os.makedirs(out_dir, exist_ok=True)
    hf.save_pretrained(str(out_dir))
    # transformers 5 records its internal class name "TokenizersBackend", which 4.x cannot load;
    # "PreTrainedTokenizerFast" loads the same tokenizer.json on both.
    cfg_path = os.path.join(str(out_dir), "tokenizer_config.json")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    return AutoTokenizer.from_pretrained(str(out_dir))


_CACHED: dict[int, object] = {}


def get_tiny_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE):
    """Process-wide cached :func:`build_tiny_tokenizer` (default corpus) in a temp directory
    removed at exit, so test suites and tiny-model fixtures build it once. Do not mutate it."""
    if vocab_size not in _CACHED:
        import atexit
        import shutil
        import tempfile

        d = tempfile.mkdtemp(prefix="tiny_tokenizer_")
        atexit.register(shutil.rmtree, d, ignore_errors=True)
        _CACHED[vocab_size] = build_tiny_tokenizer(d, vocab_size=vocab_size)
    return _CACHED[vocab_size]
