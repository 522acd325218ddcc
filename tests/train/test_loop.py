"""The whole loop on CPU: 2 trainer ranks (TP=2), one embedded engine, the agent harness on the
built-in tasks, the tool-format rubric, weight sync and checkpoints.

- a run writes one metrics row per step, with the criterion rates, KL, entropy, sync stats;
  the engine ends at the trainer's policy version;
- SIGUSR1 mid-run: the loop finishes the step, checkpoints and exits 75; a restart resumes
  from that step and finishes; the metrics file has each step exactly once (disaggregated, and
  colocated: ``rollout.placement=colocated``).
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
from tests.train.test_kill_resume import RUBRIC

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    """The tiny random Qwen3-MoE policy + tokenizer (megatron_tg.models.tiny, recipes/tiny_cpu.yaml)."""
    from megatron_tg.models.tiny import build_tiny_policy

    return build_tiny_policy(tmp_path_factory.mktemp("policy"))


def _launch(policy_dir, run_dir, steps, extra=()):
    """Two trainer processes started the way srun starts tasks (rank env vars, no agent),
    so each one's exit code is observable, as Slurm's batch script sees them."""
    overrides = [f"model.hf_config={policy_dir}", f"model.hf_checkpoint={policy_dir}",
                 f"logging.run_dir={run_dir}", f"checkpoint.dir={run_dir}/ckpt",
                 f"steps={steps}", "parallel.tp=2", "parallel.sequence_parallel=true",
                 "checkpoint.interval=100",
                 "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.buffer_size=2",
                 "rollout.max_new_tokens=48", "rollout.max_turns=2", "rollout.max_staleness=1",
                 "logging.progress_bar=false", *extra]
    port = str(_port())
    procs = []
    for rank in range(2):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
               "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        log = open(Path(run_dir) / f"rank{rank}.log", "ab")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "megatron_tg.train", "--recipe", "recipes/tiny_cpu.yaml",
             *overrides], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def _wait(procs, timeout, run_dir=None):
    """The ranks' exit codes; a hung run fails with its stacks (:func:`wait_or_dump`)."""
    return wait_or_dump(procs, timeout, lambda: _tail(run_dir, 12000) if run_dir else "")


def _port():
    from megatron_tg.parallel.ports import free_port

    return free_port()


def _rows(run_dir):
    p = Path(run_dir) / "metrics.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def _tail(run_dir, chars=4000):
    return "\n".join((Path(run_dir) / f"rank{r}.log").read_text()[-chars:] for r in range(2))


@pytest.mark.slow
@pytest.mark.parametrize("placement", [
    [],  # disaggregated, the default
    # engines and trainer take turns (docs/colocated.md): the stop's checkpoint is taken with
    # the trainer's state onloaded, and the restart writes it into engines on the base weights
    ["rollout.placement=colocated", "rollout.max_staleness=0"]], ids=["disaggregated", "colocated"])
def test_loop_signal_checkpoint_resume(policy_dir, tmp_path, placement):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    procs = _launch(policy_dir, run_dir, steps=4, extra=placement)
    deadline = time.monotonic() + 400
    while len(_rows(run_dir)) < 1:  # wait for step 1 to finish, then ask to stop
        assert all(p.poll() is None for p in procs), _tail(run_dir)
        assert time.monotonic() < deadline, _tail(run_dir)
        time.sleep(1)
    # Like Slurm's --signal to the step's tasks: every rank gets SIGUSR1.
    for p in procs:
        p.send_signal(signal.SIGUSR1)
    assert _wait(procs, 300, run_dir) == [75, 75], _tail(run_dir)
    stopped_at = len(_rows(run_dir))
    assert 1 <= stopped_at < 4
    latest = (run_dir / "ckpt" / "latest").read_text().strip()
    assert latest == f"step_{stopped_at:08d}"

    procs = _launch(policy_dir, run_dir, steps=4, extra=placement)
    assert _wait(procs, 500, run_dir) == [0, 0], _tail(run_dir)
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    last = rows[-1]
    for key in ("loss", "criteria/tests_pass", "criteria/search_lines", "kl/frac_gated",
                "entropy/all", "sync/bytes", "sync/seconds", "rollout/staleness_max",
                "optim/grad_norm", "reward/mean"):
        assert key in last, sorted(last)
    assert last["sync/tensors"] > 0 and last["rollout/staleness_max"] <= 1
    if placement:  # every step, before and after the restart, trained on released engines
        assert all(r["colocated/engine_bytes_at_train"] == 0.0 for r in rows)
    # Routing replay is on by default for a MoE policy: the engines returned routed experts
    # and every step's student pass replayed them (a rollout without them is an error).
    assert all(r["train/routing_replay"] == 1.0 for r in rows)
    # real generation happened: turns, tokens, and a loss over assistant tokens
    assert all(r["rollout/turns"] >= 1 and r["rollout/response_tokens"] > 0 for r in rows)
    assert all(r["entropy/all"] > 0 for r in rows)
    assert (run_dir / "config.yaml").exists()
    # One records file per step, none lost or doubled by the resume; 2 x 2 rollouts each.
    from megatron_tg.train.samples import read_samples, steps_recorded

    assert steps_recorded(run_dir) == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        recs = read_samples(run_dir, step)
        assert len(recs) == 4 and len({r["rollout_id"] for r in recs}) == 4
        for r in recs:
            assert set(r["criteria"]) >= {"search_lines"} or r["judge_error"], r
            assert r["turns"] and all(t["tokens"] > 0 for t in r["turns"])
            if r["trained"]:
                assert all(t["loss_tokens"] == t["tokens"] for t in r["turns"])
    assert (run_dir / "ckpt" / "latest").read_text().strip() == "step_00000004"
    # the manifest: one entry per start, the resume at the step it resumed from
    import json

    import torch

    starts = json.loads((run_dir / "manifest.json").read_text())["starts"]
    assert [e["step"] for e in starts] == [0, stopped_at]
    assert starts[0]["packages"]["torch"] == torch.__version__
    assert starts[1]["changed_since_first"] == []  # same code, packages and config
    assert starts[0]["judge"]["rubric_sha256"] and starts[0]["engines"]
    assert all("version" in e and e["url"].startswith("http://") for e in starts[0]["engines"])


@pytest.mark.slow
def test_loop_with_the_rollout_side_as_its_own_process(policy_dir, tmp_path):
    """rollout.service=local: rank 0 starts the service (which starts the engine), trains
    from its batches (hinted turns included), pushes weights straight to the engine, and
    stops it at exit."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rubric = tmp_path / "coin_flips.yaml"
    # every_turn: a turn cut by the token limit fails no_digit too (final_turn would not see it)
    rubric.write_text(RUBRIC.replace("scope: final_turn\n    weight: 0.5", "scope: every_turn\n    weight: 0.5"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_port())}
    res = subprocess.run(
        [sys.executable, "-m", "megatron_tg.train", "--recipe", "recipes/tiny_cpu.yaml",
         f"model.hf_config={policy_dir}", f"model.hf_checkpoint={policy_dir}",
         f"logging.run_dir={run_dir}", f"checkpoint.dir={run_dir}/ckpt", "steps=2",
         "checkpoint.interval=100", "rollout.prompts_per_step=2", "rollout.group_size=2",
         "rollout.buffer_size=2", "rollout.max_new_tokens=48", "rollout.max_turns=2",
         "rollout.max_staleness=1", "logging.progress_bar=false", "rollout.service=local",
         f"judge.rubric={rubric}", "objective.primary_criteria=[has_e]", "objective.hinted_samples=1"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    svc_log = run_dir / "rollout_service" / "service.log"
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:] + svc_log.read_text()[-3000:]
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # batches came over the RPC; the engine serves the trainer's weights
        assert r["service/next_batch_s"] >= 0 and r["capacity/inflight_limit"] == 4
        assert r["sync/tensors"] > 0 and r["sync/probe_logprob_diff"] < 0.1
        assert r["rollout/turns"] >= 1 and r["turn/gen_s"] > 0
    # objective.hinted_samples=1: every turn failing no_digit (the rubric's only feedback)
    # got one hinted sample from the engine, over the RPC, and was trained on.
    assert sum(r["hinted/samples"] for r in rows) > 0
    for r in rows:
        assert r["hinted/failed"] == 0
        assert (r["hinted/samples"] > 0) == (r["kl/frac_gated"] > 0) and r["hinted/tokens"] >= r["hinted/samples"]
    start = json.loads((run_dir / "manifest.json").read_text())["starts"][0]
    pid = start["rollout_service"]["pid"]
    assert start["engines"] and "serving http://127.0.0.1:" in svc_log.read_text()
    assert f"pid {pid} serving" in svc_log.read_text()
    with pytest.raises(ProcessLookupError):  # stopped with the trainer
        os.kill(pid, 0)
    assert "done: step 2 of 2 (this rank: cpu" in res.stdout


@pytest.mark.slow
def test_the_loop_at_cp2_takes_cp1_s_first_steps(policy_dir, tmp_path):
    """``parallel.cp=2`` trains the real loop (embedded engine, agent harness, judge, weight
    sync) with the same first steps as CP 1 (here TP 2, the same two ranks and DP 1): seeded
    sampling with staleness 0, so both runs see the same rollouts at step 1 and, while the
    updates agree, after it."""
    rubric = tmp_path / "coin_flips.yaml"  # every turn, so a rollout cut by length is judged too
    rubric.write_text(RUBRIC.replace("scope: final_turn", "scope: every_turn"))
    rows = {}
    for name, extra in (("cp1", ["parallel.tp=2"]),
                        ("cp2", ["parallel.tp=1", "parallel.sequence_parallel=false", "parallel.cp=2"])):
        run_dir = tmp_path / name
        run_dir.mkdir()
        procs = _launch(policy_dir, run_dir, steps=2, extra=[
            "rollout.sampling_seed=1234", "rollout.max_staleness=0", "rollout.group_size=4",
            # Criteria a random policy passes about half the time: GRPO has a gradient and the
            # failing turns get the KL (the expert pass runs).
            f"judge.rubric={rubric}", "objective.primary_criteria=[has_e]",
            "rollout.max_new_tokens=24", *extra])
        assert _wait(procs, 600, run_dir) == [0, 0], _tail(run_dir)
        rows[name] = _rows(run_dir)
    a, b = rows["cp1"], rows["cp2"]
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
    keys = ["loss", "kl/frac_gated", "entropy/all", "reward/mean", "rollout/response_tokens",
            "optim/grad_norm"]
    diffs = {k: [abs(x[k] - y[k]) for x, y in zip(a, b)] for k in keys if k in a[0]}
    print(f"\nmax |CP2 - CP1| per step: {diffs}; CP 1: {[{k: r[k] for k in keys if k in r} for r in a]}")
    assert a[0]["rollout/response_tokens"] == b[0]["rollout/response_tokens"]  # the same rollouts
    assert a[0]["reward/mean"] == b[0]["reward/mean"]
    assert a[0]["kl/frac_gated"] > 0 and a[0]["optim/grad_norm"] > 0 and a[0]["loss"] != 0
    for k in ("loss", "kl/frac_gated", "entropy/all", "optim/grad_norm"):
        assert b[0][k] == pytest.approx(a[0][k], rel=1e-4, abs=1e-6), k
