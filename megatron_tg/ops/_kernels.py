"""Per-chunk math of the vocab-parallel ops: forward statistics and hand-written gradients.

Every kernel sees one chunk of rows, sliced to this rank's *valid* vocabulary columns, in the
compute dtype (≥ fp32). Log-probabilities are always formed as ``z - lse`` (finite for finite
logits) and never as ``log(p)``, so ±1e4 logits cannot produce ``0 · -inf``. Products
``p · (...)`` are zeroed where ``p == 0`` so that -inf logits (masked tokens) are also safe.

A forward returns ``(value [c], saved)`` where ``saved`` is a tuple of per-row tensors that
the backward needs; they are already reduced across ranks, so no backward issues a collective.

Conventions (all per token, natural log):

* logprob  : log p(y) = z_y - lse(z).
* entropy  : H(p) = -Σ p log p;                    ∂H/∂z = -p ⊙ (log p + H).
* reverse  : KL(p_s ‖ p_e) = Σ p_s (log p_s - log p_e); ∂/∂z_s = p_s ⊙ (log p_s - log p_e - KL).
* forward  : KL(p_e ‖ p_s) = Σ p_e (log p_e - log p_s); ∂/∂z_s = p_s - p_e.
* jsd (β)  : m = β p_e + (1-β) p_s,
             JSD_β = β KL(p_e ‖ m) + (1-β) KL(p_s ‖ m);
             ∂/∂z_s = (1-β) p_s ⊙ (log(p_s/m) - KL(p_s ‖ m)).
  (∂JSD/∂p_s,j = (1-β) log(p_s,j/m_j): the two "-p/m" terms cancel against the "+1"; then the
  softmax Jacobian gives the centring by Σ p_s log(p_s/m) = KL(p_s ‖ m).) As β→0,
  JSD_β/β → KL(p_e ‖ p_s) (forward); as β→1, JSD_β/(1-β) → KL(p_s ‖ p_e) (reverse).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from megatron_tg.ops._shard import VocabShard

Saved = tuple[torch.Tensor, ...]


def _zero_where_no_mass(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """x with entries where p == 0 set to 0 (in place): keeps 0 · ±inf out of the sums."""
    return x.masked_fill_(p == 0, 0.0)


class Kernel:
    """One op's chunk math. ``uses_expert``: whether a second logits tensor is consumed."""

    uses_expert = False

    def forward(self, shard: VocabShard, zs: torch.Tensor, ze: Optional[torch.Tensor],
                aux: Optional[torch.Tensor]) -> tuple[torch.Tensor, Saved]:
        raise NotImplementedError

    def backward(self, shard: VocabShard, zs: torch.Tensor, ze: Optional[torch.Tensor],
                 aux: Optional[torch.Tensor], saved: Saved, g: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class LogProbKernel(Kernel):
    """log p(target). ``aux`` holds the global target ids of the chunk."""

    def _local_target(self, shard: VocabShard, target: torch.Tensor):
        local = target - shard.vocab_start
        hit = (local >= 0) & (local < shard.n_valid)
        return local.clamp(0, max(shard.n_valid - 1, 0)), hit

    def forward(self, shard, zs, ze, aux):
        m = shard.all_max(shard.local_max(zs))
        z0 = zs - m[:, None]
        idx, hit = self._local_target(shard, aux)
        if shard.n_valid:
            z_target = torch.where(hit, z0.gather(1, idx[:, None]).squeeze(1), 0.0)
        else:
            z_target = z0.new_zeros(z0.shape[0])
        sum_exp = z0.exp_().sum(-1)
        # One reduction carries both partial sums: Σ exp and the owner rank's target logit.
        red = shard.all_sum(torch.stack([sum_exp, z_target], dim=-1))
        log_s = red[:, 0].log()
        return red[:, 1] - log_s, (m + log_s,)

    def backward(self, shard, zs, ze, aux, saved, g):
        (lse,) = saved
        grad = (zs - lse[:, None]).exp_().mul_(-g[:, None])
        if shard.n_valid:
            idx, hit = self._local_target(shard, aux)
            grad.scatter_add_(1, idx[:, None], torch.where(hit, g, 0.0)[:, None])
        return grad


class EntropyKernel(Kernel):
    def forward(self, shard, zs, ze, aux):
        m = shard.all_max(shard.local_max(zs))
        z0 = zs - m[:, None]
        e = z0.exp()
        red = shard.all_sum(torch.stack([e.sum(-1), _zero_where_no_mass(z0.mul_(e), e).sum(-1)], -1))
        s = red[:, 0]
        h = s.log() - red[:, 1] / s  # H = log S - Σ p (z - m)
        return h, (m + s.log(), h)

    def backward(self, shard, zs, ze, aux, saved, g):
        lse, h = saved
        logp = zs - lse[:, None]
        p = logp.exp()
        return _zero_where_no_mass(logp.add_(h[:, None]).mul_(p), p).mul_(-g[:, None])


class KLKernel(Kernel):
    """KL in direction ``reverse`` (student ‖ expert) or ``forward`` (expert ‖ student).

    Temporaries are ordered so that at most two c × n blocks (plus a bool mask) are live
    besides the inputs, in forward and in backward: the chunk size sets the op's memory.
    """

    uses_expert = True

    def __init__(self, direction: str) -> None:
        assert direction in ("reverse", "forward")
        self.direction = direction

    def forward(self, shard, zs, ze, aux):
        maxes = shard.all_max(torch.stack([shard.local_max(zs), shard.local_max(ze)], -1))
        ms, me = maxes[:, 0], maxes[:, 1]
        # KL(p_x ‖ p_y) with x the distribution that weights the log-ratio.
        x, mx, y, my = (zs, ms, ze, me) if self.direction == "reverse" else (ze, me, zs, ms)
        sum_y = (y - my[:, None]).exp_().sum(-1)
        x0 = x - mx[:, None]
        # Differences of max-shifted logits: large only where the KL itself is large, so the
        # later "A/S - log S + log S'" does not cancel catastrophically (±1e4 logits).
        diff = (y - my[:, None]).neg_().add_(x0)  # x0 - y0
        ex = x0.exp_()
        sum_x = ex.sum(-1)
        a = _zero_where_no_mass(diff.mul_(ex), ex).sum(-1)
        del diff, ex
        red = shard.all_sum(torch.stack([sum_x, sum_y, a], -1))
        log_sx, log_sy = red[:, 0].log(), red[:, 1].log()
        kl = red[:, 2] / red[:, 0] - log_sx + log_sy
        lse_x, lse_y = mx + log_sx, my + log_sy
        lse_s, lse_e = (lse_x, lse_y) if self.direction == "reverse" else (lse_y, lse_x)
        return kl, (lse_s, lse_e, kl)

    def backward(self, shard, zs, ze, aux, saved, g):
        lse_s, lse_e, kl = saved
        ps = (zs - lse_s[:, None]).exp_()
        if self.direction == "forward":
            return ps.sub_((ze - lse_e[:, None]).exp_()).mul_(g[:, None])
        # log p_s - log p_e - KL = (z_s - z_e) - (lse_s - lse_e) - KL, without a log p_e block.
        grad = (zs - ze).sub_((lse_s - lse_e + kl)[:, None]).mul_(ps)
        return _zero_where_no_mass(grad, ps).mul_(g[:, None])


class JSDKernel(Kernel):
    """Generalised JSD with mixture m = β p_e + (1-β) p_s, for 0 < β < 1."""

    uses_expert = True

    def __init__(self, beta: float) -> None:
        if not 0.0 < beta < 1.0:
            raise ValueError(f"JSD beta must be in (0, 1) here, got {beta}")
        self.beta = beta
        self.log_b, self.log_1mb = math.log(beta), math.log1p(-beta)

    def _log_mixture(self, lps: torch.Tensor, lpe: torch.Tensor) -> torch.Tensor:
        lm = lpe + self.log_b
        return torch.logaddexp(lm, lps + self.log_1mb, out=lm)

    @staticmethod
    def _kl_to_mixture(lp: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
        """Σ p (log p − log m); consumes ``lp``."""
        p = lp.exp()
        return _zero_where_no_mass(lp.sub_(lm).mul_(p), p).sum(-1)

    def forward(self, shard, zs, ze, aux):
        maxes = shard.all_max(torch.stack([shard.local_max(zs), shard.local_max(ze)], -1))
        ms, me = maxes[:, 0], maxes[:, 1]
        sums = shard.all_sum(torch.stack([(zs - ms[:, None]).exp_().sum(-1),
                                          (ze - me[:, None]).exp_().sum(-1)], -1))
        lse_s, lse_e = ms + sums[:, 0].log(), me + sums[:, 1].log()
        lps, lpe = zs - lse_s[:, None], ze - lse_e[:, None]
        lm = self._log_mixture(lps, lpe)
        t_s = self._kl_to_mixture(lps, lm)
        t_e = self._kl_to_mixture(lpe, lm)
        del lps, lpe, lm
        terms = shard.all_sum(torch.stack([t_s, t_e], -1))
        t_s, t_e = terms[:, 0], terms[:, 1]
        return self.beta * t_e + (1.0 - self.beta) * t_s, (lse_s, lse_e, t_s)

    def backward(self, shard, zs, ze, aux, saved, g):
        lse_s, lse_e, kl_s_m = saved
        lps = zs - lse_s[:, None]
        lm = self._log_mixture(lps, ze - lse_e[:, None])
        ps = lps.exp()
        grad = lps.sub_(lm).sub_(kl_s_m[:, None]).mul_(ps)
        del lm
        return _zero_where_no_mass(grad, ps).mul_(g[:, None] * (1.0 - self.beta))


def kl_kernel(direction: str, beta: float) -> Kernel:
    """The kernel for a KL ``direction``; jsd at β = 0 / 1 is forward / reverse KL exactly."""
    if direction in ("reverse", "forward"):
        return KLKernel(direction)
    if direction == "jsd":
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"jsd beta must be in [0, 1], got {beta}")
        if beta == 0.0:
            return KLKernel("forward")
        if beta == 1.0:
            return KLKernel("reverse")
        return JSDKernel(beta)
    raise ValueError(f"direction must be 'reverse', 'forward' or 'jsd', got {direction!r}")


RESCUE_THRESHOLD = 1e-4
"""Default student probability under which a token counts as one the student cannot sample
(the "rescue mass" is the expert's probability on such tokens)."""

DIAGNOSTICS = ("rescue_mass", "grad_norm_reverse", "grad_norm_forward")
"""Per-row diagnostics of :class:`DiagnosticKL`, in the order of its ``rows`` columns."""


class DiagnosticKL(Kernel):
    """A KL/JSD kernel plus, per row, why a direction can or cannot move the student.

    * ``rescue_mass`` = Σ_j p_e,j · [p_s,j < threshold]: the expert's mass on tokens the student
      practically never samples (what guidance must "rescue");
    * ``grad_norm_reverse`` = ‖∂KL(p_s ‖ p_e)/∂z_s‖₂ = ‖p_s ⊙ (d − KL_rev)‖ with
      d = log p_s − log p_e: tokens with p_s ≈ 0 contribute ≈ 0 whatever the expert says;
    * ``grad_norm_forward`` = ‖∂KL(p_e ‖ p_s)/∂z_s‖₂ = ‖p_s − p_e‖.

    Both norms are of the unweighted per-row divergence, for whichever direction the loss uses.
    They reuse the inner kernel's (already reduced) log-normalisers and cost one extra
    all-reduce of [c, 6] partial sums per chunk. The reverse norm needs KL_rev, which is only
    known after the reduction, so it is expanded as S3 − 2·K·S2 + K²·S4 (S_k: the sums below);
    the partials are formed in float64 so the expansion does not cancel away a small norm.
    The forward pass appends each chunk's [c, 3] result to ``rows``; backward is the inner
    kernel's.
    """

    uses_expert = True

    def __init__(self, inner: Kernel, threshold: float = RESCUE_THRESHOLD) -> None:
        if not 0.0 < threshold < 1.0:
            raise ValueError(f"rescue threshold must be in (0, 1), got {threshold}")
        self.inner, self.threshold = inner, float(threshold)
        self.rows: list[torch.Tensor] = []

    def forward(self, shard, zs, ze, aux):
        val, saved = self.inner.forward(shard, zs, ze, aux)
        lse_s, lse_e = saved[0], saved[1]
        lps = (zs - lse_s[:, None]).double()
        lpe = (ze - lse_e[:, None]).double()
        ps, pe = lps.exp(), lpe.exp()
        d = _zero_where_no_mass(lps - lpe, ps)  # p_s·d := 0 where p_s = 0 (also p_e = 0 there)
        ps_d = ps * d
        ps2 = ps * ps
        parts = torch.stack([ps_d.sum(-1), (ps2 * d).sum(-1), (ps_d * ps_d).sum(-1), ps2.sum(-1),
                             (ps - pe).square().sum(-1),
                             torch.where(ps < self.threshold, pe, 0.0).sum(-1)], -1)
        del lps, lpe, ps, pe, d, ps_d, ps2
        s1, s2, s3, s4, fwd2, rescue = shard.all_sum(parts).unbind(-1)
        rev2 = (s3 - 2.0 * s1 * s2 + s1 * s1 * s4).clamp(min=0.0)
        self.rows.append(torch.stack([rescue, rev2.sqrt(), fwd2.sqrt()], -1).to(val.dtype))
        return val, saved

    def backward(self, shard, zs, ze, aux, saved, g):
        return self.inner.backward(shard, zs, ze, aux, saved, g)

    def result(self) -> dict[str, torch.Tensor]:
        """Per-row diagnostics ``{name: [T]}`` of every chunk the forward saw, in row order."""
        if not self.rows:
            return {k: torch.empty(0) for k in DIAGNOSTICS}
        cols = torch.cat(self.rows).unbind(-1)
        return dict(zip(DIAGNOSTICS, cols))
