"""One micro-batch of the TG objective on the megatron policy: expert pass, student pass, loss.

Order matters: the expert forward runs first, under ``no_grad``, and only its hidden states
at the gated rows are kept ([G, H]); its activations are freed before the student's forward
builds the autograd graph. With prefix reuse (the shared expert) the student runs first and
the expert pass covers only the suffixes (see :mod:`megatron_tg.train.prefix_kv`). Neither
pass materialises logits: the fused vocab-parallel ops compute the output layer at the loss
rows only, chunk by chunk. With routing replay (``mb.routed_experts``) only the student
forward replays the engine's expert choice; the expert pass routes freely (its feedback
context was never served). The caller sets the backward action and clears the ids
(:mod:`megatron_tg.train.routing`).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from megatron_tg.objectives import LossOutput, PolicyBatch, TGObjective, select_rows
from megatron_tg.train.batching import MicroBatch
from megatron_tg.train.policy import forward_hidden, unwrap
from megatron_tg.train.prefix_kv import record_kv, reuse_kv
from megatron_tg.train.routing import replay_routing


def ops_reduce_hidden_grad(model: torch.nn.Module) -> bool:
    """Whether the fused ops must all-reduce the hidden-state gradient over TP themselves
    (see :mod:`megatron_tg.train.policy`): only when sequence parallelism is off."""
    return not bool(unwrap(model).config.sequence_parallel)


def expert_hidden_states(expert_model: torch.nn.Module, mb: MicroBatch, *,
                         lockstep: bool = False):
    """[G, H] expert hidden states at the gated rows (or None) and the expert's output weight.

    ``lockstep``: another rank of the expert-parallel group runs an expert pass for this
    micro-batch, so this rank must take part in its MoE all-to-alls even with nothing gated;
    it forwards its student rows and discards the result.
    """
    if mb.expert is None or mb.expert_rows.numel() == 0:
        if lockstep:
            with torch.no_grad():
                forward_hidden(expert_model, mb.student)
        return None, None
    with torch.no_grad():
        out = forward_hidden(expert_model, mb.expert)
        return select_rows(out.hidden, mb.expert_rows).detach(), out.output_weight.detach()


def _replay(model: torch.nn.Module, mb: MicroBatch):
    # The model sees the packed rows as one THD sequence [1, B·S] (train/batching.py).
    return replay_routing(model, mb.routed_experts, mb.routed_layers, 1, mb.student.tokens.numel())


def micro_batch_loss(model: torch.nn.Module, objective: TGObjective, mb: MicroBatch, *,
                     vocab_size: int, expert_model: torch.nn.Module | None = None,
                     num_rollouts: float | None = None, num_assistant_tokens: float | None = None,
                     num_gated_tokens: float | None = None, expert_lockstep: bool = False,
                     prefix_reuse: bool = False) -> LossOutput:
    """The TG loss of one micro-batch (call ``.loss.backward()`` on the result).

    ``expert_model`` is the policy itself for the paper's shared-weight expert (None), or a
    frozen/EMA copy. ``num_rollouts`` is the rollout-average denominator when several
    micro-batches are accumulated into one step (default: this micro-batch's rollouts);
    ``num_assistant_tokens`` / ``num_gated_tokens`` likewise for the token-level ("global")
    normalisations. ``prefix_reuse`` (shared expert; the micro-batch built with it): the
    student pass runs first and the expert pass covers only the suffixes.
    """
    if prefix_reuse or mb.expert_prefix is not None:  # shared expert reusing the student's
        # prefix keys/values: the student pass first
        if expert_model is not None:
            raise ValueError("prefix reuse needs the shared-weight expert (objective.expert=shared)")
        gpt = unwrap(model)
        with record_kv(gpt) as store, _replay(model, mb):
            student = forward_hidden(model, mb.student)
        expert_hidden = expert_weight = None
        if mb.expert_prefix is not None and mb.expert_rows.numel() > 0:
            with torch.no_grad(), reuse_kv(gpt, store, mb.expert_prefix):
                out = forward_hidden(model, mb.expert)
                expert_hidden = select_rows(out.hidden, mb.expert_rows).detach()
        else:
            store.clear()
            # Same pass order on every EP rank: each MoE all-to-all of the student pass must
            # meet the other ranks' student pass, or backward pairs mismatched splits.
            expert_hidden_states(model, replace(mb, expert=None), lockstep=expert_lockstep)
    else:
        expert_hidden, expert_weight = expert_hidden_states(expert_model or model, mb,
                                                            lockstep=expert_lockstep)
        with _replay(model, mb):
            student = forward_hidden(model, mb.student)
    batch = PolicyBatch(
        target_ids=mb.target_ids, behaviour_logprobs=mb.behaviour_logprobs,
        loss_mask=mb.loss_mask, rollout_index=mb.rollout_index, advantages=mb.advantages,
        gate=mb.gate, hidden=select_rows(student.hidden, mb.rows),
        output_weight=student.output_weight, expert_hidden=expert_hidden,
        # The shared-weight expert uses the student's (live, detached) weight inside the op.
        expert_output_weight=expert_weight if expert_model is not None else None,
        vocab_size=vocab_size, num_rollouts=num_rollouts,
        num_assistant_tokens=num_assistant_tokens, num_gated_tokens=num_gated_tokens)
    return objective(batch)
