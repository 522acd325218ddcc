"""Agentic coding environment: tasks, sandboxed tools, grading, and the multi-turn harness that
turns one task into one token-exact :class:`~megatron_tg.rollout.types.Rollout`."""

from megatron_tg.agent.environment import Environment, Episode, LocalEnvironment
from megatron_tg.agent.grading import Grader
from megatron_tg.agent.grading_verdict import GradeResult
from megatron_tg.agent.harness import DEFAULT_SYSTEM_PROMPT, AgentHarness, run_standalone
from megatron_tg.agent.runtimes import ContainerSandbox, sandbox_from_config
from megatron_tg.agent.sandbox import BWRAP_APT_HINT, ExecResult, Limits, Sandbox, SandboxError, bwrap_path
from megatron_tg.agent.tasks import Task, TaskFormatError, builtin_tasks, load_tasks, materialize
from megatron_tg.agent.tools import Tools, ToolResult, search_lines, tool_specs

__all__ = [
    "AgentHarness", "BWRAP_APT_HINT", "ContainerSandbox", "DEFAULT_SYSTEM_PROMPT", "Environment", "Episode",
    "ExecResult", "GradeResult", "Grader", "Limits", "LocalEnvironment", "Sandbox", "SandboxError", "Task",
    "TaskFormatError", "ToolResult", "Tools", "builtin_tasks", "bwrap_path", "load_tasks", "materialize",
    "run_standalone", "sandbox_from_config", "search_lines", "tool_specs",
]
