"""Optimizers: megatron-core's (distributed or not) and a plain AdamW over DDP grad buffers.

:class:`MegatronOptimizer` is ``get_megatron_optimizer``: with
``parallel.use_distributed_optimizer`` megatron's ``DistributedOptimizer`` (ZeRO-1 over DDP's
grad buffers, the GPU recipes' choice), which also runs on CPU under gloo through the
optimizer patches of :mod:`megatron_tg.parallel.cpu_patches` (8, 9), so the tests run the
optimizer the GPU recipes use. Without it, on CPU, the trainer uses
:class:`CPUAdamW`: ``torch.optim.AdamW`` over the parameters, reading megatron DDP's
``main_grad`` buffers (already averaged over DP by ``finalize_model_grads``), with the same
global-norm clipping rule megatron applies:

    ||g||² = Σ_dense ||g_p||² (TP duplicates counted once, summed over TP x PP)
           + Σ_expert ||g_p||² (summed over the expert-model-parallel ranks: ETP x EP x PP)

With bf16 (or fp16) parameters it keeps fp32 master copies and steps those, then rounds
them into the model, as megatron's ``Float16OptimizerWithFloat16Params`` does: Adam on bf16
weights would lose any update smaller than half their spacing (at lr 3e-6, nearly all).
Both optimizers expose their fp32 main parameters as :class:`~megatron_tg.train.ema.MainShard`
ranges (``main_shards``), which the EMA expert averages.

CPUAdamW's checkpoint is sharded like the parameters it belongs to (megatron's
``optim_state_to_sharding_state``), so it reshards on load exactly like the model; the fp32
masters are saved with it (``master_param``), so a resumed bf16 run loses nothing. The
distributed optimizer saves in megatron's ``dp_reshardable`` format (what the checkpointer
asks for: :data:`megatron_tg.train.checkpoint.OPTIMIZER_METADATA`): its grad-buffer shards as
they are, resumable at another data-parallel size (not at another TP/PP layout).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from megatron_tg.train.ema import MainShard, equal_ranges


def _is_expert(p: torch.nn.Parameter) -> bool:
    # megatron marks expert weights allreduce=False when EP > 1 (see ParallelDims' etp rule).
    return not getattr(p, "allreduce", True)


def _counts_once(p: torch.nn.Parameter, tp_rank: int) -> bool:
    """A TP-replicated parameter (norms, router) contributes from TP rank 0 only."""
    return bool(getattr(p, "tensor_model_parallel", False)) or tp_rank == 0


def _dp_group(p: torch.nn.Parameter):
    """The ranks over which ``p``'s gradient is averaged: its main copy's sharding group."""
    from megatron.core import parallel_state as mps

    if _is_expert(p):
        return mps.get_expert_data_parallel_group()
    return mps.get_data_parallel_group(with_context_parallel=True)


@torch.no_grad()
def global_grad_norm(params: list[torch.nn.Parameter]) -> float:
    from megatron.core import parallel_state as mps

    tp_rank = mps.get_tensor_model_parallel_rank()
    # On the parameters' device: the sums are all-reduced over NCCL groups on GPU.
    device = params[0].device if params else torch.device("cpu")
    dense = torch.zeros((), dtype=torch.float64, device=device)
    expert = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        g = p.main_grad if getattr(p, "main_grad", None) is not None else p.grad
        if g is None:
            continue
        sq = g.detach().double().pow(2).sum()
        if _is_expert(p):
            expert += sq
        elif _counts_once(p, tp_rank):
            dense += sq
    if dist.is_initialized():
        dist.all_reduce(dense, group=mps.get_model_parallel_group())
        dist.all_reduce(expert, group=mps.get_expert_tensor_model_pipeline_parallel_group())
    return math.sqrt(float(dense + expert))


class _LearningRate:
    """The learning rate both optimizers expose, read from and written to every param group
    of the torch optimizer they wrap (``self.opt``), as the scheduler sets it each step."""

    opt: Any

    @property
    def lr(self) -> float:
        return self.opt.param_groups[0]["lr"]

    @lr.setter
    def lr(self, value: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = value


class CPUAdamW(_LearningRate):
    """AdamW on megatron DDP's ``main_grad`` with global-norm clipping (CPU path)."""

    def __init__(self, model: torch.nn.Module, *, lr: float, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 grad_clip: float = 1.0) -> None:
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.grad_clip = grad_clip
        # fp32 masters for low-precision parameters (fp32 parameters are their own).
        self.main = [p if p.dtype == torch.float32 else p.detach().float().clone()
                     for p in self.params]
        self.opt = torch.optim.AdamW(self.main, lr=lr, betas=betas, eps=eps,
                                     weight_decay=weight_decay)
        self.num_steps = 0

    def main_shards(self) -> list[MainShard]:
        """Equal contiguous ranges of each fp32 master over its DP group (see
        :mod:`megatron_tg.train.ema`): the layout megatron's distributed optimizer would give."""
        out = []
        for p, m in zip(self.params, self.main):
            group = _dp_group(p) if dist.is_initialized() else None
            rank, size = (dist.get_rank(group), dist.get_world_size(group)) if group else (0, 1)
            a, b = equal_ranges(p.numel(), rank, size)
            out.append(MainShard(param=p, main=m.detach().view(-1)[a:b], start=a, group=group))
        return out

    def zero_grad(self) -> None:
        zero = getattr(self.model, "zero_grad_buffer", None)
        if zero is not None:
            zero()
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> dict[str, float]:
        """One update from the current ``main_grad``s; returns the grad norm (pre-clip)."""
        norm = global_grad_norm(self.params)
        if not math.isfinite(norm):
            # Skip the update, as megatron does on overflow: one bad batch must not poison
            # the weights (the caller logs it).
            self.zero_grad()
            return {"grad_norm": norm, "skipped": 1.0}
        scale = min(1.0, self.grad_clip / (norm + 1e-6)) if self.grad_clip > 0 else 1.0
        for p, m in zip(self.params, self.main):
            g = p.main_grad if getattr(p, "main_grad", None) is not None else p.grad
            m.grad = (g * scale).to(m.dtype) if g is not None else None
        self.opt.step()
        self.num_steps += 1
        for p, m in zip(self.params, self.main):
            m.grad = None
            if m is not p:
                p.copy_(m)  # round the updated master into the model's dtype
        return {"grad_norm": norm, "skipped": 0.0}

    def _init_state(self) -> None:
        """Materialise AdamW's state so a checkpoint can be loaded into it before any step."""
        for group in self.opt.param_groups:
            for p in group["params"]:
                st = self.opt.state[p]
                if not st:
                    st["step"] = torch.zeros((), dtype=torch.float32)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False,
                           metadata: dict | None = None) -> dict[str, Any]:
        """Sharded like the model's parameters; ``is_loading``/``metadata`` are megatron's
        optimizer arguments, which this format does not need."""
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            optim_state_to_sharding_state,
        )

        self._init_state()
        state = self.opt.state_dict()
        # One step counter for all params (they always step together), kept unsharded.
        steps = {int(s["step"]) for s in state["state"].values()}
        state["common_step"] = max(steps) if steps else 0
        state["num_steps"] = self.num_steps
        for i, (p, m) in enumerate(zip(self.params, self.main)):
            if m is not p:  # sharded like the parameter, with the Adam moments
                state["state"][i]["master_param"] = m.detach()
        id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, self.params)
        optim_state_to_sharding_state(state, id_map, exclude_keys=("step",))
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        step = state.pop("common_step")
        self.num_steps = int(state.pop("num_steps"))
        for i, param_state in state["state"].items():
            param_state["step"] = torch.tensor(float(step))
            master = param_state.pop("master_param", None)
            m, p = self.main[int(i)], self.params[int(i)]
            if m is not p:
                # Without a saved master (a checkpoint of an fp32 run) the model's weight,
                # already loaded, is the best one left.
                m.copy_(master if master is not None else p)
        self.opt.load_state_dict(state)


def _main_param(opt, model_param: torch.nn.Parameter) -> torch.Tensor:
    """The distributed optimizer's fp32 main shard of ``model_param``, read from its param
    groups without touching ``opt.optimizer.state``.

    megatron's ``_get_main_param_and_optimizer_states`` reads ``optimizer.state[main]``, which
    for a torch optimizer (a defaultdict) creates an empty entry. Before a load that is what
    loses Adam's moments: ``DistributedOptimizer.load_state_dict`` allocates the moments to
    load into only while the state is empty, so it then loads ``param`` alone, and FusedAdam's
    first step initialises empty entries to zeros (tests/train/test_fused_adam_resume.py)."""
    if opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
        # The master copy then lives in the optimizer's state (FusedAdam master_weights).
        raise ValueError("the EMA expert reads the distributed optimizer's main parameters, "
                         "which use_precision_aware_optimizer keeps inside the optimizer state; "
                         "use objective.expert=shared/frozen or turn it off")
    group_index, group_order = opt.model_param_group_index_map[model_param]
    return opt.optimizer.param_groups[group_index]["params"][group_order]


def _drop_empty_states(opt) -> int:
    """Remove empty per-parameter entries from a distributed optimizer's inner state (what a
    read of ``state[p]`` leaves), so that megatron allocates every moment before a load
    instead of loading into nothing. Returns how many were dropped."""
    state = opt.optimizer.state
    empty = [k for k, v in state.items() if not v]
    for k in empty:
        del state[k]
    return len(empty)


class MegatronOptimizer(_LearningRate):
    """megatron-core's optimizer (distributed when ``use_distributed_optimizer``).

    It owns the fp32 master weights, reads DDP's grad buffers, clips with the same rule as
    :func:`global_grad_norm`, and shards its own checkpoint. Exposes the same small surface
    as :class:`CPUAdamW` so the trainer does not branch.
    """

    def __init__(self, model: torch.nn.Module, cfg, *, distributed: bool, bf16: bool) -> None:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.model = model
        self.opt = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=cfg.lr, weight_decay=cfg.weight_decay,
                            adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2,
                            adam_eps=cfg.eps, clip_grad=cfg.grad_clip, bf16=bf16,
                            params_dtype=torch.bfloat16 if bf16 else torch.float32,
                            use_distributed_optimizer=distributed),
            [model])
        self.num_steps = 0

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.opt.zero_grad()

    def main_shards(self) -> list[MainShard]:
        """The fp32 main parameters as megatron holds them: with the distributed optimizer,
        each DP rank's range of every parameter (``_get_model_param_range_map``) and its
        main shard (``_get_main_param_and_optimizer_states``) over the optimizer's
        ``data_parallel_group``; otherwise whole masters, split equally like CPUAdamW's."""
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        out: list[MainShard] = []
        for opt in getattr(self.opt, "chained_optimizers", [self.opt]):
            if isinstance(opt, DistributedOptimizer):
                # Every parameter of its grad buffers, in the buffers' order (the same on every
                # rank, so the EMA's per-parameter gathers pair up); a parameter wholly owned
                # by other ranks has an empty range here.
                for buf in opt.buffers:
                    for p in buf.params:
                        if p in opt.model_param_group_index_map:
                            r = opt._get_model_param_range_map(p)["param"]
                            main, start = _main_param(opt, p).view(-1), r.start
                        else:
                            main, start = torch.empty(0, device=p.device), 0
                        out.append(MainShard(param=p, main=main, start=start,
                                             group=opt.data_parallel_group))
                continue
            if hasattr(opt, "float16_groups"):  # Float16OptimizerWithFloat16Params
                pairs = list(zip(opt.float16_groups, opt.fp32_from_float16_groups))
                pairs += [(g, g) for g in opt.fp32_from_fp32_groups]
            else:  # FP32Optimizer: the parameters are the main copies
                pairs = [(g["params"], g["params"]) for g in opt.param_groups]
            for params, mains in pairs:
                for p, m in zip(params, mains):
                    group = _dp_group(p)
                    a, b = equal_ranges(p.numel(), dist.get_rank(group),
                                        dist.get_world_size(group))
                    out.append(MainShard(param=p, main=m.detach().view(-1)[a:b], start=a,
                                         group=group))
        return out

    def step(self) -> dict[str, float]:
        """megatron's step: clip to ``grad_clip`` by the global norm, update; returns megatron's
        grad norm (pre-clip), the number the loop logs."""
        ok, norm, _ = self.opt.step()
        self.num_steps += int(bool(ok))
        return {"grad_norm": float(norm if norm is not None else float("nan")),
                "skipped": 0.0 if ok else 1.0}

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False,
                           metadata: dict | None = None) -> dict[str, Any]:
        """megatron's sharded optimizer state. The distributed optimizer's format is chosen by
        ``metadata["distrib_optim_sharding_type"]``: megatron-core 0.16.1 defaults to
        ``fully_sharded_model_space``, whose save raises ``ShardedTensor.flattened_range is not
        supported``, so the checkpointer passes ``dp_reshardable``. ``is_loading`` lets megatron
        allocate the Adam state it is about to load into."""
        if is_loading:
            from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

            for opt in getattr(self.opt, "chained_optimizers", [self.opt]):
                if isinstance(opt, DistributedOptimizer):
                    _drop_empty_states(opt)
            self._materialise_torch_adam_state()
        state = self.opt.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading,
                                            metadata=metadata)
        state["num_steps"] = self.num_steps
        state["layout"] = _model_layout()
        return state

    def _materialise_torch_adam_state(self) -> None:
        """Give a fresh distributed optimizer's inner ``torch.optim.AdamW`` its state.

        Without Transformer Engine or apex (the CPU), megatron's optimizer is torch's AdamW,
        and ``DistributedOptimizer.state_dict`` reads the step counter from its per-parameter
        state, which does not exist before the first step: loading a checkpoint into a new
        optimizer would fail on ``assert len(steps) == 1``. megatron's own initialiser (a zero
        gradient step) creates it; the load then overwrites the main parameters, moments and
        step. TE's FusedAdam keeps its step in the param groups and needs none of this."""
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        for opt in getattr(self.opt, "chained_optimizers", [self.opt]):
            if (isinstance(opt, DistributedOptimizer)
                    and isinstance(opt.optimizer, torch.optim.AdamW)
                    and not any("step" in st for st in opt.optimizer.state.values())):
                opt._init_optimizer_states_with_dummy_values()

    def check_resumable(self, saved: dict[str, Any], where: str) -> None:
        """Refuse, naming both layouts, a distributed-optimizer checkpoint saved at another
        model layout: ``dp_reshardable`` shards are grad-buffer ranges, which only a change of
        DP size can remap (megatron would fail with a shape mismatch or a missing key).
        ``saved`` is the optimizer's common (unsharded) checkpoint state."""
        layout, now = saved.get("layout"), _model_layout()
        if layout is not None and layout != now:
            fmt = lambda d: ", ".join(f"{k}={v}" for k, v in d.items())  # noqa: E731
            raise ValueError(
                f"{where}: the distributed optimizer's state was saved at {fmt(layout)} and "
                f"this run has {fmt(now)}; its dp_reshardable format resumes at another "
                f"data-parallel size only (same tp/pp/ep/etp)")

    @torch.no_grad()  # fp32 parameters' main shards are views of them: an in-place copy
    def load_state_dict(self, state: dict[str, Any]) -> None:
        state.pop("layout", None)
        self.num_steps = int(state.pop("num_steps"))
        self.opt.load_state_dict(state)
        self._restore_torch_adam_steps()

    def _restore_torch_adam_steps(self) -> None:
        """Per-parameter step counters of the inner ``torch.optim.AdamW`` after a load.

        megatron-core 0.16.1's ``DistributedOptimizer.load_state_dict`` (torch-AdamW branch)
        gives every parameter one shared step tensor, and the ``dp_reshardable`` load then
        copies the pre-load local step (a non-persistent entry) into it: measured, 41
        parameters resumed from a step-2 checkpoint shared one counter reading 1.0, so Adam's
        bias correction was wrong and every step advanced it once per parameter. The step
        the checkpoint saved is in the loaded param groups (megatron writes it there);
        each parameter gets its own counter with that value."""
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        for opt in getattr(self.opt, "chained_optimizers", [self.opt]):
            if not (isinstance(opt, DistributedOptimizer)
                    and isinstance(opt.optimizer, torch.optim.AdamW)):
                continue
            for group in opt.optimizer.param_groups:
                for p in group["params"]:
                    st = opt.optimizer.state.get(p)
                    if st and "step" in group:
                        st["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)


def _model_layout() -> dict[str, int]:
    """The model-parallel sizes a distributed-optimizer checkpoint is tied to."""
    from megatron.core import parallel_state as mps

    return {"tp": mps.get_tensor_model_parallel_world_size(),
            "pp": mps.get_pipeline_model_parallel_world_size(),
            "ep": mps.get_expert_model_parallel_world_size(),
            "etp": mps.get_expert_tensor_parallel_world_size()}


def build_optimizer(model: torch.nn.Module, cfg, *, distributed: bool = False,
                    bf16: bool = False):
    """AdamW for ``model`` (megatron DDP, built with the same ``use_distributed_optimizer``)
    from an ``OptimizerConfig``: megatron's on GPU and, on either device, megatron's
    distributed optimizer when ``distributed``; :class:`CPUAdamW` on CPU otherwise."""
    ddp_distributed = getattr(getattr(model, "ddp_config", None), "use_distributed_optimizer",
                              distributed)
    if ddp_distributed != distributed:
        raise ValueError(f"the optimizer's use_distributed_optimizer={distributed} differs from "
                         f"the DistributedDataParallel model's ({ddp_distributed}): megatron's "
                         f"distributed optimizer needs DDP's sharded grad buffers")
    if distributed or torch.cuda.is_available():
        return MegatronOptimizer(model, cfg, distributed=distributed, bf16=bf16)
    return CPUAdamW(model, lr=cfg.lr, weight_decay=cfg.weight_decay,
                    betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.eps, grad_clip=cfg.grad_clip)
