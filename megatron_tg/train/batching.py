"""Judged rollouts -> packed micro-batches for the policy (student) and expert forward passes.

Layout contract (what :mod:`megatron_tg.train.step` and the loss rely on):

- Sequences are packed first-fit-decreasing into rows of at most ``row_tokens`` tokens; a row
  is padded to a multiple of ``pad_multiple`` (TP, because sequence parallelism splits the
  sequence). The model runs the ``[B, S]`` rows as one sequence of ``B * S`` tokens in
  megatron's THD form (:meth:`PackedRows.packed_seq_params`): every packed sequence is a
  segment of ``cu_seqlens`` and so is each row's padding, attention is causal within a
  segment and never crosses one, and no mask tensor exists (memory linear in the tokens).
  RoPE positions restart at 0 in every segment (megatron's THD RoPE).
- Student position ``p`` of a sequence predicts its token ``p + 1``; a row is in the loss iff
  that token is an assistant token. Rows are addressed by flat index ``b * S + s`` into the
  ``[B, S, ...]`` output of the policy.
- The expert (feedback-conditioned) sequences are packed the same way. For every gated
  student row predicting token ``i``, the expert row predicting the same token is
  ``position_map[i] - 1`` of its expert sequence; ``expert_rows`` lists them in the order of
  the student's gated rows (increasing flat index), so the expert's hidden states gathered
  at ``expert_rows`` line up with ``gate_index``. Expert sequences are built only for turns
  with at least one gated row (none at all in mode "grpo": ``expert`` is then None), and the
  expert rows widen beyond ``row_tokens`` when an expert sequence (its rollout + the inserted
  feedback messages) does not fit in it.

Cost of the expert pass: ``shared`` mode packs one expert sequence per failing rollout,
truncated after its last failing turn (≤ one extra forward over the failing rollouts);
``exact`` packs one sequence per failing turn, each truncated after its turn (Σ_k prefix_k
tokens). Only gated rows reach the output layer (fused op), never the whole sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from megatron_tg.chat.feedback import build_expert_sequences
from megatron_tg.config.objective import ObjectiveConfig
from megatron_tg.objectives.batch import PolicyBatch
from megatron_tg.objectives.guidance import build_gate
from megatron_tg.parallel.cp import CPLayout
from megatron_tg.rollout.types import Rollout
from megatron_tg.sampling.hinted import hinted_rollout
from megatron_tg.sampling.train_sample import TrainSample
from megatron_tg.train.prefix_kv import PrefixPlan, build_prefix_plan


@dataclass
class PackedRows:
    """Sequences packed into ``[B, S]`` token rows, run as one THD sequence of ``B·S`` tokens."""

    tokens: torch.Tensor          # [B, S] long
    position_ids: torch.Tensor    # [B, S] long, restarting at 0 for every segment
    offsets: list[tuple[int, int]]  # per input sequence: (row, start column)
    cu_seqlens: torch.Tensor      # [segments + 1] int32, segment bounds in flat b·S + s order
    max_seqlen: int               # longest segment
    _cp_layouts: dict = field(default_factory=dict, repr=False, compare=False)

    def flat(self, seq: int, pos: int) -> int:
        row, start = self.offsets[seq]
        return row * self.tokens.shape[1] + start + pos

    def cp_layout(self, cp: int, *, tp: int = 1) -> CPLayout:
        """How the flattened rows split over ``cp`` context-parallel ranks: every segment
        (packed sequences and row paddings) padded to a multiple of ``2·cp``, the share a
        multiple of ``tp`` (sequence parallelism); computed once per (cp, tp)."""
        key = (cp, tp)
        if self._cp_layouts.get(key) is None:
            self._cp_layouts[key] = CPLayout.from_cu_seqlens(self.cu_seqlens, cp, tp=tp)
        return self._cp_layouts[key]

    def packed_seq_params(self, device: torch.device | str | None = None):
        """megatron's ``PackedSeqParams`` for the flattened rows: one ``cu_seqlens`` tensor for
        queries and keys (a core attention tells the prefix-reuse pass by a different one)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = self.cu_seqlens.to(device) if device is not None else self.cu_seqlens
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                               max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen)


def pack(sequences: Sequence[Sequence[int]], row_tokens: int, pad_multiple: int = 1,
         pad_id: int = 0, cost: Sequence[int] | None = None) -> PackedRows:
    """First-fit-decreasing packing; raises if one sequence is longer than ``row_tokens``.

    ``cost`` (default: the lengths) is what a sequence uses of a row's ``row_tokens`` budget:
    an expert suffix with prefix reuse costs its prefix too, because its queries attend to
    the prefix's keys (attention work per row stays within budget², as without reuse)."""
    if not sequences:
        raise ValueError("nothing to pack")
    if any(len(s) == 0 for s in sequences):
        raise ValueError(f"sequence {[len(s) for s in sequences].index(0)} is empty")
    cost = [len(s) for s in sequences] if cost is None else list(cost)
    longest = max(cost)
    if longest > row_tokens:
        raise ValueError(f"a sequence of {longest} tokens exceeds the row budget of {row_tokens}")
    order = sorted(range(len(sequences)), key=lambda i: -cost[i])
    rows: list[list[int]] = []     # sequence indices per row
    used: list[int] = []
    for i in order:
        n = cost[i]
        for r, u in enumerate(used):
            if u + n <= row_tokens:
                rows[r].append(i)
                used[r] += n
                break
        else:
            rows.append([i])
            used.append(n)
    width = max(sum(len(sequences[i]) for i in members) for members in rows)
    width = -(-width // pad_multiple) * pad_multiple
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    offsets: list[tuple[int, int]] = [(0, 0)] * len(sequences)
    seglens: list[int] = []
    for r, members in enumerate(rows):
        col = 0
        for i in members:
            n = len(sequences[i])
            tokens[r, col:col + n] = torch.as_tensor(list(sequences[i]), dtype=torch.long)
            positions[r, col:col + n] = torch.arange(n)
            offsets[i] = (r, col)
            seglens.append(n)
            col += n
        if col < width:  # the row's padding: a segment of its own, attending only to itself
            positions[r, col:] = torch.arange(width - col)
            seglens.append(width - col)
    cu = torch.zeros(len(seglens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(seglens).cumsum(0)
    return PackedRows(tokens=tokens, position_ids=positions, offsets=offsets, cu_seqlens=cu,
                      max_seqlen=max(seglens))


@dataclass
class MicroBatch:
    """Everything one micro-batch needs: the rows the passes run and the loss's inputs.

    ``policy`` is the loss's side of it, indexed like ``rows``; the step hands it to the
    objective with the model's hidden states added (:func:`megatron_tg.train.step.run_step`).
    Its ``loss_mask`` is all True: the loss rows are selected by the assistant mask here."""

    student: PackedRows
    rows: torch.Tensor                # [N] flat student rows in the loss (predict assistant tokens)
    policy: PolicyBatch
    """[N] per row: target ids, behaviour log-probs, rollout index, gate, ``pg_mask``
    (None: every row is the rollouts' own; False on hinted sequences' rows, which only the KL
    term sees); [R] advantages. No hidden states yet."""
    turn_index: torch.Tensor          # [N] assistant turn of the predicted token
    expert: PackedRows | None         # None when nothing is gated
    expert_rows: torch.Tensor         # [G] flat expert rows, aligned with policy.gate.nonzero()
    num_rollouts: int
    num_tokens: int                   # real (unpadded) student tokens
    expert_prefix: PrefixPlan | None = None
    """With prefix reuse: ``expert`` holds only the expert sequences' suffixes (from the first
    inserted feedback on) and this says where their prefix keys are in the student's rows."""
    routed_experts: torch.Tensor | None = None
    """[B·S, layers, top_k] the engine's expert ids per student token, in flat ``b·S + s``
    order (routing replay; None: route freely). Positions without an engine row (padding,
    a rollout's last token) get experts 0..k-1: they influence no loss row."""
    routed_layers: tuple[int, ...] = ()
    """Decoder-layer index of each layer slice of ``routed_experts``."""


def routed_experts_layout(rollouts: Sequence[Rollout], student: PackedRows
                          ) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The rollouts' engine routing laid out like ``student``'s tokens (see MicroBatch);
    rollout ``k`` is packed sequence ``k``."""
    missing = [ro.rollout_id for ro in rollouts if ro.routed_experts is None]
    if missing:
        raise ValueError(f"routing replay is on but rollout(s) {missing[:3]} carry no routed "
                         "experts (engine without --enable-return-routed-experts?)")
    first = rollouts[0].routed_experts
    for ro in rollouts:
        re = ro.routed_experts
        # A loss row's hidden state depends on the routing of every position up to it: the
        # rows must reach the position before the last generated token.
        need = max((seg.end for seg in ro.assistant_turns()), default=1) - 1
        if re.rows < need:
            raise ValueError(f"rollout {ro.rollout_id!r}: routed experts cover "
                             f"{re.rows} positions, its loss needs {need}")
        if re.layers != first.layers or re.top_k != first.top_k:
            raise ValueError(f"rollout {ro.rollout_id!r}: routed experts for layers "
                             f"{re.layers} x top-{re.top_k}, others {first.layers} x top-{first.top_k}")
    b, width = student.tokens.shape
    out = torch.arange(first.top_k, dtype=torch.uint8 if first.num_experts <= 256 else torch.int16)
    out = out.repeat(b * width, len(first.layers), 1)
    for k, ro in enumerate(rollouts):
        ids = torch.from_numpy(ro.routed_experts.ids.copy())
        start = student.flat(k, 0)
        out[start:start + ids.shape[0]] = ids.to(out.dtype)
    return out, tuple(first.layers)


@dataclass
class _StudentRows:
    """The student part of a micro-batch: its packed sequences and loss rows, in build order."""

    seqs: list[tuple[int, Rollout, bool]]
    """Packed sequence ``q`` -> (its sample, its rollout, whether it is the sample's own)."""
    packed: PackedRows
    rows: list[int] = field(default_factory=list)       # flat student row of each loss row
    targets: list[int] = field(default_factory=list)
    behaviour: list[float] = field(default_factory=list)
    rollout: list[int] = field(default_factory=list)    # sample index
    failed: list[bool] = field(default_factory=list)    # its turn has feedback
    thinking: list[bool] = field(default_factory=list)
    own: list[bool] = field(default_factory=list)       # False on hinted sequences' rows
    token: list[tuple[int, int]] = field(default_factory=list)  # (packed sequence, token index)
    turn: list[int] = field(default_factory=list)       # assistant turn of the predicted token


def _student_part(samples: Sequence[TrainSample], tokenizer, row_tokens: int, pad_multiple: int,
                  pad_id: int) -> _StudentRows:
    """Pack the samples' rollouts, then their hinted sequences, and list the loss rows: every
    position whose next token is an assistant token (a hinted sequence: its last turn only)."""
    # Packed sequence k: sample k's rollout for k < len(samples), then the hinted sequences.
    seqs: list[tuple[int, Rollout, bool]] = [(k, s.rollout, True) for k, s in enumerate(samples)]
    seqs += [(k, hinted_rollout(s.rollout, h, tokenizer), False)
             for k, s in enumerate(samples) for h in s.hinted]
    out = _StudentRows(seqs, pack([ro.token_ids for _, ro, _ in seqs], row_tokens, pad_multiple,
                                  pad_id))
    for q, (k, ro, is_own) in enumerate(seqs):
        amask, tmask = ro.assistant_mask(), ro.thinking_mask()
        turn_of, lps = ro.turn_index_per_token(), ro.logprobs_per_token()
        first = 1 if is_own else ro.assistant_turns()[-1].start  # hinted: its last turn only
        for i in range(max(first, 1), len(ro.token_ids)):
            if not amask[i]:
                continue
            out.rows.append(out.packed.flat(q, i - 1))
            out.token.append((q, i))
            out.turn.append(turn_of[i])
            out.targets.append(ro.token_ids[i])
            out.behaviour.append(lps[i])
            out.rollout.append(k)
            out.failed.append(turn_of[i] in samples[k].feedback_by_turn)
            out.thinking.append(bool(tmask[i]))
            out.own.append(is_own)
    return out


def _gate_part(student: _StudentRows, loss_mask: torch.Tensor,
               cfg: ObjectiveConfig) -> torch.Tensor:
    """[N] KL gate of the loss rows (build order): the mode's gate, and only where feedback
    was given, because an expert sequence exists only there."""
    failed = torch.tensor(student.failed, dtype=torch.bool)
    gate = build_gate(loss_mask, failed, torch.tensor(student.thinking, dtype=torch.bool), cfg)
    return gate * failed.float()


def _expert_part(student: _StudentRows, gate: torch.Tensor, samples: Sequence[TrainSample],
                 tokenizer, cfg: ObjectiveConfig, *, row_tokens: int, pad_multiple: int,
                 pad_id: int, framing: str, prefix_reuse: bool
                 ) -> tuple[PackedRows | None, PrefixPlan | None, dict[tuple[int, int], tuple[int, int]]]:
    """The expert sequences of the gated turns, packed; the prefix plan (prefix reuse); and
    (packed sequence, token index) -> (expert sequence, position predicting that token)."""
    # Expert sequences only for turns with a gated row: feedback on turns the mode does not
    # distil (e.g. mode "grpo") must not cost an expert forward pass.
    gated_turns: dict[int, set[int]] = {}
    for j in gate.nonzero().squeeze(1).tolist():
        gated_turns.setdefault(student.token[j][0], set()).add(student.turn[j])
    expert_seqs: list[list[int]] = []
    prefixes: list[tuple[int, int, int]] = []  # per expert sequence: (packed seq, prefix, suffix)
    expert_pos: dict[tuple[int, int], tuple[int, int]] = {}  # (packed seq, token i) -> (eseq, epos)
    for k, turns in sorted(gated_turns.items()):
        owner, ro, _ = student.seqs[k]
        fb = {t: samples[owner].feedback_by_turn[t] for t in sorted(turns)}
        for eseq in build_expert_sequences(ro, fb, tokenizer, cfg.expert_sequence, framing):
            e = len(expert_seqs)
            # Tokens before the first inserted feedback are the student's own (same ids,
            # same positions): with prefix reuse the expert pass skips them.
            cut = eseq.feedback_spans[0].start if prefix_reuse else 0
            expert_seqs.append(eseq.token_ids[cut:])
            prefixes.append((k, cut, len(eseq.token_ids) - cut))
            for i, on in enumerate(eseq.kl_mask):
                if on:
                    expert_pos[(k, i)] = (e, eseq.position_map[i] - 1 - cut)
    if not expert_seqs:
        return None, None, expert_pos
    # An expert sequence is longer than its rollout by the inserted feedback, so a rollout
    # that fits the student's row budget may not fit it: widen the expert rows instead of
    # failing (the budget bounds packing, not which rollouts can be trained on).
    full = [p + n for _, p, n in prefixes]  # whole expert sequence lengths
    budget = max(row_tokens, max(full))
    expert = pack(expert_seqs, budget, pad_multiple, pad_id, cost=full)
    plan = build_prefix_plan(student.packed, expert, prefixes) if prefix_reuse else None
    return expert, plan, expert_pos


def build_micro_batch(samples: Sequence[TrainSample], tokenizer, cfg: ObjectiveConfig, *,
                      row_tokens: int, pad_multiple: int = 1, framing: str = "user",
                      pad_id: int = 0, prefix_reuse: bool = False,
                      routing_replay: bool = False) -> MicroBatch:
    """Pack ``samples`` into one micro-batch: student rows, their gate, expert rows.

    ``prefix_reuse`` (shared-weight expert only): pack only the expert sequences' suffixes,
    from their first inserted feedback on; the expert pass takes the prefix keys/values from
    the student pass (:mod:`megatron_tg.train.prefix_kv`). ``routing_replay``: lay out the
    engine's routed experts for the student pass (every sample must carry them).

    A sample's hinted turns (:mod:`megatron_tg.sampling.hinted`) are packed after the samples as
    sequences of their own, with the sample's rollout index: their rows carry the KL gate of
    the failing turn they replace and are left out of ``pg_mask``."""
    student = _student_part(samples, tokenizer, row_tokens, pad_multiple, pad_id)
    loss_mask = torch.ones(len(student.rows), dtype=torch.bool)
    gate = _gate_part(student, loss_mask, cfg)
    expert, plan, expert_pos = _expert_part(
        student, gate, samples, tokenizer, cfg, row_tokens=row_tokens, pad_multiple=pad_multiple,
        pad_id=pad_id, framing=framing, prefix_reuse=prefix_reuse)

    # Gated rows in increasing flat order; their expert rows in the same order.
    rows_t = torch.tensor(student.rows, dtype=torch.long)
    order = torch.argsort(rows_t)
    rows_t = rows_t[order]
    targets, behaviour, rindex, turns = (torch.tensor(x)[order] for x in (
        student.targets, student.behaviour, student.rollout, student.turn))
    gate = gate[order]
    own = torch.tensor(student.own, dtype=torch.bool)[order]
    thinking = torch.tensor(student.thinking, dtype=torch.bool)[order]
    expert_rows = []
    for j in gate.nonzero().squeeze(1).tolist():
        e, epos = expert_pos[student.token[int(order[j])]]
        expert_rows.append(expert.flat(e, epos))
    policy = PolicyBatch(
        target_ids=targets.long(), behaviour_logprobs=behaviour.float(), loss_mask=loss_mask,
        rollout_index=rindex.long(), gate=gate,
        advantages=torch.tensor([s.advantage for s in samples], dtype=torch.float32),
        pg_mask=None if bool(own.all()) else own,
        thinking_mask=thinking if bool(thinking.any()) else None)
    seqs = student.seqs
    return MicroBatch(
        student=student.packed, rows=rows_t, policy=policy, turn_index=turns.long(),
        expert=expert, expert_rows=torch.tensor(expert_rows, dtype=torch.long),
        num_rollouts=len(samples), num_tokens=sum(len(ro.token_ids) for _, ro, _ in seqs),
        expert_prefix=plan,
        **(dict(zip(("routed_experts", "routed_layers"),
                    routed_experts_layout([ro for _, ro, _ in seqs], student.packed)))
           if routing_replay else {}))
