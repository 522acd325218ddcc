"""Hinted turns: the policy's own samples of a failing turn with its feedback in context.

The paper's KL term is computed on the student's *own* tokens: at a failing turn it teaches,
position by position, what the feedback-conditioned expert would put next *after the
student's prefix*. Where the expert's behaviour differs from the student's by several tokens
in a row (a new tool-call argument: ``</parameter>\\n<parameter=lines>\\n2\\n</parameter>``
where the student closes the call), the first KL step can only teach the first of them (the
branch token): the student's turn never contains the tokens after it, so the expert is
never asked about them. The student then samples the branch token and continues it the only
way it knows (a second ``query`` parameter), and those half-changed calls fail the task
until later steps teach the next token, and so on (measured in the README: the "first dip").

``objective.hinted_samples = n`` adds, for each failing turn, ``n`` samples of that turn drawn
by the engines with the turn's feedback inserted exactly where the expert sees it (the
expert's context, so the tokens are the expert's own path, past every branch). Each becomes a
*hinted sequence* for the trainer: the student's context (no feedback) followed by the
hinted turn. The KL term runs on it like on a failing turn (student on the student context,
expert on the feedback context, same tokens); the GRPO term never sees it (it is not the
policy's sample of the student context and has no reward). Cost: one generation request per
hinted sample after judging, plus its tokens in the student and expert passes. 0 (default)
is the paper's method.

With routing replay, a hinted sequence carries the engine's routing *on the student's
context*: its prefix's rows are the rollout's own (same tokens, same context) and the hinted
turn's rows come from one prefill-only request on the student sequence
(``max_new_tokens=1``, the token discarded), so the trainer's student pass routes exactly as
the engine would.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from megatron_tg.chat.feedback import insert_feedback
from megatron_tg.chat.parsing import assistant_token_spans
from megatron_tg.rollout.routed_experts import RoutedExperts, RoutedExpertsBuilder
from megatron_tg.rollout.types import Rollout, Segment


log = logging.getLogger(__name__)


@dataclass
class HintedTurn:
    """One sample of a failing turn drawn with its feedback in context."""

    turn: int
    """The failing assistant turn (index into the rollout's turns) it replaces."""
    token_ids: list[int]
    """The generated tokens (as the engine produced them, stop token included)."""
    logprobs: list[float]
    """The engine's log-probs of ``token_ids`` under the feedback context (records only)."""
    finish_reason: str = "stop"
    routed_experts: RoutedExperts | None = None
    """The engine's routing of the student sequence (routing replay), or None."""

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError(f"hinted turn {self.turn}: no tokens")
        if len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"hinted turn {self.turn}: {len(self.logprobs)} log-probs for "
                             f"{len(self.token_ids)} tokens")

    def to_dict(self) -> dict[str, Any]:
        d = {"turn": self.turn, "token_ids": list(self.token_ids), "logprobs": list(self.logprobs),
             "finish_reason": self.finish_reason}
        if self.routed_experts is not None:
            d["routed_experts"] = self.routed_experts.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "HintedTurn":
        re = d.get("routed_experts")
        return cls(int(d["turn"]), [int(t) for t in d["token_ids"]], [float(x) for x in d["logprobs"]],
                   str(d.get("finish_reason", "stop")),
                   RoutedExperts.from_dict(re) if re is not None else None)


def hinted_rollout(rollout: Rollout, hinted: HintedTurn, tokenizer) -> Rollout:
    """The student sequence of ``hinted`` as a rollout: ``rollout`` up to the start of the
    failing turn (every segment before it, unchanged), then the hinted turn as its last
    assistant segment. Its turn numbering is the original's (the hinted turn has index
    ``hinted.turn``), so the turn's feedback applies to it unchanged."""
    turns = rollout.assistant_turns()
    if not 0 <= hinted.turn < len(turns):
        raise ValueError(f"hinted turn {hinted.turn} out of range: rollout "
                         f"{rollout.rollout_id!r} has {len(turns)} turns")
    if not hinted.token_ids:
        raise ValueError(f"hinted turn {hinted.turn} of {rollout.rollout_id!r} is empty")
    start = turns[hinted.turn].start
    keep = [s for s in rollout.segments if s.end <= start]
    ids = list(rollout.token_ids[:start]) + list(hinted.token_ids)
    thinking, calls = assistant_token_spans(tokenizer, hinted.token_ids, offset=start)
    seg = Segment("assistant", start, len(ids), logprobs=list(hinted.logprobs),
                  policy_version=turns[hinted.turn].policy_version, thinking=thinking,
                  tool_calls=calls, meta={"hinted": True})
    return Rollout(rollout.task_id, rollout.group_id, ids, [*keep, seg], hinted.finish_reason,
                   rollout_id=f"{rollout.rollout_id}+hint{hinted.turn}",
                   routed_experts=hinted.routed_experts)


def _stable_int(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def _finish(res) -> str:
    return "length" if res.finish_type == "length" else "stop"


async def sample_hinted_turn(client, rollout: Rollout, turn: int, feedback: str, tokenizer, *,
                             framing: str, sampling_params: dict[str, Any], rid: str,
                             routing: dict[str, Any] | None = None,
                             vocab_size: int | None = None) -> HintedTurn | None:
    """One hinted sample of ``turn`` (None when the engine returned no token); a reply that
    is not a valid turn raises :class:`~megatron_tg.rollout.context.MalformedOutputError`."""
    from megatron_tg.rollout.context import MalformedOutputError

    eseq = insert_feedback(rollout, {turn: feedback}, tokenizer, framing)
    start = rollout.assistant_turns()[turn].start
    prompt = eseq.token_ids[:eseq.position_map[start]]  # the expert's context up to the turn
    res = await client.generate(prompt, dict(sampling_params), return_logprob=True, rid=rid)
    ids = [int(t) for t in res.output_ids]
    if not ids:
        return None
    lps = [float(x) for x in res.output_logprobs or []]
    if len(lps) != len(ids):
        raise MalformedOutputError(f"{rid}: {len(lps)} log-probs for {len(ids)} tokens")
    bad = [t for t in ids if vocab_size is not None and not 0 <= t < vocab_size]
    if bad:
        raise MalformedOutputError(f"{rid}: token ids {bad[:5]} outside the vocabulary "
                                   f"[0, {vocab_size})")
    out = HintedTurn(turn, ids, lps, _finish(res))
    if routing:
        out.routed_experts = await _student_routing(client, rollout, start, ids, routing, rid)
    return out


async def _student_routing(client, rollout: Rollout, start: int, ids: list[int],
                           routing: dict[str, Any], rid: str) -> RoutedExperts:
    """The engine's routing of the student sequence ``rollout[:start] + ids``: the rollout's
    own rows for the prefix, one prefill-only request for the rest."""
    from megatron_tg.rollout.engine.routing import decode_routed_experts

    seq = list(rollout.token_ids[:start]) + ids
    builder = RoutedExpertsBuilder(**routing)
    own = rollout.routed_experts
    keep = min(start, own.rows if own is not None else 0)
    if keep:
        builder.add(0, own.ids[:keep].astype(np.int32), rollout.token_ids[:keep])
    res = await client.generate(seq, {"max_new_tokens": 1, "temperature": 0.0},
                                return_logprob=False, rid=f"{rid}/route",
                                extra={"return_routed_experts": True,
                                       "routed_experts_start_len": keep})
    payload = res.meta_info.get("routed_experts")
    if payload is None:
        from megatron_tg.rollout.context import MalformedOutputError

        raise MalformedOutputError(f"{rid}: the engine returned no routed_experts for the "
                                   "hinted sequence (SGLang needs --enable-return-routed-experts)")
    fed = (seq + [int(t) for t in res.output_ids])[:-1]
    rows = decode_routed_experts(payload, 1, builder.top_k)
    builder.add(keep, rows.reshape(len(fed) - keep, -1, builder.top_k), fed[keep:])
    return builder.for_rollout(seq)


async def add_hinted_turns(client, samples: Sequence, tokenizer, *, n: int, framing: str,
                           sampling_params: dict[str, Any], seed: int | None = None,
                           routing: dict[str, Any] | None = None,
                           vocab_size: int | None = None) -> dict[str, float]:
    """``n`` hinted samples of every failing turn of ``samples`` (TrainSamples), appended to
    each sample's ``hinted``. Returns metrics. A request the engines fail
    (:class:`~megatron_tg.rollout.client.SGLangClientError`, after the client's own retries)
    or answer with a malformed turn (``MalformedOutputError``: log-probs, token ids outside
    ``vocab_size``, missing routing) is counted and logged, not raised: the step trains without that hinted sample (the
    rollout itself is unaffected). Any other error is raised."""
    from megatron_tg.rollout.context import request_seed

    jobs = []
    for s in samples:
        for turn, fb in sorted(s.feedback_by_turn.items()):
            for j in range(n):
                p = dict(sampling_params)
                rid = f"{s.rollout.rollout_id}/hint{turn}.{j}"
                if seed is not None:  # seeded runs stay reproducible: one seed per request id
                    p["sampling_seed"] = request_seed(seed, _stable_int(rid))
                jobs.append((s, sample_hinted_turn(client, s.rollout, turn, fb, tokenizer,
                                                   framing=framing, sampling_params=p, rid=rid,
                                                   routing=routing, vocab_size=vocab_size)))
    from megatron_tg.rollout.client import SGLangClientError
    from megatron_tg.rollout.context import MalformedOutputError

    results = await asyncio.gather(*(c for _, c in jobs), return_exceptions=True)
    failed = 0
    tokens = 0
    for (s, _), r in zip(jobs, results):
        if isinstance(r, (SGLangClientError, MalformedOutputError)) or r is None:  # the engines'
            # failure: this sample only
            if failed == 0 and r is not None:
                log.warning("hinted sample of %s failed (counted in hinted/failed): %s",
                            s.rollout.rollout_id, r)
            failed += 1
            continue
        if isinstance(r, BaseException):  # our bug, bad input or cancellation: never hidden
            raise r
        s.hinted.append(r)
        tokens += len(r.token_ids)
    return {"hinted/samples": float(len(jobs) - failed), "hinted/failed": float(failed),
            "hinted/tokens": float(tokens)}
