"""The paper environment's call probe (megatron_tg.demo.call_probe): the two teacher-forced
probabilities it reads from an embedded engine equal the HF model's softmax at the same
positions, and the positions are the ``lines`` branch and the closing tag after its value."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch


@pytest.mark.slow
def test_the_probe_reads_the_engine_s_probabilities_at_the_call_s_two_tokens(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_tg.demo import call_probe as C
    from megatron_tg.models.tiny import build_tiny_policy
    from megatron_tg.rollout.client import SGLangClient
    from megatron_tg.rollout.engine.launch import start_engines

    policy = build_tiny_policy(tmp_path / "policy")
    tok = AutoTokenizer.from_pretrained(policy)
    (engine,) = start_engines([policy], tmp_path / "logs")
    try:
        loop = asyncio.new_event_loop()

        class Side:  # what the probe uses of a RolloutSide: its client and its event loop
            client = SGLangClient([engine.url], timeout_s=60)

            @staticmethod
            def call(coro):
                return loop.run_until_complete(coro)

        probe = C.CallProbe(Side, tok, n=3, seed=0, start=10_000)
        for name, ids, pos in probe.seqs:  # the positions are the two decision tokens
            nxt = tok.decode(ids[pos:pos + 1])
            assert nxt == ("<parameter" if name == "p_branch" else "</"), (name, nxt)
            assert tok.decode(ids[:pos]).endswith(
                "</parameter>\n" if name == "p_branch" else "<parameter=lines>\n2\n")
        got = probe(1)
        loop.run_until_complete(Side.client.close())
    finally:
        engine.stop()
    model = AutoModelForCausalLM.from_pretrained(policy, torch_dtype=torch.float32).eval()
    want: dict[str, list[float]] = {}
    with torch.no_grad():
        for name, ids, pos in probe.seqs:
            lp = model(torch.tensor([ids[:pos + 1]])).logits[0, pos - 1].float().log_softmax(-1)
            want.setdefault(name, []).append(float(lp[ids[pos]]))
    ref = C.summarize(want)
    assert set(got) == set(ref) == {f"probe/{m}{s}" for m in ("p_branch", "p_close")
                                    for s in ("", "_min", "_logmean")}
    for k in ref:
        assert got[k] == pytest.approx(ref[k], rel=1e-4, abs=1e-7), k
    assert all(0.0 < got[f"probe/{m}"] < 1.0 for m in ("p_branch", "p_close"))


def test_summarize():
    from megatron_tg.demo.call_probe import summarize

    out = summarize({"p": [math.log(0.5), math.log(0.25)]})
    assert out == pytest.approx({"probe/p": 0.375, "probe/p_min": 0.25,
                                 "probe/p_logmean": (math.log(0.5) + math.log(0.25)) / 2})
