"""Release and resume of the embedded engine's memory, as SGLang 0.5.23's
``/release_memory_occupation`` and ``/resume_memory_occupation`` (read from its
``managers/scheduler_components/weight_updater.py``, ``constants.py`` and
``entrypoints/http_server.py``):

* tags ``weights``, ``kv_cache``, ``cuda_graph``; none (or an empty list) means all three;
* release only when the engine is idle: no running request, and no waiting one unless
  generation is paused (``is_fully_idle(ignore_waiting=paused)``); SGLang asserts this in its
  scheduler, which a busy call kills; here the call answers 400 instead;
* releasing ``weights`` frees every parameter's and buffer's storage (``resize_(0)``: the
  tensors stay, their bytes go); buffers are stashed first and restored on resume (SGLang's
  ``_export_static_state``); parameters come back with the values they had only with
  ``--enable-weights-cpu-backup``; without it their contents after resume are undefined
  (SGLang's memory saver remaps fresh pages) and here are NaN (integers: zero), so a sync
  that forgets to write them shows at once: colocated mode resumes ``weights``, updates them
  from tensors, then resumes ``kv_cache`` (slime's ``onload_weights`` / ``onload_kv``);
* the embedded engine's KV cache is the running batch's (a transformers ``DynamicCache``
  made per batch, no static pool as SGLang's ``--mem-fraction-static``): an idle engine
  holds none, so releasing ``kv_cache`` frees what an idle engine holds (0 bytes) and keeps
  retracted requests from being admitted until it is resumed;
* ``cuda_graph``: there are none on CPU; the tag is accepted and tracked.

Stricter than SGLang, where it would crash or serve from unmapped memory: releasing a tag
that is released, resuming one that is not (SGLang: ``KeyError`` in its scheduler),
generating while ``weights`` or ``kv_cache`` is released, and updating weights while
``weights`` is released are all refused with HTTP 400. Without ``--enable-memory-saver``
SGLang's calls succeed and free nothing; so do these (the accounting shows it).

The accounting (``/server_info``'s ``memory_occupation``) counts the bytes the engine's
tensors really hold: parameters and buffers (each storage once), the KV cache of the running
batch, and the weights' CPU backup.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

KV_CACHE, WEIGHTS, CUDA_GRAPH = "kv_cache", "weights", "cuda_graph"
ALL_TAGS = (KV_CACHE, WEIGHTS, CUDA_GRAPH)  # SGLang's GPU_MEMORY_ALL_TYPES, in its order
NOT_IDLE = "release_memory_occupation should be called only when server is idle."


class MemoryStateError(ValueError):
    """A release/resume the engine's state does not allow (answered with HTTP 400)."""


def parse_tags(tags) -> list[str]:
    """SGLang's rule: None or [] means every tag."""
    if tags is None or (isinstance(tags, list) and not tags):
        return list(ALL_TAGS)
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise MemoryStateError(f"tags must be a list of strings or null, got {tags!r}")
    unknown = [t for t in tags if t not in ALL_TAGS]
    if unknown:
        raise MemoryStateError(f"unknown memory tags {unknown}; SGLang's are {list(ALL_TAGS)}")
    return list(dict.fromkeys(tags))


@dataclass
class _Storage:
    storage: torch.UntypedStorage
    nbytes: int
    tensors: list[torch.Tensor]  # every parameter/buffer on this storage
    is_buffer: bool
    backup: torch.Tensor | None = None  # uint8 copy of the bytes while released, when kept


@dataclass
class MemoryOccupation:
    """The engine model's weight storage, freed and reallocated in place.

    All methods run on the scheduler thread (between generation steps)."""

    model: torch.nn.Module
    enable_memory_saver: bool = False
    enable_weights_cpu_backup: bool = False
    released: set[str] = field(default_factory=set)
    _storages: list[_Storage] = field(default_factory=list)

    def __post_init__(self) -> None:
        by_ptr: dict[int, _Storage] = {}
        params = {id(p) for p in self.model.parameters()}
        tensors = [t for _, t in self.model.named_parameters(remove_duplicate=False)]
        tensors += [t for _, t in self.model.named_buffers(remove_duplicate=False)]
        for t in tensors:
            st = t.untyped_storage()
            entry = by_ptr.get(st.data_ptr())
            if entry is None:  # tied weights (lm_head = embed_tokens) share one storage
                entry = by_ptr[st.data_ptr()] = _Storage(st, st.nbytes(), [], id(t) not in params)
            entry.tensors.append(t)
        self._storages = list(by_ptr.values())
        if self.enable_memory_saver:
            for s in self._storages:
                _make_resizable(s)

    # ---- accounting ------------------------------------------------------------------------
    def weights_bytes(self) -> int:
        return sum(s.storage.nbytes() for s in self._storages)

    def backup_bytes(self) -> int:
        return sum(s.backup.nbytes for s in self._storages if s.backup is not None)

    # ---- release / resume --------------------------------------------------------------------
    def release(self, tags: list[str]) -> None:
        again = [t for t in tags if t in self.released]
        if again:
            raise MemoryStateError(f"memory tags {again} are already released")
        if WEIGHTS in tags and self.enable_memory_saver:
            self._free_weights()
        self.released.update(tags)

    def resume(self, tags: list[str]) -> None:
        missing = [t for t in tags if t not in self.released]
        if missing:
            raise MemoryStateError(f"memory tags {missing} are not released")
        if WEIGHTS in tags and self.enable_memory_saver:
            self._restore_weights()
        self.released.difference_update(tags)

    @torch.no_grad()
    def _free_weights(self) -> None:
        for s in self._storages:
            # Buffers (rotary tables, ...) are always stashed, as SGLang's _export_static_state;
            # parameters only with --enable-weights-cpu-backup.
            if s.is_buffer or self.enable_weights_cpu_backup:
                s.backup = torch.empty(s.nbytes, dtype=torch.uint8)
                s.backup.untyped_storage().copy_(s.storage)
            # A numpy view (the weight checker's hashing) pins a storage for good: move it.
            _make_resizable(s)
            s.storage.resize_(0)

    @torch.no_grad()
    def _restore_weights(self) -> None:
        for s in self._storages:
            s.storage.resize_(s.nbytes)
            if s.backup is not None:
                s.storage.copy_(s.backup.untyped_storage())
                s.backup = None
                continue
            for t in s.tensors:  # undefined contents: make a missed update loud
                t.fill_(float("nan") if t.dtype.is_floating_point else 0)

    def refusal(self) -> str | None:
        """Why generation cannot run now, or None."""
        held = [t for t in (WEIGHTS, KV_CACHE) if t in self.released]
        if not held:
            return None
        return (f"the engine's memory is released (tags {held}): generation needs "
                "/resume_memory_occupation first")


@torch.no_grad()
def _make_resizable(s: _Storage) -> None:
    """Move a storage's bytes into one that can be freed in place (SGLang allocates the
    weights inside its memory saver's region; here a checkpoint's tensors may be memory-mapped
    from the file, and a storage once seen through ``Tensor.numpy()`` stays unresizable)."""
    if s.storage.resizable():
        return
    fresh = torch.UntypedStorage(s.nbytes)
    fresh.copy_(s.storage)
    for t in s.tensors:
        t.set_(fresh, t.storage_offset(), t.size(), t.stride())
    s.storage = fresh


def kv_cache_bytes(batch) -> int:
    """Bytes of the key/value tensors of a running batch (0 when there is none)."""
    if batch is None:
        return 0
    from .model_runner import _layers

    total = 0
    for holder, ka, va in _layers(batch.cache):
        for t in (getattr(holder, ka, None), getattr(holder, va, None)):
            if isinstance(t, torch.Tensor):
                total += t.untyped_storage().nbytes()
    return total
