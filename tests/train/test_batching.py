"""The student / expert packing path of :mod:`megatron_tg.train.batching` on the megatron policy.

1. Packing is exact: per-token log-probs from packed rows (several rollouts per row, run as
   one THD sequence with ``PackedSeqParams``) and from one-rollout-per-row batches equal those
   of a plain (unpacked, no ``PackedSeqParams``) forward over each rollout alone, at TP=1 and
   TP=2 (sequence parallel, padded rows).
2. The expert pass is the feedback-conditioned model: the expert hidden states that
   ``build_micro_batch`` + ``expert_hidden_states`` keep at the gated rows give the same logits
   as a plain forward over the expert context built here *independently* — the conversation
   rendered by the tokenizer's chat template with the feedback message inserted before the
   failing assistant message — at the positions predicting that turn's tokens, in both
   ``shared`` (all feedback in one context) and ``exact`` (one context per failing turn) modes.
3. Gates (model-free, in-process): which rows ``build_micro_batch`` gates per mode, checked
   against the rollouts' own masks.

Both model checks run inside one spawned world per TP size (two spawns in total) because the
machine has 2 shared cores and every spawn re-imports megatron.
"""

from __future__ import annotations

import pytest
import torch

from megatron_tg.chat.builder import simulate_rollout
from megatron_tg.config.objective import ObjectiveConfig
from megatron_tg.testing.distributed import run_distributed
from megatron_tg.sampling.train_sample import TrainSample
from megatron_tg.train.batching import build_micro_batch, pack
from tests.chat.convos import SEARCH_TOOL, conversation
from tests.train.common import tiny_policy

FB0 = "Use the lines= argument of the search tool."
FB_LAST = "End with a markdown table of what you changed."
FB1 = "Run the tests before you edit anything."


def _variants() -> list[tuple[list[dict], dict[int, str]]]:
    """(messages, feedback_by_turn): multi-turn rollouts with thinking spans and tool calls.

    A: 4 turns, failing turns 0 (thinking + call) and 3 (thinking + final answer): two
       feedback insertions in one rollout, so ``shared`` and ``exact`` differ for turn 3.
    B: 2 turns ending on tool results, failing turn 1 (two tool calls, no thinking).
    C: 3 turns, nothing failing (packed beside the others; no expert, no gate).
    """
    full = conversation()
    c = conversation()[:9]
    c[1] = {"role": "user", "content": "Why does count() return one item too few?"}
    return [(full, {0: FB0, 3: FB_LAST}), (conversation()[:6], {1: FB1}), (c, {})]


def _samples(tok) -> tuple[list[TrainSample], list[list[dict]]]:
    samples, convos = [], []
    for k, (msgs, fb) in enumerate(_variants()):
        ro = simulate_rollout(tok, msgs, tools=[SEARCH_TOOL], group_id="g0", rollout_id=f"r{k}")
        samples.append(TrainSample(ro, advantage=0.5 - k, feedback_by_turn=dict(fb)))
        convos.append(msgs)
    return samples, convos


def _assistant_msg_indices(msgs) -> list[int]:
    return [i for i, m in enumerate(msgs) if m["role"] == "assistant"]


def _hand_built_context(tok, msgs, feedback: dict[int, str], turn: int) -> tuple[list[int], int]:
    """Token ids of the conversation with a ``user`` feedback message inserted right before each
    failing assistant message (plain chat-template rendering, not the framing module), and the
    position where assistant turn ``turn`` starts in it."""
    where = _assistant_msg_indices(msgs)
    out = []
    for i, m in enumerate(msgs):
        for k, fb in feedback.items():
            if where[k] == i:
                out.append({"role": "user", "content": fb})
        out.append(m)
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    ids = enc(tok.apply_chat_template(out, tools=[SEARCH_TOOL], tokenize=False))
    cut = out.index(msgs[where[turn]])
    head = enc(tok.apply_chat_template(out[:cut], tools=[SEARCH_TOOL], tokenize=False,
                                       add_generation_prompt=True))
    assert ids[:len(head)] == head, "the generation prompt must be a token-exact prefix"
    return ids, len(head)


def _expert_references(tok, samples, convos):
    """Per mode: list of (sample, turn, context ids, turn start) for every failing turn."""
    refs = {"shared": [], "exact": []}
    for k, (s, msgs) in enumerate(zip(samples, convos)):
        for t in sorted(s.feedback_by_turn):
            ids, start = _hand_built_context(tok, msgs, s.feedback_by_turn, t)
            refs["shared"].append((k, t, ids, start))
            ids, start = _hand_built_context(tok, msgs, {t: s.feedback_by_turn[t]}, t)
            refs["exact"].append((k, t, ids, start))
    return refs


def _rank_fn(rank, world, tp, state, hf_cfg, samples, contexts, tok_dir):
    """Everything the model checks need, computed on one TP layout."""
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from megatron_tg.models.qwen3_moe import Qwen3Arch, build_model
    from megatron_tg.models.qwen3_moe.mapping import current_layout, load_hf_weights
    from megatron_tg.parallel.dims import Axis
    from megatron_tg.parallel.state import init_parallel
    from megatron_tg.train.batching import build_micro_batch, pack
    from megatron_tg.train.policy import forward_hidden, unwrap
    from megatron_tg.train.prefix_kv import record_kv, reuse_kv
    from megatron_tg.train.step import expert_hidden_states

    tok = AutoTokenizer.from_pretrained(tok_dir)
    ctx = init_parallel(tp=tp)
    arch = Qwen3Arch.from_hf(hf_cfg)
    model = build_model(arch, tp=tp)
    load_hf_weights(model, state, arch, current_layout())
    model.eval()
    group = ctx.group(Axis.TP)

    def logits(hidden, weight):
        """Full-vocabulary logits of [N, H] hidden rows (gather of the TP vocab shards)."""
        local = hidden @ weight.t()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=-1)[:, :arch.vocab_size]

    def plain(ids):
        """Causal forward over one sequence alone (plain [1, S] input, not THD), padded at the end to a
        multiple of TP for sequence parallelism (a causal model ignores what comes later)."""
        n = len(ids)
        width = -(-n // tp) * tp
        t = torch.zeros(1, width, dtype=torch.long)
        t[0, :n] = torch.tensor(ids)
        with torch.no_grad():
            out = forward_hidden(model, t)  # no PackedSeqParams: megatron's causal path
        return logits(out.hidden[0, :n], out.output_weight)

    def token_logprobs(logit_rows, ids):
        return torch.log_softmax(logit_rows[:-1].double(), -1).gather(
            1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)

    def packed_logprobs(rows):
        with torch.no_grad():
            out = forward_hidden(model, rows)
        flat = out.hidden.reshape(-1, out.hidden.shape[-1])
        res = []
        for k, s in enumerate(samples):
            ids = s.rollout.token_ids
            idx = torch.tensor([rows.flat(k, p) for p in range(len(ids))])
            res.append(token_logprobs(logits(flat[idx], out.output_weight), ids))
        return res

    seqs = [s.rollout.token_ids for s in samples]
    longest = max(len(x) for x in seqs)
    one_per_row = pack(seqs, longest, pad_multiple=tp)  # no two of these fit in one row
    all_in_one = pack(seqs, sum(len(x) for x in seqs), pad_multiple=tp)
    result = dict(
        plain=[token_logprobs(plain(ids), ids) for ids in seqs],
        one_per_row=packed_logprobs(one_per_row), one_per_row_offsets=one_per_row.offsets,
        packed=packed_logprobs(all_in_one), packed_offsets=all_in_one.offsets,
        student_logits={}, expert={}, reference={})
    result["reuse"], result["reuse_tokens"] = {}, {}
    for mode in ("shared", "exact"):
        cfg = ObjectiveConfig(mode="tg", expert_sequence=mode)
        mb = build_micro_batch(samples, tok, cfg, row_tokens=2 * longest, pad_multiple=tp)
        eh, ew = expert_hidden_states(model, mb)
        result["expert"][mode] = logits(eh, ew)
        result["reference"][mode] = [plain(ids) for _, _, ids, _ in contexts[mode]]
        # Prefix reuse: the student pass records keys/values, the expert pass covers only
        # the suffixes (rows packed with other budgets, so RoPE shifts are non-trivial).
        for budget in (2 * longest, longest + 64):
            mb = build_micro_batch(samples, tok, cfg, row_tokens=budget, pad_multiple=tp,
                                   prefix_reuse=True)
            gpt = unwrap(model)
            with torch.no_grad():
                with record_kv(gpt) as store:
                    forward_hidden(model, mb.student)
                with reuse_kv(gpt, store, mb.expert_prefix):
                    out = forward_hidden(model, mb.expert)
            rows = out.hidden.reshape(-1, out.hidden.shape[-1])[mb.expert_rows]
            result["reuse"][(mode, budget)] = logits(rows, out.output_weight)
            result["reuse_tokens"][(mode, budget)] = int((mb.expert.tokens != 0).sum())
    # The student (no feedback) at the same positions: the feedback must change the logits,
    # or the expert comparison above would prove nothing.
    result["student_logits"] = [plain(ids) for ids in seqs]
    return result


@pytest.fixture(scope="module")
def setup():
    tok, hf_cfg, state = tiny_policy()
    samples, convos = _samples(tok)
    contexts = _expert_references(tok, samples, convos)
    out = {tp: run_distributed(_rank_fn, tp, tp, state, hf_cfg, samples, contexts,
                               tok.name_or_path) for tp in (1, 2)}
    return tok, samples, contexts, out


def test_packed_and_unpacked_logprobs_equal_plain_forward(setup):
    _, samples, _, out = setup
    for tp, ranks in out.items():
        r = ranks[0]
        assert len({row for row, _ in r["one_per_row_offsets"]}) == len(samples)
        assert {row for row, _ in r["packed_offsets"]} == {0}  # really packed: one row
        for k in range(len(samples)):
            for variant in ("one_per_row", "packed"):
                torch.testing.assert_close(r[variant][k], r["plain"][k], atol=2e-5, rtol=1e-5,
                                           msg=f"tp={tp} {variant} rollout {k}")
        if tp == 2:  # TP=2 agrees with TP=1, and both TP ranks see the same values
            for k in range(len(samples)):
                torch.testing.assert_close(r["packed"][k], out[1][0]["plain"][k], atol=1e-4,
                                           rtol=1e-4, msg=f"tp=2 vs tp=1, rollout {k}")
                torch.testing.assert_close(ranks[1]["packed"][k], r["packed"][k])


def _rows_of_turn(mb, k, seg) -> list[int]:
    """Indices into the expert's [G, ...] outputs of the rows predicting ``seg``'s tokens."""
    gated = mb.rows[mb.policy.gate.nonzero().squeeze(1)].tolist()
    where = {flat: j for j, flat in enumerate(gated)}
    return [where[mb.student.flat(k, i - 1)] for i in range(seg.start, seg.end)]


@pytest.mark.parametrize("mode", ["shared", "exact"])
def test_expert_logits_equal_hand_built_feedback_context(setup, mode):
    tok, samples, contexts, out = setup
    mb = build_micro_batch(samples, tok, ObjectiveConfig(mode="tg", expert_sequence=mode),
                           row_tokens=2 * max(len(s.rollout.token_ids) for s in samples))
    checked = 0
    for tp, ranks in out.items():
        r = ranks[0]
        expert = r["expert"][mode]
        assert expert.shape[0] == int(mb.policy.gate.sum())
        for (k, t, ids, start), ref in zip(contexts[mode], r["reference"][mode]):
            seg = samples[k].rollout.turn(t)
            n = seg.end - seg.start
            assert ids[start:start + n] == samples[k].rollout.token_ids[seg.start:seg.end]
            rows = _rows_of_turn(mb, k, seg)
            # Reference logits predicting the turn's tokens: positions start-1 .. start+n-2.
            torch.testing.assert_close(expert[rows], ref[start - 1:start - 1 + n], atol=1e-4,
                                       rtol=1e-4, msg=f"tp={tp} {mode} rollout {k} turn {t}")
            student = r["student_logits"][k][seg.start - 1:seg.end - 1]
            assert (student - expert[rows]).abs().max() > 1e-2, "feedback had no effect"
            checked += 1
    assert checked == 2 * 3  # 2 TP sizes x 3 failing turns


@pytest.mark.parametrize("mode", ["shared", "exact"])
def test_prefix_reuse_expert_equals_the_full_expert_pass(setup, mode):
    """The expert pass over suffixes only, attending to the student's recorded prefix
    keys/values (re-rotated for their new positions), gives the full expert pass's logits."""
    tok, samples, _, out = setup
    full = build_micro_batch(samples, tok, ObjectiveConfig(mode="tg", expert_sequence=mode),
                             row_tokens=2 * max(len(s.rollout.token_ids) for s in samples))
    full_tokens = sum(len(x) for x in _expert_sequences(full))
    for tp, ranks in out.items():
        r = ranks[0]
        for (m, budget), got in r["reuse"].items():
            if m != mode:
                continue
            torch.testing.assert_close(got, r["expert"][mode], atol=1e-4, rtol=1e-4,
                                       msg=f"tp={tp} {mode} budget {budget}")
            # and it really skipped the prefixes
            assert r["reuse_tokens"][(m, budget)] < 0.7 * full_tokens
        if tp == 2:
            for key, got in r["reuse"].items():
                torch.testing.assert_close(ranks[1]["reuse"][key], got)


def _expert_sequences(mb) -> list[list[int]]:
    return [row[row != 0].tolist() for row in mb.expert.tokens]


# ---------------------------------------------------------------------- gates (no model)
@pytest.fixture(scope="module")
def gate_samples():
    from megatron_tg.chat import get_tiny_tokenizer

    tok = get_tiny_tokenizer()
    samples, _ = _samples(tok)
    return tok, samples


def _expected_rows(mb, samples, turns_of, with_thinking: bool) -> set[int]:
    """Flat student rows predicting the assistant tokens of ``turns_of(k)``, from the rollout's
    own masks (``with_thinking=False`` drops thinking tokens)."""
    out = set()
    for k, s in enumerate(samples):
        ro = s.rollout
        amask, tmask, turn = ro.assistant_mask(), ro.thinking_mask(), ro.turn_index_per_token()
        for i in range(len(ro.token_ids)):
            if amask[i] and turn[i] in turns_of(k) and (with_thinking or not tmask[i]):
                out.add(mb.student.flat(k, i - 1))
    return out


def _gated(mb) -> set[int]:
    return set(mb.rows[mb.policy.gate.nonzero().squeeze(1)].tolist())


def _check_expert_alignment(mb):
    """Each gated row's expert row predicts the same token the student row predicts."""
    if mb.expert is None:
        assert mb.expert_rows.numel() == 0
        return
    nz = mb.policy.gate.nonzero().squeeze(1)
    assert mb.expert_rows.numel() == nz.numel()
    etok = mb.expert.tokens.reshape(-1)
    assert torch.equal(etok[mb.expert_rows + 1], mb.policy.target_ids[nz])
    assert torch.equal(etok[mb.expert_rows], mb.student.tokens.reshape(-1)[mb.rows[nz]])


@pytest.mark.parametrize("expert_sequence", ["shared", "exact"])
def test_gates_per_mode(gate_samples, expert_sequence):
    tok, samples = gate_samples
    row = 2 * max(len(s.rollout.token_ids) for s in samples)
    failing = lambda k: set(samples[k].feedback_by_turn)  # noqa: E731
    every = lambda k: set(range(samples[k].rollout.num_turns))  # noqa: E731

    def mb_for(smp=samples, **kw):
        cfg = ObjectiveConfig(expert_sequence=expert_sequence, **kw)
        return build_micro_batch(smp, tok, cfg, row_tokens=row, pad_multiple=2)

    # Loss rows are exactly the assistant tokens of every rollout.
    mb = mb_for(mode="tg")
    assert set(mb.rows.tolist()) == _expected_rows(mb, samples, every, True)
    assert mb.rows.numel() == sum(sum(s.rollout.assistant_mask()) for s in samples)

    # tg: exactly the failing turns' assistant tokens, thinking included by default.
    assert _gated(mb) == _expected_rows(mb, samples, failing, True)
    assert any(samples[0].rollout.thinking_mask())  # the fixture really has thinking tokens
    _check_expert_alignment(mb)
    # ... thinking excluded by distill_thinking=False and by mode no_thinking.
    for kw in (dict(mode="tg", distill_thinking=False), dict(mode="no_thinking")):
        m = mb_for(**kw)
        assert _gated(m) == _expected_rows(m, samples, failing, False), kw
        assert _gated(m) < _gated(mb)
        _check_expert_alignment(m)

    # always_on: the caller gives feedback for every turn -> every assistant token is gated.
    every_fb = [TrainSample(s.rollout, s.advantage,
                            {t: f"hint {t}" for t in range(s.rollout.num_turns)}) for s in samples]
    m = mb_for(every_fb, mode="always_on")
    assert _gated(m) == set(m.rows.tolist()) == _expected_rows(m, samples, every, True)
    _check_expert_alignment(m)
    # always_on only gates where an expert exists (turns the caller gave feedback for).
    m = mb_for(mode="always_on")
    assert _gated(m) == _expected_rows(m, samples, failing, True)

    # grpo: nothing gated, no expert forward at all, whatever feedback the samples carry.
    m = mb_for(mode="grpo")
    assert m.policy.gate.sum() == 0 and m.expert_rows.numel() == 0 and m.expert is None
    # tg with no failing turn: no expert either.
    m = mb_for([TrainSample(s.rollout, s.advantage, {}) for s in samples], mode="tg")
    assert m.policy.gate.sum() == 0 and m.expert is None


def test_expert_sequence_longer_than_row_budget(gate_samples):
    """A rollout that exactly fills the student row budget still gets its expert: the expert
    context is longer by the feedback message, and the expert rows widen to hold it."""
    tok, samples = gate_samples
    s = samples[0]
    n = len(s.rollout.token_ids)
    mb = build_micro_batch([s], tok, ObjectiveConfig(mode="tg"), row_tokens=n, pad_multiple=2)
    assert mb.student.tokens.shape[1] == n + n % 2
    assert mb.expert.tokens.shape[1] > n
    _check_expert_alignment(mb)


def test_pack_thd_segments():
    """Every packed sequence is one THD segment at its flat offset, each row's padding is a
    segment of its own, and no mask tensor exists."""
    seqs = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    rows = pack(seqs, row_tokens=5, pad_multiple=4)
    assert rows.tokens.shape == (2, 8)
    assert not hasattr(rows, "attention_mask")
    cu = rows.cu_seqlens.tolist()
    assert rows.cu_seqlens.dtype == torch.int32 and cu[0] == 0 and cu[-1] == rows.tokens.numel()
    segments = list(zip(cu[:-1], cu[1:]))
    for i, s in enumerate(seqs):
        r, c = rows.offsets[i]
        n = len(s)
        assert rows.tokens[r, c:c + n].tolist() == s
        assert rows.position_ids[r, c:c + n].tolist() == list(range(n))
        assert (rows.flat(i, 0), rows.flat(i, 0) + n) in segments
    # padding: the rest of each row, one segment per row
    for r in range(2):
        used = sum(len(seqs[i]) for i, (rr, _) in enumerate(rows.offsets) if rr == r)
        assert (r * 8 + used, r * 8 + 8) in segments
    assert len(segments) == len(seqs) + 2 and rows.max_seqlen == 4
    p = rows.packed_seq_params()
    assert p.qkv_format == "thd" and p.cu_seqlens_q is p.cu_seqlens_kv
    assert p.max_seqlen_q == p.max_seqlen_kv == 4
    with pytest.raises(ValueError, match="sequence 1 is empty"):
        pack([[1], []], row_tokens=4)
