"""The demo's rollout function: one episode of the didactic task through the rollout manager.

The RL runs generate with the project's real rollout path: the
:class:`~megatron_tg.rollout.manager.RolloutManager` calls :class:`DemoAgent` once per rollout
with a :class:`~megatron_tg.rollout.context.RolloutContext`, whose ``generate`` talks to the
engines over SGLang's HTTP API (the embedded CPU engine here). The episode is the same as the
lock-step driver :func:`megatron_tg.demo.episodes.run_episodes` that evaluates the base model —
same prompt, tool, stop rules and verdicts — but asynchronous and version-aware, so rollouts
of different groups interleave on the engine while the trainer trains.

No hint is ever put into a training rollout: the student acts alone, and the trainer inserts
the judge's feedback only into the expert's context (paper §3).
"""

from __future__ import annotations

from typing import Any, Callable

from megatron_tg.chat.builder import RolloutBuilder
from megatron_tg.chat.template import continuation_ids
from megatron_tg.demo import task as T
from megatron_tg.rollout.types import Rollout


class DemoAgent:
    """``rollout_fn(ctx) -> Rollout`` for :class:`~megatron_tg.demo.task.FactTask` prompts.

    The rollout's metadata carries the task's privileged info (the judge's ``task_info``) and
    the episode verdicts of :func:`~megatron_tg.demo.task.episode_metrics` (``success``,
    ``new_format``, ...), which the demo logs next to the judge's criteria.
    """

    def __init__(self, tokenizer, *, max_turns: int = 4, max_new_tokens: int = 48,
                 max_context_tokens: int = 512,
                 metrics_fn: Callable[..., dict[str, Any]] = T.episode_metrics) -> None:
        self.tok = tokenizer
        self.metrics_fn = metrics_fn  # the environment's episode verdicts (paper_env has its own)
        self.max_turns = max_turns
        self.max_new_tokens = max_new_tokens
        self.max_context_tokens = max_context_tokens

    async def __call__(self, ctx) -> Rollout:
        task = ctx.task
        if not isinstance(task, T.FactTask):
            raise TypeError(f"DemoAgent runs FactTask prompts, got {type(task).__name__}")
        b = RolloutBuilder(self.tok, task.prompt_messages(), task_id=task.id,
                           group_id=ctx.group_id, rollout_id=ctx.rollout_id)
        finish = "max_turns"
        tool_errors = 0  # calls the tool answered with an error (bad lines=, unknown tool, ...)
        for k in range(self.max_turns):
            room = self.max_context_tokens - len(b.token_ids)
            if room <= 0:
                finish = "length"
                break
            out = await ctx.generate(b.token_ids, max_new_tokens=min(self.max_new_tokens, room))
            parsed = b.add_assistant(out.ids, out.logprobs, out.version, meta=out.segment_meta())
            if out.finish_type != "stop" or not parsed.terminated:
                finish = "length"  # cut mid-turn: its calls may be incomplete
                break
            calls = sorted(list(parsed.tool_calls) + list(parsed.errors), key=lambda c: c.start)
            if not calls:
                finish = "stop"
                break
            if k + 1 == self.max_turns:
                break  # no next turn would see the tool results
            async with ctx.tool_slot():  # in-process tools, but timed like sandboxed ones
                responses = [T.run_tool_call(task, c) for c in calls]
            tool_errors += sum(r.startswith("Error:") for r in responses)
            msgs = [{"role": "tool", "content": r} for r in responses]
            if len(b.token_ids) + len(continuation_ids(self.tok, msgs, history=b.history,
                                                       tools=b.tools)) >= self.max_context_tokens:
                # no turn would see these results: they are not part of the rollout, which
                # then stays within max_context_tokens (the trainer's budget is planned on it)
                finish = "length"
                break
            b.add_messages(msgs)
        verdicts = self.metrics_fn(task, b.parsed, finish)
        metadata: dict[str, Any] = {**task.info(), "hint": None, **verdicts,
                                    "n_malformed_calls": sum(len(t.errors) for t in b.parsed),
                                    "n_tool_errors": tool_errors, "finish_reason": finish}
        return b.build(finish, metadata=metadata)
