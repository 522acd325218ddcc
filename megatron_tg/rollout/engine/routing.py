"""Returning routed experts the way SGLang 0.5.23 does (``return_routed_experts``).

SGLang's contract (``srt/managers/io_struct.py``, ``scheduler.py``, ``tokenizer_manager.py``):

* the server must run with ``--enable-return-routed-experts`` (it allocates the capture
  buffers) and the request must set ``return_routed_experts: true``;
* ``routed_experts_start_len`` (default 0) is an absolute position in ``[0, prompt_tokens]``;
  the reply covers positions ``[start_len, seqlen - 1)``: one row per token that went
  through the model, i.e. every token except the last generated one (never fed back);
* ``meta_info["routed_experts"]`` is the base64 of an int32 array ``[rows, layers, top_k]``
  with the expert each MoE router picked (SGLang: ``layers = num_hidden_layers``; with
  expert load balancing the ids are *physical* slots, which the caller must map back).

The embedded engine keeps all of it except the padding rows of non-MoE layers: it returns
one layer slice per MoE layer (``layers = number of MoE layers``), and it refuses a request
for routed experts when the flag is off (SGLang silently returns nothing) so a missing flag
cannot go unnoticed.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import torch

from .errors import RequestError


def parse_routing_fields(body: dict[str, Any], n_prompts: int, batched: bool
                         ) -> list[tuple[bool, int]]:
    """(return_routed_experts, routed_experts_start_len) per prompt of a /generate body."""
    want, start = body.get("return_routed_experts", False), body.get("routed_experts_start_len", 0)
    wants = want if isinstance(want, list) else [want] * n_prompts
    starts = start if isinstance(start, list) else [start] * n_prompts
    if len(wants) != n_prompts or len(starts) != n_prompts:
        raise RequestError(f"return_routed_experts / routed_experts_start_len must have one entry "
                           f"per prompt ({n_prompts})")
    out = []
    for w, s in zip(wants, starts):
        if not isinstance(w, bool):
            raise RequestError(f"return_routed_experts must be a boolean, got {w!r}")
        if isinstance(s, bool) or not isinstance(s, int):
            raise RequestError(f"routed_experts_start_len must be an integer, got {s!r}")
        out.append((w, s))
    return out if batched else out[:1]


def start_len_error(start_len: int, prompt_tokens: int) -> str | None:
    """SGLang's check of ``routed_experts_start_len`` (the request is aborted with it)."""
    if start_len < 0:
        return (f"routed_experts_start_len={start_len} is lower than 0. "
                "Please use a non-negative routed_experts_start_len.")
    if start_len > prompt_tokens:
        return (f"routed_experts_start_len={start_len} is higher than the number of input "
                f"tokens {prompt_tokens}. Please use a smaller routed_experts_start_len.")
    return None


def encode_routed_experts(rows: torch.Tensor) -> str:
    """[rows, layers, top_k] expert ids -> SGLang's base64 int32 payload."""
    return base64.b64encode(rows.to(torch.int32).contiguous().numpy().tobytes()).decode("ascii")


def decode_routed_experts(payload: str, num_layers: int, top_k: int) -> np.ndarray:
    """SGLang's ``meta_info["routed_experts"]`` -> int32 ``[rows, num_layers, top_k]``."""
    flat = np.frombuffer(base64.b64decode(payload), dtype=np.int32)
    if flat.size % (num_layers * top_k):
        raise ValueError(f"routed_experts holds {flat.size} ids, not a multiple of "
                         f"layers x top_k = {num_layers} x {top_k}")
    return flat.reshape(-1, num_layers, top_k)
