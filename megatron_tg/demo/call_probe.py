"""The paper environment's call probe: the served policy's probabilities at the two tokens
that decide a ``lines`` call, teacher-forced, every N steps (issue 38's dip).

On ``n`` held-out tasks (the ``eval`` split from the index the caller names: the demo's
:data:`.rl.HELD_OUT_START`, never trained on), without any hint, the engine's prompt
log-probs (``logprob_start_len=0``, the weights of the step just synced) of two reference
tool-call turns (:mod:`.paper_env`):

* ``probe/p_branch``: P(the ``<parameter`` that opens ``lines=`` | the turn up to the
  branch), after the base's usual thinking (no announcement): the no-hint probability of the
  new behaviour, the phase experiment's knob, now measured along the run;
* ``probe/p_close``: P(the first token of ``</parameter>`` | the turn through the ``lines``
  value), after thinking that announces ``with lines N``: whether a started ``lines`` call
  is closed. Half-formed calls (``</parameter>`` skipped after the value) are what the dip's
  failed rollouts show; H2 predicts this probability falls in the dip while ``p_branch``
  rises.

Each is logged as the mean over tasks, with ``_min`` (the worst task) and ``_logmean`` (the
mean log-probability, which shows a fall from 1 - 1e-3 to 1 - 1e-2 that the mean hides).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from megatron_tg.demo import paper_env as P
from megatron_tg.demo import task as T

LINES = 2
"""The ``lines`` value of the reference calls (one of :data:`.task.NEW_FORMAT_LINES`)."""


def _turn_ids(tokenizer, task: T.FactTask, *, lines: bool, announce: bool) -> tuple[list[int], int]:
    """(prompt + first assistant turn ids, where the turn starts)."""
    from megatron_tg.chat.builder import simulate_rollout

    args: dict[str, Any] = {"query": task.key}
    if lines:
        args[T.LINES_PARAM] = str(LINES)
    msgs = list(task.prompt_messages()) + [{
        "role": "assistant", "content": "", "tool_calls": [T._call(args)],
        "reasoning_content": P.thinking_text(task, 0, new=announce, brief=False, lines=LINES)}]
    ro = simulate_rollout(tokenizer, msgs)
    return list(ro.token_ids), ro.assistant_turns()[0].start


def probe_sequences(tokenizer, tasks: Sequence[T.FactTask]) -> list[tuple[str, list[int], int]]:
    """(metric, ids, position) per task and metric: the metric is the probability of
    ``ids[position]`` given ``ids[:position]``."""
    out = []
    close_text = "</parameter>"
    for t in tasks:
        old, start = _turn_ids(tokenizer, t, lines=False, announce=False)
        new, _ = _turn_ids(tokenizer, t, lines=True, announce=False)
        j = next(i for i, (a, b) in enumerate(zip(old, new)) if a != b)
        if j <= start:
            raise ValueError(f"task {t.key}: the two calls differ before the assistant turn")
        out.append(("p_branch", new[:j + 1], j))
        ann, start = _turn_ids(tokenizer, t, lines=True, announce=True)
        value = f"<parameter={T.LINES_PARAM}>\n{LINES}\n"
        k = next((i for i in range(start, len(ann))
                  if tokenizer.decode(ann[start:i]).endswith(value)), None)
        if k is None or not tokenizer.decode(ann[k:]).startswith(close_text[:2]):
            raise ValueError(f"task {t.key}: no {close_text!r} after the lines value in the reference call")
        out.append(("p_close", ann[:k + 1], k))
    return out


def summarize(values: dict[str, list[float]]) -> dict[str, float]:
    """Log-probabilities per metric -> ``probe/<metric>``, ``_min``, ``_logmean``."""
    out = {}
    for name, lps in values.items():
        ps = [math.exp(x) for x in lps]
        out[f"probe/{name}"] = sum(ps) / len(ps)
        out[f"probe/{name}_min"] = min(ps)
        out[f"probe/{name}_logmean"] = sum(lps) / len(lps)
    return out


class CallProbe:
    """A rollout-side probe (``RolloutSide.probes``): the two probabilities on the engine."""

    def __init__(self, side, tokenizer, n: int, seed: int, start: int) -> None:
        """``n`` tasks of the ``eval`` split from index ``start`` (the caller's held-out range)."""
        self.side = side
        self.seqs = probe_sequences(tokenizer, T.make_tasks(n, seed=seed, start=start, split="eval"))

    def __call__(self, step: int) -> dict[str, float]:
        import asyncio

        client = self.side.client
        url = client.servers[0].url

        async def one(ids: list[int], pos: int) -> float:
            body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
                    "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                    "rid": f"call_probe/{step}/{len(ids)}/{pos}"}
            res = await client.generate_on(url, body)
            return float(res["meta_info"]["input_token_logprobs"][pos][0])

        async def all_():
            return await asyncio.gather(*(one(ids, pos) for _, ids, pos in self.seqs))

        lps = self.side.call(all_())
        values: dict[str, list[float]] = {}
        for (name, _, _), lp in zip(self.seqs, lps):
            values.setdefault(name, []).append(lp)
        return summarize(values)
