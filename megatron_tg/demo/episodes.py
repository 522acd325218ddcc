"""The demo's multi-turn episode driver: one task -> a token-exact rollout, over any
``generate(input_ids) -> output_ids`` (HF ``generate``, the embedded engine, ...), with the
episode verdicts of :func:`.task.episode_metrics` (or an environment's own)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from megatron_tg.chat.builder import RolloutBuilder
from megatron_tg.chat.parsing import ParsedTurn
from megatron_tg.demo.task import FEEDBACK_ROLE, FactTask, episode_metrics, hint_message, run_tool_call
from megatron_tg.rollout.types import Rollout

GenerateOutput = Any  # list[int] | tuple[list[int], list[float]]
GenerateFn = Callable[[list[int]], GenerateOutput]
GenerateBatchFn = Callable[[list[list[int]]], list[GenerateOutput]]


@dataclass
class Episode:
    task: FactTask
    rollout: Rollout
    turns: list[ParsedTurn]
    hint: str | None
    hint_turns: tuple[int, ...]
    finish_reason: str
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def success(self) -> bool:
        return bool(self.metrics["success"])

    @property
    def new_format(self) -> bool:
        return bool(self.metrics["new_format"])



def _split_output(out: GenerateOutput, eos_id: int) -> tuple[list[int], list[float] | None]:
    if isinstance(out, tuple):
        ids, lps = list(out[0]), (None if out[1] is None else [float(x) for x in out[1]])
    else:
        ids, lps = list(out), None
    if eos_id in ids:  # anything after the stop token (batch padding) is not part of the turn
        cut = ids.index(eos_id) + 1
        ids = ids[:cut]
        lps = None if lps is None else lps[:cut]
    if lps is not None and len(lps) != len(ids):
        raise ValueError(f"generate returned {len(lps)} log-probs for {len(ids)} tokens")
    return ids, lps


def run_episodes(tasks: Sequence[FactTask], generate_batch: GenerateBatchFn, tokenizer, *,
                 hint: str | None = None, hint_turns: Sequence[int] = (0,),
                 hint_role: str = FEEDBACK_ROLE, max_turns: int = 4,
                 max_context_tokens: int | None = None, policy_version: int = 0,
                 group_ids: Sequence[str] | None = None,
                 rollout_ids: Sequence[str] | None = None,
                 hint_by_turn: Mapping[int, str] | None = None,
                 metrics_fn: Callable[..., dict[str, Any]] | None = None) -> list[Episode]:
    """Run one episode per task in lock step: each round sends the context of every unfinished
    episode to ``generate_batch(list_of_input_ids) -> list_of_outputs`` (an output is the
    generated ids, or ``(ids, logprobs)``; anything after the stop token is dropped), parses the
    turns, runs the tool calls and appends the responses.

    ``hint`` (e.g. :data:`HINT`) is inserted as a ``hint_role`` message right before each
    assistant turn in ``hint_turns`` — token for token where ``insert_feedback`` puts
    feedback for that turn. An episode ends when a turn makes no tool call (``stop``), a turn
    lacks the stop token (``length``), ``max_turns`` turns were made (``max_turns``) or the
    next context would exceed ``max_context_tokens`` (``length``).

    ``hint_by_turn`` (instead of ``hint``) puts a different hint before each listed turn
    (the paper suite's environment, whose turns fail different criteria); ``metrics_fn``
    replaces :func:`episode_metrics` (same arguments).

    Rollouts carry ``metadata = task.info() | {"hint": ..., **metrics}``; log-probs are 0.0 when
    ``generate`` returns ids only (``metadata["logprobs"] = "missing"``). A hinted episode's
    hint is part of its prompt/tool segments: such rollouts measure the expert's own
    behaviour; the student's training rollouts are the hint-less ones.
    """
    eos_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    if hint_by_turn is not None and hint is not None:
        raise ValueError("pass hint (with hint_turns) or hint_by_turn, not both")
    if hint_by_turn is None:
        hint_by_turn = {k: hint for k in hint_turns} if hint is not None else {}
    hint_turns = tuple(sorted(hint_by_turn))
    hmsgs = {k: [hint_message(h, hint_role)] for k, h in hint_by_turn.items()}
    metrics_fn = episode_metrics if metrics_fn is None else metrics_fn
    builders: list[RolloutBuilder] = []
    for i, t in enumerate(tasks):
        msgs = list(t.prompt_messages()) + hmsgs.get(0, [])
        builders.append(RolloutBuilder(tokenizer, msgs, task_id=t.id,
                                       group_id=group_ids[i] if group_ids else t.id,
                                       rollout_id=rollout_ids[i] if rollout_ids else ""))
    finish: list[str | None] = [None] * len(tasks)
    missing_lp = [False] * len(tasks)
    for k in range(max_turns):
        active = [i for i in range(len(tasks)) if finish[i] is None]
        if not active:
            break
        outs = generate_batch([builders[i].token_ids for i in active])
        if len(outs) != len(active):
            raise ValueError(f"generate_batch returned {len(outs)} outputs for {len(active)} inputs")
        for i, out in zip(active, outs):
            ids, lps = _split_output(out, eos_id)
            if not ids:
                finish[i] = "length"
                continue
            if lps is None:
                lps, missing_lp[i] = [0.0] * len(ids), True
            parsed = builders[i].add_assistant(ids, lps, policy_version)
            if ids[-1] != eos_id:
                finish[i] = "length"
            elif not parsed.tool_calls and not parsed.errors:
                finish[i] = "stop"
            elif k + 1 == max_turns:
                finish[i] = "max_turns"
            else:
                calls = sorted(list(parsed.tool_calls) + list(parsed.errors), key=lambda c: c.start)
                new = [{"role": "tool", "content": run_tool_call(tasks[i], c)} for c in calls]
                new += hmsgs.get(k + 1, [])
                builders[i].add_messages(new)
                if max_context_tokens is not None and len(builders[i].token_ids) >= max_context_tokens:
                    finish[i] = "length"
    episodes = []
    for i, t in enumerate(tasks):
        b = builders[i]
        reason = finish[i] or "max_turns"
        # A context cut after tool results ends with a non-assistant segment: keep it (it is
        # untrained), the rollout stays valid.
        m = metrics_fn(t, b.parsed, reason)
        md = {**t.info(), "hint": hint, "hint_turns": list(hint_turns), **m}
        if missing_lp[i]:
            md["logprobs"] = "missing"
        rollout = b.build(reason, metadata=md)
        episodes.append(Episode(t, rollout, list(b.parsed), hint, hint_turns, reason, m))
    return episodes


def run_episode(task: FactTask, generate: GenerateFn, tokenizer, **kwargs) -> Episode:
    """One episode with a single-sequence ``generate(input_ids) -> output_ids`` (or
    ``(ids, logprobs)``); keyword arguments as :func:`run_episodes`."""
    return run_episodes([task], lambda batch: [generate(x) for x in batch], tokenizer, **kwargs)[0]


def rate(episodes: Sequence[Episode], key: str) -> float:
    vals = [e.metrics[key] for e in episodes if e.metrics[key] is not None]
    return sum(bool(v) for v in vals) / len(vals) if vals else float("nan")
