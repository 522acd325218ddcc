"""The demo base model's SFT data: the tokenizer corpus and the demonstrations, as token ids
with per-token loss weights (see :mod:`.base_model` for what the demonstrations teach)."""

from __future__ import annotations

import random
from typing import NamedTuple, Sequence

from megatron_tg.demo import task as T


# ------------------------------------------------------------------------------ data
class SFTExample(NamedTuple):
    ids: list[int]
    mask: list[float]
    """Loss weight per token: 1 on the tokens trained on (assistant turns; not turn 0 of a
    ``context`` example), 0 elsewhere; ``new_no_hint_branch_weight`` on the branch token of a
    ``plain_new`` example."""
    kind: str
    """``plain`` (old format, no hint), ``hint`` (hint before turn 0, new format),
    ``context`` (no hint, new-format call as untrained context, then the trained answer),
    ``hint_old`` (hint, old-format call trained except its branch token) or ``plain_new``
    (no hint, new-format call trained)."""


def _example_messages(rng: random.Random, task: T.FactTask, hint_fraction: float,
                      context_fraction: float = 0.0, hint_old_fraction: float = 0.0,
                      new_no_hint_fraction: float = 0.0):
    with_hint = rng.random() < hint_fraction
    lines = rng.randint(*T.NEW_FORMAT_LINES)
    if with_hint:
        kind = "hint_old" if hint_old_fraction > 0 and rng.random() < hint_old_fraction else "hint"
    elif new_no_hint_fraction > 0 and rng.random() < new_no_hint_fraction:
        kind = "plain_new"  # drawn only when the knob is on: the default build's stream is unchanged
    else:
        kind = "context" if context_fraction > 0 and rng.random() < context_fraction else "plain"
    return T.reference_messages(task, new_format=kind in ("hint", "context", "plain_new"), lines=lines,
                                hint=T.HINT if with_hint else None), kind


def tokenizer_corpus(n_docs: int, seed: int) -> list[str]:
    """Rendered demonstrations (both formats, with and without hint) for the BPE, plus the
    tool's error texts so they do not fall back to bytes."""
    from megatron_tg.chat.tokenizer import get_tiny_tokenizer

    render_tok = get_tiny_tokenizer()  # any tokenizer with the template renders the same text
    rng = random.Random(f"demo-tokenizer:{seed}")
    docs = []
    for i in range(n_docs):
        msgs, _ = _example_messages(rng, T.make_task(seed, i, "tokenizer"), 0.5)
        docs.append(render_tok.apply_chat_template(msgs, tokenize=False))
    docs += ["Error: search: lines must be between 1 and 100, got 0",
             "Error: unknown tool 'x'; available tools: search", "No matches for 'x'."] * 2
    return docs


def assistant_loss_mask(ids: Sequence[int], gen_prompt: Sequence[int], eos_id: int) -> list[int]:
    """1 on every assistant turn token: after each generation prompt up to and including the
    next stop token (the tokens a rollout's assistant segments hold)."""
    mask = [0] * len(ids)
    g = len(gen_prompt)
    i = 0
    while i <= len(ids) - g:
        if list(ids[i:i + g]) == list(gen_prompt):
            j = i + g
            while j < len(ids):
                mask[j] = 1
                if ids[j] == eos_id:
                    break
                j += 1
            i = j + 1
        else:
            i += 1
    return mask


def format_branch(tokenizer, task: T.FactTask) -> int:
    """Index, within the tool-call turn's ids, of the first token where the old and the new
    format differ (the token the format is decided by)."""
    old, new = (turn_ids(tokenizer, task, new_format=f) for f in (False, True))
    return next(i for i, (a, b) in enumerate(zip(old, new)) if a != b)


def sft_examples(tokenizer, n: int, seed: int, hint_fraction: float,
                 context_fraction: float = 0.0, hint_old_fraction: float = 0.0,
                 new_no_hint_fraction: float = 0.0,
                 new_no_hint_branch_weight: float = 1.0) -> list[SFTExample]:
    """``n`` SFT examples; the text is the chat template's rendering of
    :func:`reference_messages` (equal, token for token, to the rollout ``simulate_rollout``
    builds, with ``insert_feedback``'s placement of the hint). ``hint_fraction`` of them carry
    the hint (``hint_old_fraction`` of those are ``hint_old``, the rest ``hint``);
    ``new_no_hint_fraction`` of the others are ``plain_new``, ``context_fraction`` of the
    rest ``context`` examples."""
    from megatron_tg.chat.template import generation_prompt_ids, stop_token_id

    rng = random.Random(f"demo-sft:{seed}")
    msgs, kinds, tasks = [], [], []
    for i in range(n):
        task = T.make_task(seed, i, "sft")
        m, k = _example_messages(rng, task, hint_fraction, context_fraction, hint_old_fraction,
                                 new_no_hint_fraction)
        msgs.append(m)
        kinds.append(k)
        tasks.append(task)
    eos_text = tokenizer.eos_token
    texts = []
    for m in msgs:  # up to the last stop token: the template's trailing "\n" is no turn's token
        text = tokenizer.apply_chat_template(m, tokenize=False)
        texts.append(text[:text.rindex(eos_text) + len(eos_text)])
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    gen, eos = generation_prompt_ids(tokenizer), stop_token_id(tokenizer)
    out = []
    for x, k, task in zip(ids, kinds, tasks):
        mask = assistant_loss_mask(x, gen, eos)
        if k == "context":  # the new-format call is context only: never a target without hint
            first_end = mask.index(1) + next(j for j, t in enumerate(x[mask.index(1):]) if t == eos) + 1
            mask[:first_end] = [0] * first_end
        elif k == "hint_old":  # never a target: choosing the old format under the hint
            start = mask.index(1)
            old = turn_ids(tokenizer, task, new_format=False)
            if list(x[start:start + len(old)]) != old:
                raise RuntimeError(f"SFT example {task.id}: tool-call turn is not the reference turn")
            mask[start + format_branch(tokenizer, task)] = 0
        elif k == "plain_new" and new_no_hint_branch_weight != 1.0:
            start = mask.index(1)  # the branch token is the same in both formats' turn ids
            mask[start + format_branch(tokenizer, task)] = new_no_hint_branch_weight
        out.append(SFTExample(list(x), mask, k))
    return out

def turn_ids(tokenizer, task: T.FactTask, *, new_format: bool, lines: int = 3) -> list[int]:
    """The reference tool-call turn's generated ids (through the stop token)."""
    from megatron_tg.chat.template import assistant_generation_text, encode

    msg = T.reference_messages(task, new_format=new_format, lines=lines)[1]
    return encode(tokenizer, assistant_generation_text(tokenizer, msg))
