"""The demo base model's evaluation: sampled episodes through the multi-turn driver with HF
``generate``, and the exact teacher-forced probabilities at the new format's branch."""

from __future__ import annotations

import random
import time
from typing import Any, Sequence

from megatron_tg.demo import episodes as E
from megatron_tg.demo import task as T
from megatron_tg.demo.base_config import BaseModelConfig
from megatron_tg.demo.sft_data import format_branch, turn_ids


# ------------------------------------------------------------------------------ sampling
def hf_generate_batch(model, tokenizer, *, temperature: float = 1.0, max_new_tokens: int = 48,
                      batch_size: int = 128, generator_seed: int | None = None):
    """A ``generate_batch`` for :func:`~megatron_tg.demo.episodes.run_episodes` backed by HF
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



def expert_turn_kl(model, tokenizer, tasks: Sequence[T.FactTask]) -> dict[str, float]:
    """What TG's expert says about the student's usual turn: for the reference OLD-format
    tool-call turn of each task (no hint), the per-token forward KL(expert || student) with the
    expert = the same model on the trainer's expert sequence (:func:`build_expert_sequences`,
    hint right before the turn). A good expert disagrees at the format's branch token only;
    everywhere else it should continue the student's call as the student does."""
    import torch

    from megatron_tg.chat.builder import simulate_rollout
    from megatron_tg.chat.feedback import build_expert_sequences

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

    from megatron_tg.chat.template import prompt_ids

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
    no_hint = E.run_episodes(tasks, gen, tokenizer, **kw)
    hinted = E.run_episodes(tasks, gen, tokenizer, hint=T.HINT, **kw)
    rng = random.Random(f"demo-eval:{seed}")
    forced = [turn_ids(tokenizer, t, new_format=True, lines=rng.randint(*T.NEW_FORMAT_LINES)) for t in tasks]
    forced_eps = E.run_episodes(tasks, _forced_first_turn(gen, forced), tokenizer, **kw)
    sample_s = time.perf_counter() - t0
    pb_no = branch_probabilities(model, tokenizer, tasks, hint=None)
    pb_hint = branch_probabilities(model, tokenizer, tasks, hint=T.HINT)
    expert_kl = expert_turn_kl(model, tokenizer, tasks[:64])
    first_no = [e.metrics["first_call_new_format"] for e in no_hint]
    m = {
        "eval_episodes": n,
        "eval_temperature": cfg.eval_temperature,
        "success_no_hint": E.rate(no_hint, "success"),
        "new_format_no_hint": E.rate(no_hint, "new_format"),
        "new_format_no_hint_count": sum(e.new_format for e in no_hint),
        "search_call_rate_no_hint": sum(1 for f in first_no if f is not None) / n,
        "format_ok_no_hint": E.rate(no_hint, "format_ok"),
        "success_hint": E.rate(hinted, "success"),
        "new_format_hint": E.rate(hinted, "new_format"),
        "success_forced_new_no_hint": E.rate(forced_eps, "success"),
        "p_branch_no_hint_mean": sum(pb_no) / n,
        "p_branch_no_hint_max": max(pb_no),
        "p_branch_hint_mean": sum(pb_hint) / n,
        "p_branch_hint_min": min(pb_hint),
        "eval_sampling_s": round(sample_s, 2),
        **expert_kl,
    }
    return m


