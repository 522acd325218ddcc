"""The remote-sandbox protocol over loopback: a real worker (aiohttp server, real sandbox,
workspaces and grader) and the harness driving it through RemoteEnvironment."""

from __future__ import annotations

import asyncio
import dataclasses

import aiohttp
import pytest
from aiohttp import web

from megatron_tg.agent import AgentHarness, builtin_tasks, run_standalone
from megatron_tg.agent.environment import LocalEnvironment
from megatron_tg.agent.remote import EnvironmentServer, RemoteEnvironment, RemoteEnvironmentError
from megatron_tg.agent.sandbox import Limits
from megatron_tg.config.rollout import RolloutConfig

from .conftest import ScriptedClient
from .test_harness import turn

TOKEN = "t0ken-for-the-loopback-test"


async def start_worker(sandbox, tasks):
    env = LocalEnvironment(sandbox, test_limits=Limits(wall_s=30, cpu_s=20, memory_mb=1024, max_procs=32))
    runner = web.AppRunner(EnvironmentServer(env, tasks, TOKEN, max_episodes=2).app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)  # loopback only
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


def test_harness_over_the_remote_protocol(tok, sandbox):
    tasks = builtin_tasks()
    fizz = next(t for t in tasks if t.id == "fizzbuzz")
    ref = fizz.privileged["reference"]["solution.py"]

    async def main():
        runner, url = await start_worker(sandbox, tasks)
        remote = RemoteEnvironment(url, TOKEN, timeout_s=60)
        try:
            assert await remote.health() == {"tasks": len(tasks), "sandbox": "bwrap", "episodes": 0}
            h = AgentHarness(tok, RolloutConfig(max_turns=6, max_new_tokens=512, max_context_tokens=4096),
                             environment=remote)
            assert h.sandbox is None  # nothing local: the worker holds the workspace
            script = [turn(tok, "", None, ("read_file", {"path": "solution.py"}), ("list_dir", {})),
                      turn(tok, "", None, ("write_file", {"path": "solution.py", "content": ref})),
                      turn(tok, "", None, ("run_tests", {})), turn(tok, "Done.")]
            r = await run_standalone(h, ScriptedClient(tok, script), fizz)
            assert r.metadata["tests_passed"] is True and r.metadata["tool_calls"] == 4, r.metadata
            assert r.metadata["tests"]["results"] == {"_hidden_test.py::test_hidden": "passed"}
            r = await run_standalone(h, ScriptedClient(tok, [turn(tok, "No.")]), fizz)
            assert r.metadata["tests_passed"] is False
            assert (await remote.health())["episodes"] == 0  # closed after each rollout

            # errors, each named
            bad = RemoteEnvironment(url, "wrong-token-of-some-length")
            with pytest.raises(RemoteEnvironmentError, match="401 missing or wrong bearer token"):
                await bad.health()
            await bad.aclose()
            with pytest.raises(RemoteEnvironmentError, match="404 task_id 'nope' is not in this worker"):
                await remote.open(dataclasses.replace(fizz, id="nope"))
            changed = dataclasses.replace(fizz, hidden_files={"_hidden_test.py": "def test_hidden(): pass\n"})
            with pytest.raises(RemoteEnvironmentError, match="409 task 'fizzbuzz' differs"):
                await remote.open(changed)
            with pytest.raises(RemoteEnvironmentError, match="404 no episode 'abc'"):
                await remote.request("POST", "/v1/episodes/abc/call", {"name": "list_dir"})
            ep = await remote.open(fizz)
            with pytest.raises(RemoteEnvironmentError, match="400 call needs name"):
                await remote.request("POST", f"/v1/episodes/{ep.id}/call", {"name": "x", "arguments": {"a": 1}})
            res = await ep.call("read_file", {"path": "_hidden_test.py"})
            assert not res.ok and "no such file" in res.output  # the hidden tests stay on the worker
            ep2 = await remote.open(fizz)
            with pytest.raises(RemoteEnvironmentError, match="503 this worker holds 2 episodes"):
                await remote.open(fizz)
            for e in (ep, ep2):
                await e.close()
            async with aiohttp.ClientSession() as s:  # no token at all
                async with s.get(url + "/v1/health") as resp:
                    assert resp.status == 401
        finally:
            await remote.aclose()
            await runner.cleanup()

    asyncio.run(main())


def test_config_needs_a_token_file_with_a_url():
    from megatron_tg.config.base import ConfigError

    with pytest.raises(ConfigError, match="rollout.sandbox_token_file: required with rollout.sandbox_url"):
        RolloutConfig(sandbox_url="http://127.0.0.1:8765").validate()


def test_the_serve_command_and_a_harness_configured_by_url(tok, tmp_path):
    """`python -m megatron_tg.agent.remote serve` as its own process on 127.0.0.1, and a
    harness that only has rollout.sandbox_url / sandbox_token_file."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import megatron_tg
    from megatron_tg.parallel.ports import free_port
    from megatron_tg.agent.tasks import BUILTIN_TASKS

    repo = Path(megatron_tg.__file__).resolve().parent.parent
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "megatron_tg.agent.remote", "serve", "--token-file", str(token_file),
                             "--port", str(port), f"rollout.tasks={BUILTIN_TASKS}", "rollout.test_timeout_s=30"],
                            env={**os.environ, "PYTHONPATH": str(repo)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    cfg = RolloutConfig(sandbox_url=f"http://127.0.0.1:{port}", sandbox_token_file=str(token_file),
                        max_turns=4, max_new_tokens=512, max_context_tokens=4096)
    cfg.validate()
    h = AgentHarness(tok, cfg)
    fizz = next(t for t in builtin_tasks() if t.id == "fizzbuzz")

    async def main():
        for _ in range(600):  # the worker imports and loads its tasks first (slow under load)
            try:
                return await h.env.health()
            except RemoteEnvironmentError:
                await asyncio.sleep(0.1)
        raise AssertionError("the worker did not answer")

    try:
        assert asyncio.run(main())["tasks"] == 16
        ref = fizz.privileged["reference"]["solution.py"]
        script = [turn(tok, "", None, ("write_file", {"path": "solution.py", "content": ref})), turn(tok, "Done.")]

        async def roll():
            try:
                return await run_standalone(h, ScriptedClient(tok, script), fizz)
            finally:
                await h.env.aclose()

        r = asyncio.run(roll())
        assert r.metadata["tests_passed"] is True, r.metadata
    finally:
        proc.terminate()
        out = proc.communicate(timeout=20)[0]
    assert proc.returncode in (0, -15), out
