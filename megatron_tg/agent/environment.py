"""Where an episode's workspace lives and its tools run: here (:class:`LocalEnvironment`) or
on an environment worker reached over the network (:mod:`megatron_tg.agent.remote`).

The harness sees only these two protocols: open an episode for a task, call tools in it,
grade it, close it. It holds no workspace, sandbox or trainer state itself, so the same
harness drives local workspaces, remote CPU-node workers, or a rollout service process.
"""

from __future__ import annotations

import asyncio
import atexit
from typing import Any, Protocol

from megatron_tg.agent.grading import Grader
from megatron_tg.agent.proc import Limits
from megatron_tg.agent.sandbox import Sandbox, rmtree
from megatron_tg.agent.tasks import Task, materialize
from megatron_tg.agent.tools import ToolResult, Tools
from megatron_tg.agent.workspace import WorkspacePool


class Episode(Protocol):
    async def call(self, name: str, arguments: dict[str, str]) -> ToolResult: ...

    async def grade(self) -> dict[str, Any]:
        """The grading metadata (``tests_passed``, ``tests``) of the final workspace."""
        ...

    async def close(self) -> None: ...


class Environment(Protocol):
    async def open(self, task: Task) -> Episode: ...


class LocalEpisode:
    def __init__(self, env: "LocalEnvironment", task: Task, ws: str, sandbox: Sandbox, tools: Tools):
        self.env, self.task, self.ws, self.sandbox, self.tools = env, task, ws, sandbox, tools

    async def call(self, name: str, arguments: dict[str, str]) -> ToolResult:
        return await self.tools.call(name, arguments)

    async def grade(self) -> dict[str, Any]:
        grader = Grader(self.sandbox, self.env.test_limits, str(self.env.workspaces.run_dir))
        return (await grader.grade(self.task, self.ws)).metadata()

    async def close(self) -> None:
        await asyncio.to_thread(rmtree, self.ws)


class LocalEnvironment:
    """Workspaces on this machine, commands in ``sandbox``."""

    def __init__(self, sandbox: Sandbox, *, test_limits: Limits, search_default_lines: int = 5,
                 tool_output_chars: int = 8192, workspace_root: str | None = None):
        self.sandbox, self.test_limits = sandbox, test_limits
        self.search_default_lines, self.tool_output_chars = search_default_lines, tool_output_chars
        self.workspaces = WorkspacePool(workspace_root)
        atexit.register(self.workspaces.close)

    @classmethod
    def from_config(cls, cfg, sandbox: Sandbox, workspace_root: str | None = None) -> "LocalEnvironment":
        test_limits = Limits(**{**vars(sandbox.limits), "wall_s": cfg.test_timeout_s,
                                "cpu_s": max(1, int(cfg.test_timeout_s + 0.999))})
        return cls(sandbox, test_limits=test_limits, search_default_lines=cfg.search_default_lines,
                   tool_output_chars=cfg.tool_output_chars, workspace_root=workspace_root or cfg.workspace_root)

    async def open(self, task: Task) -> LocalEpisode:
        ws = self.workspaces.new()
        try:
            await asyncio.to_thread(materialize, task, ws)  # a repo copy can be large
            if not self.sandbox.checked:  # once, before per-task copies are made
                await self.sandbox.self_test(ws)
            sandbox = self.sandbox.for_task(task)
            await asyncio.to_thread(sandbox.adopt, ws, ws)
        except BaseException:
            await asyncio.to_thread(rmtree, ws)
            raise
        tools = Tools(ws, sandbox, test_command=task.test_command, search_default_lines=self.search_default_lines,
                      max_output_chars=self.tool_output_chars, shell_limits=sandbox.limits)
        return LocalEpisode(self, task, ws, sandbox, tools)


__all__ = ["Environment", "Episode", "LocalEnvironment", "LocalEpisode"]
