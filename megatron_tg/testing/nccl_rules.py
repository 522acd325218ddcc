"""NCCL's rules on CPU: a test policy under which a gloo run fails where NCCL would fail.

On GPU every process group of the trainer is NCCL except megatron's explicit gloo twins;
NCCL moves CUDA memory only. On CPU every group is gloo, which accepts any CPU tensor, so a
receive buffer allocated with ``torch.empty(shape)`` (the host, on every run) passes every CPU
test and fails a GPU job at first contact ("No backend type associated with device type
cpu"). Under this policy (:func:`enable`, in each rank's process) the CPU stands in for the
accelerator and three of NCCL's rules are enforced at every ``torch.distributed`` call:

1. **Device.** Each tensor records where its buffer was *requested* (:class:`Placement`, a
   ``TorchFunctionMode``). A buffer is on the host when it comes from a factory given no
   device (torch's default device is the CPU on every run), from a factory given the device
   as the string ``"cpu"``, from ``Tensor.cpu()``/``.to("cpu")``/``pin_memory()``, or when it
   is computed only from host tensors. Everything else is on the accelerator: model
   parameters, megatron's buffers (``torch.cuda.current_device()``), and any buffer
   allocated on a ``torch.device`` taken from a tensor or the parallel context (what is
   ``cuda:N`` on GPU). ``.cpu()`` of an accelerator tensor and ``.to(device)`` of a host one
   return copies, as on GPU. A host tensor in a collective of a group that is NCCL on GPU
   raises :class:`NCCLRuleError` naming the call, the group and the tensor.
2. **Layout and dtype.** Dense, contiguous tensors only, of a dtype NCCL carries (torch's
   ``ncclDataType`` map: no int16/uint16/uint32/uint64); no bitwise reductions, no AVG of
   bool.
3. **Backend of every group.** A group is NCCL on GPU unless it was made with an explicit
   ``backend="gloo"`` (megatron's ``*_gloo`` twins), whose collectives keep gloo's rules. The
   weight-update group (trainer rank 0 and the engine GPUs; gloo to the CPU engines of the
   tests) is NCCL with SGLang engines: its trainer-side broadcasts are checked too.

Limits (what this cannot see): a buffer that is written ``torch.device("cpu")`` literally is
taken for the accelerator (host buffers are written ``"cpu"`` or ``.cpu()`` in this code
base); tensors made by C++ without a Python call (``torch.load``, autograd) count as the
accelerator; ops in threads other than the one that enabled the policy are not tracked
(their tensors count as the accelerator), though their collectives are still checked; the
``*_object`` collectives are not checked (torch allocates their buffers on the group's
device itself). Mixed-device arithmetic, which CUDA refuses, is not enforced.

Tests opt in per run: ``run_distributed(..., comm_rules="nccl")`` or the environment
variable :data:`ENV` (``nccl`` or ``gloo``) that the ``comm_rules`` test fixture sets.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

ENV = "MEGATRON_TG_COMM_RULES"
RULES = ("gloo", "nccl")
_HOST_ATTR = "_tg_host_buffer"

# torch's ncclDataType map (ProcessGroupNCCL / NCCLUtils.hpp), bool and fp8 as uint8.
NCCL_DTYPES = frozenset({
    torch.int8, torch.uint8, torch.bool, torch.int32, torch.int64, torch.float16, torch.bfloat16,
    torch.float32, torch.float64, torch.float8_e5m2, torch.float8_e4m3fn, torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
    # complex tensors are viewed as real by torch.distributed before they reach the backend
    torch.complex64, torch.complex128,
})


class NCCLRuleError(RuntimeError):
    """A collective that NCCL would refuse on GPU."""


def is_host(t: torch.Tensor) -> bool:
    """Whether ``t``'s buffer was requested on the host (see rule 1)."""
    return bool(getattr(t, _HOST_ATTR, False))


def _mark(t: torch.Tensor, host: bool) -> torch.Tensor:
    if host:
        setattr(t, _HOST_ATTR, True)
    elif getattr(t, _HOST_ATTR, False):
        delattr(t, _HOST_ATTR)
    return t


def _device_is_host(device) -> bool | None:
    """Rule 1 for a requested device: None for no request."""
    if device is None:
        return None
    if isinstance(device, str):
        return device.split(":")[0] in ("cpu", "meta")
    if isinstance(device, torch.device):
        return device.type == "meta"  # a device object stands for the accelerator
    return False  # an int is a CUDA ordinal


def _tensors(args: Iterable) -> Iterable[torch.Tensor]:
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    yield b


_T = torch.Tensor
_MOVES = {_T.to, _T.cpu, _T.pin_memory, _T.type_as}


def _to_target(args, kwargs) -> bool | None:
    """Whether ``Tensor.to(*args, **kwargs)`` targets the host (None: only a dtype)."""
    if "device" in kwargs:
        return _device_is_host(kwargs["device"])
    for a in args[1:]:
        if isinstance(a, torch.Tensor):
            return is_host(a)
        if isinstance(a, (str, torch.device, int)) and not isinstance(a, bool):
            return _device_is_host(a)
    return None


class Placement(TorchFunctionMode):
    """Records, per tensor, whether its buffer was requested on the host (rule 1)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MOVES:
            return self._move(func, args, kwargs)
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            outs = (out,)
        elif isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
            outs = out
        else:
            return out
        inputs = list(_tensors(args)) + list(_tensors(kwargs.values()))
        host = _device_is_host(kwargs.get("device"))
        if host is None:  # no device asked: inherit, or torch's default device (the host)
            host = all(is_host(t) for t in inputs) if inputs else (
                torch.get_default_device().type == "cpu")
        ids = {id(t) for t in inputs}
        for t in outs:
            if isinstance(t, torch.Tensor) and id(t) not in ids \
                    and not isinstance(t, torch.nn.Parameter):
                _mark(t, host)
        return out

    @staticmethod
    def _move(func, args, kwargs):
        src = args[0]
        if func is _T.cpu or func is _T.pin_memory:
            target = True
        elif func is _T.type_as:
            target = is_host(args[1])
        else:
            target = _to_target(args, kwargs)
        out = func(*args, **kwargs)
        if target is None:
            target = is_host(src)
        elif target != is_host(src) and out is src:
            out = out.clone()  # a move between host and device copies on GPU
        return _mark(out, target) if out is not src else out


# ---- the collectives -------------------------------------------------------------------
_GLOO_GROUPS: set[int] = set()
"""ids of groups made with an explicit backend="gloo" (gloo on GPU too)."""


def _gloo_on_gpu(group) -> bool:
    return group is not None and id(group) in _GLOO_GROUPS


def _group_name(group) -> str:
    if group is None or group is dist.GroupMember.WORLD:
        return "the default group"
    try:
        return f"the group of ranks {dist.get_process_group_ranks(group)}"
    except Exception:  # a group torch does not register (the weight-update group's handle)
        return "a group"


def check_tensor(op: str, t: torch.Tensor, group, what: str = "tensor") -> None:
    """NCCL's rules for one tensor of ``op`` on ``group`` (no-op on a gloo group)."""
    if _gloo_on_gpu(group):
        return
    where = f"{op} on {_group_name(group)}"
    if is_host(t):
        raise NCCLRuleError(
            f"{where}: {what} {tuple(t.shape)} {t.dtype} is a host (CPU) buffer; this group is "
            "NCCL on GPU, which refuses CPU tensors (\"No backend type associated with device "
            "type cpu\"): allocate it on the device (device=the parallel context's or a "
            "parameter's device)")
    if t.layout != torch.strided:
        raise NCCLRuleError(f"{where}: {what} has layout {t.layout}; NCCL needs dense tensors")
    if not t.is_contiguous():
        raise NCCLRuleError(f"{where}: {what} {tuple(t.shape)} is not contiguous; NCCL refuses "
                            "it (\"Tensors must be contiguous\")")
    if t.dtype not in NCCL_DTYPES:
        raise NCCLRuleError(f"{where}: {what} has dtype {t.dtype}, which NCCL does not carry "
                            "(\"Input tensor data type is not supported for NCCL process group\")")


def _check_op(op: str, reduce_op, t: torch.Tensor, group) -> None:
    if reduce_op is None or _gloo_on_gpu(group):
        return
    if reduce_op in (dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR):
        raise NCCLRuleError(f"{op} on {_group_name(group)}: ReduceOp {reduce_op} does not exist in NCCL")
    if reduce_op == dist.ReduceOp.AVG and t.dtype == torch.bool:
        raise NCCLRuleError(f"{op} on {_group_name(group)}: NCCL has no ReduceOp.AVG of bool tensors")


def _arg(args, kwargs, i: int, name: str, default=None):
    return args[i] if len(args) > i else kwargs.get(name, default)


# op -> (positions/names of its tensor arguments, position/name of its group, of its op)
_SPECS: dict[str, tuple[tuple[tuple[int, str], ...], tuple[int, str], tuple[int, str] | None]] = {
    "broadcast": (((0, "tensor"),), (2, "group"), None),
    "all_reduce": (((0, "tensor"),), (2, "group"), (1, "op")),
    "reduce": (((0, "tensor"),), (3, "group"), (2, "op")),
    "all_gather": (((0, "tensor_list"), (1, "tensor")), (2, "group"), None),
    "all_gather_into_tensor": (((0, "output_tensor"), (1, "input_tensor")), (2, "group"), None),
    "reduce_scatter": (((0, "output"), (1, "input_list")), (3, "group"), (2, "op")),
    "reduce_scatter_tensor": (((0, "output"), (1, "input")), (3, "group"), (2, "op")),
    "all_to_all": (((0, "output_tensor_list"), (1, "input_tensor_list")), (2, "group"), None),
    "all_to_all_single": (((0, "output"), (1, "input")), (4, "group"), None),
    "send": (((0, "tensor"),), (2, "group"), None),
    "recv": (((0, "tensor"),), (2, "group"), None),
    "isend": (((0, "tensor"),), (2, "group"), None),
    "irecv": (((0, "tensor"),), (2, "group"), None),
    "gather": (((0, "tensor"), (1, "gather_list")), (3, "group"), None),
    "scatter": (((0, "tensor"), (1, "scatter_list")), (3, "group"), None),
}


# The ``*_object`` collectives: on GPU torch puts their buffers on the group's device itself
# (``_get_object_coll_device``: the current CUDA device for NCCL); on CPU it is "cpu". Their
# inner tensor calls (``recv_object_list`` -> ``recv`` -> ``irecv``) are therefore not checked.
_OBJECT_OPS = ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
               "send_object_list", "recv_object_list")
_INSIDE_OBJECT_OP = threading.local()


def _inside_object_op() -> bool:
    return getattr(_INSIDE_OBJECT_OP, "depth", 0) > 0


def _object_op(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _INSIDE_OBJECT_OP.depth = getattr(_INSIDE_OBJECT_OP, "depth", 0) + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _INSIDE_OBJECT_OP.depth -= 1

    wrapper.__wrapped_nccl_rules__ = fn
    return wrapper


def _checked(op: str, fn):
    tensor_specs, group_spec, op_spec = _SPECS[op]

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _inside_object_op():
            return fn(*args, **kwargs)
        group = _arg(args, kwargs, *group_spec)
        reduce_op = _arg(args, kwargs, *op_spec) if op_spec else None
        for i, name in tensor_specs:
            value = _arg(args, kwargs, i, name)
            for t in ([value] if isinstance(value, torch.Tensor) else list(value or [])):
                check_tensor(f"torch.distributed.{op}", t, group, name)
                _check_op(f"torch.distributed.{op}", reduce_op, t, group)
        return fn(*args, **kwargs)

    wrapper.__wrapped_nccl_rules__ = fn
    return wrapper


def _checked_batch(fn):
    @functools.wraps(fn)
    def wrapper(p2p_op_list, *args, **kwargs):
        for p in ([] if _inside_object_op() else p2p_op_list):
            check_tensor("torch.distributed.batch_isend_irecv", p.tensor, p.group,
                         f"the tensor of a {getattr(p.op, '__name__', p.op)}")
        return fn(p2p_op_list, *args, **kwargs)

    wrapper.__wrapped_nccl_rules__ = fn
    return wrapper


def _recording_new_group(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        group = fn(*args, **kwargs)
        backend = _arg(args, kwargs, 2, "backend")
        if group is not None and backend is not None and str(backend).lower() == "gloo":
            _GLOO_GROUPS.add(id(group))
        return group

    wrapper.__wrapped_nccl_rules__ = fn
    return wrapper


_STATE: dict[str, Any] = {}


def enabled() -> bool:
    return bool(_STATE)


def enable() -> None:
    """Apply the policy in this process (idempotent). Call before megatron makes its groups
    (they are recorded as they are made) and before the tensors the test checks exist."""
    if _STATE:
        return
    if torch.cuda.is_available():
        return  # real NCCL enforces its own rules
    from torch.distributed import distributed_c10d as c10d

    for op in _SPECS:
        setattr(dist, op, _checked(op, getattr(dist, op)))
    for op in ("isend", "irecv"):  # P2POp accepts only c10d's own isend/irecv objects
        setattr(c10d, op, getattr(dist, op))
    dist.batch_isend_irecv = _checked_batch(dist.batch_isend_irecv)
    for op in _OBJECT_OPS:
        setattr(dist, op, _object_op(getattr(dist, op)))
    dist.new_group = _recording_new_group(dist.new_group)
    # The weight-update group (trainer rank 0 + engine GPUs) broadcasts through its
    # ProcessGroup directly, as SGLang's side does; with SGLang engines it is NCCL.
    from megatron_tg.rollout.transport import WeightUpdateGroup

    plain = WeightUpdateGroup.broadcast

    def broadcast(self, tensor):
        check_tensor("the weight-update group's broadcast", tensor, None, "tensor")
        return plain(self, tensor)

    broadcast.__wrapped_nccl_rules__ = plain
    WeightUpdateGroup.broadcast = broadcast
    mode = Placement()
    mode.__enter__()
    _STATE["mode"] = mode


def disable() -> None:
    """Undo :func:`enable` (tests of the policy itself)."""
    if not _STATE:
        return
    _STATE.pop("mode").__exit__(None, None, None)
    from megatron_tg.rollout.transport import WeightUpdateGroup

    WeightUpdateGroup.broadcast = getattr(WeightUpdateGroup.broadcast, "__wrapped_nccl_rules__",
                                          WeightUpdateGroup.broadcast)
    from torch.distributed import distributed_c10d as c10d

    for name in list(_SPECS) + list(_OBJECT_OPS) + ["batch_isend_irecv", "new_group"]:
        fn = getattr(dist, name)
        setattr(dist, name, getattr(fn, "__wrapped_nccl_rules__", fn))
    for op in ("isend", "irecv"):
        setattr(c10d, op, getattr(dist, op))
    _GLOO_GROUPS.clear()


def from_env(rules: str | None = None) -> str:
    """The rules a test run asked for (argument, else :data:`ENV`, else gloo's own)."""
    rules = rules or os.environ.get(ENV) or "gloo"
    if rules not in RULES:
        raise ValueError(f"{ENV}={rules!r}: expected one of {', '.join(RULES)}")
    return rules
