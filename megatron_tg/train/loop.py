"""The TG training loop: generate -> judge -> train (GRPO + gated KL) -> sync -> checkpoint/log.

    python -m megatron_tg.train --recipe recipes/tiny_cpu.yaml [key=value ...]

One process per GPU (torchrun or srun); global rank 0 also owns the rollout side (engines,
manager, judge), which generates in the background while the trainer trains (with
``rollout.placement=colocated`` the two take turns on the same GPUs instead:
:mod:`megatron_tg.weight_sync.colocated`). On SIGUSR1 or
SIGTERM (Slurm's warning before the time limit) the loop finishes the current step, saves a
checkpoint and exits with :data:`EXIT_REQUEUE` so the batch script requeues the job; a
restarted job resumes from the newest checkpoint.
"""

from __future__ import annotations

import signal
import time

import torch
import torch.distributed as dist

from megatron_tg.config.schema import TGConfig
from megatron_tg.sampling.protocols import MakeRolloutSource
from megatron_tg.weight_sync.colocated import StartupRelease, make_phases
from megatron_tg.train.manifest import write_manifest
from megatron_tg.train.metrics import MetricsLogger
from megatron_tg.train.samples import SampleRecorder
from megatron_tg.train.scatter import scatter_by_tokens, wait_for_batch
from megatron_tg.train.trainer import Trainer
from megatron_tg.weight_sync.checks import SyncChecks

EXIT_DONE, EXIT_REQUEUE = 0, 75  # 75 = EX_TEMPFAIL: "try again", the Slurm scripts' contract


class StopFlag:
    """Set by SIGUSR1/SIGTERM; every rank agrees on it once per step (an all-reduce)."""

    def __init__(self) -> None:
        self.requested = False
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self._set)

    def _set(self, signum, frame) -> None:
        self.requested = True

    def agreed(self, device: torch.device) -> bool:
        # on the parallel context's device: the default group is NCCL on GPU (no host tensors)
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.requested = bool(flag.item())
        return self.requested


def run(cfg: TGConfig, *, make_rollout_side: MakeRolloutSource) -> int:
    """Train ``cfg.steps`` steps; returns the process exit code."""
    # First: a SIGUSR1/SIGTERM while the model loads or the engines sync must not kill the
    # process (their default action) but stop it after its first step, with a checkpoint.
    stop = StopFlag()
    # colocated with running engines: they give their GPU memory back before the model is built
    startup = StartupRelease.for_config(cfg)
    trainer = Trainer(cfg, before_build=startup)
    state = trainer.resume() or {}
    rank0 = trainer.ctx.rank == 0
    side = make_rollout_side(trainer) if rank0 else None
    if side is not None and "rollouts" in state:
        side.load_state_dict(state["rollouts"])
    # rollout.placement: what runs around training (colocated: engines and trainer take turns)
    phases = make_phases(trainer, side, SyncChecks.from_config(cfg.rollout),
                         released_at_start=startup is not None and startup.released)
    phases.start()  # a restart (or released engines): the engines get the checkpoint's weights
    if rank0:  # what produced this run, appended at every start (train/manifest.py)
        write_manifest(cfg.logging.run_dir, cfg, step=trainer.step, **side.identity())
    _say(rank0, f"resumed from checkpoint step {trainer.step} of {cfg.steps}" if trainer.step
         else f"starting at step 0 of {cfg.steps}")
    log = MetricsLogger(cfg.logging, cfg.logging.run_dir, enabled=rank0,
                        total_steps=cfg.steps, start_step=trainer.step)
    records = SampleRecorder(cfg.logging, cfg.logging.run_dir, enabled=rank0,
                             start_step=trainer.step, tokenizer=trainer.tokenizer)
    code = EXIT_DONE
    wait_limit = cfg.timeouts.rollout_wait(cfg)
    try:
        if rank0 and trainer.step == 0 and (baseline := side.probe_metrics(0)):
            log.log(0, baseline)  # step-0 baselines: the held-out evaluation, probes
        while trainer.step < cfg.steps:
            phases.before_generate()
            t0 = time.perf_counter()
            batch = side.next_batch(trainer.step) if rank0 else (None, None)      # generate + judge
            # the others wait on the store, not in the scatter (no collective timeout applies)
            waited = wait_for_batch(trainer.step, rank=trainer.ctx.rank, timeout_s=wait_limit)
            samples, metrics = scatter_by_tokens(*batch, rank=trainer.ctx.rank, dims=trainer.ctx.dims)
            t1 = time.perf_counter()
            waited = torch.tensor([waited], device=trainer.ctx.device)
            dist.all_reduce(waited, op=dist.ReduceOp.MAX)  # the longest store wait of any rank
            metrics.update(phases.before_train())
            metrics.update(trainer.train_step(samples))                          # GRPO + gated KL
            metrics.update(phases.after_train())
            t2 = time.perf_counter()
            metrics.update(phases.sync())                                        # -> engines
            stopping = stop.agreed(trainer.ctx.device)
            trainer.checkpointer.finalize()  # completes the async saves every rank has written
            due = stopping or trainer.step % cfg.checkpoint.interval == 0 or trainer.step == cfg.steps
            if due and phases.save_before_serving:  # colocated: the engines hold their weights only
                phases.save({"rollouts": side.state_dict() if rank0 else None})  # checkpoint
            metrics.update(phases.after_sync())  # colocated: the engines take their memory back
            if rank0:
                metrics.update(side.probe_metrics(trainer.step))
            tokens = sum(len(s.rollout.token_ids) for s in samples) * trainer.ctx.dims.dp
            metrics.update({"time/rollout_wait": t1 - t0, "time/train": t2 - t1,
                            # how close rank 0's batch came to the other ranks' wait limit
                            "time/rollout_wait_limit_frac": (t1 - t0) / wait_limit,
                            "time/rollout_store_wait": float(waited),
                            "time/step": time.perf_counter() - t0,
                            "throughput/train_tokens_per_s": tokens / max(t2 - t1, 1e-9)})
            log.log(trainer.step, metrics)
            if rank0:
                records.write(trainer.step, side.last_judged, batch[0], trainer.turn_stats)
            if due and not phases.save_before_serving:  # after the step's row: a kill in it keeps the row
                phases.save({"rollouts": side.state_dict() if rank0 else None})  # checkpoint
            if stopping and trainer.step < cfg.steps:
                trainer.checkpointer.finalize(blocking=True)  # complete before saying so
                _say(rank0, f"stop requested: checkpointed step {trainer.step}, exiting {EXIT_REQUEUE}"
                            " (requeue)")
                code = EXIT_REQUEUE
                break
        trainer.checkpointer.finalize(blocking=True)  # the last save completes before the exit
    finally:
        log.close()
        if side is not None:
            side.close()
    dist.barrier()  # no rank leaves before rank 0 has stopped its engines
    dist.destroy_process_group()
    if code == EXIT_DONE:
        _say(rank0, f"done: step {trainer.step} of {cfg.steps} ({_usage()})")
    return code


def _usage() -> str:
    """This process's CPU time and peak resident memory (rank 0's own, without the engine or
    rollout-service processes; docs/rollout-service.md compares the placements)."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return f"this rank: cpu {ru.ru_utime + ru.ru_stime:.1f} s, peak rss {ru.ru_maxrss / 1024:.0f} MiB"


def _say(rank0: bool, text: str) -> None:
    """One line on rank 0's stdout: the step log of a Slurm job (metrics go to metrics.jsonl)."""
    if rank0:
        print(f"[train {time.strftime('%F %T')}] {text}", flush=True)
