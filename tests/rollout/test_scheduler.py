"""The engine's generation loop in-process (no HTTP): bookkeeping seen from callbacks."""

from __future__ import annotations

import threading

from megatron_tg.rollout.engine.model_runner import ModelRunner
from megatron_tg.rollout.engine.protocol import GenRequest, SamplingParams
from megatron_tg.rollout.engine.scheduler import Scheduler


def test_a_finished_request_is_out_of_the_running_batch_before_its_caller_hears(model_a):
    # A caller that has its answer and polls num_running for its *next* request must not
    # see the old one counted (the pause tests race on exactly that).
    sched = Scheduler(ModelRunner(str(model_a)), eos_ids=set())
    seen: dict[str, tuple[int, bool]] = {}
    done = threading.Event()

    def on_done(req: GenRequest) -> None:
        running = [s.req for s in sched.running]
        seen[req.rid] = (len(running), any(r is req for r in running))
        if len(seen) == 2:
            done.set()

    sched.start()
    try:
        for rid, n in (("short", 3), ("long", 12)):
            sched.submit(GenRequest(rid, [5, 17, 42], SamplingParams.from_dict({"max_new_tokens": n, "temperature": 0})), on_done)
        assert done.wait(60)
    finally:
        sched.stop()
    assert seen["short"][1] is False and seen["long"] == (0, False)
    assert seen["short"][0] in (0, 1)  # "long" may or may not have been admitted with it


def test_a_failed_step_empties_the_batch_before_answering_with_500(model_a):
    class Broken(ModelRunner):
        def decode(self, batch, tokens):
            raise RuntimeError("device fell over")

    sched = Scheduler(Broken(str(model_a)), eos_ids=set())
    seen: list[tuple[int, dict]] = []
    done = threading.Event()

    def on_done(req: GenRequest) -> None:
        seen.append((len(sched.running), req.finish_reason))
        done.set()

    sched.start()
    try:
        sched.submit(GenRequest("r", [5, 17, 42], SamplingParams.from_dict({"max_new_tokens": 8})), on_done)
        assert done.wait(60)
    finally:
        sched.stop()
    ((running, reason),) = seen
    assert running == 0 and reason["type"] == "abort" and reason["status_code"] == 500
    assert "device fell over" in reason["message"]
