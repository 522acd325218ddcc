"""SIGKILL while an asynchronous checkpoint is being written, resume from the previous one.

With ``checkpoint.async_save`` the save of step k is written in the background during step
k+1 and completed (``COMPLETE``, rename, ``latest``) only once every rank's writer has
finished. The run is SIGKILLed while ``.tmp-step_k`` exists (the write scheduled, not yet
completed): ``latest`` must still name step k-1, the restarted run must resume from step k-1,
and, with seeded sampling and a fully on-policy manager, redo step k exactly as the killed
run did (same loss, rewards, gradient norm), then train to the end.
"""

from __future__ import annotations

import signal
import time

import pytest

from megatron_tg.testing.processes import wait_or_dump
from tests.train.test_kill_resume import (RUBRIC, _last_by_step, _latest, _rows, _start, _tail,  # noqa: F401
                                          kill_group, policy_dir)

# Every test here under NCCL's rules (tests/conftest.py: comm_rules; plain gloo on request).
pytestmark = pytest.mark.usefixtures("comm_rules")

N, K = 4, 2  # killed while step K's checkpoint is written, during step K + 1


@pytest.mark.slow
def test_sigkill_during_an_async_save_resumes_from_the_previous_checkpoint(policy_dir, tmp_path):  # noqa: F811
    rubric = tmp_path / "coin_flips.yaml"
    rubric.write_text(RUBRIC)
    run = tmp_path / "run"
    run.mkdir()
    writing = run / "ckpt" / f".tmp-step_{K:08d}"
    proc = _start(policy_dir, run, rubric)
    deadline = time.monotonic() + 600
    while not writing.exists():
        assert proc.poll() is None, f"the run ended before step {K}'s save:\n{_tail(run)}"
        assert time.monotonic() < deadline, _tail(run)
        time.sleep(0.02)
    kill_group(proc)
    assert proc.returncode == -signal.SIGKILL
    assert _latest(run) == f"step_{K - 1:08d}", _latest(run)  # the killed save never became latest
    first_life = _last_by_step(_rows(run))
    assert K in first_life, sorted(first_life)  # step K was logged before its save began

    proc = _start(policy_dir, run, rubric)
    assert wait_or_dump([proc], 600, lambda: _tail(run)) == [0], _tail(run)
    log = (run / "trainer.log").read_text()
    assert f"resumed from checkpoint step {K - 1}" in log
    assert _latest(run) == f"step_{N:08d}"
    assert not list((run / "ckpt").glob(".tmp-*"))  # the killed write was cleaned up
    rows = _rows(run)
    resumed = _last_by_step(rows)
    assert sorted(resumed) == list(range(1, N + 1))
    # The redone step K equals the killed run's step K: resumed from the complete checkpoint
    # of step K - 1 (model, optimizer, data position), not from the half-written one.
    redone = [r for r in rows if r["step"] == K][-1]
    for key in ("loss", "reward/mean", "optim/grad_norm", "rollout/response_tokens"):
        assert redone[key] == pytest.approx(first_life[K][key], rel=1e-5, abs=1e-7), key
