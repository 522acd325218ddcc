"""An Adam that keeps its state the way Transformer Engine's ``FusedAdam`` does, on CPU.

Read from TE's ``transformer_engine/pytorch/optimizers/fused_adam.py`` (2.x):

* the step counter is **one integer per param group**, ``group["step"]``, incremented at
  the top of ``step()`` (there is no per-parameter ``state[p]["step"]``, unlike
  ``torch.optim.AdamW``);
* the moments live in ``self.state[p]["exp_avg"]`` / ``["exp_avg_sq"]`` and are created
  lazily: ``step()`` runs ``initialize_state(p)`` (zeros) for a parameter whose
  ``len(self.state[p]) == 0`` — so an *empty* entry, such as the one a read of
  ``optimizer.state[p]`` leaves in the defaultdict, is indistinguishable from "never
  stepped", and the moments restart at zero;
* ``load_state_dict`` loads torch's way, then sets every saved state again as an fp32 copy
  (``set_scaled_state``), creating the entries it names.

The update is the one of TE's ``multi_tensor_adam`` kernel with ``adam_w_mode=1`` and bias
correction: m ← β₁m + (1 − β₁)g, v ← β₂v + (1 − β₂)g², p ← p − lr·(m̂ / (√v̂ + ε) + wd·p).

megatron-core picks its Adam class and its state-dict branch from module globals set at
import (``Adam``/``USING_PYTORCH_OPTIMIZER`` in ``megatron.core.optimizer``,
``HAVE_APEX_OR_TE``/``USING_TE_OPTIMIZER`` in ``distrib_optimizer``): :func:`install` points
them at this class, so ``get_megatron_optimizer`` runs its TE path around it.
"""

from __future__ import annotations

from copy import deepcopy
from itertools import chain

import torch


class TEStyleAdam(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 adam_w_mode=True, bias_correction=True):
        if not adam_w_mode:
            raise ValueError("TEStyleAdam implements FusedAdam's AdamW mode only")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      bias_correction=bias_correction))

    def initialize_state(self, p) -> None:
        self.state[p]["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
        self.state[p]["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if not group["params"]:
                continue
            group["step"] = group.get("step", 0) + 1  # FusedAdam: one counter per group
            t = group["step"]
            b1, b2 = group["betas"]
            c1 = 1 - b1 ** t if group["bias_correction"] else 1.0
            c2 = 1 - b2 ** t if group["bias_correction"] else 1.0
            for p in group["params"]:
                state = self.state[p]
                if len(state) == 0:  # FusedAdam's lazy initialisation
                    self.initialize_state(p)
                if p.grad is None:
                    continue
                g = p.grad.float()
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                update = (m / c1) / ((v / c2).sqrt() + group["eps"]) + group["weight_decay"] * p
                p.sub_(group["lr"] * update)

    def load_state_dict(self, state_dict):
        # FusedAdam.load_state_dict: torch's load, then every saved state set again in fp32
        super().load_state_dict(state_dict)
        saved = deepcopy(state_dict["param_groups"])
        id_map = dict(zip(chain.from_iterable(g["params"] for g in saved),
                          chain.from_iterable(g["params"] for g in self.param_groups)))
        for k, v in state_dict["state"].items():
            if k in id_map:
                param = id_map[k]
                self.state[param] = {}
                for name, value in v.items():
                    if value is not None:
                        self.state[param][name] = value.float().clone()


def install() -> None:
    """Make megatron-core build :class:`TEStyleAdam` and treat it as TE's FusedAdam."""
    from megatron.core import optimizer as mopt
    from megatron.core.optimizer import distrib_optimizer as dopt

    mopt.Adam = TEStyleAdam
    mopt.USING_PYTORCH_OPTIMIZER = False
    dopt.Adam = TEStyleAdam  # its isinstance check of the inner optimizer
    dopt.HAVE_APEX_OR_TE = True
    dopt.USING_TE_OPTIMIZER = True
