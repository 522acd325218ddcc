"""Optimizer, checkpointing and logging: the parts of a run that do not depend on the method."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_tg.config.base import check_range


@dataclass
class OptimizerConfig:
    """Adam(W) with linear warm-up to a constant learning rate (the paper uses a constant lr)."""

    lr: float = 3e-6
    """Peak learning rate after warm-up (paper: Adam, 3e-6)."""

    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW); 0 = plain Adam as in the paper. megatron's optimizer
    (GPU, or ``parallel.use_distributed_optimizer``) exempts biases and 1-D weights (norms),
    megatron's default; the CPU default's AdamW decays every weight. Equal at 0."""

    adam_beta1: float = 0.9
    """Adam's first-moment decay."""

    adam_beta2: float = 0.999
    """Adam's second-moment decay."""

    eps: float = 1e-8
    """Adam's denominator epsilon."""

    grad_clip: float = 1.0
    """Clip the global gradient L2 norm to this; 0 = no clipping."""

    warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to ``lr``."""

    micro_batch_tokens: int = 8192
    """Token budget of one packed micro-batch per data-parallel rank; rollouts are packed up to
    it and gradients accumulate over micro-batches. Must hold one model.seq_length sequence."""

    def validate(self) -> None:
        check_range("optimizer.lr", self.lr, gt=0)
        check_range("optimizer.weight_decay", self.weight_decay, ge=0)
        check_range("optimizer.adam_beta1", self.adam_beta1, ge=0, lt=1)
        check_range("optimizer.adam_beta2", self.adam_beta2, ge=0, lt=1)
        check_range("optimizer.eps", self.eps, gt=0)
        check_range("optimizer.grad_clip", self.grad_clip, ge=0)
        check_range("optimizer.warmup_steps", self.warmup_steps, ge=0)
        check_range("optimizer.micro_batch_tokens", self.micro_batch_tokens, ge=1)


@dataclass
class CheckpointConfig:
    """Where and how often the trainer state is saved, and whether a run resumes from it."""

    dir: str = "${logging.run_dir}/checkpoints"
    """Checkpoint root; one ``step_<N>`` directory per save. Defaults to inside the run dir."""

    interval: int = 50
    """Save every this many optimizer steps (the last step is always saved); 0 = only the last."""

    keep_last: int = 3
    """Checkpoints kept on disk, oldest deleted first; 0 = keep all."""

    resume: bool = True
    """Continue from the newest complete checkpoint in ``dir`` when there is one."""

    save_on_signal: bool = True
    """Save before exiting on SIGUSR1/SIGTERM (Slurm's pre-emption warning), then requeue."""

    async_save: bool = True
    """Write the distributed checkpoint in the background (megatron's async save path) while
    training goes on; it becomes ``latest`` only once every rank's write has finished. The
    save on a stop signal and the last step's save are waited for before the process exits."""

    write_gbps_per_node: float = 2.0
    """Planning only: checkpoint write bandwidth of one trainer node to ``dir``, in GB/s (an
    assumption: measure your filesystem; the planner's expected save time and the USR1 lead
    time follow from it)."""

    def validate(self) -> None:
        check_range("checkpoint.interval", self.interval, ge=0)
        check_range("checkpoint.keep_last", self.keep_last, ge=0)
        check_range("checkpoint.write_gbps_per_node", self.write_gbps_per_node, gt=0)


@dataclass
class LoggingConfig:
    """Where metrics go. Every sink writes under ``run_dir``, next to the saved config."""

    run_dir: str = "runs/${run_name}"
    """Directory of this run: resolved config, metrics, checkpoints (by default)."""

    jsonl: bool = True
    """Append one JSON object per step to ``run_dir/metrics.jsonl``."""

    tensorboard: bool = False
    """Also write TensorBoard event files to ``run_dir/tb``."""

    wandb_project: Optional[str] = None
    """Weights & Biases project to log to; None = no W&B."""

    log_interval: int = 1
    """Log every this many optimizer steps."""

    progress_bar: bool = True
    """Show a tqdm bar on rank 0 (turn off for batch jobs whose log is a file)."""

    samples_per_step: int = 256
    """Rollouts recorded per step in ``run_dir/samples/step_NNNNN.jsonl`` (id, policy
    version, turns, verdicts, feedback, judge reply on an error, reward, advantage, gate and
    KL per turn); judge errors first. 0 = no records."""

    samples_text: bool = False
    """Record each turn's decoded text (cut to ``samples_max_chars``); False = token counts."""

    samples_max_chars: int = 4000
    """Longest text kept per recorded string (turn text, feedback, judge reply)."""

    samples_compress_bytes: int = 1 << 20
    """A step's records larger than this are written gzip-compressed (``.jsonl.gz``)."""

    update_stats: bool = False
    """Log what each optimizer step did to the fp32 main weights (``optim/update_norm``,
    ``optim/update_rms_over_lr``, ``optim/update_abs_mean_over_lr``; :mod:`megatron_tg.train.
    update_stats`): how far the weights moved and how sign-like the step was. Costs one copy
    of this rank's main-weight shard during the step, so it is off by default."""

    def validate(self) -> None:
        check_range("logging.log_interval", self.log_interval, ge=1)
        check_range("logging.samples_per_step", self.samples_per_step, ge=0)
        check_range("logging.samples_max_chars", self.samples_max_chars, ge=1)
        check_range("logging.samples_compress_bytes", self.samples_compress_bytes, ge=0)
