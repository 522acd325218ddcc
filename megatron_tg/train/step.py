"""The TG step on the megatron policy, through megatron's pipeline schedules.

One path for every layout: :func:`run_step` hands the micro-batches of one optimizer step
to ``megatron.core.pipeline_parallel.get_forward_backward_func()`` — the 1F1B schedule
under pipeline parallelism, ``forward_backward_no_pipelining`` at PP = 1 — twice:

1. **Expert pass** (forward-only schedule, under ``no_grad``) over the micro-batches the
   :class:`~megatron_tg.train.pass_plan.PassPlan` gives an expert pass. The last stage
   keeps only the hidden states at the gated rows, ``[G, H]`` per micro-batch (and a
   separate expert's output weight); every other activation is freed before step 2. Dummy
   passes (expert-parallel lock-step) forward the student rows and keep nothing. The step's
   kept states are parked in pinned host memory on GPU (:func:`park`) and each micro-batch's
   come back at its loss: at paper scale they would otherwise hold tens of GiB of the GPU
   for the whole step (``megatron-tg memory``: ``expert_states`` and the host note;
   docs/memory-plan.md per recipe).
2. **Student pass** (forward-backward schedule) over every micro-batch of the plan; the
   loss is computed on the last stage from the student's hidden states and the kept
   expert states. Padding micro-batches have loss weight 0.

Neither pass materialises logits: the last stage's output layer is swapped for the
sequence gather (:mod:`megatron_tg.train.policy`) and the fused vocab-parallel ops compute
the output layer at the loss rows only. Losses and metrics exist on the last stage; they are
broadcast over the pipeline group so every rank returns them.

Prefix reuse (shared expert, :mod:`megatron_tg.train.prefix_kv`) needs the student's keys
and values before the expert pass, but the loss needs the expert's states at the student's
forward: both happen inside one forward step, which only works when the whole model is on
this rank, so it is used at PP = 1 only (the trainer turns it off under PP; see
docs/micro-batch.md §6 for the cost). Routing replay: only the student forward replays the
engine's experts; a forward step ends by setting ``REPLAY_BACKWARD`` so that a recomputed
forward during the schedule's backward replays the ids of its own micro-batch (megatron pops
them first-in first-out, the order 1F1B runs backwards in); the caller clears them after
the step (:func:`~megatron_tg.train.routing.clear_replay`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from functools import partial
from typing import ContextManager, Protocol, Sequence

import torch
import torch.distributed as dist

from megatron_tg.objectives import LossOutput, TGObjective, select_rows
from megatron_tg.train.batching import MicroBatch, PackedRows
from megatron_tg.train.pass_plan import ExpertPass, PassPlan, build_pass_plan, has_expert
from megatron_tg.train.policy import HiddenOutput, cp_size, forward_hidden, sp_size, unwrap
from megatron_tg.train.prefix_kv import record_kv, reuse_kv
from megatron_tg.train.routing import cp_share_of_ids, replay_backward, replay_routing


class ExpertWeights(Protocol):
    """Weights of an expert model that exist only around its pass (the gathered EMA)."""

    def expert_pass(self, passes: int) -> ContextManager[None]: ...


def ops_reduce_hidden_grad(model: torch.nn.Module) -> bool:
    """Whether the fused ops must all-reduce the hidden-state gradient over TP themselves
    (see :mod:`megatron_tg.train.policy`): only when sequence parallelism is off."""
    return not bool(unwrap(model).config.sequence_parallel)


def forward_rows(model: torch.nn.Module, rows: PackedRows) -> HiddenOutput:
    """The one call into the model: its inputs (THD tokens, positions, ``PackedSeqParams``)
    are derived from the packed rows by :func:`~megatron_tg.train.policy.forward_hidden`."""
    return forward_hidden(model, rows)


def expert_hidden_states(expert_model: torch.nn.Module, mb: MicroBatch):
    """[G, H] expert hidden states at the gated rows (or None) and the expert's output weight,
    computed directly on a single-stage model (tests and benchmarks of the expert pass)."""
    if not has_expert(mb):
        return None, None
    with torch.no_grad():
        out = forward_rows(expert_model, mb.expert)
        return select_rows(out.hidden, mb.expert_rows).detach(), out.output_weight.detach()


@dataclass
class MicroBatchResult:
    """What the loss of one (non-padding) micro-batch reports, on every rank."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    rows: dict[str, torch.Tensor] = field(default_factory=dict)


def _replay(model: torch.nn.Module, mb: MicroBatch):
    # The model sees the packed rows as one THD sequence [1, B·S] (train/batching.py), or under
    # context parallelism this rank's share of it (train/policy.py): the ids are split alike.
    ids = mb.routed_experts
    if ids is not None and cp_size() > 1:
        from megatron.core import parallel_state as mps

        layout = mb.student.cp_layout(cp_size(), tp=sp_size(unwrap(model)))
        ids = cp_share_of_ids(layout, ids, mps.get_context_parallel_rank())
    n = ids.shape[0] if ids is not None else mb.student.tokens.numel()
    return replay_routing(model, ids, mb.routed_layers, 1, n)


def _padding(mb: MicroBatch) -> MicroBatch:
    """A zero-weight stand-in: the micro-batch's student rows without its expert part."""
    return replace(mb, expert=None, expert_rows=mb.expert_rows[:0], expert_prefix=None,
                   policy=replace(mb.policy, gate=torch.zeros_like(mb.policy.gate)))


def _schedule(model, step_fn, items: list, *, forward_only: bool,
              shape: tuple[int, int] | None = None) -> list:
    """Run megatron's schedule for this layout over ``items`` (one per micro-batch;
    ``shape``: the first one's [B, S], default its student rows')."""
    from megatron.core import parallel_state as mps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    config = unwrap(model).config
    if mps.get_pipeline_model_parallel_world_size() > 1 and not config.variable_seq_lengths:
        # Micro-batches differ in token count: stages must exchange shapes per micro-batch.
        raise ValueError("pipeline parallelism needs the model built with variable_seq_lengths=True")
    first = shape or items[0][1].student.tokens.shape
    return get_forward_backward_func()(
        forward_step_func=step_fn, data_iterator=iter(items), model=[model],
        num_microbatches=len(items), seq_length=first[1], micro_batch_size=first[0],
        forward_only=forward_only, collect_non_loss_data=forward_only)


def _from_last_stage(obj):
    """``obj`` of the last pipeline stage, on every stage of this pipeline."""
    from megatron.core import parallel_state as mps

    if mps.get_pipeline_model_parallel_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=mps.get_pipeline_model_parallel_last_rank(),
                               group=mps.get_pipeline_model_parallel_group())
    return box[0]


def park(t: torch.Tensor) -> torch.Tensor:
    """``t`` in pinned host memory when it is on a GPU (copied on the current stream, so a
    later move back is ordered after it); unchanged on CPU."""
    if not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def _expert_step(data_iterator, model):
    _, mb, kind = next(data_iterator)
    out = forward_rows(model, mb.expert if kind is ExpertPass.REAL else mb.student)

    def keep(output_tensor, non_loss_data=True):
        if kind is not ExpertPass.REAL:  # a dummy pass: its all-to-alls were the point
            return None
        return park(select_rows(output_tensor, mb.expert_rows).detach()), out.output_weight.detach()

    return out.hidden, keep


def run_forward(model: torch.nn.Module, rows: PackedRows, fn):
    """``fn(HiddenOutput)`` of one forward-only pass over ``rows`` (under ``no_grad``),
    computed on the last pipeline stage and returned on every rank (collective)."""

    def step(data_iterator, model):
        next(data_iterator)
        out = forward_rows(model, rows)
        return out.hidden, lambda output_tensor, non_loss_data=True: fn(
            replace(out, hidden=output_tensor))

    with torch.no_grad():
        store = _schedule(model, step, [(0, None)], forward_only=True,
                          shape=tuple(rows.tokens.shape))
    return _from_last_stage(store[0] if unwrap(model).post_process else None)


def run_step(model: torch.nn.Module, objective: TGObjective, batches: Sequence[MicroBatch],
             plan: PassPlan | None = None, *, vocab_size: int,
             expert_model: torch.nn.Module | None = None, prefix_reuse: bool = False,
             expert_weights: ExpertWeights | None = None,
             num_rollouts: float | None = None, num_assistant_tokens: float | None = None,
             num_gated_tokens: float | None = None) -> list[MicroBatchResult | None]:
    """Forward and backward of one step's micro-batches (gradients accumulate in ``model``);
    returns per plan entry its loss/metrics (None for padding), on every rank.

    ``expert_model`` is None for the paper's shared-weight expert (the policy itself) or a
    frozen/EMA copy. ``plan`` defaults to :func:`build_pass_plan` without expert
    parallelism. The ``num_*`` totals are the step's denominators (default: per micro-batch).
    ``prefix_reuse`` (shared expert, PP = 1; the micro-batches built with it): the expert
    pass runs inside the student's forward step on the suffixes only. ``expert_weights``
    (the gathered EMA expert, :mod:`megatron_tg.train.ema_gather`): the expert model's
    weights exist only inside its ``expert_pass``, which every rank enters once per step."""
    from megatron.core import parallel_state as mps

    plan = plan or build_pass_plan(batches, ep=1)
    reuse = prefix_reuse or any(mb.expert_prefix is not None for mb in batches)
    if reuse and expert_model is not None:
        raise ValueError("prefix reuse needs the shared-weight expert (objective.expert=shared)")
    if reuse and mps.get_pipeline_model_parallel_world_size() > 1:
        raise ValueError("prefix reuse runs at pipeline size 1 only (build the micro-batches "
                         "with prefix_reuse=False under PP)")
    if reuse and cp_size() > 1:
        raise ValueError("prefix reuse runs at context-parallel size 1 only (the student's keys "
                         "and values are split over CP; build the micro-batches with "
                         "prefix_reuse=False)")
    mbs = [batches[p.source] if not p.padding else _padding(batches[0]) for p in plan]
    n = len(plan)
    last = unwrap(model).post_process
    totals = dict(num_rollouts=num_rollouts, num_assistant_tokens=num_assistant_tokens,
                  num_gated_tokens=num_gated_tokens, vocab_size=vocab_size)

    kept: dict[int, tuple] = {}
    passes = plan.expert_passes if not reuse else []
    # A collective on every rank (gathered EMA), with or without passes of its own.
    weights = (expert_weights.expert_pass(len(passes)) if expert_weights is not None
               else contextlib.nullcontext())
    with weights:
        if passes:
            items = [(i, mbs[i], plan.passes[i].expert) for i in passes]
            with torch.no_grad():
                store = _schedule(expert_model or model, _expert_step, items, forward_only=True)
            if last:
                kept = {i: s for i, s in zip(passes, store) if s is not None}

    def loss_fn(i, mb, student, expert, output_tensor):
        eh, ew = expert if expert is not None else (None, None)
        if eh is not None and eh.device != output_tensor.device:  # parked by the expert pass
            eh = eh.to(output_tensor.device, non_blocking=True)
        batch = replace(
            mb.policy, hidden=select_rows(output_tensor, mb.rows),
            output_weight=student.output_weight, expert_hidden=eh,
            # The shared-weight expert uses the student's (live, detached) weight in the op.
            expert_output_weight=ew if expert_model is not None else None, **totals)
        out: LossOutput = objective(batch)
        padding = plan.passes[i].padding
        # The schedule scales the returned loss by CP / num_microbatches (megatron's mean over
        # micro-batches); ours already carries the step's denominators, so undo that scale.
        scale = 0.0 if padding else n / mps.get_context_parallel_world_size()
        result = None if padding else MicroBatchResult(
            loss=out.loss.detach().cpu(), metrics={k: v.detach().cpu() for k, v in out.metrics.items()},
            rows={k: v.detach().cpu() for k, v in out.rows.items()})
        return out.loss * scale, result

    def student_step(data_iterator, model):
        i, mb, kind = next(data_iterator)
        expert = kept.get(i)
        if reuse:
            gpt = unwrap(model)
            with record_kv(gpt) as store, _replay(model, mb):
                student = forward_rows(model, mb.student)
            if kind is ExpertPass.REAL:
                with torch.no_grad(), reuse_kv(gpt, store, mb.expert_prefix):
                    e = forward_rows(model, mb.expert)
                    expert = (select_rows(e.hidden, mb.expert_rows).detach(), None)
            else:
                store.clear()
                if kind is ExpertPass.DUMMY:  # lock-step: the same passes in the same order
                    with torch.no_grad():
                        forward_rows(model, mb.student)
        else:
            with _replay(model, mb):
                student = forward_rows(model, mb.student)
        replay_backward(model)  # a recomputed forward replays this micro-batch's experts
        return student.hidden, partial(loss_fn, i, mb, student, expert)

    items = [(i, mbs[i], p.expert) for i, p in enumerate(plan)]
    store = _schedule(model, student_step, items, forward_only=False)
    return _from_last_stage(store if last else None)
