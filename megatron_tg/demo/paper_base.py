"""The paper suite's base model: the tiny Qwen3-MoE SFT'd on :mod:`.paper_env`.

Built like the main demo's (:func:`.base_model.build_with`: tokenizer fitted to the rendered
transcripts, plain AdamW SFT on assistant tokens, sampling evaluation, HF checkpoint), on
demonstrations where each style criterion's new behaviour appears only after its feedback:

* each reference turn gets, with probability ``hint_fraction``, a hint naming a non-empty
  subset of the criteria that can fail there (:data:`.paper_env.TURN_CRITERIA`), framed and
  joined exactly as the trainer builds the expert's context (the sequence *is*
  :func:`megatron_tg.chat.feedback.insert_feedback` of the hint-less rollout, so the tokens
  match the trainer's expert pass); the turn then shows each hinted criterion's new
  behaviour — thinking that announces it, and the action;
* ``hint_old_fraction`` of the hinted criteria keep the old behaviour with the tokens where it
  departs from the new one masked out of the loss (the main base's ``hint_old`` examples,
  generalised with a token diff): the expert learns to continue an old turn coherently but
  never to choose it under the hint;
* without a hint, a turn is old in every criterion; on ``context_fraction`` of the hint-less
  examples the first turn shows random new behaviours as untrained context, so the answer
  after, e.g., a ``lines=`` call or a brief thought is still learned.

Evaluation (``base_metrics.json``): per criterion the sampled rate without hint, with every
hint of the turn (:func:`.paper_env.all_fail_hints`) and with its own hint alone, task success
in each case, and the teacher-forced probability of each criterion's first departing token on
the student's usual (all-old) turn without hint (``p_decision_no_hint_*``).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import random
from itertools import combinations
from pathlib import Path
from typing import Any, Mapping, Sequence

from megatron_tg.demo import base_config as BC
from megatron_tg.demo import base_eval as BE
from megatron_tg.demo import base_model as B
from megatron_tg.demo import paper_env as P
from megatron_tg.demo import sft_data as SD
from megatron_tg.demo import episodes as E
from megatron_tg.demo import task as T

BUILD_FORMAT = 1
DEFAULTS = dict(steps=500, eval_episodes=128, eval_max_new_tokens=64)
"""The paper base's :class:`.base_config.BaseModelConfig` overrides (longer turns than the main
demo's: thinking comes first)."""
CRITERION_KEYS = {"search_lines": "new_format", "answer_style": "answer_style",
                  "brief_thinking": "brief_thinking"}
"""Criterion -> the :func:`.paper_env.episode_metrics` verdict that measures it."""


def config(seed: int = 0, **overrides: Any) -> BC.BaseModelConfig:
    return BC.BaseModelConfig(seed=seed, **{**DEFAULTS, **overrides})


def build_hash(cfg: BC.BaseModelConfig) -> str:
    import torch
    import transformers

    here = Path(__file__).resolve().parent
    src = hashlib.sha256(b"".join((here / f).read_bytes() for f in
                                  ("task.py", "episodes.py", "base_config.py", "sft_data.py",
                                   "base_eval.py", "base_model.py", "paper_env.py", "paper_base.py")))
    blob = json.dumps({"format": BUILD_FORMAT, "config": dataclasses.asdict(cfg),
                       "hints": P.all_fail_hints(), "source": src.hexdigest(),
                       "torch": torch.__version__, "transformers": transformers.__version__},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------ data
def _subsets(crits: Sequence[str]) -> list[tuple[str, ...]]:
    return [c for r in range(1, len(crits) + 1) for c in combinations(crits, r)]


def draw_example(rng: random.Random, task: T.FactTask, cfg: BC.BaseModelConfig) -> dict[str, Any]:
    """One demonstration's choices: ``hints`` (turn -> criteria named), ``behaviour``
    ((turn, criterion) -> new?), ``masked`` ((turn, criterion) shown old under its hint, its
    departing tokens untrained), ``context`` (turn 0 untrained), ``lines``."""
    lines = rng.randint(*T.NEW_FORMAT_LINES)
    hints: dict[int, tuple[str, ...]] = {}
    behaviour: dict[tuple[int, str], bool] = {}
    masked: list[tuple[int, str]] = []
    for k, crits in enumerate(P.TURN_CRITERIA):
        if rng.random() < cfg.hint_fraction:
            hints[k] = rng.choice(_subsets(crits))
        for c in crits:
            if c in hints.get(k, ()):
                if cfg.hint_old_fraction > 0 and rng.random() < cfg.hint_old_fraction:
                    masked.append((k, c))
                    behaviour[(k, c)] = False
                else:
                    behaviour[(k, c)] = True
    context = 0 not in hints and cfg.context_fraction > 0 and rng.random() < cfg.context_fraction
    if context:  # random new behaviours on turn 0, as untrained context
        pick = rng.choice(_subsets(P.TURN_CRITERIA[0]))
        behaviour.update({(0, c): True for c in pick})
    # drawn only when asked for: the default base's stream of choices stays as it was
    wrong = cfg.wrong_answer_fraction > 0 and rng.random() < cfg.wrong_answer_fraction
    skip = cfg.skip_search_fraction > 0 and rng.random() < cfg.skip_search_fraction
    if skip:  # one assistant turn, every behaviour old, no hint: the failure is the decision alone
        hints, behaviour, masked, context, wrong = {}, {}, [], False, False
    return {"hints": hints, "behaviour": behaviour, "masked": masked, "context": context,
            "lines": lines, "wrong": wrong, "skip": skip}


def _turn_ids(tok, task: T.FactTask, behaviour: Mapping[tuple[int, str], bool], turn: int, lines: int,
              answer_value: int | None = None) -> list[int]:
    from megatron_tg.chat.template import assistant_generation_text, encode

    msgs = [m for m in P.reference_messages(task, behaviour, lines=lines, answer_value=answer_value)
            if m["role"] == "assistant"]
    return encode(tok, assistant_generation_text(tok, msgs[turn]))


def departures(old: Sequence[int], new: Sequence[int]) -> list[int]:
    """Indices into ``old`` where it departs from ``new``: the first ``old`` token of every
    differing run of a token diff (the tokens a model decides the behaviour by)."""
    old, new = list(old), list(new)
    pre = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
    if pre == len(old) == len(new):
        return []
    # the common prefix first (difflib's longest block could align elsewhere), then a diff
    ops = difflib.SequenceMatcher(a=old[pre:], b=new[pre:], autojunk=False).get_opcodes()
    return sorted({pre + i1 for tag, i1, _, _, _ in ops if tag != "equal" and pre + i1 < len(old)})


def sft_example(tok, task: T.FactTask, choice: Mapping[str, Any]) -> SD.SFTExample:
    """Token ids and loss weights of one drawn demonstration (see the module docstring)."""
    from megatron_tg.chat.builder import simulate_rollout
    from megatron_tg.chat.feedback import insert_feedback

    beh, lines = choice["behaviour"], choice["lines"]
    value = P.wrong_value(task) if choice.get("wrong") else None
    ro = simulate_rollout(tok, P.reference_messages(task, beh, lines=lines, answer_value=value,
                                                    skip_search=bool(choice.get("skip"))))
    turns = ro.assistant_turns()
    if choice["hints"]:
        es = insert_feedback(ro, {k: P.hint_for(cs) for k, cs in choice["hints"].items()}, tok,
                             framing=T.FEEDBACK_ROLE, truncate=False)
        ids, pmap = list(es.token_ids), list(es.position_map)
    else:
        ids, pmap = list(ro.token_ids), list(range(len(ro.token_ids)))
    mask = [0.0] * len(ids)
    for k, seg in enumerate(turns):
        if k == 0 and choice["context"]:
            continue
        for j in range(seg.start, seg.end):
            mask[pmap[j]] = 1.0
    for k, c in choice["masked"]:
        old = list(ro.token_ids[turns[k].start:turns[k].end])
        if old != _turn_ids(tok, task, beh, k, lines, value):
            raise RuntimeError(f"SFT example {task.id}: turn {k} is not its reference rendering")
        new = _turn_ids(tok, task, {**beh, (k, c): True}, k, lines, value)
        for i in departures(old, new):
            mask[pmap[turns[k].start + i]] = 0.0
    return SD.SFTExample(ids, mask, "hint" if choice["hints"] else ("context" if choice["context"] else "plain"))


def sft_examples(tok, cfg: BC.BaseModelConfig) -> list[SD.SFTExample]:
    rng = random.Random(f"demo-paper-sft:{cfg.seed}")
    return [sft_example(tok, t, draw_example(rng, t, cfg))
            for t in (T.make_task(cfg.seed, i, "sft") for i in range(cfg.pool_size))]


def tokenizer_corpus(cfg: BC.BaseModelConfig) -> list[str]:
    from megatron_tg.chat.tokenizer import get_tiny_tokenizer

    render = get_tiny_tokenizer()
    rng = random.Random(f"demo-paper-tokenizer:{cfg.seed}")
    docs = []
    for i in range(cfg.tokenizer_docs):
        t = T.make_task(cfg.seed, i, "tokenizer")
        ch = draw_example(rng, t, cfg)
        beh = {(k, c): rng.random() < 0.5 for k, cs in enumerate(P.TURN_CRITERIA) for c in cs}
        docs.append(render.apply_chat_template(
            P.reference_messages(t, beh, lines=ch["lines"],
                                 hints={k: P.hint_for(cs) for k, cs in ch["hints"].items()},
                                 skip_search=bool(ch.get("skip"))),
            tokenize=False))
    return docs + ["Error: search: lines must be between 1 and 100, got 0",
                   "Error: unknown tool 'x'; available tools: search", "No matches for 'x'."] * 2


# ------------------------------------------------------------------------------ evaluation
def decision_probabilities(model, tok, tasks: Sequence[T.FactTask]) -> dict[str, list[float]]:
    """Per criterion, per task: the probability, teacher-forced on the all-old reference
    rollout without hint, of the new behaviour's first departing token (its decision)."""
    import torch

    from megatron_tg.chat.builder import simulate_rollout

    out: dict[str, list[float]] = {c: [] for c in P.STYLE_CRITERIA}
    with torch.inference_mode():
        for t in tasks:
            ro = simulate_rollout(tok, P.reference_messages(t, {}, lines=2))
            pr = torch.softmax(model(input_ids=torch.tensor([ro.token_ids])).logits[0].float(), -1)
            for k, crits in enumerate(P.TURN_CRITERIA):
                seg = ro.assistant_turns()[k]
                old = list(ro.token_ids[seg.start:seg.end])
                for c in crits:
                    new = _turn_ids(tok, t, {(k, c): True}, k, 2)
                    i = departures(old, new)[0]
                    out[c].append(float(pr[seg.start + i - 1, new[i]]))
    return out


def evaluate(model, tok, cfg: BC.BaseModelConfig) -> dict[str, Any]:
    """The rates of the module docstring (``eval`` split, temperature ``cfg.eval_temperature``)."""
    tasks = T.make_tasks(cfg.eval_episodes, seed=cfg.seed, split="eval")
    gen = BE.hf_generate_batch(model, tok, temperature=cfg.eval_temperature,
                              max_new_tokens=cfg.eval_max_new_tokens, batch_size=cfg.eval_batch_size,
                              generator_seed=cfg.seed + 17)
    kw = dict(max_turns=cfg.max_turns, metrics_fn=P.episode_metrics)
    conds: dict[str, dict[int, str]] = {"no_hint": {}, "all_hints": P.all_fail_hints()}
    for c in P.STYLE_CRITERIA:
        conds[f"hint_{c}"] = {k: P.hint_for([c]) for k, cs in enumerate(P.TURN_CRITERIA) if c in cs}
    m: dict[str, Any] = {"eval_episodes": len(tasks)}
    for name, hints in conds.items():
        eps = E.run_episodes(tasks, gen, tok, hint_by_turn=hints, **kw)
        m[f"success_{name}"] = E.rate(eps, "success")
        m[f"thinking_words_{name}"] = sum(e.metrics["thinking_words"] for e in eps) / len(eps)
        for c, key in CRITERION_KEYS.items():
            m[f"{c}_{name}"] = E.rate(eps, key)
        m[f"all_criteria_{name}"] = E.rate(eps, "all_criteria")
    for c, ps in decision_probabilities(model, tok, tasks[:64]).items():
        m[f"p_decision_no_hint_{c}_mean"] = sum(ps) / len(ps)
        m[f"p_decision_no_hint_{c}_max"] = max(ps)
    # the names the demo's reports read (the main base's): task success, tool format
    m["new_format_no_hint"] = m["search_lines_no_hint"]
    m["new_format_hint"], m["success_hint"] = m["search_lines_all_hints"], m["success_all_hints"]
    return m


def build(out_dir, *, seed: int = 0, force: bool = False, log=None, **overrides: Any) -> dict[str, Any]:
    """Build (or reuse) the paper suite's base model in ``out_dir`` (see :func:`.base_model.build_with`)."""
    cfg = config(seed, **overrides)
    return B.build_with(out_dir, cfg, build_hash(cfg), force=force, log=log,
                        corpus=lambda: tokenizer_corpus(cfg), examples=lambda tok: sft_examples(tok, cfg),
                        evaluate_fn=lambda model, tok: evaluate(model, tok, cfg),
                        extra={"hints": {str(k): v for k, v in P.all_fail_hints().items()},
                               "feedback": P.FEEDBACK, "env": "paper"})


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m megatron_tg.demo.paper_base",
                                 description="Build (or reuse) the paper suite's base model.")
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--force", action="store_true")
    a = ap.parse_args(argv)
    over = {} if a.steps is None else {"steps": a.steps}
    m = build(a.out_dir, seed=a.seed, force=a.force, log=print, **over)
    print(json.dumps({k: v for k, v in m.items() if not isinstance(v, (dict, list))}, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
