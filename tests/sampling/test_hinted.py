"""Hinted turns (``objective.hinted_samples``, :mod:`megatron_tg.sampling.hinted`).

1. A hinted sequence is the student's context up to the failing turn, then the hinted turn.
2. Packed with its rollout: its rows are gated, carry the rollout's index, are out of
   ``pg_mask``, and their expert rows predict the same tokens from the feedback context; the
   rollout's own rows and gates are unchanged.
3. The GRPO term (and the policy metrics) over a batch with hinted rows equals the term over
   the same batch without them; the KL term is the same function of all gated rows.
4. The rollout service's wire keeps them.
5. Against the embedded engine (SGLang's HTTP API): the hinted sample is the engine's
   continuation of the feedback context built independently here (the chat template with the
   feedback message inserted), seeded, and the routing it carries is the engine's routing of
   the student sequence.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from megatron_tg.chat import get_tiny_tokenizer
from megatron_tg.chat.builder import simulate_rollout
from megatron_tg.config.objective import ObjectiveConfig
from megatron_tg.objectives.batch import PolicyBatch
from megatron_tg.objectives.grpo import policy_gradient_term
from megatron_tg.objectives.guidance import gated_kl_term
from megatron_tg.sampling.hinted import HintedTurn, hinted_rollout
from megatron_tg.sampling.train_sample import TrainSample
from megatron_tg.train.batching import build_micro_batch
from tests.chat.convos import SEARCH_TOOL, call, conversation
from tests.objectives.fixtures import logits_as_hidden

FB = "Use the lines= argument of the search tool."


def _hinted_ids(tok) -> list[int]:
    """An assistant turn in the new format, rendered by the template (what a hinted sample of
    the search turn looks like)."""
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [call("search", query="def count", lines=2)]}]
    ro = simulate_rollout(tok, msgs, tools=[SEARCH_TOOL])
    seg = ro.assistant_turns()[0]
    return ro.token_ids[seg.start:seg.end]


@pytest.fixture(scope="module")
def setup():
    tok = get_tiny_tokenizer()
    a = simulate_rollout(tok, conversation(), tools=[SEARCH_TOOL], group_id="g", rollout_id="a")
    b = simulate_rollout(tok, conversation()[:6], tools=[SEARCH_TOOL], group_id="g", rollout_id="b")
    ids = _hinted_ids(tok)
    plain = [TrainSample(a, 0.7, {0: FB, 2: "Say why."}), TrainSample(b, -0.7, {})]
    hinted = [TrainSample(a, 0.7, {0: FB, 2: "Say why."},
                          hinted=[HintedTurn(0, ids, [-0.5] * len(ids)),
                                  HintedTurn(2, ids[:7], [-0.1] * 7, "length")]),
              TrainSample(b, -0.7, {})]
    return tok, plain, hinted, ids


def test_hinted_sequence_is_the_student_context_then_the_hinted_turn(setup):
    tok, _, hinted, ids = setup
    ro = hinted[0].rollout
    for h in hinted[0].hinted:
        hr = hinted_rollout(ro, h, tok)
        start = ro.assistant_turns()[h.turn].start
        assert hr.token_ids == ro.token_ids[:start] + h.token_ids
        assert hr.num_turns == h.turn + 1  # its last turn has the failing turn's index
        assert hr.segments[:-1] == [s for s in ro.segments if s.end <= start]
        assert hr.validate(len(tok)) is hr and hr.finish_reason == h.finish_reason
    with pytest.raises(ValueError, match="out of range"):
        hinted_rollout(ro, HintedTurn(9, ids, [0.0] * len(ids)), tok)


@pytest.mark.parametrize("expert_sequence", ["shared", "exact"])
def test_hinted_rows_are_kl_only_and_aligned(setup, expert_sequence):
    tok, plain, hinted, ids = setup
    cfg = ObjectiveConfig(mode="tg", expert_sequence=expert_sequence)
    row = 2 * max(len(s.rollout.token_ids) for s in plain)
    m0 = build_micro_batch(plain, tok, cfg, row_tokens=row, pad_multiple=2)
    m1 = build_micro_batch(hinted, tok, cfg, row_tokens=row, pad_multiple=2)
    assert m0.policy.pg_mask is None and m1.policy.pg_mask is not None
    own, extra = m1.policy.pg_mask, ~m1.policy.pg_mask
    # The rollouts' own rows: the same tokens, rollouts, advantages and gates as without.
    key = lambda mb, sel: sorted(zip(mb.policy.target_ids[sel].tolist(), mb.policy.rollout_index[sel].tolist(),  # noqa: E731
                                     mb.policy.gate[sel].tolist(), mb.policy.behaviour_logprobs[sel].tolist()))
    assert key(m1, own) == key(m0, torch.ones_like(m0.policy.loss_mask))
    assert torch.equal(m1.policy.advantages, m0.policy.advantages)
    # Hinted rows: exactly the hinted tokens (after the context), all gated, rollout 0's.
    n_hint = len(ids) + 7
    assert int(extra.sum()) == n_hint and bool((m1.policy.gate[extra] == 1).all())
    assert set(m1.policy.rollout_index[extra].tolist()) == {0}
    assert sorted(m1.policy.target_ids[extra].tolist()) == sorted(ids + ids[:7])
    # Expert rows of every gated row (hinted ones included) predict the row's token, from
    # an expert sequence holding the feedback.
    nz = m1.policy.gate.nonzero().squeeze(1)
    etok = m1.expert.tokens.reshape(-1)
    assert torch.equal(etok[m1.expert_rows + 1], m1.policy.target_ids[nz])
    feedback = hinted[0].feedback_by_turn
    width = m1.expert.tokens.shape[1]
    hinted_at = extra[nz]
    for r, turn in zip(m1.expert_rows[hinted_at].tolist(), m1.turn_index[nz][hinted_at].tolist()):
        row_text = tok.decode(m1.expert.tokens[r // width, :r % width + 1].tolist())
        assert feedback[turn] in row_text  # the feedback of the turn the hinted row belongs to
    assert m1.num_tokens == sum(s.num_tokens for s in hinted)


def test_grpo_term_ignores_hinted_rows(setup):
    tok, plain, hinted, _ = setup
    cfg = ObjectiveConfig(mode="tg", tis_cap=2.0)
    row = 2 * max(len(s.rollout.token_ids) for s in plain)
    mb = build_micro_batch(hinted, tok, cfg, row_tokens=row)
    n, vocab = mb.rows.numel(), len(tok)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(n, vocab, generator=g, dtype=torch.float64, requires_grad=True)
    expert = torch.randn(int(mb.policy.gate.sum()), vocab, generator=g, dtype=torch.float64)

    def batch(sel, with_mask):
        gate_rows = mb.policy.gate.nonzero().squeeze(1)
        keep_gate = torch.isin(gate_rows, sel.nonzero().squeeze(1))
        return PolicyBatch(target_ids=mb.policy.target_ids[sel], behaviour_logprobs=mb.policy.behaviour_logprobs[sel] - 0.3,
                           loss_mask=mb.policy.loss_mask[sel], rollout_index=mb.policy.rollout_index[sel],
                           advantages=mb.policy.advantages, gate=mb.policy.gate[sel],
                           **logits_as_hidden(logits[sel]),
                           pg_mask=mb.policy.pg_mask[sel] if with_mask else None,
                           expert_hidden=expert[keep_gate])

    every = torch.ones(n, dtype=torch.bool)
    full, own = batch(every, True), batch(mb.policy.pg_mask, False)
    l_full, m_full = policy_gradient_term(torch.log_softmax(full.hidden, -1).gather(1, full.target_ids[:, None])[:, 0], full, cfg)
    l_own, m_own = policy_gradient_term(torch.log_softmax(own.hidden, -1).gather(1, own.target_ids[:, None])[:, 0], own, cfg)
    assert float(l_full.detach()) == pytest.approx(float(l_own.detach()), rel=1e-12)
    for k in m_own:
        assert float(m_full[k]) == pytest.approx(float(m_own[k]), rel=1e-9), k
    (grad,) = torch.autograd.grad(l_full, logits, retain_graph=True)
    assert float(grad[~mb.policy.pg_mask].abs().max()) == 0.0  # no policy gradient on hinted rows
    # The KL term covers the hinted rows: more gated rows than the rollouts' own.
    kl_full, km = gated_kl_term(full, cfg, None)
    kl_own, _ = gated_kl_term(own, cfg, None)
    assert float(kl_full.detach()) != pytest.approx(float(kl_own.detach()))
    (gk,) = torch.autograd.grad(kl_full, logits)
    assert float(gk[~mb.policy.pg_mask].abs().max()) > 0.0
    # frac_gated stays a statement about the rollouts' own tokens.
    assert float(km["kl/frac_gated"]) == pytest.approx(float(mb.policy.gate[mb.policy.pg_mask].mean()))


def test_wire_keeps_hinted_turns(setup):
    from megatron_tg.rollout.routed_experts import RoutedExperts
    from megatron_tg.sampling.service.wire import decode_batch, encode_batch

    tok, _, hinted, ids = setup
    routed = RoutedExperts(np.arange(24, dtype=np.uint8).reshape(4, 3, 2) % 5, (0, 1, 2), 5)
    s = TrainSample(hinted[0].rollout, 0.7, {0: FB},
                    hinted=[HintedTurn(0, ids, [-0.5] * len(ids), "stop", routed)])
    out, _, _ = decode_batch(encode_batch([s], [(s.rollout, None)], {}))
    (h,) = out[0].hinted
    assert (h.turn, h.token_ids, h.logprobs, h.finish_reason) == (0, ids, [-0.5] * len(ids), "stop")
    assert np.array_equal(h.routed_experts.ids, routed.ids) and h.routed_experts.layers == (0, 1, 2)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from megatron_tg.models.tiny import build_tiny_policy
    from megatron_tg.rollout.engine.launch import start_engines

    policy = build_tiny_policy(tmp_path_factory.mktemp("policy"))
    (e,) = start_engines([policy], tmp_path_factory.mktemp("engine"),
                         extra_args=["--enable-return-routed-experts"])
    yield policy, e
    e.stop()


def _routing(policy):
    from megatron_tg.models.qwen3_moe import Qwen3Arch

    arch = Qwen3Arch.from_hf(policy)
    return dict(moe_layers=arch.moe_layers, num_layers=arch.num_layers,
                top_k=arch.num_experts_per_tok, num_experts=arch.num_experts)


def test_hinted_samples_from_the_engine(engine):
    """Seeded hinted samples are the engine's continuation of the feedback context (rendered
    here by the chat template, independently of the framing code), and carry the engine's
    routing of the student sequence, the rollout's own rows reused for the prefix."""
    from megatron_tg.rollout.client import SGLangClient
    from megatron_tg.rollout.context import request_seed
    from megatron_tg.rollout.engine.routing import decode_routed_experts
    from megatron_tg.sampling.hinted import _stable_int, add_hinted_turns

    policy, e = engine
    tok = get_tiny_tokenizer()
    msgs = conversation()[:6]
    ro = simulate_rollout(tok, msgs, tools=[SEARCH_TOOL], group_id="g", rollout_id="r7")
    routing = _routing(policy)
    params = {"max_new_tokens": 12, "temperature": 1.0}

    async def go():
        async with SGLangClient([e.url]) as client:
            async def prefill_rows(ids):
                res = await client.generate(ids, {"max_new_tokens": 1}, return_logprob=False,
                                            extra={"return_routed_experts": True,
                                                   "routed_experts_start_len": 0})
                return decode_routed_experts(res.meta_info["routed_experts"], 1, routing["top_k"])

            from megatron_tg.rollout.routed_experts import RoutedExperts

            rows = prefill_rows(ro.token_ids)
            rows = (await rows).reshape(len(ro.token_ids), -1, routing["top_k"])
            ro.routed_experts = RoutedExperts(rows[:len(ro.token_ids) - 1].astype(np.uint8),
                                              tuple(routing["moe_layers"]), routing["num_experts"])
            sample = TrainSample(ro, 1.0, {1: FB})
            metrics = await add_hinted_turns(client, [sample], tok, n=2, framing="user",
                                             sampling_params=params, seed=11, routing=routing)
            # The feedback context, by hand: the user message right before assistant turn 1.
            where = [i for i, m in enumerate(msgs) if m["role"] == "assistant"][1]
            ctx = msgs[:where] + [{"role": "user", "content": FB}]
            prompt = tok(tok.apply_chat_template(ctx, tools=[SEARCH_TOOL], tokenize=False,
                                                 add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"]
            direct = []
            for j in range(2):
                seed = request_seed(11, _stable_int(f"r7/hint1.{j}"))
                res = await client.generate(prompt, {**params, "sampling_seed": seed})
                direct.append([int(t) for t in res.output_ids])
            fresh = []
            for h in sample.hinted:
                seq = ro.token_ids[:ro.assistant_turns()[1].start] + h.token_ids
                fresh.append((seq, (await prefill_rows(seq)).reshape(len(seq), -1, routing["top_k"])))
            return sample, metrics, direct, fresh

    sample, metrics, direct, fresh = asyncio.run(go())
    assert metrics["hinted/samples"] == 2 and metrics["hinted/failed"] == 0
    assert [h.token_ids for h in sample.hinted] == direct
    assert all(h.turn == 1 and 0 < len(h.token_ids) <= 12 for h in sample.hinted)
    for h, (seq, rows) in zip(sample.hinted, fresh):
        re = h.routed_experts
        assert re.rows == len(seq) - 1
        assert np.array_equal(re.ids.astype(np.int64), rows[:len(seq) - 1].astype(np.int64))
    # The batch packs them with the engine's routing laid out for the student pass.
    mb = build_micro_batch([sample], tok, ObjectiveConfig(mode="tg"), row_tokens=4096,
                           routing_replay=True)
    for q, h in enumerate(sample.hinted, start=1):
        start = mb.student.flat(q, 0)
        got = mb.routed_experts[start:start + h.routed_experts.rows]
        assert torch.equal(got.long(), torch.from_numpy(h.routed_experts.ids.astype(np.int64)))


@pytest.mark.parametrize("bad", [-1, "2", 1.5, True])
def test_hinted_samples_must_be_a_count(bad):
    from megatron_tg.config.base import ConfigError

    with pytest.raises(ConfigError, match="objective.hinted_samples must be an integer >= 0"):
        ObjectiveConfig(hinted_samples=bad).validate()


class _Answers:
    """A client whose generate answers from a script: an exception to raise, or token ids."""

    def __init__(self, script, logprobs=None):
        self.script, self.prompts, self.logprobs = list(script), [], logprobs

    async def generate(self, ids, params, return_logprob=True, rid=None, extra=None):
        from types import SimpleNamespace

        self.prompts.append(list(ids))
        what = self.script.pop(0)
        if isinstance(what, BaseException):
            raise what
        lps = self.logprobs if self.logprobs is not None else [-0.1] * len(what)
        return SimpleNamespace(output_ids=what, output_logprobs=lps,
                               finish_type="stop", meta_info={})


def test_an_engine_failure_costs_one_hinted_sample_and_other_errors_raise(setup):
    from megatron_tg.rollout.client import SGLangClientError
    from megatron_tg.sampling.hinted import add_hinted_turns

    tok, plain, _, ids = setup
    sample = TrainSample(plain[0].rollout, 0.7, {0: FB, 2: "Say why."})
    client = _Answers([SGLangClientError("every server failed"), ids])
    metrics = asyncio.run(add_hinted_turns(client, [sample], tok, n=1, framing="user",
                                           sampling_params={"max_new_tokens": 8}))
    assert metrics == {"hinted/samples": 1.0, "hinted/failed": 1.0, "hinted/tokens": float(len(ids))}
    assert [h.turn for h in sample.hinted] == [2] and sample.hinted[0].token_ids == ids
    # Not an engine failure (here a bug-shaped error from the client): raised, not counted.
    with pytest.raises(TypeError, match="boom"):
        asyncio.run(add_hinted_turns(_Answers([TypeError("boom"), ids]),
                                     [TrainSample(plain[0].rollout, 0.7, {0: FB, 2: "x"})], tok,
                                     n=1, framing="user", sampling_params={}))


def test_prefix_reuse_rebuilds_the_hinted_expert_sequences(setup):
    """With prefix reuse (shared expert) every expert key segment, its prefix keys taken from
    the student rows, is token for token an expert sequence of the build without reuse,
    hinted ones included: a hinted suffix reuses its own student sequence's prefix."""
    tok, _, hinted, _ = setup
    cfg = ObjectiveConfig(mode="tg", expert="shared")
    row = 2 * max(s.num_tokens for s in hinted)
    full = build_micro_batch(hinted, tok, cfg, row_tokens=row)
    reuse = build_micro_batch(hinted, tok, cfg, row_tokens=row, prefix_reuse=True)

    def segments(flat, cu):
        out = [tuple(flat[a:b]) for a, b in zip(cu[:-1], cu[1:])]
        return sorted(seg for seg in out if any(seg))  # drop the rows' padding segments

    want = segments(full.expert.tokens.reshape(-1).tolist(), full.expert.cu_seqlens.tolist())
    plan = reuse.expert_prefix
    keys = reuse.expert.tokens.reshape(-1).tolist() + reuse.student.tokens.reshape(-1)[plan.src].tolist()
    got = segments([keys[i] for i in plan.kv_index.tolist()], plan.cu_seqlens_kv.tolist())
    assert len(want) == 2 + 1  # rollout a's expert sequence and its two hinted turns'
    assert got == want
    nz = reuse.policy.gate.nonzero().squeeze(1)
    etok = reuse.expert.tokens.reshape(-1)
    assert torch.equal(etok[reuse.expert_rows + 1], reuse.policy.target_ids[nz])


def test_malformed_engine_replies_are_counted_and_bad_wire_data_is_refused(setup):
    from megatron_tg.sampling.hinted import add_hinted_turns
    from megatron_tg.sampling.service.wire import WireError, decode_batch, encode_batch

    tok, plain, hinted, ids = setup
    for client, vocab in ((_Answers([ids], logprobs=[-0.1]), None),  # 1 log-prob for many tokens
                          (_Answers([[len(tok) + 3]]), len(tok))):  # a token outside the vocabulary
        sample = TrainSample(plain[0].rollout, 0.7, {0: FB})
        metrics = asyncio.run(add_hinted_turns(client, [sample], tok, n=1, framing="user",
                                               sampling_params={}, vocab_size=vocab))
        assert metrics["hinted/failed"] == 1 and metrics["hinted/samples"] == 0 and not sample.hinted
    wire = encode_batch(hinted[:1], [(hinted[0].rollout, None)], {})
    wire["samples"][0]["hinted"][0]["logprobs"] = [0.0]
    with pytest.raises(WireError, match="bad hinted turn .*1 log-probs for"):
        decode_batch(wire)
