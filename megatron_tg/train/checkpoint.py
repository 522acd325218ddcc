"""Trainer checkpoints: megatron distributed checkpoints plus everything needed to resume.

Layout of ``ROOT``::

    ROOT/latest                  name of the newest complete checkpoint (replaced atomically)
    ROOT/step_00000040/dist/     torch_dist checkpoint of {"model", "optimizer"} and, with a
                                 frozen/EMA expert, "expert" (resharding; the EMA in fp32)
    ROOT/step_00000040/trainer_state.pt   step, rollout-manager state, objective state, config
    ROOT/step_00000040/rng/rank_00003.pt  every rank's RNG streams (CPU, CUDA, megatron tracker)
    ROOT/step_00000040/hf_config/  the run's HF config.json, generation config, tokenizer
                                 files and chat template (copies: a few MB), so that
                                 ``megatron-tg convert megatron-to-hf`` writes a complete HF
                                 dir from the step dir alone, like from a converted checkpoint
    ROOT/step_00000040/COMPLETE  written last, before the rename

A save goes to ``ROOT/.tmp-step_…`` and is renamed only when every rank has finished, so a
kill mid-save leaves the previous checkpoint intact and ``latest`` pointing at it; stale
temporary directories are removed on the next save. The newest ``keep_last`` are kept.

**Asynchronous saves** (``checkpoint.async_save``): the distributed checkpoint's tensors are
written by megatron's async save path (``dist_checkpointing.save(..., async_sharded_save=
True)`` scheduled on an ``AsyncCallsQueue``: a forked writer per rank, so training goes on
while the previous checkpoint is written). The small files (RNG, trainer state) are written
at once. The checkpoint is *completed* (``COMPLETE``, the rename, ``latest``) by a finalize
function that megatron runs only after every rank's writer has finished and its results were
gathered (an all-reduce over the ranks' "still writing" flags, then the metadata); a rank or
writer killed before that leaves only a ``.tmp-`` directory, never a ``latest``.
:meth:`Checkpointer.finalize` is called by every rank once per step (non-blocking: one
all-reduce) and blocking before the next save and before the process exits.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_tg.convert.common import HF_CONFIG_SUBDIR
from megatron_tg.train.ema import ShardedEMA
from megatron_tg.train.policy import unwrap
from megatron_tg.train.signals import ignore_stop_signals

_PREFIX = "step_"

OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}
"""How megatron's distributed optimizer shards its checkpoint (what Megatron-LM's training
passes too): the grad-buffer shards as they are, reloadable at another data-parallel size.
megatron-core 0.16.1's default, ``fully_sharded_model_space``, fails at save
(``ShardedTensor.flattened_range is not supported``). Other optimizers ignore it."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


_WRITER_MANAGERS: list = []  # the manager behind megatron's results queue, kept alive


def _signal_proof_writer_queue() -> None:
    """Start the helper process of megatron's torch_dist writer ignoring SIGUSR1/SIGTERM.

    Slurm signals every process of a step (the time-limit warning, ``scancel --signal``), not
    only the trainer. The first torch_dist save spawns a multiprocessing manager (its writer
    results queue, ``filesystem_async._results_queue``) that lives across saves; the signal's
    default action kills it, and the very save the signal asked for then fails (BrokenPipe /
    ConnectionRefused) instead of checkpointing. Made here first, megatron reuses it."""
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:
        return
    if getattr(filesystem_async, "_results_queue", "absent") is not None:
        return  # already made (by us or by megatron), or a megatron without this global
    from multiprocessing.managers import SyncManager

    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))  # megatron's context
    manager.start(ignore_stop_signals)
    filesystem_async._results_queue = manager.Queue()
    _WRITER_MANAGERS.append(manager)


def rng_state() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _with_data(sharded: dict[str, Any], tensors: dict[str, torch.Tensor],
               prefix: str) -> dict[str, Any]:
    """``sharded`` with the data of each entry named in ``tensors`` replaced (same shape and
    sharding, the given dtype)."""
    out = dict(sharded)
    for name, t in tensors.items():
        sh = out.get(prefix + name)
        if sh is None:
            raise KeyError(f"the expert's sharded state has no entry {prefix + name!r} for the "
                           f"EMA parameter {name!r}")
        fields = {f.name for f in dataclasses.fields(sh)}
        out[prefix + name] = dataclasses.replace(
            sh, data=t, **({"dtype": t.dtype} if "dtype" in fields else {}))
    return out


class Checkpointer:
    def __init__(self, root: str | os.PathLike, keep_last: int = 3, async_save: bool = False,
                 hf_model_dir: str | os.PathLike | None = None,
                 hf_tokenizer_dir: str | os.PathLike | None = None) -> None:
        """``hf_model_dir`` / ``hf_tokenizer_dir``: where every save copies the HF side files
        into ``hf_config/`` from (:data:`~megatron_tg.convert.hf_io.SIDE_FILES`): config.json
        and generation_config.json from the model's directory, tokenizer files and chat
        template from the tokenizer's (which win where both have one)."""
        if keep_last < 1:
            raise ValueError(f"checkpoint.keep_last must be >= 1, got {keep_last}")
        self.root = Path(root)
        self.hf_model_dir = Path(hf_model_dir) if hf_model_dir else None
        self.hf_tokenizer_dir = Path(hf_tokenizer_dir) if hf_tokenizer_dir else None
        self.keep_last = keep_last
        self.async_save = async_save
        self._queue = None  # megatron's AsyncCallsQueue, made at the first async save
        self.in_flight: list[int] = []  # steps whose async write has not been completed yet

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        marker = self.root / "latest"
        if not marker.exists():
            return None
        path = self.root / marker.read_text().strip()
        if not (path / "COMPLETE").exists():
            raise RuntimeError(f"{marker} names {path.name}, which is incomplete or missing")
        return path

    @staticmethod
    def _sharded(model, optimizer, expert=None, ema: ShardedEMA | None = None,
                 is_loading: bool = False) -> dict[str, Any]:
        model_sd = unwrap(model).sharded_state_dict()
        out = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata=dict(OPTIMIZER_METADATA))}
        if expert is not None:  # frozen/EMA expert weights, sharded like the policy's
            if ema is not None:  # the fp32 average, not its bf16 cast (of any ema_weights)
                with ema.shaped_targets():
                    out["expert"] = expert.sharded_state_dict(prefix="expert.")
                out["expert"] = _with_data(out["expert"], ema.full_state(), "expert.")
            else:
                out["expert"] = expert.sharded_state_dict(prefix="expert.")
        return out

    def save(self, step: int, model, optimizer, trainer_state: dict[str, Any],
             expert=None, ema: ShardedEMA | None = None) -> Path:
        """Collective: every rank calls it. Returns the final directory, which exists once
        the save is complete: at return for a synchronous save, at a later :meth:`finalize`
        for an asynchronous one."""
        from megatron.core import dist_checkpointing

        self.finalize(blocking=True)  # the previous write completes first: one in flight at most
        name = f"{_PREFIX}{step:08d}"
        tmp = self.root / f".tmp-{name}"
        if _rank() == 0:
            for stale in self.root.glob(".tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
            (tmp / "dist").mkdir(parents=True)
            (tmp / "rng").mkdir()
        _barrier()
        _signal_proof_writer_queue()
        request = dist_checkpointing.save(self._sharded(model, optimizer, expert, ema), str(tmp / "dist"),
                                          async_sharded_save=self.async_save)
        torch.save(rng_state(), tmp / "rng" / f"rank_{_rank():05d}.pt")
        if _rank() == 0:
            torch.save({"step": step, **trainer_state}, tmp / "trainer_state.pt")
            self.copy_hf_files(tmp / HF_CONFIG_SUBDIR)
        if request is None:  # written: complete it now
            self._complete(step, tmp)
        else:  # megatron runs this after its own finalization, once every rank's writer is done
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            request.add_finalize_fn(lambda: self._complete(step, tmp))
            if self._queue is None:
                self._queue = AsyncCallsQueue()
            self._queue.schedule_async_request(request)
            self.in_flight.append(step)
        return self.root / name

    def copy_hf_files(self, dst: Path) -> None:
        """Copy the run's HF config and tokenizer files into ``dst`` (rank 0's job)."""
        from megatron_tg.convert.hf_io import MODEL_FILES, copy_side_files

        if self.hf_model_dir is not None and self.hf_model_dir.is_dir():
            copy_side_files(self.hf_model_dir, dst)
        if self.hf_tokenizer_dir is not None and self.hf_tokenizer_dir.is_dir():
            copy_side_files(self.hf_tokenizer_dir, dst, skip=MODEL_FILES)

    def finalize(self, blocking: bool = False) -> list[int]:
        """Collective: complete the asynchronous saves whose writes have finished on every
        rank (``blocking``: wait for all of them). Returns the steps completed now."""
        if self._queue is None or not self.in_flight:
            return []
        done = self._queue.maybe_finalize_async_calls(blocking=blocking)
        completed, self.in_flight = self.in_flight[:len(done)], self.in_flight[len(done):]
        return completed

    def _complete(self, step: int, tmp: Path) -> None:
        """Collective: once every rank's files are written, mark ``tmp`` complete, rename it and
        point ``latest`` at it."""
        _barrier()
        name = f"{_PREFIX}{step:08d}"
        final = self.root / name
        if _rank() == 0:
            (tmp / "COMPLETE").write_text(f"{step}\n")
            if final.exists():  # a re-run of the same step after a crash: replace it
                shutil.rmtree(final)
            os.replace(tmp, final)
            marker_tmp = self.root / ".latest.tmp"
            marker_tmp.write_text(name + "\n")
            os.replace(marker_tmp, self.root / "latest")
            self._prune()
        _barrier()

    def _prune(self) -> None:
        done = sorted(p for p in self.root.glob(f"{_PREFIX}*") if (p / "COMPLETE").exists())
        for old in done[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    def load(self, path: Path, model, optimizer, expert=None,
             ema: ShardedEMA | None = None) -> dict[str, Any]:
        """Collective: restore model, optimizer (and expert) and this rank's RNG; return the
        trainer state."""
        from megatron.core import dist_checkpointing

        check = getattr(optimizer, "check_resumable", None)
        if check is not None:  # before megatron's load fails on another layout's shards
            common = dist_checkpointing.load_common_state_dict(str(path / "dist"))
            check(common.get("optimizer", {}), str(path))
        state = dist_checkpointing.load(self._sharded(model, optimizer, expert, ema,
                                                      is_loading=True), str(path / "dist"))
        unwrap(model).load_state_dict(state["model"])
        if expert is not None:  # keys carry the "expert." prefix the save gave them
            loaded = {k.removeprefix("expert."): v for k, v in state["expert"].items()}
            if ema is not None:
                ema.load_full_state(loaded)
            else:
                expert.load_state_dict(loaded)
        optimizer.load_state_dict(state["optimizer"])
        rng_file = path / "rng" / f"rank_{_rank():05d}.pt"
        if rng_file.exists():  # absent when resuming at a different world size
            set_rng_state(torch.load(rng_file, weights_only=False))
        return torch.load(path / "trainer_state.pt", weights_only=False)
