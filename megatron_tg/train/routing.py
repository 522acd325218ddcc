"""Routing replay: the student pass routes every token to the experts the engine used.

Why: a MoE's expert choice is discrete, so tiny numeric differences between the engine
and the trainer (kernels, dtype, weight versions) flip tokens to other experts, and the
trainer then scores a different function than the one that sampled (GRPO on Qwen3-30B-A3B
without replay has collapsed in published runs). megatron-core does the replay itself
(``moe_enable_routing_replay``: each router owns a ``RouterReplay``, whose
``REPLAY_FORWARD`` action takes the given top-k ids and gathers their scores instead of
taking the top-k; ``REPLAY_BACKWARD`` does the same for a recomputed forward). This module
only lays the engine's ids out the way megatron's routers see their tokens and drives the
actions:

* **Layout.** A micro-batch's ids are ``[B·S, layers, top_k]`` in the student's flat
  ``b·S + s`` order (:mod:`megatron_tg.train.batching`). A router sees its input as
  ``[S_local, B, H]`` flattened position-major (row ``s·B + b``); under sequence parallelism
  TP rank r holds the contiguous positions ``[r·S/TP, (r+1)·S/TP)``. With expert
  parallelism routing happens before the token dispatch, on the tokens this rank holds, so
  EP needs nothing more. Under pipeline parallelism each stage's routers are its own
  layers': they are matched to the ids' layer slices by their global layer number.
* **Which routers.** The policy's own, found in its modules (not megatron's global
  instance list, which also holds any other model built with replay on). Frozen/EMA expert
  copies are built without replay.
* **Which passes.** Only the student pass: the expert pass on the feedback context routes
  freely (that context was never served) and so does a lock-step dummy pass. Indices are
  set per micro-batch and cleared after its backward, since ``set_target_indices`` appends
  to the backward-replay list; ``REPLAY_BACKWARD`` is set for the backward so that a
  recomputed forward (activation recompute) replays the same ids.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch

from megatron_tg.train.policy import unwrap


def moe_routers(model: torch.nn.Module) -> list[tuple[int, object]]:
    """(0-based global layer index, router) of this rank's MoE layers, in layer order."""
    gpt = unwrap(model)
    out = []
    for layer in gpt.decoder.layers:
        router = getattr(getattr(layer, "mlp", None), "router", None)
        if router is not None:
            out.append((int(layer.layer_number) - 1, router))
    return out


def replay_enabled(model: torch.nn.Module) -> bool:
    routers = moe_routers(model)
    return bool(routers) and all(getattr(r, "router_replay", None) is not None for _, r in routers)


def router_targets(ids: torch.Tensor, batch: int, seq: int, *, tp_rank: int = 0, tp: int = 1,
                   sequence_parallel: bool = False) -> torch.Tensor:
    """``[B·S, L, k]`` ids in flat ``b·S + s`` order -> ``[S_local·B, L, k]`` in the order this
    rank's routers see tokens (position-major, this TP rank's slice under SP)."""
    per_pos = ids.view(batch, seq, *ids.shape[1:]).transpose(0, 1)  # [S, B, L, k]
    if sequence_parallel and tp > 1:
        if seq % tp:
            raise ValueError(f"sequence length {seq} is not a multiple of TP={tp}")
        chunk = seq // tp
        per_pos = per_pos[tp_rank * chunk:(tp_rank + 1) * chunk]
    return per_pos.reshape(-1, *ids.shape[1:])


def cp_share_of_ids(layout, ids: torch.Tensor, rank: int) -> torch.Tensor:
    """``[T, L, k]`` routed-expert ids of the real packed tokens -> this CP rank's ``[T_pad /
    CP, L, k]``, split like the tokens (:class:`~megatron_tg.parallel.cp.CPLayout`). Pad tokens
    get experts ``0 .. k-1`` (distinct, as a router's top-k is); their outputs reach no loss."""
    k = ids.shape[-1]
    fill = torch.arange(k, dtype=ids.dtype, device=ids.device).expand(layout.padded_tokens, *ids.shape[1:]).clone()
    return layout.split(fill.index_copy(0, layout.pad_index.to(ids.device), ids), rank)


@contextlib.contextmanager
def replay_routing(model: torch.nn.Module, ids: torch.Tensor | None, layers: Sequence[int],
                   batch: int, seq: int) -> Iterator[None]:
    """Within the block, this model's routers replay ``ids`` (see the module docstring).

    ``ids`` is None: no replay (the block routes freely). Call :func:`replay_backward`
    before the backward of the same micro-batch, and :func:`clear_replay` after the step."""
    if ids is None:
        yield
        return
    from megatron.core import parallel_state as mps
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routers = moe_routers(model)
    if not routers:  # a pipeline stage of dense layers only: nothing routes here
        yield
        return
    if not replay_enabled(model):
        raise RuntimeError("routing replay needs the policy built with moe_enable_routing_replay "
                           "(rollout.routing_replay); this model's routers have no RouterReplay")
    gpt = unwrap(model)
    local = router_targets(ids, batch, seq, tp_rank=mps.get_tensor_model_parallel_rank(),
                           tp=mps.get_tensor_model_parallel_world_size(),
                           sequence_parallel=bool(gpt.config.sequence_parallel))
    slot = {layer: j for j, layer in enumerate(layers)}
    for layer, router in routers:
        if layer not in slot:
            raise ValueError(f"routed experts hold layers {list(layers)}, not MoE layer {layer}")
        replay = router.router_replay
        # No clearing here: under 1F1B the next micro-batch's forward runs before this one's
        # backward, and a recomputed backward pops the ids first-in first-out.
        replay.set_target_indices(local[:, slot[layer]].long().contiguous())
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield
    finally:
        for _, router in routers:
            router.router_replay.clear_router_replay_action()


def replay_backward(model: torch.nn.Module) -> None:
    """Before the backward: a recomputed forward replays the ids it was given in forward."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for _, router in moe_routers(model):
        if getattr(router, "router_replay", None) is not None and \
                router.router_replay.replay_backward_list:
            router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)


def clear_replay(model: torch.nn.Module) -> None:
    """After the step's backward: drop the ids (they would accumulate) and actions."""
    for _, router in moe_routers(model):
        replay = getattr(router, "router_replay", None)
        if replay is not None:
            replay.clear_indices()
            replay.clear_router_replay_action()
