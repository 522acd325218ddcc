"""The didactic experiment's base model: a tiny Qwen3-MoE SFT'd on :mod:`megatron_tg.demo.task`.

:func:`build_base_model` reproduces the "SFT that never saw the new tool format" of paper §5.1
at toy scale, on CPU, in the project's real formats:

1. tokenizer: :func:`megatron_tg.chat.build_tiny_tokenizer` (Qwen3-Coder framing) with its BPE
   fitted to rendered demo transcripts, so sequences stay short (~105 tokens);
2. data: demonstrations from :func:`~megatron_tg.demo.task.reference_messages`, rendered with
   the chat template; loss on assistant turns. Without the hint the search call uses the OLD
   format; on ``hint_fraction`` (0.5) of the examples the hint (the trainer's framed feedback
   message) sits right before the tool-call turn — token for token where ``insert_feedback``
   puts the expert's feedback — and the call uses the NEW format (``lines=N``). On
   ``context_fraction`` (0.2) of the hint-less examples the call is new-format but *context
   only* (masked out of the loss) and only the answer after its result is trained: the model
   never learns to emit the new format without the hint, but can still read a result it
   fetched that way. Without them (0.0) the answer after a new-format call without hint (the
   state TG's student reaches) was right 0.06–1.0 of the time over 21 measured builds, under
   0.8 in 7 (with them: 0.96–1.0 over 6 builds);
3. model: ``transformers.Qwen3MoeForCausalLM`` (the 30B model's architecture path: q/k norm,
   GQA, top-k routed experts), trained with plain PyTorch AdamW;
4. evaluation by sampling (temperature 1, full vocabulary) through the multi-turn episode
   driver :func:`~megatron_tg.demo.task.run_episodes` with HF ``generate``, plus the exact
   teacher-forced probability of the new format's first token at the branch point;
5. ``save_pretrained`` of model and tokenizer into ``out_dir`` + ``base_metrics.json``.

The build is deterministic given its settings and cached: ``out_dir`` holding a build with the
same :func:`build_hash` (settings, this package's source, torch/transformers versions) is
reused. ``python -m megatron_tg.demo.base_model OUT_DIR [--quick]`` builds from the shell.

Measured (one torch thread, the 2-core CI machine; ~390k parameters): the default build
(400 steps x 32 sequences) takes ~70 s of SFT and ~80 s in all (CPU time); seeds 0 / 1 / 2
give task success without hint 0.99 / 0.99 / 0.98, new format without hint 0 (exact branch
probability ~1e-6), new format with hint 1.0, success after a forced new-format call without
hint 0.99–1.0. ``QUICK`` (300 steps): ~52 s of SFT, rates in :data:`QUICK_EXPECTED`; its
exact no-hint branch probability is 2.8e-5, not ~1e-6. The phase experiment's knob
(``new_no_hint_fraction`` 0.05 with ``new_no_hint_branch_weight`` 0.003 / 0.2, default build)
gave 4.8e-5 / 5.1e-3 (``python -m megatron_tg.demo --suite phase``, seed 0).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Sequence

from megatron_tg.demo import task as T

METRICS_FILE = "base_metrics.json"
BUILD_FORMAT = 2  # bump when the build's outputs change meaning


@dataclass(frozen=True)
class BaseModelConfig:
    seed: int = 0
    steps: int = 400
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    hint_fraction: float = 0.5
    """Fraction of SFT examples that carry the hint (and use the new format)."""
    context_fraction: float = 0.2
    """Fraction of the other examples whose (untrained) tool call uses the new format."""
    hint_old_fraction: float = 0.15
    """Fraction of the hint examples whose tool call uses the OLD format, with the format's
    branch token (the first token where the two formats differ) masked out of the loss: the
    model never learns to choose the old format under the hint, but learns to continue an
    old-format call it finds in its context coherently. That is what the TG expert is asked to
    do: it scores the student's (old-format) turn token by token. Without these examples the
    expert, teacher-forced past the branch onto a prefix it never saw, predicted junk
    (``</parameter`` after ``</``, a digit instead of ``</tool_call>``) with per-token KL of
    10-13 nats at three positions besides the branch; the KL then taught malformed calls and
    the student stopped searching within 5 RL steps (measured with forward KL). With 0.15:
    off-branch KL mean < 0.001, max 0.04 (seed 0); 0.25 cost task success in one build
    (0.87 without hint, 0.54 with); 0.15, and 0.1 with context_fraction 0.3, kept it at
    0.98-0.99 (seed 0, 256 episodes each)."""
    new_no_hint_fraction: float = 0.0
    """Fraction of the hint-less examples whose tool call uses the new format and is TRAINED
    (kind ``plain_new``): the knob of the phase experiment, which needs base models whose
    no-hint probability of the new format is ~1e-4 or ~1e-2 instead of ~1e-6. 0 (default): no
    such example, the base model of paper §5.1."""
    new_no_hint_branch_weight: float = 1.0
    """Loss weight of the format's branch token in ``plain_new`` examples (the rest of the call
    keeps weight 1, so a model that does branch writes a well-formed new-format call). The
    weighted-CE optimum of the branch probability is about f*w / (f*w + 1 - f) with f =
    ``new_no_hint_fraction``, w this weight: a fraction alone cannot reach 1e-4 with a pool of
    a few thousand examples (it would be under one example)."""
    wrong_answer_fraction: float = 0.0
    """Paper environment only (:mod:`.paper_base`): fraction of the demonstrations whose
    answer states a wrong value (:func:`.paper_env.wrong_value`), so
    the base fails the task on about this fraction of its episodes and GRPO has a task
    gradient from step 1 (issue 38's stability comparison). 0 (default): every demonstration
    answers right, and the random stream that draws the others is unchanged."""
    pool_size: int = 4096
    """Distinct SFT examples, rendered and tokenised once, then sampled with replacement."""
    # model (Qwen3MoeConfig)
    hidden_size: int = 64
    num_layers: int = 3
    num_heads: int = 4
    num_kv_heads: int = 2
    num_experts: int = 4
    experts_per_token: int = 2
    moe_intermediate_size: int = 128
    max_position_embeddings: int = 1024
    # tokenizer
    vocab_size: int = 512
    tokenizer_docs: int = 600
    # evaluation
    eval_episodes: int = 256
    """Sampled episodes per condition (no hint / hint / forced new format without hint)."""
    eval_temperature: float = 1.0
    eval_max_new_tokens: int = 48
    eval_batch_size: int = 128
    max_turns: int = 3
    threads: int = 1
    """torch threads for the build (1 measured fastest on the 2-core CI machines)."""

    def model_config(self, vocab_size: int, eos_id: int, pad_id: int):
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            vocab_size=vocab_size, hidden_size=self.hidden_size,
            intermediate_size=2 * self.hidden_size, moe_intermediate_size=self.moe_intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, head_dim=self.hidden_size // self.num_heads,
            num_experts=self.num_experts, num_experts_per_tok=self.experts_per_token,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
            max_position_embeddings=self.max_position_embeddings, tie_word_embeddings=False,
            eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None,
        )


QUICK = dict(steps=400, eval_episodes=128)
"""Overrides for the CI-sized build (``--quick`` / the tests): the full build's 400 SFT steps,
evaluated on half the episodes. 300 steps (the earlier setting) learned the copy skill on one
machine's kernels and package versions but not on another's; 400 learns it on both (below)."""

QUICK_EXPECTED = {"success_no_hint": 0.8, "success_hint": 0.8, "success_forced_new_no_hint": 0.8}
"""Lower bounds the tests assert for the QUICK build (seed 0), with margins measured on more
than one setting. 128 episodes per rate (success without hint / with hint / after a forced
new-format call without hint), seed 0, ``build_base_model(out, seed=0, **QUICK)``:

* 400 steps, this machine's AVX2 kernels: 0.984 / 0.961 / 0.992;
* 400 steps, ``ATEN_CPU_CAPABILITY=default`` (torch's non-vectorised kernels: other float
  rounding, as on another CPU): 0.961 / 0.914 / 0.875;
* 300 steps (the earlier QUICK), a fresh venv of today's packages: 0.805 / 0.625 / 0.633, and
  0.789 without hint on another machine, where the earlier tree measured 0.938 / 0.922 / 0.961 —
  a build at the edge of learning the skill, which is why QUICK moved to 400 steps.

New format with the hint 0.992 / 1.000, without it 0 / 0 (400 steps). The 0.8 bounds sit
0.075 under the lowest measured rate (sampling noise at 128 episodes: about ±0.03); a build
that misses the copy skill scores far lower (150 steps: 0.19)."""


# ------------------------------------------------------------------------------ hashing
def _source_digest() -> str:
    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for name in ("task.py", "base_model.py"):
        h.update((here / name).read_bytes())
    return h.hexdigest()


def build_hash(cfg: BaseModelConfig) -> str:
    import torch
    import transformers

    blob = json.dumps({"format": BUILD_FORMAT, "config": dataclasses.asdict(cfg), "hint": T.HINT,
                       "source": _source_digest(), "torch": torch.__version__,
                       "transformers": transformers.__version__}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


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
    from megatron_tg.chat.framing import generation_prompt_ids, stop_token_id

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


# ------------------------------------------------------------------------------ sampling
def hf_generate_batch(model, tokenizer, *, temperature: float = 1.0, max_new_tokens: int = 48,
                      batch_size: int = 128, generator_seed: int | None = None):
    """A ``generate_batch`` for :func:`~megatron_tg.demo.task.run_episodes` backed by HF
    ``generate``: left-padded batches, pure temperature sampling over the full vocabulary
    (``top_k=0``, ``top_p=1``), returns ``(ids, logprobs)`` per row with log-probs of
    ``log_softmax(logits / temperature)`` (the engine's convention); ``temperature=0`` is
    greedy with raw log-probs. ``generator_seed`` reseeds torch's global RNG once, at
    construction (HF ``generate`` samples from the global RNG)."""
    import torch

    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    pad = tokenizer.convert_tokens_to_ids(tokenizer.pad_token)
    if generator_seed is not None:
        torch.manual_seed(generator_seed)

    sampling = (dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0
                else dict(do_sample=False))

    @torch.inference_mode()
    def generate_batch(contexts: list[list[int]]):
        outs = []
        for s in range(0, len(contexts), batch_size):
            chunk = contexts[s:s + batch_size]
            t = max(len(c) for c in chunk)
            ids = torch.full((len(chunk), t), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), t), dtype=torch.long)
            for b, c in enumerate(chunk):
                ids[b, t - len(c):] = torch.tensor(c)
                mask[b, t - len(c):] = 1
            res = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                 eos_token_id=eos, pad_token_id=pad, output_logits=True,
                                 return_dict_in_generate=True, **sampling)
            new = res.sequences[:, t:]
            logits = torch.stack(res.logits, dim=1).float()  # [B, n, V], raw
            lp = torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)
            lp = lp.gather(-1, new[:, :lp.shape[1], None]).squeeze(-1)
            for b in range(len(chunk)):
                row = new[b].tolist()
                n = row.index(eos) + 1 if eos in row else len(row)
                outs.append((row[:n], lp[b, :n].tolist()))
        return outs

    return generate_batch


def _forced_first_turn(generate_batch, first_turns: list[list[int]]):
    """Wrap ``generate_batch`` so that the first round returns ``first_turns`` (teacher-forced
    tool call; log-probs 0) and later rounds sample."""
    state = {"round": 0}

    def gen(contexts):
        state["round"] += 1
        if state["round"] == 1:
            if len(contexts) != len(first_turns):
                raise ValueError(f"{len(contexts)} contexts for {len(first_turns)} forced turns")
            return [(list(t), [0.0] * len(t)) for t in first_turns]
        return generate_batch(contexts)

    return gen


def turn_ids(tokenizer, task: T.FactTask, *, new_format: bool, lines: int = 3) -> list[int]:
    """The reference tool-call turn's generated ids (through the stop token)."""
    from megatron_tg.chat.framing import assistant_generation_text, encode

    msg = T.reference_messages(task, new_format=new_format, lines=lines)[1]
    return encode(tokenizer, assistant_generation_text(tokenizer, msg))


def expert_turn_kl(model, tokenizer, tasks: Sequence[T.FactTask]) -> dict[str, float]:
    """What TG's expert says about the student's usual turn: for the reference OLD-format
    tool-call turn of each task (no hint), the per-token forward KL(expert || student) with the
    expert = the same model on the trainer's expert sequence (:func:`build_expert_sequences`,
    hint right before the turn). A good expert disagrees at the format's branch token only;
    everywhere else it should continue the student's call as the student does."""
    import torch

    from megatron_tg.chat.builder import simulate_rollout
    from megatron_tg.chat.framing import build_expert_sequences

    at_branch, off_branch = [], []
    with torch.no_grad():
        for t in tasks:
            ro = simulate_rollout(tokenizer, T.reference_messages(t, new_format=False))
            ex = build_expert_sequences(ro, {0: T.HINT}, tokenizer)[0]
            ls = model(torch.tensor([ro.token_ids])).logits[0].float().log_softmax(-1)
            le = model(torch.tensor([ex.token_ids])).logits[0].float().log_softmax(-1)
            turn = ro.assistant_turns()[0]
            b = turn.start + format_branch(tokenizer, t)
            for j in range(turn.start, turn.end):
                e, st = le[ex.position_map[j] - 1], ls[j - 1]
                kl = float((e.exp() * (e - st)).sum())
                (at_branch if j == b else off_branch).append(kl)
    return {"expert_kl_branch_mean": sum(at_branch) / len(at_branch),
            "expert_kl_off_branch_mean": sum(off_branch) / len(off_branch),
            "expert_kl_off_branch_max": max(off_branch)}


def branch_probabilities(model, tokenizer, tasks: Sequence[T.FactTask], *, hint: str | None,
                         lines: int = 3) -> list[float]:
    """Teacher-forced P(first token of the new format | the old-format call up to the branch),
    per task: in the tool-call turn the two formats share a prefix (``...<parameter=query>\\n
    KEY\\n</parameter>\\n``) and then diverge at one token (the ``</`` of ``</function>`` vs the
    ``<parameter`` of ``<parameter=lines>``, the delimiter of paper Fig. 3); this is the
    model's probability of the new branch there."""
    import torch

    from megatron_tg.chat.framing import prompt_ids

    seqs, at, want = [], [], []
    for t in tasks:
        old, new = turn_ids(tokenizer, t, new_format=False), turn_ids(tokenizer, t, new_format=True, lines=lines)
        j = next(i for i, (a, b) in enumerate(zip(old, new)) if a != b)
        msgs = list(t.prompt_messages()) + ([T.hint_message(hint)] if hint is not None else [])
        p = prompt_ids(tokenizer, msgs)
        seqs.append(p + new[:j])
        at.append(len(p) + j - 1)
        want.append(new[j])
    probs = []
    with torch.inference_mode():
        L = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), L, dtype=torch.long)
        for b, s in enumerate(seqs):  # right padding: causal attention never sees it
            ids[b, :len(s)] = torch.tensor(s)
        logits = model(input_ids=ids).logits.float()
        pr = torch.softmax(logits, dim=-1)
        for b in range(len(seqs)):
            probs.append(float(pr[b, at[b], want[b]]))
    return probs


def evaluate(model, tokenizer, cfg: BaseModelConfig, *, n: int | None = None, seed: int | None = None) -> dict[str, Any]:
    """The base model's three properties, by sampling episodes through :func:`run_episodes`.

    * ``success_no_hint``: task success without hint;
    * ``new_format_no_hint``: fraction of episodes whose search calls all use ``lines`` (at
      least one call), without hint — the base rate RL must escape from;
    * ``new_format_hint``: the same with the hint before the tool-call turn;
    * ``success_hint``, ``success_forced_new_no_hint`` (turn 0 teacher-forced to a new-format
      call, no hint: can the model answer from an N-line result it only saw with the hint?);
    * ``p_branch_*``: mean / max of :func:`branch_probabilities` (exact, no sampling noise).
    """
    n = cfg.eval_episodes if n is None else n
    seed = cfg.seed if seed is None else seed
    model.eval()
    tasks = T.make_tasks(n, seed=seed, split="eval")  # a stream SFT never drew from
    gen = hf_generate_batch(model, tokenizer, temperature=cfg.eval_temperature,
                            max_new_tokens=cfg.eval_max_new_tokens, batch_size=cfg.eval_batch_size,
                            generator_seed=seed + 17)
    kw = dict(max_turns=cfg.max_turns)
    t0 = time.perf_counter()
    no_hint = T.run_episodes(tasks, gen, tokenizer, **kw)
    hinted = T.run_episodes(tasks, gen, tokenizer, hint=T.HINT, **kw)
    rng = random.Random(f"demo-eval:{seed}")
    forced = [turn_ids(tokenizer, t, new_format=True, lines=rng.randint(*T.NEW_FORMAT_LINES)) for t in tasks]
    forced_eps = T.run_episodes(tasks, _forced_first_turn(gen, forced), tokenizer, **kw)
    sample_s = time.perf_counter() - t0
    pb_no = branch_probabilities(model, tokenizer, tasks, hint=None)
    pb_hint = branch_probabilities(model, tokenizer, tasks, hint=T.HINT)
    expert_kl = expert_turn_kl(model, tokenizer, tasks[:64])
    first_no = [e.metrics["first_call_new_format"] for e in no_hint]
    m = {
        "eval_episodes": n,
        "eval_temperature": cfg.eval_temperature,
        "success_no_hint": T.rate(no_hint, "success"),
        "new_format_no_hint": T.rate(no_hint, "new_format"),
        "new_format_no_hint_count": sum(e.new_format for e in no_hint),
        "search_call_rate_no_hint": sum(1 for f in first_no if f is not None) / n,
        "format_ok_no_hint": T.rate(no_hint, "format_ok"),
        "success_hint": T.rate(hinted, "success"),
        "new_format_hint": T.rate(hinted, "new_format"),
        "success_forced_new_no_hint": T.rate(forced_eps, "success"),
        "p_branch_no_hint_mean": sum(pb_no) / n,
        "p_branch_no_hint_max": max(pb_no),
        "p_branch_hint_mean": sum(pb_hint) / n,
        "p_branch_hint_min": min(pb_hint),
        "eval_sampling_s": round(sample_s, 2),
        **expert_kl,
    }
    return m


# ------------------------------------------------------------------------------ training
def _lr_at(step: int, cfg: BaseModelConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    p = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def train(model, examples, cfg: BaseModelConfig, pad_id: int, log=None) -> list[float]:
    """Plain PyTorch AdamW SFT; cross-entropy on assistant tokens only (logits computed only
    where a target exists). Returns the per-step losses."""
    import torch
    import torch.nn.functional as F

    rng = random.Random(f"demo-batches:{cfg.seed}")
    decay = [p for n_, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n_]
    no_decay = [p for n_, p in model.named_parameters() if not (p.ndim >= 2 and "norm" not in n_)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    model.train()
    losses = []
    for step in range(cfg.steps):
        # Uniform batches: length-bucketed ones (sort 8 batches' draw by length, split) cut
        # padding by a third but left the copy skill unlearnt at 300 steps (success 0.05 vs 0.95).
        batch = [examples[rng.randrange(len(examples))] for _ in range(cfg.batch_size)]
        L = max(len(x[0]) for x in batch)
        ids = torch.full((len(batch), L), pad_id, dtype=torch.long)
        weight = torch.zeros((len(batch), L), dtype=torch.float32)
        for b, (x, m, _) in enumerate(batch):
            ids[b, :len(x)] = torch.tensor(x)
            weight[b, :len(m)] = torch.tensor(m, dtype=torch.float32)
        tgt_mask = weight > 0
        # right padding needs no attention mask: causal attention never looks right.
        h = model.model(input_ids=ids).last_hidden_state
        sel = tgt_mask[:, 1:]
        logits = model.lm_head(h[:, :-1][sel])
        w = weight[:, 1:][sel]
        if bool((w == 1).all()):  # the plain mean: the default build's arithmetic, unchanged
            loss = F.cross_entropy(logits.float(), ids[:, 1:][sel])
        else:  # per-token weights, normalised by the token count (a weight scales its token only)
            loss = (F.cross_entropy(logits.float(), ids[:, 1:][sel], reduction="none") * w).sum() / w.numel()
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        losses.append(float(loss.detach()))
        if log is not None and (step % 50 == 0 or step == cfg.steps - 1):
            log(f"step {step:4d}  loss {losses[-1]:.4f}  lr {_lr_at(step, cfg):.2e}")
    model.eval()
    return losses


# ------------------------------------------------------------------------------ build
def load_metrics(out_dir: str | os.PathLike) -> dict[str, Any] | None:
    p = Path(out_dir) / METRICS_FILE
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _complete(out_dir: Path) -> bool:
    return all((out_dir / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json",
                                                  "tokenizer_config.json"))


def build_base_model(out_dir: str | os.PathLike, *, seed: int = 0, steps: int | None = None,
                     force: bool = False, log=None, **overrides: Any) -> dict[str, Any]:
    """Build (or reuse) the base model in ``out_dir``; returns its metrics.

    ``overrides`` are :class:`BaseModelConfig` fields (``steps`` too). Reuse: when ``out_dir``
    holds a complete build whose ``build_hash`` equals this one's, its stored metrics are
    returned with ``cached: True`` (``force=True`` rebuilds). Metrics: the :func:`evaluate`
    rates, ``sft_seconds`` (training only), ``build_seconds``, ``n_params``, losses, the hint
    text/role the model was trained with, the config and the hash.
    """
    if steps is not None:
        overrides["steps"] = steps
    cfg = BaseModelConfig(seed=seed, **overrides)
    return build_with(
        out_dir, cfg, build_hash(cfg), force=force, log=log,
        corpus=lambda: tokenizer_corpus(cfg.tokenizer_docs, cfg.seed),
        examples=lambda tok: sft_examples(tok, cfg.pool_size, cfg.seed, cfg.hint_fraction,
                                          cfg.context_fraction, cfg.hint_old_fraction,
                                          cfg.new_no_hint_fraction, cfg.new_no_hint_branch_weight),
        evaluate_fn=lambda model, tok: evaluate(model, tok, cfg),
        extra={"hint_text": T.HINT, "hint_role": T.FEEDBACK_ROLE, "feedback": T.FEEDBACK})


def build_with(out_dir: str | os.PathLike, cfg: BaseModelConfig, h: str, *, corpus, examples,
               evaluate_fn, extra: dict[str, Any], force: bool = False, log=None) -> dict[str, Any]:
    """The build steps shared by this module's base model and the paper suite's
    (:mod:`.paper_base`): reuse a complete build of hash ``h``, else fit the tokenizer on
    ``corpus()``, make the SFT pool ``examples(tokenizer)``, train (:func:`train`), evaluate
    (``evaluate_fn(model, tokenizer)``), save; ``extra`` goes into the metrics as is."""
    import torch

    out = Path(out_dir)
    prev = load_metrics(out)
    if not force and prev is not None and prev.get("build_hash") == h and _complete(out):
        return {**prev, "cached": True}

    say = log or (lambda s: None)
    t_start, c_start = time.perf_counter(), time.process_time()
    old_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        from transformers import Qwen3MoeForCausalLM

        from megatron_tg.chat.framing import stop_token_id
        from megatron_tg.chat.tokenizer import build_tiny_tokenizer

        out.mkdir(parents=True, exist_ok=True)
        mp = out / METRICS_FILE
        if mp.exists():
            mp.unlink()  # an interrupted rebuild must not look complete
        tok = build_tiny_tokenizer(out, corpus=corpus(), vocab_size=cfg.vocab_size)
        eos, pad = stop_token_id(tok), tok.convert_tokens_to_ids(tok.pad_token)
        t0 = time.perf_counter()
        pool = examples(tok)
        data_s = time.perf_counter() - t0
        say(f"tokenizer {len(tok)} ids; {len(pool)} SFT examples, mean length "
            f"{sum(len(x) for x, _, _ in pool) / len(pool):.1f} tokens ({data_s:.1f} s)")

        torch.manual_seed(cfg.seed)
        model = Qwen3MoeForCausalLM(cfg.model_config(len(tok), eos, pad))
        n_params = sum(p.numel() for p in model.parameters())
        say(f"Qwen3MoeForCausalLM: {n_params:,} parameters")
        t0, c0 = time.perf_counter(), time.process_time()
        losses = train(model, pool, cfg, pad, log=say)
        sft_s, sft_cpu = time.perf_counter() - t0, time.process_time() - c0

        t0 = time.perf_counter()
        metrics = evaluate_fn(model, tok)
        eval_s = time.perf_counter() - t0
        model.generation_config.eos_token_id = eos
        model.generation_config.pad_token_id = pad
        model.save_pretrained(out)
        metrics.update({
            "build_hash": h, "config": dataclasses.asdict(cfg), "n_params": n_params,
            "vocab_size": len(tok), **extra,
            "mean_sft_tokens": sum(len(x) for x, _, _ in pool) / len(pool),
            "sft_seconds": round(sft_s, 1), "sft_cpu_seconds": round(sft_cpu, 1),
            "sft_ms_per_step": round(1000 * sft_s / cfg.steps, 1),
            "eval_seconds": round(eval_s, 1), "data_seconds": round(data_s, 1),
            "loss_first": losses[0], "loss_last": float(sum(losses[-20:]) / len(losses[-20:])),
            "threads": cfg.threads,
        })
        metrics["build_seconds"] = round(time.perf_counter() - t_start, 1)
        metrics["build_cpu_seconds"] = round(time.process_time() - c_start, 1)
        mp.write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
        return {**metrics, "cached": False}
    finally:
        torch.set_num_threads(old_threads)


def load_base_model(out_dir: str | os.PathLike):
    """(model, tokenizer) from a built ``out_dir``, model in eval mode (fp32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(out_dir)).eval()
    return model, AutoTokenizer.from_pretrained(str(out_dir))


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m megatron_tg.demo.base_model",
                                 description="Build (or reuse) the demo's SFT'd tiny Qwen3-MoE base model.")
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help=f"CI-sized build: {QUICK}")
    ap.add_argument("--force", action="store_true", help="rebuild even if a matching build exists")
    a = ap.parse_args(argv)
    over = dict(QUICK) if a.quick else {}
    if a.steps is not None:
        over["steps"] = a.steps
    m = build_base_model(a.out_dir, seed=a.seed, force=a.force, log=print, **over)
    keys = ("cached", "n_params", "sft_seconds", "sft_cpu_seconds", "build_seconds",
            "build_cpu_seconds", "success_no_hint", "new_format_no_hint", "new_format_hint",
            "success_hint", "success_forced_new_no_hint", "p_branch_no_hint_mean", "p_branch_hint_mean",
            "expert_kl_branch_mean", "expert_kl_off_branch_mean", "expert_kl_off_branch_max")
    print(json.dumps({k: m.get(k) for k in keys}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
