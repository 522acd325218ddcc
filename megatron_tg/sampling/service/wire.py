"""What travels between the trainer and the rollout service, as JSON (docs/rollout-service.md).

Everything is plain JSON (no pickle: a message never runs code on the reader). A batch is
every judged rollout of the step once (``judged``: the rollout and its judge result) plus
the training samples as indices into it, so a rollout's tokens cross the wire once.
Floats survive exactly (Python writes the shortest repr that reads back to the same double),
so the trainer gets bit-identical samples whichever side of the socket judged them.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Sequence

from megatron_tg.judge.judge import CriterionResult, JudgeResult
from megatron_tg.rollout.types import Rollout
from megatron_tg.sampling.hinted import HintedTurn
from megatron_tg.sampling.train_sample import TrainSample

PROTOCOL = "tg-rollout/1"
"""Sent by both ends on connect; a service and a trainer that disagree refuse each other."""

PLACEMENT_KEYS = ("service", "service_url", "service_poll_s", "service_start_timeout_s",
                  "sync_master_address", "api_key_file")
"""rollout.* keys that say where things run, not what is generated: they may differ between
the trainer's config and the service's (the trainer is told the service's URL, the service
is not)."""


class WireError(ValueError):
    """A message that does not have the shape the protocol requires."""


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def loads(data: bytes, what: str) -> Any:
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireError(f"{what} is not JSON: {exc}") from exc


def config_fingerprint(cfg) -> dict[str, Any]:
    """The parts of the config that decide what a batch is (seed, model, rollout, judge,
    objective), placement keys left out: trainer and service must agree on them."""
    out = {"seed": cfg.seed, "model.hf_config": cfg.model.hf_config}
    for section in ("rollout", "judge", "objective"):
        for k, v in dataclasses.asdict(getattr(cfg, section)).items():
            if not (section == "rollout" and k in PLACEMENT_KEYS):
                out[f"{section}.{k}"] = v
    return json.loads(json.dumps(out, default=str))  # tuples -> lists, as they arrive


def config_mismatch(mine: dict[str, Any], theirs: Any) -> list[str]:
    """``key: service X, trainer Y`` for every fingerprint key the two disagree on."""
    if not isinstance(theirs, dict):
        return ["config: expected an object of config keys"]
    keys = sorted(set(mine) | set(theirs))
    return [f"{k}: service {mine.get(k)!r}, trainer {theirs.get(k)!r}"
            for k in keys if mine.get(k) != theirs.get(k)]


def judge_result_to_dict(res: JudgeResult | None) -> dict[str, Any] | None:
    return None if res is None else dataclasses.asdict(res)


def judge_result_from_dict(d: Any) -> JudgeResult | None:
    if d is None:
        return None
    if not isinstance(d, dict):
        raise WireError(f"judge result: expected an object, got {type(d).__name__}")
    names = {f.name for f in dataclasses.fields(JudgeResult)}
    unknown = set(d) - names
    if unknown:
        raise WireError(f"judge result: unknown keys {sorted(unknown)}")
    crits = {k: CriterionResult(**v) for k, v in d.get("criteria", {}).items()}
    return JudgeResult(**{**d, "criteria": crits})


def encode_batch(samples: Sequence[TrainSample], judged: Sequence[tuple[Rollout, Any]],
                 metrics: dict[str, float]) -> dict[str, Any]:
    """A batch of :meth:`RolloutSource.next_batch` plus ``last_judged``, as JSON values."""
    index = {id(ro): i for i, (ro, _) in enumerate(judged)}
    out_samples = []
    for s in samples:
        i = index.get(id(s.rollout))
        if i is None:  # the side contract: every sample is one of the batch's judged rollouts
            raise WireError(f"sample {s.rollout.rollout_id!r} is not among the batch's judged rollouts")
        out_samples.append({"judged": i, "advantage": s.advantage, "reward": s.reward,
                            "feedback": {str(k): v for k, v in s.feedback_by_turn.items()},
                            **({"hinted": [h.to_dict() for h in s.hinted]} if s.hinted else {})})
    return {"judged": [[ro.to_dict(), judge_result_to_dict(res)] for ro, res in judged],
            "samples": out_samples, "metrics": metrics}


def decode_batch(d: Any) -> tuple[list[TrainSample], list[tuple[Rollout, Any]], dict[str, float]]:
    if not isinstance(d, dict) or set(d) != {"judged", "samples", "metrics"}:
        raise WireError("batch: expected an object with judged, samples and metrics")
    judged = [(Rollout.from_dict(ro), judge_result_from_dict(res)) for ro, res in d["judged"]]
    samples = []
    for s in d["samples"]:
        i = s["judged"]
        if not isinstance(i, int) or not 0 <= i < len(judged):
            raise WireError(f"batch: sample index {i!r} outside the {len(judged)} judged rollouts")
        try:
            hinted = [HintedTurn.from_dict(h) for h in s.get("hinted", [])]
        except (KeyError, TypeError, ValueError) as exc:
            raise WireError(f"batch: sample {i}: bad hinted turn ({exc})") from exc
        samples.append(TrainSample(judged[i][0], float(s["advantage"]),
                                   {int(k): v for k, v in s["feedback"].items()},
                                   reward=s["reward"], hinted=hinted))
    return samples, judged, {str(k): float(v) for k, v in d["metrics"].items()}
