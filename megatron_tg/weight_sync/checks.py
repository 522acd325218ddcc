"""What the weight sync (:mod:`.weight_sync`) and the handling of lost and returned engines
(:mod:`.engine_loss`) both need, in a module of their own so that neither imports the other
for it: what a push reports (:class:`SyncStats`), when the checks run (:class:`SyncChecks`),
the error of a failed check (:class:`SyncCheckError`), and the log-prob probe: the trainer's
log-probs of a fixed sequence (:func:`probe_tokens`, :func:`trainer_logprobs`) against an
engine's (:func:`engine_logprobs`), compared by :func:`compare_logprobs`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_tg.models.qwen3_moe.config import Qwen3Arch
from megatron_tg.parallel.dims import Axis


class SyncCheckError(RuntimeError):
    """An engine does not serve the weights the trainer just sent."""


@dataclass
class SyncStats:
    tensors: int = 0
    bytes: int = 0
    buckets: int = 0
    seconds: float = 0.0
    lost: list[str] = field(default_factory=list)
    """Engines found dead (or restarted) during this push, on the sender; the push sent
    nothing after it found them and must be redone without them (:mod:`.engine_loss`)."""

    def as_metrics(self) -> dict[str, float]:
        return {"sync/tensors": self.tensors, "sync/bytes": self.bytes,
                "sync/buckets": self.buckets, "sync/seconds": self.seconds,
                "sync/MBps": self.bytes / 2**20 / max(self.seconds, 1e-9)}


@dataclass
class SyncChecks:
    """When the checks of a sync run (config: rollout.sync_verify_coverage, sync_probe_*): the
    coverage check (:func:`~megatron_tg.weight_sync.sync.verify_coverage`) and the log-prob probe."""

    verify_coverage: bool = True
    probe_interval: int = 1
    probe_tol: float = 0.1
    probe_tokens: int = 32
    syncs: int = 0

    def coverage_due(self) -> bool:
        return self.verify_coverage and self.syncs == 1

    def probe_due(self) -> bool:
        return self.probe_interval > 0 and self.syncs % self.probe_interval == 0

    @classmethod
    def from_config(cls, r: Any) -> "SyncChecks":
        return cls(r.sync_verify_coverage, r.sync_probe_interval, r.sync_probe_tol, r.sync_probe_tokens)



# ---- the log-prob probe: proof that the engines serve what was sent ----------------------
def probe_tokens(vocab_size: int, n: int, seed: int = 1234) -> list[int]:
    """The fixed sequence whose log-probs engines and trainer compare."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n,), generator=g).tolist()


@torch.no_grad()
def trainer_logprobs(model: torch.nn.Module, arch: Qwen3Arch, ctx, tokens: list[int]) -> torch.Tensor:
    """log p(tokens[i] | tokens[:i]) for i >= 1 under the trainer's weights (collective)."""
    from megatron_tg.ops import fused_vocab_parallel_logprob
    from megatron_tg.train.batching import pack
    from megatron_tg.train.step import ops_reduce_hidden_grad, run_forward

    tp = ctx.dims.tp
    # One packed row (sequence parallelism splits it by tp); under PP the last stage
    # computes the log-probs and the pipeline receives them.
    rows = pack([tokens], row_tokens=len(tokens), pad_multiple=tp)
    n = len(tokens)
    target = torch.tensor(tokens[1:n])
    return run_forward(model, rows, lambda h: fused_vocab_parallel_logprob(
        h.hidden[0, :n - 1], h.output_weight, target, ctx.group(Axis.TP),
        vocab_size=arch.vocab_size, reduce_hidden_grad=ops_reduce_hidden_grad(model)).float().cpu())


async def engine_logprobs(client, url: str, tokens: list[int]) -> torch.Tensor:
    """The engine's log-probs of the same positions (its prompt log-probs)."""
    body = {"input_ids": tokens, "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
    out = await client.generate_on(url, body)
    lps = out["meta_info"]["input_token_logprobs"]
    return torch.tensor([float(x[0]) for x in lps[1:len(tokens)]])


def compare_logprobs(url: str, engine: torch.Tensor, trainer: torch.Tensor, tol: float, version: int) -> float:
    """Mean |engine - trainer| over the sequence; raises naming the engine above ``tol``."""
    if engine.shape != trainer.shape:
        raise SyncCheckError(f"{url}: returned {engine.numel()} prompt log-probs, expected {trainer.numel()}")
    diff = float((engine - trainer.cpu()).abs().mean())
    if not diff <= tol:  # also catches NaN
        raise SyncCheckError(
            f"engine {url} does not serve the weights of version {version}: its log-probs of the probe "
            f"sequence differ from the trainer's by {diff:.4g} on average (rollout.sync_probe_tol={tol}); "
            "it serves stale or missing weights (a name its loader skipped, a failed bucket)")
    return diff
