"""Per-sample records: what the judge said and what the trainer did with every rollout.

``RUN_DIR/samples/step_NNNNN.jsonl`` (``.jsonl.gz`` above ``logging.samples_compress_bytes``),
written by global rank 0 after each optimizer step, one JSON object per rollout:

    rollout_id, group_id, task_id, finish_reason, policy_version (oldest turn), tokens,
    trained (False: excluded, e.g. a judge error), reward (the scalar the advantage came
    from), rewards (per criterion), advantage, judge_error, judge_reply (the judge's raw reply,
    only on an error), criteria {name: passed, failing_turns, feedback, detail, judge_feedback},
    turns [{turn, tokens, policy_version, weight_version (the engine's, when it reported
            one), feedback (inserted, framed), loss_tokens,
            gated_tokens, kl_mean (over the gated tokens), is_weight_mean, text (with
            logging.samples_text)}]

Bounded by ``logging.samples_per_step`` rollouts (judge errors first) and
``logging.samples_max_chars`` per string. A file is written to a temporary name and renamed,
so a reader never sees half of one; a resumed run first deletes the files of steps after its
checkpoint (they are re-run and rewritten), so no step is lost or recorded twice.

    python -m megatron_tg.train.samples RUN_DIR [--step N]   # a step's records, one line each
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Protocol, Sequence

import torch

from megatron_tg.rollout.types import Rollout
from megatron_tg.sampling.train_sample import TrainSample
from megatron_tg.train.batching import MicroBatch

_NAME = re.compile(r"^step_(\d+)\.jsonl(\.gz)?$")

TurnStats = dict[str, dict[int, dict[str, float]]]
"""rollout id -> assistant turn -> {loss_tokens, gated_tokens, kl_mean, is_weight_mean}."""


class Detokenizer(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class CriterionVerdict(Protocol):
    passed: bool
    failing_turns: list[int]
    feedback: str | None
    detail: str
    judge_feedback: str | None


class JudgeVerdict(Protocol):
    """What the records read of a judge's result (:class:`megatron_tg.judge.JudgeResult`)."""

    criteria: dict[str, CriterionVerdict]
    judge_error: str | None
    llm_reply: str | None

    @property
    def rewards(self) -> dict[str, float]: ...


class TurnStatsAccumulator:
    """Sums per (rollout, turn) over the micro-batches of a step (one DP rank's share)."""

    def __init__(self) -> None:
        self._sums: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0.0] * 4)

    def add(self, mb: MicroBatch, samples: Sequence[TrainSample],
            rows: dict[str, torch.Tensor]) -> None:
        kl = rows.get("kl")
        weight = rows.get("is_weight")
        gated = (mb.policy.gate > 0).tolist()
        own = mb.policy.pg_mask.tolist() if mb.policy.pg_mask is not None else None
        for j, (k, turn) in enumerate(zip(mb.policy.rollout_index.tolist(), mb.turn_index.tolist())):
            if own is not None and not own[j]:  # a hinted turn's row: not the rollout's token
                continue
            acc = self._sums[(samples[k].rollout.rollout_id, turn)]
            acc[0] += 1.0
            if weight is not None:
                acc[3] += float(weight[j])
            if gated[j]:
                acc[1] += 1.0
                if kl is not None:
                    acc[2] += float(kl[j])

    def result(self) -> TurnStats:
        out: TurnStats = defaultdict(dict)
        for (rid, turn), (n, g, kl, w) in self._sums.items():
            out[rid][turn] = {"loss_tokens": n, "gated_tokens": g,
                              "kl_mean": kl / g if g else None, "is_weight_mean": w / n}
        return dict(out)


def _cut(text: str | None, limit: int) -> str | None:
    if text is None or len(text) <= limit:
        return text
    return text[:limit] + f"... [{len(text) - limit} more chars]"


def rollout_record(rollout: Rollout, result: JudgeVerdict | None, sample: TrainSample | None,
                   stats: dict[int, dict[str, float]] | None, cfg, tokenizer: Detokenizer | None
                   ) -> dict[str, Any]:
    """One rollout's record (``cfg``: the logging config)."""
    limit = cfg.samples_max_chars
    turns = []
    for k, seg in enumerate(rollout.assistant_turns()):
        t: dict[str, Any] = {"turn": k, "tokens": seg.end - seg.start,
                             "policy_version": seg.policy_version,
                             "weight_version": (seg.meta or {}).get("weight_version"),
                             "feedback": _cut((sample.feedback_by_turn.get(k) if sample else None),
                                              limit)}
        t.update((stats or {}).get(k, {"loss_tokens": 0.0, "gated_tokens": 0.0,
                                       "kl_mean": None, "is_weight_mean": None}))
        if cfg.samples_text and tokenizer is not None:
            t["text"] = _cut(tokenizer.decode(rollout.token_ids[seg.start:seg.end]), limit)
        turns.append(t)
    versions = [s.policy_version for s in rollout.assistant_turns() if s.policy_version is not None]
    error = result.judge_error if result is not None else None
    return {
        "rollout_id": rollout.rollout_id, "group_id": rollout.group_id,
        "task_id": rollout.task_id, "finish_reason": rollout.finish_reason,
        "policy_version": min(versions) if versions else None,
        "tokens": len(rollout.token_ids), "trained": sample is not None,
        "reward": sample.reward if sample is not None else None,
        "rewards": dict(result.rewards) if result is not None and error is None else None,
        "advantage": sample.advantage if sample is not None else None,
        "judge_error": _cut(error, limit),
        "judge_reply": _cut(result.llm_reply, limit) if error is not None else None,
        "criteria": {} if result is None else {
            name: {"passed": c.passed, "failing_turns": list(c.failing_turns),
                   "feedback": _cut(c.feedback, limit), "detail": _cut(c.detail, limit),
                   "judge_feedback": _cut(c.judge_feedback, limit)}
            for name, c in result.criteria.items()},
        "turns": turns,
    }


class SampleRecorder:
    """Writes one records file per step (rank 0 only; a no-op elsewhere)."""

    def __init__(self, cfg, run_dir: str | Path, *, enabled: bool, start_step: int = 0,
                 tokenizer: Detokenizer | None = None) -> None:
        self.cfg, self.tokenizer = cfg, tokenizer
        self.enabled = enabled and cfg.samples_per_step > 0
        self.dir = Path(run_dir) / "samples"
        if not self.enabled:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        for path in self.dir.iterdir():  # steps after the checkpoint will be redone
            m = _NAME.match(path.name)
            if (m and int(m.group(1)) > start_step) or path.name.startswith(".tmp-"):
                path.unlink()

    def write(self, step: int, judged: Iterable[tuple[Rollout, JudgeVerdict | None]],
              samples: Sequence[TrainSample], stats: TurnStats) -> Path | None:
        """Record ``judged`` (every rollout of the step with its judge result); ``samples``
        are the ones trained on, ``stats`` the trainer's per-turn values."""
        if not self.enabled:
            return None
        trained = {s.rollout.rollout_id: s for s in samples}
        judged = sorted(judged, key=lambda p: p[1] is None or p[1].judge_error is None)
        lines = [json.dumps(rollout_record(ro, res, trained.get(ro.rollout_id),
                                           stats.get(ro.rollout_id), self.cfg, self.tokenizer),
                            allow_nan=True)
                 for ro, res in judged[: self.cfg.samples_per_step]]
        data = ("".join(line + "\n" for line in lines)).encode()
        name = f"step_{step:05d}.jsonl"
        if len(data) > self.cfg.samples_compress_bytes:
            data, other, name = gzip.compress(data), name, name + ".gz"
        else:
            other = name + ".gz"
        tmp = self.dir / f".tmp-{name}"
        tmp.write_bytes(data)
        os.replace(tmp, self.dir / name)
        (self.dir / other).unlink(missing_ok=True)  # a re-run step that changed compression
        return self.dir / name


def steps_recorded(run_dir: str | Path) -> list[int]:
    d = Path(run_dir) / "samples"
    if not d.is_dir():
        return []
    return sorted(int(m.group(1)) for p in d.iterdir() if (m := _NAME.match(p.name)))


def read_samples(run_dir: str | Path, step: int) -> list[dict[str, Any]]:
    """The records of ``step`` (plain or gzip); a missing step is a named error."""
    d = Path(run_dir) / "samples"
    for name, opener in ((f"step_{step:05d}.jsonl", open), (f"step_{step:05d}.jsonl.gz", gzip.open)):
        if (d / name).exists():
            with opener(d / name, "rt") as f:
                return [json.loads(line) for line in f if line.strip()]
    raise FileNotFoundError(f"no records for step {step} in {d} (recorded: "
                            f"{steps_recorded(run_dir) or 'none'})")


def summary_line(rec: dict[str, Any]) -> str:
    verdicts = " ".join(f"{n}={'pass' if c['passed'] else 'FAIL' + str(c['failing_turns'])}"
                        for n, c in rec["criteria"].items())
    gated = sum(t.get("gated_tokens") or 0 for t in rec["turns"])
    kls = [t["kl_mean"] for t in rec["turns"] if t.get("kl_mean") is not None]
    head = (f"{rec['rollout_id']:<14} v{rec['policy_version']} {rec['tokens']:>6} tok "
            f"{len(rec['turns'])} turns")
    if rec["judge_error"]:
        return f"{head}  JUDGE ERROR: {rec['judge_error']}  reply: {rec['judge_reply']!r}"
    adv = rec["advantage"]
    return (f"{head}  reward {rec['reward']:.3g} adv {adv:+.3f}  {verdicts}  gated {gated:g}"
            + (f" kl {sum(kls) / len(kls):.4g}" if kls else "")) if adv is not None else \
        f"{head}  not trained  {verdicts}"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Show one step's per-sample records of a run.")
    p.add_argument("run_dir")
    p.add_argument("--step", type=int, default=None, help="default: the last recorded step")
    p.add_argument("--json", action="store_true", help="print the raw records")
    args = p.parse_args(argv)
    steps = steps_recorded(args.run_dir)
    step = args.step if args.step is not None else (steps[-1] if steps else 0)
    records = read_samples(args.run_dir, step)
    print(f"step {step}: {len(records)} rollouts")
    for rec in records:
        print(json.dumps(rec) if args.json else summary_line(rec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
