"""Fixtures for the agent tests: a sandbox with short limits, the tiny Qwen3-Coder tokenizer,
and a scripted engine that replays pre-written assistant turns as token ids.

Tests that run commands need bubblewrap. Without it they are skipped (and say why); CI
installs it with ``apt-get install -y bubblewrap``.
"""

from __future__ import annotations

import tempfile

import pytest

from megatron_tg.agent.sandbox import BWRAP_APT_HINT, Limits, Sandbox, bwrap_path, rmtree
from megatron_tg.chat import encode, get_tiny_tokenizer, stop_token_id
from megatron_tg.rollout.client import GenerateResult

# Short limits keep the hostile snippets cheap on a shared 2-core machine.
FAST = Limits(wall_s=4.0, cpu_s=2, memory_mb=384, max_procs=24, max_output_bytes=4096, kill_output_bytes=1 << 20)


def need_bwrap() -> None:
    if bwrap_path() is None:
        msg = f"bubblewrap (bwrap) not installed; sandbox tests skipped. Install: {BWRAP_APT_HINT}"
        print(msg)
        pytest.skip(msg)


@pytest.fixture(scope="session")
def sandbox() -> Sandbox:
    need_bwrap()
    return Sandbox("bwrap", limits=FAST)


@pytest.fixture
def workdir(sandbox):
    d = tempfile.mkdtemp(prefix="tg-test-ws-")
    sandbox.adopt(d, d)
    yield d
    rmtree(d)


@pytest.fixture(scope="session")
def tok():
    return get_tiny_tokenizer()


class ScriptedClient:
    """Duck-typed SGLangClient: answers each generate() with the next scripted assistant text,
    tokenised by the tiny tokenizer (as an engine would emit it), with made-up log-probs.
    A script entry without the stop token comes back with finish_reason "length"; so does one
    longer than ``max_new_tokens`` (cut)."""

    def __init__(self, tok, turns: list[str]):
        self.tok, self.turns = tok, list(turns)
        self.eos = stop_token_id(tok)
        self.requests: list[dict] = []
        self.outputs: list[GenerateResult] = []

    async def generate(self, input_ids, sampling_params=None, return_logprob=True, rid=None):
        self.requests.append({"input_ids": list(input_ids), "params": dict(sampling_params or {}), "rid": rid})
        if not self.turns:
            raise AssertionError("the harness asked for more turns than scripted")
        ids = encode(self.tok, self.turns.pop(0))
        limit = (sampling_params or {}).get("max_new_tokens")
        if limit is not None and len(ids) > limit:
            ids = ids[:limit]
        finish = {"type": "stop", "matched": self.eos} if ids and ids[-1] == self.eos else {"type": "length"}
        lps = [-0.01 - 0.001 * (i % 13) for i in range(len(ids))]
        res = GenerateResult(rid or "r", ids, lps, finish, "0", "scripted")
        self.outputs.append(res)
        return res
