"""The policy's forward pass as the loss needs it: hidden states, never full logits.

Megatron's ``GPTModel`` ends in a vocab-parallel ``ColumnParallelLinear``: with sequence
parallelism it all-gathers the sequence-split hidden states, multiplies by its vocabulary
shard, and in backward reduce-scatters the partial input gradient. :func:`forward_hidden`
runs the same model with that last layer swapped for the gather alone, so the caller gets
the full-sequence hidden states ``[B, S, H]`` (identical on every TP rank) plus the output
weight shard, and the fused vocab-parallel ops compute log-probs/KL only at the rows that
carry a loss. Packed rows run in megatron's THD form (one sequence of ``B·S`` tokens with
``PackedSeqParams``); callers pass the packed rows, never a mask. The gather keeps the
output layer's backward (a reduce-scatter that sums the TP ranks' partial gradients), so
the ops are told not to all-reduce that gradient again (``reduce_hidden_grad=False``);
without sequence parallelism the hidden states are replicated and the ops all-reduce it
themselves (``reduce_hidden_grad=True``).

Context parallelism (``parallel.cp > 1``, packed rows only): the micro-batch's segments are
padded and split by :meth:`PackedRows.cp_layout` (:class:`~megatron_tg.parallel.cp.CPLayout`,
megatron's and TE's load-balanced split), and the model sees only this rank's share: its
token ids, its RoPE positions and the padded global bounds in ``PackedSeqParams``. The last
stage's output-layer input comes back to the full real-order ``[B, S, H]`` by an all-gather
over the CP group (:func:`~megatron_tg.parallel.cp.gather_tokens`; its backward
reduce-scatters the gradient), so every CP rank computes the same loss on the same rows:
each rank's parameter gradient is then CP times its tokens' share of the loss gradient, which
megatron's DDP averages over DP x CP back to the loss gradient. What that costs: the output
layer at the loss rows runs on every CP rank (docs/context-parallel.md).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass
class HiddenOutput:
    hidden: torch.Tensor          # [B, S, H], full sequence, replicated over TP; on a pipeline
    #                               stage before the last: the stage's output [S/TP, B, H]
    output_weight: torch.Tensor | None  # [V_pad / TP, H] this rank's vocabulary shard (None
    #                                     before the last stage, which alone holds it)
    reduce_hidden_grad: bool      # pass to the fused ops / TGObjective


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel under DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


class _GatherOnly(torch.nn.Module):
    """Stands in for the output layer: the sequence all-gather, without the matmul."""

    def __init__(self, sequence_parallel: bool) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_states, weight=None, runtime_gather_output=None, **_):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=True)
        return hidden_states, None


@contextlib.contextmanager
def _hidden_mode(gpt):
    layer = gpt.output_layer
    gpt.output_layer = _GatherOnly(bool(layer.sequence_parallel))
    try:
        yield layer
    finally:
        gpt.output_layer = layer


def sp_size(gpt) -> int:
    """TP when sequence parallelism splits each CP share over it, else 1."""
    from megatron.core import parallel_state as mps

    return mps.get_tensor_model_parallel_world_size() if gpt.config.sequence_parallel else 1


def output_weight(gpt) -> torch.Tensor:
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


def cp_size() -> int:
    """The context-parallel group's size (1 when megatron's parallel state has none)."""
    from megatron.core import parallel_state as mps

    try:
        return mps.get_context_parallel_world_size()
    except (AssertionError, AttributeError):  # parallel state not initialised (unit tests)
        return 1


def forward_hidden(model: torch.nn.Module, batch, position_ids: torch.Tensor | None = None
                   ) -> HiddenOutput:
    """Run ``model`` (possibly DDP-wrapped) and return the output layer's input.

    ``batch`` is either packed rows (:class:`~megatron_tg.train.batching.PackedRows`: the
    ``[B, S]`` rows run as one THD sequence of ``B·S`` tokens, causal within each packed
    sequence) or a ``[B, S]`` token tensor run plainly (each row one causal sequence, with
    ``position_ids``). Either way ``hidden`` is ``[B, S, H]``: flat row ``b·S + s`` is
    token ``s`` of row ``b``, the index the micro-batch fields use.

    Under pipeline parallelism a stage other than the last has no output layer: it returns
    its decoder output as it is (``[B·S / TP, 1, H]`` for packed rows), which the schedule
    sends to the next stage (whose input comes from ``set_input_tensor``, not ``tokens``)."""
    gpt = unwrap(model)
    device = next(gpt.parameters()).device
    layout = None
    if hasattr(batch, "packed_seq_params") and cp_size() > 1:
        from megatron.core import parallel_state as mps

        shape = batch.tokens.shape
        layout = batch.cp_layout(cp_size(), tp=sp_size(gpt))
        r = mps.get_context_parallel_rank()
        tokens = layout.split(layout.pad(batch.tokens.reshape(-1)), r)[None].to(device)
        position_ids = layout.positions(r)[None].to(device)
        params = layout.packed_seq_params(device)
    elif hasattr(batch, "packed_seq_params"):
        shape = batch.tokens.shape
        tokens = batch.tokens.reshape(1, -1).to(device)
        position_ids = batch.position_ids.reshape(1, -1).to(device)
        params = batch.packed_seq_params(device)
    else:
        if cp_size() > 1:
            raise ValueError("context parallelism runs packed rows only (PackedRows), not a "
                             "[B, S] token tensor")
        shape, tokens, params = batch.shape, batch.to(device), None
        if position_ids is None:
            position_ids = torch.arange(shape[1], device=device).expand(shape[0], -1)
        position_ids = position_ids.to(device)
    if not gpt.post_process:
        return HiddenOutput(hidden=model(tokens, position_ids, None, packed_seq_params=params),
                            output_weight=None,
                            reduce_hidden_grad=not bool(gpt.config.sequence_parallel))
    with _hidden_mode(gpt) as layer:
        hidden = model(tokens, position_ids, None, packed_seq_params=params)  # [b, s, H]
    if layout is not None:  # this rank's share [1, T_pad / CP, H] -> the real tokens [T, H]
        from megatron.core import parallel_state as mps

        hidden = layout.unpad(layout.gather(hidden[0], mps.get_context_parallel_group()))
    return HiddenOutput(hidden=hidden.reshape(*shape, hidden.shape[-1]),
                        output_weight=output_weight(gpt),
                        reduce_hidden_grad=not bool(layer.sequence_parallel))
