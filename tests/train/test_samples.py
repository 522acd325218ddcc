"""Per-sample records: every rollout of a step with its verdicts, feedback, the judge's raw
reply on an error, reward, advantage and the trainer's per-turn gate/KL; written atomically,
bounded, compressed when large, and a resumed run neither loses nor duplicates a step."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from megatron_tg.chat import get_tiny_tokenizer
from megatron_tg.chat.builder import simulate_rollout
from megatron_tg.config.train import LoggingConfig
from megatron_tg.judge.judge import CriterionResult, JudgeResult
from megatron_tg.sampling.train_sample import TrainSample
from megatron_tg.train.samples import (SampleRecorder, TurnStatsAccumulator, main, read_samples,
                                       steps_recorded)
from tests.chat.convos import SEARCH_TOOL, conversation


@pytest.fixture(scope="module")
def judged():
    tok = get_tiny_tokenizer()
    out = []
    for k in range(3):
        ro = simulate_rollout(tok, conversation(), tools=[SEARCH_TOOL], group_id="g0",
                              rollout_id=f"r{k}", policy_version=[3, 4, 4, 4][:4])
        crit = {"search_lines": CriterionResult("search_lines", k != 0, 1.0, False,
                                                [0] if k == 0 else [], "Use lines=.",
                                                detail="old format" if k == 0 else "")}
        res = JudgeResult(ro.rollout_id, ro.task_id, ro.group_id, crit)
        if k == 2:  # the judge's reply could not be parsed
            res = JudgeResult(ro.rollout_id, ro.task_id, ro.group_id, {},
                              judge_error="unparseable verdict", llm_reply="I think it is fine?")
        out.append((ro, res))
    samples = [TrainSample(out[0][0], -0.7, {0: "<hint>Use lines=.</hint>"}, reward=0.0),
               TrainSample(out[1][0], 0.7, {}, reward=1.0)]
    return tok, out, samples


def test_records_hold_verdicts_feedback_reply_and_turn_stats(judged, tmp_path):
    tok, pairs, samples = judged
    stats = {"r0": {0: {"loss_tokens": 12.0, "gated_tokens": 12.0, "kl_mean": 0.031,
                        "is_weight_mean": 1.02}}}
    rec = SampleRecorder(LoggingConfig(samples_text=True), tmp_path, enabled=True, tokenizer=tok)
    path = rec.write(7, pairs, samples, stats)
    assert path.name == "step_00007.jsonl" and not list(tmp_path.glob("samples/.tmp-*"))
    rows = {r["rollout_id"]: r for r in read_samples(tmp_path, 7)}
    assert list(rows)[0] == "r2"  # judge errors first
    r0, r1, r2 = rows["r0"], rows["r1"], rows["r2"]
    assert r0["criteria"]["search_lines"] == {"passed": False, "failing_turns": [0],
                                              "feedback": "Use lines=.", "detail": "old format",
                                              "judge_feedback": None}
    assert r0["turns"][0]["feedback"] == "<hint>Use lines=.</hint>"
    assert r0["turns"][0]["gated_tokens"] == 12.0 and r0["turns"][0]["kl_mean"] == 0.031
    assert r0["turns"][1]["gated_tokens"] == 0.0 and r0["turns"][1]["feedback"] is None
    assert r0["reward"] == 0.0 and r0["advantage"] == -0.7 and r0["rewards"] == {"search_lines": 0.0}
    assert r0["policy_version"] == 3 and r0["turns"][1]["policy_version"] == 4
    seg = pairs[0][0].assistant_turns()[0]
    assert r0["turns"][0]["tokens"] == seg.end - seg.start
    assert r0["turns"][0]["text"] == tok.decode(pairs[0][0].token_ids[seg.start:seg.end])
    assert r1["trained"] and r1["judge_reply"] is None
    assert not r2["trained"] and r2["advantage"] is None
    assert r2["judge_error"] == "unparseable verdict" and r2["judge_reply"] == "I think it is fine?"


def test_bounded_compressed_and_resume_safe(judged, tmp_path, capsys):
    tok, pairs, samples = judged
    cfg = LoggingConfig(samples_per_step=2, samples_compress_bytes=0)  # always compress
    rec = SampleRecorder(cfg, tmp_path, enabled=True)
    for step in (1, 2, 3):
        rec.write(step, pairs, samples, {})
    assert steps_recorded(tmp_path) == [1, 2, 3]
    assert (tmp_path / "samples" / "step_00002.jsonl.gz").exists()
    with gzip.open(tmp_path / "samples" / "step_00002.jsonl.gz", "rt") as f:
        assert len(f.read().splitlines()) == 2  # bounded
    # Killed after step 3, resumed from the checkpoint of step 2: step 3 is redone.
    (tmp_path / "samples" / ".tmp-step_00004.jsonl").write_text("{half")
    again = SampleRecorder(LoggingConfig(), tmp_path, enabled=True, start_step=2)
    assert steps_recorded(tmp_path) == [1, 2]
    assert not list(tmp_path.glob("samples/.tmp-*"))
    again.write(3, pairs, samples, {})
    assert steps_recorded(tmp_path) == [1, 2, 3] and len(read_samples(tmp_path, 3)) == 3
    assert not (tmp_path / "samples" / "step_00003.jsonl.gz").exists()
    with pytest.raises(FileNotFoundError, match="no records for step 9"):
        read_samples(tmp_path, 9)
    assert main([str(tmp_path), "--step", "3"]) == 0
    out = capsys.readouterr().out
    assert "step 3: 3 rollouts" in out and "JUDGE ERROR: unparseable verdict" in out
    assert "search_lines=FAIL[0]" in out
    # Off: no directory, no files.
    assert SampleRecorder(LoggingConfig(samples_per_step=0), tmp_path / "off",
                          enabled=True).write(1, pairs, samples, {}) is None
    assert not (tmp_path / "off").exists()


def test_turn_stats_from_a_micro_batch(judged):
    from megatron_tg.config.objective import ObjectiveConfig
    from megatron_tg.train.batching import build_micro_batch

    tok, pairs, samples = judged
    mb = build_micro_batch(samples, tok, ObjectiveConfig(), row_tokens=4096)
    n = mb.rows.numel()
    kl = torch.where(mb.policy.gate > 0, torch.full((n,), 0.5), torch.zeros(n))
    acc = TurnStatsAccumulator()
    acc.add(mb, samples, {"kl": kl, "is_weight": torch.full((n,), 2.0)})
    stats = acc.result()
    seg = samples[0].rollout.assistant_turns()[0]
    assert stats["r0"][0]["loss_tokens"] == seg.end - seg.start  # every generated token
    assert stats["r0"][0]["gated_tokens"] == float((mb.policy.gate > 0).sum()) > 0
    assert stats["r0"][0]["kl_mean"] == 0.5 and stats["r0"][0]["is_weight_mean"] == 2.0
    assert stats["r0"][1]["gated_tokens"] == 0 and stats["r0"][1]["kl_mean"] is None
    assert all(t["gated_tokens"] == 0 for t in stats["r1"].values())
    json.dumps(stats)  # JSON-able as written
