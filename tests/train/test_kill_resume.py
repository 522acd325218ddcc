"""SIGKILL mid-run, resume, and the same losses as an uninterrupted run.

Run A trains N steps straight. Run B trains the same config, is SIGKILLed (no handler, no
final checkpoint: what an OOM killer or a node failure does) during step k+1, i.e. after the
checkpoint of step k, and is restarted; it resumes from step k and trains to N. With seeded
sampling (``rollout.sampling_seed``) and a fully on-policy manager (``max_staleness=0``: each
step's data is exactly the next prompts), steps k+1..N of B must equal A's: same loss, same
rewards, same gradient norm. Everything that makes this hold is under test: the torch_dist
model/optimizer checkpoint, the rollout manager's data position and in-flight prompts, the
engine restarted on the base weights and re-synced to the checkpoint's, and the per-request
seeds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_tg.testing.processes import wait_or_dump

# Every test here under NCCL's rules (tests/conftest.py: comm_rules; plain gloo on request).
pytestmark = pytest.mark.usefixtures("comm_rules")

REPO = Path(__file__).resolve().parents[2]
N, K = 4, 2

# Two regex criteria that random text passes about half the time, so a random policy gets
# non-zero advantages and failing turns (gated KL) at every step: the losses compared are
# real GRPO + KL losses, not zeros.
RUBRIC = """
name: coin_flips
description: criteria a random policy passes about half the time
criteria:
  - name: has_e
    scope: final_turn
    weight: 1.0
    primary: true
    feedback: null
    checker: {type: regex, args: {pattern: "e"}}
  - name: no_digit
    scope: final_turn
    weight: 0.5
    feedback: Do not write digits.
    checker: {type: regex, args: {pattern: "[0-9]", must_match: false}}
"""


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    from megatron_tg.models.tiny import build_tiny_policy

    return build_tiny_policy(tmp_path_factory.mktemp("policy"))


def _start(policy_dir, run_dir: Path, rubric: Path) -> subprocess.Popen:
    from megatron_tg.parallel.ports import free_port

    overrides = [f"model.hf_config={policy_dir}", f"model.hf_checkpoint={policy_dir}",
                 f"logging.run_dir={run_dir}", f"checkpoint.dir={run_dir}/ckpt", f"steps={N}",
                 "checkpoint.interval=1", "checkpoint.keep_last=2", f"judge.rubric={rubric}",
                 "objective.primary_criteria=[has_e]",
                 "rollout.sampling_seed=1234", "rollout.max_staleness=0",
                 "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.buffer_size=2",
                 "rollout.max_new_tokens=24", "rollout.max_turns=2", "logging.progress_bar=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID"):
        env.pop(k, None)
    log = open(run_dir / "trainer.log", "ab")
    # its own process group: the kill takes the trainer's helper processes with it (megatron's
    # async-save worker), as a node's loss does; a SIGKILL to the trainer alone left them
    # running, reparented to init, after the test (seen in CI)
    return subprocess.Popen([sys.executable, "-m", "megatron_tg.train", "--recipe",
                             "recipes/tiny_cpu.yaml", *overrides],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to the trainer and every process of its group; then reap the trainer."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


def _rows(run_dir: Path) -> list[dict]:
    p = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []


def _latest(run_dir: Path) -> str | None:
    p = run_dir / "ckpt" / "latest"
    return p.read_text().strip() if p.exists() else None


def _tail(run_dir: Path) -> str:
    return (run_dir / "trainer.log").read_text()[-4000:]


def _last_by_step(rows: list[dict]) -> dict[int, dict]:
    """Step -> its last logged row (a step the kill interrupted after logging is redone)."""
    return {r["step"]: r for r in rows}


@pytest.mark.slow
def test_sigkill_then_resume_reproduces_the_uninterrupted_losses(policy_dir, tmp_path):
    rubric = tmp_path / "coin_flips.yaml"
    rubric.write_text(RUBRIC)
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    a_dir.mkdir()
    b_dir.mkdir()

    a = _start(policy_dir, a_dir, rubric)  # A runs alongside B's first life
    b = _start(policy_dir, b_dir, rubric)
    deadline = time.monotonic() + 600
    while _latest(b_dir) != f"step_{K:08d}":  # step K is checkpointed: B is now in step K+1
        assert b.poll() is None, f"run B ended before it could be killed:\n{_tail(b_dir)}"
        assert time.monotonic() < deadline, _tail(b_dir)
        time.sleep(0.05)
    kill_group(b)
    assert b.returncode == -signal.SIGKILL
    killed_rows = len(_rows(b_dir))
    assert killed_rows in (K, K + 1), killed_rows  # killed in step K+1 (rarely after logging it)

    b = _start(policy_dir, b_dir, rubric)
    assert wait_or_dump([a, b], 600, lambda: _tail(a_dir) + "\n" + _tail(b_dir)) == [0, 0], \
        _tail(a_dir) + "\n" + _tail(b_dir)
    assert f"resumed from checkpoint step {K}" in (b_dir / "trainer.log").read_text()

    ra, rb = _last_by_step(_rows(a_dir)), _last_by_step(_rows(b_dir))
    assert sorted(ra) == sorted(rb) == list(range(1, N + 1))
    # The data really trains: non-zero advantages and gated KL in the compared steps.
    assert any(ra[s]["reward/std"] > 0 for s in range(K + 1, N + 1))
    assert any(ra[s]["kl/frac_gated"] > 0 for s in range(K + 1, N + 1))
    for s in range(1, N + 1):
        for key in ("loss", "reward/mean", "kl/mean_gated", "optim/grad_norm",
                    "rollout/response_tokens"):
            assert rb[s][key] == pytest.approx(ra[s][key], rel=1e-5, abs=1e-7), (s, key, ra[s][key], rb[s][key])
    # The engines served the checkpoint's weights after the restart, not the base weights:
    # the first resumed step's rollouts have the trained policy's behaviour log-probs.
    assert rb[K + 1]["rollout/staleness_max"] == 0
