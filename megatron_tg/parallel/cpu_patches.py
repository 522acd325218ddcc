"""Make megatron-core's local (non-Transformer-Engine) model code run on CPU under gloo.

Applied only when no CUDA device is present (tests and the CPU demo); on GPU this module
is never imported by the training path. Each patch replaces exactly one CUDA-only
assumption and leaves the parallel logic (TP/EP collectives, vocab-parallel ops, MoE
token dispatch, distributed checkpointing) untouched, so the CPU tests exercise the same
code the cluster runs. Measured on megatron-core 0.16.1 and 0.19.2.

1. ``torch.cuda.current_device()`` is used as an *allocation device* at ~40 sites
   (tensor_parallel.mappings/layers, rotary embeddings, the MoE router, gpt_model, the DDP
   grad buffers). We make it return the CPU device (a ``torch.device``, which the NCCL-rules
   test policy, :mod:`megatron_tg.testing.nccl_rules`, reads as the accelerator) so those
   allocations land on the CPU.
2. ``torch.cuda.synchronize`` is called around torch_dist checkpoint saves: a no-op here.
   0.19.x's DDP grad sync asks for ``torch.cuda.current_stream()`` to wait on CUDA-graph
   events; on CPU there is one implicit stream, so a null stream (every wait a no-op)
   and a null ``torch.cuda.stream`` context stand in.
3. The CUDA RNG tracker (``tensor_parallel.random``) stores CUDA generator states; a
   subclass keeps CPU generator states instead and forks the CPU RNG. Dropout in TP
   regions therefore still draws from per-TP-rank streams, as on GPU.
4. ``transformer.utils.get_default_causal_mask`` / ``get_sliding_window_causal_mask``
   build masks with ``device="cuda"``; replaced by CPU versions (same shapes, same cache).
   Only megatron's plain (unpacked) causal path reaches them (conversion parity). Training
   and the weight-sync probe run packed rows in THD form, whose CPU core attention
   (``models/qwen3_moe/attention.py``) builds no mask.
5. The alltoall MoE dispatcher moves split sizes to the host on a side CUDA stream and
   syncs with an event. On CPU the tensors are already on the host; we convert them to
   numpy exactly as the GPU path does (``all_to_all_single`` wants host split sizes) and
   skip the streams.
6. gloo has no all-gather / reduce-scatter with *uneven* sizes, which the MoE dispatcher
   uses when experts are tensor-parallel (etp > 1). The uneven branch of
   ``tensor_parallel.mappings._gather_along_first_dim`` / ``_reduce_scatter_along_first_dim``
   is replaced by pad-to-max + the even collective + trim; the even branch is untouched.
7. megatron-core 0.16.1 leaves ``moe_utils.te_general_gemm`` unbound when TE is absent,
   so every router forward raises NameError; we bind it to ``None`` (the torch fallback).

The optimizer (``get_megatron_optimizer``, distributed or not) needs two more, so that the
CPU tests run the optimizer the GPU recipes use:

8. Literal ``device="cuda"`` allocations: the optimizers' found-inf / overflow / unit-scale
   scalars (``optimizer.optimizer``), the grad scaler's scalars (``optimizer.grad_scaler``),
   the grad-norm and zero-count accumulators (``optimizer.clip_grads``) and the l2-norm of the
   non-apex multi-tensor fallback (``core.utils.local_multi_tensor_l2_norm``). Each of those
   modules gets its own view of ``torch`` (:class:`_CPUFactories`) whose factory functions
   map ``device="cuda"`` to the CPU; every other name is torch's own. Only calls that would
   raise on a CPU-only torch change. (``distrib_optimizer`` allocates through
   ``torch.cuda.current_device()``, already covered by 1; its ``.cuda()`` calls sit on the
   legacy non-gloo gather path, which the ``dp_reshardable`` checkpoint does not use.)
9. Precision is read from CUDA type names: ``param.type() == "torch.cuda.FloatTensor"``
   (or ``...BFloat16Tensor`` / ``HalfTensor``) picks the fp32-master branch in
   ``DistributedOptimizer.__init__`` (and its ``_build_model_and_main_param_groups``),
   ``Float16OptimizerWithFloat16Params.__init__``, and an assert in
   ``clip_grad_by_total_norm_fp32``; a CPU tensor says ``"torch.FloatTensor"`` and is refused
   as an unknown type. For the duration of exactly those calls (:func:`_cuda_type_names`),
   ``Tensor.type()`` without arguments answers the CUDA name of a CPU tensor's type; the
   converting form ``t.type(dtype)`` is untouched.

The pipeline schedules need one more:

10. ``pipeline_parallel/schedules.py`` allocates its token counter with a literal
    ``device="cuda"`` (``total_num_tokens`` in every schedule, PP = 1 included). That module's
    ``torch`` name is pointed at a proxy of torch whose factory functions map ``"cuda"`` to
    the CPU; every other attribute is torch's own. ``p2p_communication.py`` needs nothing
    more: it allocates on ``torch.cuda.current_device()`` (1) and its
    ``torch.cuda.synchronize()`` after ``batch_isend_irecv`` is the no-op of (2).

Everything is idempotent; :func:`apply_cpu_patches` returns the list of patches applied.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch

log = logging.getLogger(__name__)
_APPLIED: list[str] = []


def cuda_available() -> bool:
    return torch.cuda.is_available()


def apply_cpu_patches() -> list[str]:
    """Apply every patch once (no-op when CUDA is available). Returns what was patched."""
    if cuda_available():
        return []
    if _APPLIED:
        return list(_APPLIED)
    _patch_torch_cuda()
    _patch_rng_tracker()
    _patch_causal_masks()
    _patch_uneven_collectives()
    _patch_moe()
    _patch_optimizer()
    _patch_schedules()
    log.debug("megatron CPU patches applied: %s", _APPLIED)
    return list(_APPLIED)


class _NullStream:
    """The CPU's single implicit stream: ordering is program order, so waits are no-ops."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def record_event(self, event=None):
        return None

    def synchronize(self) -> None:
        pass


def _patch_torch_cuda() -> None:
    # (1) allocation device; (2) synchronize around checkpoint saves, streams in DDP.
    torch.cuda.current_device = lambda: _CPU  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.current_stream = lambda *a, **k: _NullStream()  # type: ignore[assignment]
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]
    _APPLIED.extend(["torch.cuda.current_device->cpu", "torch.cuda.synchronize->noop",
                     "torch.cuda.current_stream/stream->null"])


class CPURNGStatesTracker:
    """Drop-in for megatron's ``CudaRNGStatesTracker`` that tracks CPU generator states.

    ``fork(name)`` swaps the global CPU RNG state for the named one and restores it after,
    which is what the CUDA tracker does with the device generator.
    """

    def __init__(self, *args, **kwargs) -> None:
        self.reset()
        self.use_cudagraphable_rng = False
        self.is_inference_rng_tracker = False

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise RuntimeError(f"seed {seed} already exists")
        if name in self.states_:
            raise RuntimeError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise RuntimeError(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def _patch_rng_tracker() -> None:
    # (3) megatron calls torch.cuda.manual_seed / get_rng_state on the default tracker.
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._CUDA_RNG_STATE_TRACKER = CPURNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # model_parallel_cuda_manual_seed calls these directly on the device generator.
    torch.cuda.manual_seed = lambda seed: None  # type: ignore[assignment]
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    _APPLIED.append("tensor_parallel.random tracker->CPURNGStatesTracker")


def _patch_causal_masks() -> None:
    # (4) same semantics as megatron's, allocated on CPU; cached like the originals.
    from megatron.core.transformer import utils as tutils

    @functools.lru_cache(maxsize=32)
    def default_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq), diagonal=1).bool()

    @functools.lru_cache(maxsize=32)
    def sliding_window_causal_mask(sq: int, skv: int, window_size) -> torch.Tensor:
        m = torch.ones(sq, skv, dtype=torch.bool)
        left, right = window_size
        return ~(torch.triu(m, diagonal=-left) & torch.tril(m, diagonal=right))

    tutils.get_default_causal_mask = default_causal_mask
    tutils.get_sliding_window_causal_mask = sliding_window_causal_mask
    try:  # the fused-softmax module imported them by name
        from megatron.core.fusions import fused_softmax

        fused_softmax.get_default_causal_mask = default_causal_mask
        fused_softmax.get_sliding_window_causal_mask = sliding_window_causal_mask
    except ImportError:  # pragma: no cover - older layouts
        pass
    _APPLIED.append("transformer.utils causal masks->cpu")


def _patch_uneven_collectives() -> None:
    # (6) pad-to-max implementations of the uneven branches.
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    orig_gather = mappings._gather_along_first_dim
    orig_rs = mappings._reduce_scatter_along_first_dim

    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return orig_gather(input_, group, output_split_sizes, use_global_buffer)
        width = max(output_split_sizes)
        padded = input_.new_zeros((width, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        out = input_.new_empty((width * group.size(), *input_.shape[1:]))
        dist.all_gather_into_tensor(out, padded.contiguous(), group=group)
        pieces = [out[r * width: r * width + n] for r, n in enumerate(output_split_sizes)]
        return torch.cat(pieces, dim=0)

    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return orig_rs(input_, group, input_split_sizes, use_global_buffer)
        width = max(input_split_sizes)
        padded = input_.new_zeros((width * group.size(), *input_.shape[1:]))
        for r, chunk in enumerate(torch.split(input_, list(input_split_sizes), dim=0)):
            padded[r * width: r * width + chunk.shape[0]] = chunk
        out = input_.new_empty((width, *input_.shape[1:]))
        dist.reduce_scatter_tensor(out, padded.contiguous(), group=group)
        return out[: input_split_sizes[group.rank()]].clone()

    mappings._gather_along_first_dim = gather
    mappings._reduce_scatter_along_first_dim = reduce_scatter
    _APPLIED.append("tensor_parallel.mappings uneven gather/reduce-scatter->padded")


def _patch_moe() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    # (7) unbound name in 0.16.1 without TE; the code checks `is not None`.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
        _APPLIED.append("moe_utils.te_general_gemm=None")

    # (5) host split sizes without CUDA streams/events.
    cls = token_dispatcher.MoEAlltoAllTokenDispatcher
    cls.cuda_dtoh_stream = object()  # non-None so __init__ does not create a CUDA stream

    def _host(t):
        return t.numpy() if torch.is_tensor(t) else t

    def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            self.input_splits = _host(self.input_splits)
            self.output_splits = _host(self.output_splits)
            self.output_splits_tp = _host(self.output_splits_tp)
        return tokens_per_expert

    cls._maybe_dtoh_and_synchronize = _maybe_dtoh_and_synchronize
    _APPLIED.append("MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize->host numpy")


# ---- (8), (9): megatron's optimizer ------------------------------------------------------
_FACTORIES = ("tensor", "zeros", "ones", "empty", "full")


_CPU = torch.device("cpu")


def _host_device(device):
    return _CPU if device is not None and torch.device(device).type == "cuda" else device


class _CPUFactories:
    """``torch`` as one megatron module sees it: ``torch.tensor/zeros/ones/empty/full`` with
    ``device="cuda"`` allocate on the CPU; every other attribute is torch's."""

    def __getattr__(self, name: str):
        attr = getattr(torch, name)
        if name not in _FACTORIES:
            return attr

        @functools.wraps(attr)
        def factory(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _host_device(kwargs["device"])
            return attr(*args, **kwargs)

        return factory


_TENSOR_TYPE = torch.Tensor.type


def _type_with_cuda_names(self, dtype=None, non_blocking=False, **kwargs):
    if dtype is None and not kwargs and self.device.type == "cpu":
        name = _TENSOR_TYPE(self)
        # A TorchFunctionMode (the NCCL-rules test policy) may route the inner call back here.
        return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
    return _TENSOR_TYPE(self, dtype, non_blocking, **kwargs)


@contextlib.contextmanager
def _cuda_type_names_ctx():
    prev = torch.Tensor.type
    torch.Tensor.type = _type_with_cuda_names  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.type = prev  # type: ignore[method-assign]


def _cuda_type_names(fn):
    """``fn`` run with CPU tensors reporting CUDA type names (patch 9)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _cuda_type_names_ctx():
            return fn(*args, **kwargs)

    return wrapper


def _patch_optimizer() -> None:
    from megatron.core import utils as core_utils
    from megatron.core.optimizer import clip_grads, distrib_optimizer, grad_scaler
    from megatron.core.optimizer import optimizer as moptimizer

    # (8) per-module torch views for the literal device="cuda" sites.
    for mod in (moptimizer, grad_scaler, clip_grads, core_utils):
        mod.torch = _CPUFactories()
    # (9) the three places that read CUDA type names. clip_grad_by_total_norm_fp32 is called
    # through optimizer.py's own binding of the name, so that is the one replaced.
    dopt = distrib_optimizer.DistributedOptimizer
    dopt.__init__ = _cuda_type_names(dopt.__init__)
    f16 = moptimizer.Float16OptimizerWithFloat16Params
    f16.__init__ = _cuda_type_names(f16.__init__)
    moptimizer.clip_grad_by_total_norm_fp32 = _cuda_type_names(
        clip_grads.clip_grad_by_total_norm_fp32)
    _APPLIED.extend(["optimizer/grad_scaler/clip_grads/utils device='cuda'->cpu",
                     "optimizer Tensor.type() CUDA names in DistributedOptimizer/"
                     "Float16Optimizer __init__ and clip_grad_by_total_norm_fp32"])


# ---- (10): the pipeline schedules ---------------------------------------------------------
def _patch_schedules() -> None:
    # (10) the schedules' literal device="cuda" allocations.
    from megatron.core.pipeline_parallel import schedules

    if not isinstance(schedules.torch, _CPUFactories):
        schedules.torch = _CPUFactories()
    _APPLIED.append("pipeline_parallel.schedules torch factories device=cuda->cpu")
