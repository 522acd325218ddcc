"""Fixtures for the agent tests: a sandbox with short limits, the tiny Qwen3-Coder tokenizer,
and a scripted engine that replays pre-written assistant turns as token ids.

Tests that run commands need bubblewrap. Without it they are skipped (and say why); CI
installs it with ``apt-get install -y bubblewrap``.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
import tempfile
from pathlib import Path

import pytest

from megatron_tg.agent.sandbox import BWRAP_APT_HINT, Limits, Sandbox, bwrap_path, rmtree
from megatron_tg.chat import encode, get_tiny_tokenizer, stop_token_id
from megatron_tg.rollout.responses import GenerateResult

# Short limits keep the hostile snippets cheap on a shared 2-core machine.
FAST = Limits(wall_s=4.0, cpu_s=2, memory_mb=384, max_procs=24, max_output_bytes=4096, kill_output_bytes=1 << 20)


NOBODY = 65534
REPO = Path(__file__).resolve().parents[2]


def _blocked_for_nobody(path: str) -> str | None:
    """The highest ancestor of ``path`` that ``nobody`` cannot traverse (a 0700 directory, as
    ``mktemp -d`` and root's home make), or None."""
    cur = "/"
    for part in Path(path).parts[1:]:
        cur = os.path.join(cur, part)
        try:
            st = os.stat(cur)
        except OSError:
            return None
        if stat.S_ISDIR(st.st_mode) and not st.st_mode & stat.S_IXOTH and st.st_uid != NOBODY:
            return cur
    return None


def as_nobody(argv: list[str]) -> list[str]:
    """``argv`` run as ``nobody`` (we are root). When the checkout or its interpreter lies
    under a directory ``nobody`` cannot traverse, the command runs in a mount namespace where
    that directory is an empty 0755 tmpfs with only the checkout and the interpreter's
    prefixes bound back, so the test does not depend on where the repository was cloned."""
    need = sorted({str(REPO), sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable))})
    blocked = sorted({b for b in map(_blocked_for_nobody, need) if b})
    cmd = [shutil.which("setpriv"), f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv]
    if not blocked:
        return cmd
    if bwrap_path() is None:
        pytest.fail(f"{blocked[0]} is not traversable by other users (mode 0700) and bubblewrap is missing: "
                    f"clone the repository elsewhere or `chmod o+x {blocked[0]}`")
    wrap = [bwrap_path(), "--dev-bind", "/", "/"]
    for b in blocked:
        wrap += ["--perms", "0755", "--tmpfs", b]
    for p in need:
        if any(p == b or p.startswith(b + "/") for b in blocked):
            for d in reversed(Path(p).parents):
                if any(str(d).startswith(b + "/") for b in blocked):
                    wrap += ["--perms", "0755", "--dir", str(d)]
            wrap += ["--bind", p, p]
    return wrap + ["--", *cmd]


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

    def __init__(self, tok, turns: list[str], weight_version: str = "0"):
        # The engine's weight version it reports: a rollout at policy version v discards
        # answers from any other (rollout/context.py), as from a real engine.
        self.tok, self.turns, self.weight_version = tok, list(turns), weight_version
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
        res = GenerateResult(rid or "r", ids, lps, finish, self.weight_version, "scripted")
        self.outputs.append(res)
        return res
