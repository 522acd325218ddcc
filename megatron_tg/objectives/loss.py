"""The training loss as a sum of named terms: L = pg + λ·kl.

Math contract:

* ``pg``: the GRPO term of :mod:`megatron_tg.objectives.grpo` (clipped ratio, TIS, assistant
  tokens only, per-rollout token mean by default).
* ``kl``: λ · L_KL with L_KL from :mod:`megatron_tg.objectives.guidance` (full-vocabulary
  divergence to the stop-gradient expert, gated per :mod:`megatron_tg.objectives.modes`,
  averaged per rollout). λ = ``kl_coef``, or the entropy guard's current value when enabled.
* A term that does not apply is absent from ``terms``: mode "grpo", λ = 0, or no gated row.
  Then ``loss`` *is* the ``pg`` tensor (no ``+ 0``), so "tg" with all criteria passing is
  bitwise equal to "grpo" in value and gradient.

The objective does not know which algorithm it is: modes only change which rows are gated
(``build_gate``), which criteria enter the reward (``rewards``), and whether ``kl`` exists.
Metrics are detached 0-dim tensors (the only host sync is finding the gated rows); the
trainer averages them over micro-batches and calls :meth:`TGObjective.end_step` with the
step's gated-token entropy.

The loss reads the student's hidden states and output weight (``PolicyBatch.hidden``) and
computes the output layer inside the fused ops at the loss rows only; ``reduce_hidden_grad`` is forwarded to the fused ops —
True when the hidden states are replicated over TP (no sequence parallelism), False when the
caller gathered them with megatron's ``gather_from_sequence_parallel_region`` (see
:func:`megatron_tg.ops.fused_vocab_parallel_kl`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from megatron_tg.config.objective import ObjectiveConfig
from megatron_tg.objectives.batch import PolicyBatch
from megatron_tg.objectives.entropy_guard import EntropyGuard, GuardEvent
from megatron_tg.objectives.grpo import policy_gradient_term
from megatron_tg.objectives.guidance import gated_kl_term
from megatron_tg.objectives.modes import mode_switches
from megatron_tg.ops import fused_vocab_parallel_entropy, fused_vocab_parallel_logprob


@dataclass
class LossOutput:
    loss: torch.Tensor
    """Σ terms; call ``.backward()`` on this."""
    terms: dict[str, torch.Tensor] = field(default_factory=dict)
    """Named terms exactly as summed (``kl`` already includes λ)."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """Detached scalars for logging."""
    rows: dict[str, torch.Tensor] = field(default_factory=dict)
    """Detached per-row values [N] for per-sample records: ``is_weight`` (applied importance
    weight) and, when the KL ran, ``kl`` (0 on ungated rows)."""


class TGObjective:
    """Targeted-guidance objective for one TP group; call it once per micro-batch."""

    def __init__(self, cfg: ObjectiveConfig, group: Optional[dist.ProcessGroup] = None, *,
                 compute_entropy: bool = True, reduce_hidden_grad: bool = True) -> None:
        cfg.validate()
        self.cfg = cfg
        self.group = group
        self.reduce_hidden_grad = reduce_hidden_grad
        self.switches = mode_switches(cfg)
        self.compute_entropy = compute_entropy
        self.guard = EntropyGuard(cfg.entropy_guard, cfg.kl_coef)

    @property
    def kl_coef(self) -> float:
        """λ in effect for the next loss evaluation."""
        return self.guard.coef if self.cfg.entropy_guard.enabled else float(self.cfg.kl_coef)

    def end_step(self, gated_entropy: Optional[float]) -> Optional[GuardEvent]:
        """Once per optimizer step: let the entropy guard adjust λ for the next step."""
        return self.guard.update(gated_entropy)

    def _logprob(self, batch: PolicyBatch) -> torch.Tensor:
        kw = dict(vocab_size=batch.vocab_size, chunk_size=self.cfg.logits_chunk_size)
        return fused_vocab_parallel_logprob(batch.hidden, batch.output_weight, batch.target_ids,
                                            self.group, reduce_hidden_grad=self.reduce_hidden_grad,
                                            **kw)

    @torch.no_grad()
    def _entropy_metrics(self, batch: PolicyBatch) -> dict[str, torch.Tensor]:
        kw = dict(vocab_size=batch.vocab_size, chunk_size=self.cfg.logits_chunk_size)
        ent = fused_vocab_parallel_entropy(batch.hidden.detach(), batch.output_weight.detach(),
                                           self.group, **kw)
        mask = batch.policy_mask().to(ent.dtype)  # the policy's own samples only
        gate = batch.gate.to(ent.dtype) * mask
        return {
            "entropy/all": (ent * mask).sum() / mask.sum().clamp(min=1.0),
            # 0/0 = NaN (not 0) when nothing is gated: the guard reads NaN as "no data".
            "entropy/gated": (ent * gate).sum() / gate.sum(),
        }

    def __call__(self, batch: PolicyBatch) -> LossOutput:
        batch.validate()
        logp = self._logprob(batch)
        rows: dict[str, torch.Tensor] = {}
        pg, metrics = policy_gradient_term(logp, batch, self.cfg, rows)
        terms = {"pg": pg}
        loss = pg

        coef = self.kl_coef
        metrics["kl/coef"] = torch.tensor(coef if self.switches.kl else 0.0)
        if self.switches.kl:
            # λ = 0 (e.g. the guard's floor): no term, but the divergence is still logged.
            with torch.set_grad_enabled(torch.is_grad_enabled() and coef > 0):
                kl, kl_metrics = gated_kl_term(batch, self.cfg, self.group,
                                               reduce_hidden_grad=self.reduce_hidden_grad,
                                               rows=rows)
            metrics.update(kl_metrics)
            if kl is not None and coef > 0:
                terms["kl"] = coef * kl
                loss = loss + terms["kl"]
        if self.compute_entropy:
            metrics.update(self._entropy_metrics(batch))
        return LossOutput(loss=loss, terms=terms, metrics=metrics, rows=rows)
