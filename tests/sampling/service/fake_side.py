"""A rollout side for the service tests: the real RolloutSide, manager and judge, with a
rollout function that scripts its transcripts (no model) and a fake engine for the admin
calls (pause, continue, server info). Importable by the service process (``--factory``)."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from megatron_tg.chat import get_tiny_tokenizer
from megatron_tg.chat.builder import simulate_rollout
from megatron_tg.judge import load_rubric
from megatron_tg.sampling.rollouts import RolloutSide
from tests.chat.convos import SEARCH_TOOL, call


def scripted_rollout(tok, task, ctx):
    """Deterministic in (task, index in the group): which criteria pass varies."""
    k = task["n"] * 7 + ctx.index
    args = {"query": "def count", **({"lines": 5} if k % 3 == 0 else {})}
    msgs = [{"role": "system", "content": "agent"}, {"role": "user", "content": f"fix {task['id']}"},
            {"role": "assistant", "content": "look", "tool_calls": [call("search", **args)]},
            {"role": "tool", "content": "src/a.py:1: def count"},
            {"role": "assistant", "content": "done " * (1 + k % 4)}]
    return simulate_rollout(tok, msgs, tools=[SEARCH_TOOL], task_id=task["id"], group_id=ctx.group_id,
                            rollout_id=ctx.rollout_id, policy_version=ctx.version,
                            metadata={"tests_passed": k % 2 == 0})


def make(rollout_delay: float = 0.0, tool_delay: float = 0.0, fail_at: int = -1):
    """The factory: ``rollout_delay`` s of "generation" and ``tool_delay`` s in a tool slot
    per rollout; ``fail_at``: the probe raises at that step (probe errors are counted)."""
    def factory(host):
        tok = get_tiny_tokenizer()

        async def rollout_fn(ctx):
            await asyncio.sleep(rollout_delay)
            async with ctx.tool_slot():
                await asyncio.sleep(tool_delay)
            return scripted_rollout(tok, ctx.task, ctx)

        tasks = [{"id": f"t{i}", "n": i} for i in range(64)]
        side = RolloutSide(host.cfg, tok, rollout_fn, tasks, load_rubric("recipes/rubrics/tool_format.yaml"),
                           engine_model_dir=None, log_dir=host.cfg.logging.run_dir, version=0)

        def probe(step):
            if step == fail_at:
                raise RuntimeError("probe failed on purpose")
            return {"probe/step": float(step)}

        side.probes.append((1, probe))
        return side
    return factory


class FakeEngine:
    """Answers every admin call with {} (GET /server_info with a version) and records them."""

    def __init__(self) -> None:
        calls = self.calls = []

        class Handler(BaseHTTPRequestHandler):
            def _ok(self, body):
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                calls.append(("GET", self.path))
                self._ok({"version": "fake-1", "model_path": "fake"})

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(n)
                calls.append(("POST", self.path))
                self._ok({})

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
