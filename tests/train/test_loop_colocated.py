"""rollout.placement=colocated on the CPU loop: 2 trainer ranks (TP 2) and one embedded engine
started with --enable-memory-saver take turns (docs/colocated.md). At max_staleness=0 with
seeded sampling the run trains to the same step losses as the disaggregated run, a colocated
run stopped and restarted from its checkpoint trains on after it (with the rollout side as a
service of its own), and no train step starts
while the engine holds memory (the loop checks the engine's /server_info
``memory_occupation`` after releasing it, and logs what it read). At rollout.engine_tp=2 each of
the engine's two TP ranks reads the payload of the trainer process on its GPU."""

from __future__ import annotations

import pytest

from tests.train.test_kill_resume import RUBRIC
from tests.train.test_loop import _launch, _rows, _tail, _wait, policy_dir  # noqa: F401 (fixture)


@pytest.mark.slow
def test_colocated_trains_to_the_disaggregated_losses(policy_dir, tmp_path):  # noqa: F811
    rubric = tmp_path / "coin_flips.yaml"  # every turn, so a rollout cut by length is judged too
    rubric.write_text(RUBRIC.replace("scope: final_turn", "scope: every_turn"))
    rows = {}
    # "resumed": colocated, stopped after its step-2 checkpoint and restarted for step 3 (the
    # restart pushes the checkpoint's weights into engines that hold the base weights), with
    # the rollout side as its own process (rollout.service=local): the service generates and
    # judges, trainer rank 0 releases, resumes and writes the engine the service started.
    for name, placement, legs, service in (("disaggregated", "disaggregated", [3], "in_process"),
                                           ("colocated", "colocated", [3], "in_process"),
                                           ("resumed", "colocated", [2, 3], "local")):
        run_dir = tmp_path / name
        run_dir.mkdir()
        for steps in legs:
            procs = _launch(policy_dir, run_dir, steps=steps, extra=[
                f"rollout.placement={placement}", f"rollout.service={service}", "rollout.sampling_seed=1234",
                "rollout.max_staleness=0", "rollout.group_size=4", f"judge.rubric={rubric}",
                "objective.primary_criteria=[has_e]", "rollout.max_new_tokens=24"])
            assert _wait(procs, 600, run_dir) == [0, 0], _tail(run_dir)
        rows[name] = _rows(run_dir)
    a, b, c = rows["disaggregated"], rows["colocated"], rows["resumed"]
    assert [r["step"] for r in c] == [1, 2, 3]
    # the resumed run's step 3 trains on what the uninterrupted run's did
    for k in ("rollout/response_tokens", "reward/mean", "kl/frac_gated"):
        assert c[2][k] == b[2][k], k
    assert c[2]["loss"] == pytest.approx(b[2]["loss"], abs=2e-7)
    assert c[2]["sync/probe_logprob_diff"] < 0.1
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
    diff = max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b))
    print(f"\nmax |colocated - disaggregated| step loss: {diff}; losses {[r['loss'] for r in a]}")
    # The same rollouts (seeded sampling, the same weights at every step) and rewards, exactly.
    for k in ("rollout/response_tokens", "rollout/turns", "reward/mean", "kl/frac_gated"):
        assert [r[k] for r in a] == [r[k] for r in b], k
    # Not bit-exact: the embedded engine's log-probs round with its batch composition, which
    # depends on when requests arrive, so two disaggregated runs of this test differ too (by
    # 6.0e-8 in the step-2 loss and 1.7e-8 in the engine log-prob gap, measured); the trainer's
    # offload/onload itself is bit-exact (tests/train/test_offload.py).
    assert diff <= 2e-7
    for x, y in zip(a, b):
        assert y["optim/grad_norm"] == pytest.approx(x["optim/grad_norm"], rel=1e-6, abs=1e-9)
    assert a[0]["optim/grad_norm"] > 0 and len({r["loss"] for r in a}) > 1
    for x, r in zip(a, b):
        # the engine reported 0 bytes of weights and KV cache before every train step
        assert r["colocated/engine_bytes_at_train"] == 0.0
        assert r["colocated/onload_bytes"] > 0 and r["colocated/offload_state_bytes"] > 0
        # the same HF tensors went through /update_weights_from_tensor (one bucket: the tiny
        # model is under 1 MiB), and the engine serves them (the log-prob probe every sync)
        assert r["sync/buckets"] >= 1 and r["sync/tensors"] == x["sync/tensors"] > 0
        assert r["sync/bytes"] == x["sync/bytes"]
        assert r["sync/probe_logprob_diff"] < 0.1
    assert all("colocated/onload_bytes" not in r for r in a)


def test_colocated_engine_tp2_reads_a_payload_from_each_rank(policy_dir, tmp_path):  # noqa: F811
    """rollout.engine_tp=2: the one embedded engine (--tp-size 2) stands in for two SGLang TP
    ranks on the GPUs of trainer ranks 0 and 1. Each of its ranks' payloads is made by the
    trainer process on that rank's GPU: the engine's own accounting names the processes that
    made the shared memory it opened, and they are the two trainer processes. The payloads are
    bit-identical (else the engine refuses them), every engine weight is written (the coverage
    check at the first sync) and it serves the trainer's weights (the log-prob probe)."""
    rubric = tmp_path / "coin_flips.yaml"  # rewards that differ within a group: the weights move
    rubric.write_text(RUBRIC.replace("scope: final_turn", "scope: every_turn"))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    procs = _launch(policy_dir, run_dir, steps=2, extra=[
        "rollout.placement=colocated", "rollout.engine_tp=2", "rollout.num_engines=1",
        "rollout.max_staleness=0", "rollout.sampling_seed=1234", "rollout.group_size=4",
        f"judge.rubric={rubric}", "objective.primary_criteria=[has_e]", "rollout.max_new_tokens=24"])
    assert _wait(procs, 300, run_dir) == [0, 0], _tail(run_dir)
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["optim/grad_norm"] > 0  # the first sync sends weights the engine never had
    for r in rows:
        assert r["colocated/payload_senders"] == 2.0  # two processes, checked against the ranks
        assert r["sync/tensors"] > 0 and r["sync/buckets"] >= 1 and r["sync/engines"] == 1.0
        assert r["sync/probe_logprob_diff"] < 0.1
        assert r["colocated/engine_bytes_at_train"] == 0.0
    log = (run_dir / "rank0.log").read_text()
    line = next(x for x in log.splitlines() if "[colocated] the engines' TP ranks read payloads" in x)
    # {url: [process of engine rank 0's payload, of rank 1's]}: the processes this test started
    assert line.endswith(f": {[procs[0].pid, procs[1].pid]}}}"), line
