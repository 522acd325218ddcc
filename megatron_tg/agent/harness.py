"""The agentic coding harness: one rollout = one agent episode on one task.

Loop (token-exact; the engine's ids and log-probs are stored as generated, never re-tokenised)::

    prompt = chat template(system + tool specs, user instruction) + generation prompt
    repeat:
        turn = engine.generate(context)               # RolloutContext.generate
        parse it (parse_assistant); no tool call and nothing malformed -> done ("stop")
        run the calls in the sandboxed workspace; malformed calls become error observations
        append the tool responses as the template renders them (+ the next generation prompt)
    until the turn limit ("max_turns") or the context limit ("length")
    then grade a copy of the final workspace (megatron_tg.agent.grading) -> metadata["tests_passed"]

The result's metadata key ``tests_passed`` is what the judge's ``tests_pass`` checker reads;
``tests`` holds the per-test results and, when it failed, why.
A harness instance is shared by all rollouts (it holds no per-rollout state) and is the
``rollout_fn`` given to :class:`~megatron_tg.rollout.manager.RolloutManager`.
"""

from __future__ import annotations

import logging
from typing import Any

from megatron_tg.agent.environment import Environment, Episode, LocalEnvironment
from megatron_tg.agent.runtimes import sandbox_from_config
from megatron_tg.agent.sandbox import Sandbox
from megatron_tg.agent.tasks import Task
from megatron_tg.agent.tools import tool_specs
from megatron_tg.chat.builder import RolloutBuilder
from megatron_tg.chat.parsing import ToolCall
from megatron_tg.chat.template import continuation_ids, stop_token_id
from megatron_tg.config.rollout import RolloutConfig
from megatron_tg.rollout.types import Rollout

log = logging.getLogger(__name__)

DEFAULT_SYSTEM_PROMPT = (
    "You are a coding agent. Your current directory is the task's workspace. Use the tools to "
    "inspect and change files and to run commands. When the task is done, reply with a short "
    "summary and no tool call.")
MALFORMED_HINT = ("Write tool calls as <tool_call>\n<function=NAME>\n<parameter=ARG>\nVALUE\n"
                  "</parameter>\n</function>\n</tool_call>")


class AgentHarness:
    def __init__(self, tokenizer, config: RolloutConfig | None = None, *, sandbox: Sandbox | None = None,
                 system_prompt: str = DEFAULT_SYSTEM_PROMPT, workspace_root: str | None = None,
                 environment: Environment | None = None):
        self.tok = tokenizer
        self.cfg = config or RolloutConfig()
        if environment is None and self.cfg.sandbox_url and sandbox is None:
            from megatron_tg.agent.remote import RemoteEnvironment

            environment = RemoteEnvironment.from_config(self.cfg)
        self.sandbox = None
        if environment is None:
            self.sandbox = sandbox or sandbox_from_config(self.cfg)
            environment = LocalEnvironment.from_config(self.cfg, self.sandbox, workspace_root)
        self.env = environment
        self.system_prompt = system_prompt
        self.tools = tool_specs(self.cfg.search_default_lines)
        self.eos = stop_token_id(tokenizer)

    async def __call__(self, ctx) -> Rollout:
        return await self.run(ctx)

    async def run(self, ctx) -> Rollout:
        task = ctx.task if isinstance(ctx.task, Task) else Task.from_dict(ctx.task)
        episode = await self.env.open(task)
        try:
            b = RolloutBuilder(self.tok, [{"role": "system", "content": self.system_prompt},
                                          {"role": "user", "content": task.instruction}],
                               tools=self.tools, task_id=task.id, group_id=ctx.group_id, rollout_id=ctx.rollout_id,
                               tool_call_reading=self.cfg.tool_call_reading)
            finish, stats = await self._loop(ctx, b, episode)
            try:
                graded = await episode.grade()
            except Exception as e:  # a FAIL for this rollout; its GRPO group keeps the others
                log.warning("grading %s failed: %s: %s", task.id, type(e).__name__, e)
                graded = {"tests_passed": False, "tests": {"reason": f"grading failed: {type(e).__name__}: {e}"}}
            metadata = {**stats, **graded}
            return b.build(finish, metadata)
        finally:
            await episode.close()

    async def _loop(self, ctx, b: RolloutBuilder, tools: Episode) -> tuple[str, dict[str, Any]]:
        stats = {"tool_calls": 0, "tool_failures": 0, "malformed_tool_calls": 0, "search_calls": 0,
                 "search_calls_with_lines": 0}
        for turn in range(self.cfg.max_turns):
            room = self.cfg.max_context_tokens - len(b.token_ids)
            if room <= 0:
                return "length", stats
            out = await ctx.generate(b.token_ids, max_new_tokens=min(self.cfg.max_new_tokens, room))
            parsed = b.add_assistant(out.ids, out.logprobs, out.version, meta=out.segment_meta())
            if out.finish_type == "length" or (out.finish_type != "stop" and not parsed.terminated):
                return "length", stats  # cut mid-turn: its calls may be incomplete, stop here
            events = sorted(parsed.tool_calls + parsed.errors, key=lambda c: c.start)
            if not events:
                return "stop", stats
            if turn == self.cfg.max_turns - 1:
                return "max_turns", stats  # no next turn would see the tool results
            messages, calls_meta = [], []
            for ev in events:
                if isinstance(ev, ToolCall):
                    async with ctx.tool_slot():  # an environment-worker slot (rollout/capacity.py)
                        res = await tools.call(ev.name, ev.arguments)
                    stats["tool_calls"] += 1
                    stats["tool_failures"] += not res.ok
                    if ev.name == "search":
                        stats["search_calls"] += 1
                        stats["search_calls_with_lines"] += "lines" in ev.arguments
                    text, meta = res.output, {"name": ev.name, "ok": res.ok}
                else:
                    stats["malformed_tool_calls"] += 1
                    text = (f"Error: malformed tool call{' to ' + ev.name if ev.name else ''}: {ev.message}. "
                            + MALFORMED_HINT)
                    meta = {"name": ev.name, "ok": False, "malformed": True}
                messages.append({"role": "tool", "content": text})
                calls_meta.append(meta)
            close = b.token_ids[-1] != self.eos  # the engine stopped without emitting it
            extra = continuation_ids(self.tok, messages, history=b.history, tools=self.tools)
            if len(b.token_ids) + len(extra) + int(close) >= self.cfg.max_context_tokens:
                return "length", stats  # the observations leave no room for another turn
            b.add_messages(messages, close_turn=close, meta={"calls": calls_meta})
        return "max_turns", stats


def run_standalone(harness: AgentHarness, client, task: Task, *, version: int = 0,
                   sampling_params: dict[str, Any] | None = None, rollout_id: str = "r0"):
    """A coroutine running one rollout outside the manager (evaluation, debugging, tests)."""
    from megatron_tg.rollout.context import RolloutContext, VersionGate

    ctx = RolloutContext(client, task, group_id=f"{task.id}@0", rollout_id=rollout_id,
                         gate=VersionGate(version), sampling_params=sampling_params)
    return harness.run(ctx)


__all__ = ["AgentHarness", "DEFAULT_SYSTEM_PROMPT", "run_standalone"]
