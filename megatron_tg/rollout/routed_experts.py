"""The experts the engine routed each token of a rollout to (for routing replay).

Storage contract (:class:`RoutedExperts`): row ``i`` holds, for every MoE layer, the top-k
expert ids the engine's router picked for ``token_ids[i]`` as an *input* token; the rows
cover positions ``[0, rows)``. A rollout's last token is never fed to the engine, so
``rows <= len(token_ids) - 1``; the trainer routes any position without a row freely (none
of them can influence a loss row: they come after every generated token of the rollout).
Ids are kept as uint8 when the model has at most 256 experts (Qwen3-30B-A3B: 128), else
int16: at 48 MoE layers x top-8 a token costs 384 bytes.

Assembly (:class:`RoutedExpertsBuilder`): each turn requests only the positions not covered
yet (``routed_experts_start_len = builder.covered``), and its reply's rows are appended.
SGLang returns one slice per decoder layer (``num_hidden_layers``, dense layers included)
and, with expert load balancing, physical expert slots; the builder keeps the MoE layers'
slices and maps physical slots to logical experts when given the map.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np


def compact_dtype(num_experts: int) -> np.dtype:
    return np.dtype(np.uint8) if num_experts <= 256 else np.dtype(np.int16)


@dataclass
class RoutedExperts:
    ids: np.ndarray
    """[rows, layers, top_k] expert ids (uint8 / int16), row i = token i."""
    layers: tuple[int, ...]
    """Decoder-layer index (0-based, over the whole model) of each layer slice."""
    num_experts: int

    @property
    def rows(self) -> int:
        return int(self.ids.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.ids.shape[2])

    def validate(self, num_tokens: int, where: str = "routed_experts") -> None:
        from megatron_tg.rollout.errors import RolloutFormatError

        if self.ids.ndim != 3 or self.ids.shape[1] != len(self.layers):
            raise RolloutFormatError(where, f"ids of shape {self.ids.shape} for "
                                     f"{len(self.layers)} layers (want [rows, layers, top_k])")
        if self.rows > max(num_tokens - 1, 0):
            raise RolloutFormatError(where, f"{self.rows} rows for {num_tokens} tokens (at most "
                                     "one per token but the last)")
        if self.ids.size and int(self.ids.max()) >= self.num_experts:
            raise RolloutFormatError(where, f"expert id {int(self.ids.max())} >= num_experts "
                                     f"{self.num_experts}")

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.ids.shape), "dtype": str(self.ids.dtype),
                "layers": list(self.layers), "num_experts": self.num_experts,
                "data": base64.b64encode(np.ascontiguousarray(self.ids).tobytes()).decode("ascii")}

    @classmethod
    def from_dict(cls, d: Any, where: str = "routed_experts") -> "RoutedExperts":
        from megatron_tg.rollout.errors import RolloutFormatError

        if not isinstance(d, dict) or set(d) != {"shape", "dtype", "layers", "num_experts", "data"}:
            raise RolloutFormatError(where, "expected {shape, dtype, layers, num_experts, data}")
        if d["dtype"] not in ("uint8", "int16"):
            raise RolloutFormatError(f"{where}.dtype", f"must be uint8 or int16, got {d['dtype']!r}")
        try:
            ids = np.frombuffer(base64.b64decode(d["data"]), dtype=d["dtype"]).reshape(d["shape"])
        except (ValueError, TypeError) as e:
            raise RolloutFormatError(f"{where}.data", f"does not hold {d['shape']} {d['dtype']}: {e}")
        return cls(ids=ids, layers=tuple(int(x) for x in d["layers"]),
                   num_experts=int(d["num_experts"]))


class RoutedExpertsBuilder:
    """Appends the engine's per-turn replies into one token-exact :class:`RoutedExperts`."""

    def __init__(self, moe_layers: Sequence[int], num_layers: int, top_k: int,
                 num_experts: int, physical_to_logical: np.ndarray | None = None) -> None:
        self.moe_layers = tuple(moe_layers)
        self.num_layers, self.top_k, self.num_experts = num_layers, top_k, num_experts
        self.physical_to_logical = physical_to_logical
        self.parts: list[np.ndarray] = []
        self.tokens: list[int] = []
        """The token id at each covered position (what the rows were computed for)."""
        self.covered = 0
        """Positions with a row so far: the next request's ``routed_experts_start_len``."""

    def start_for(self, prompt: Sequence[int]) -> int:
        """``routed_experts_start_len`` for a request on ``prompt``: the covered positions
        whose tokens the prompt still holds (a harness that rewrote its context loses the
        rows after the first changed token, which the reply then recomputes)."""
        keep = 0
        limit = min(self.covered, len(prompt))
        while keep < limit and self.tokens[keep] == prompt[keep]:
            keep += 1
        if keep < self.covered:
            self.truncate(keep)
        return keep

    def truncate(self, n: int) -> None:
        ids = np.concatenate(self.parts)[:n] if self.parts else None
        self.parts = [ids] if ids is not None and n else []
        self.tokens = self.tokens[:n]
        self.covered = n

    def add(self, start: int, ids: np.ndarray, tokens: Sequence[int] | None = None) -> None:
        """A reply's int32 ``[rows, layers, top_k]`` for positions ``[start, start + rows)``,
        whose input tokens were ``tokens`` (one per row)."""
        if tokens is not None and len(tokens) != ids.shape[0]:
            raise ValueError(f"{ids.shape[0]} routed-expert rows for {len(tokens)} tokens")
        if start != self.covered:
            raise ValueError(f"routed experts from position {start}, but {self.covered} are "
                             "covered: replies must continue where the last one ended")
        if ids.ndim != 3 or ids.shape[2] != self.top_k:
            raise ValueError(f"routed experts of shape {ids.shape}, want [rows, layers, {self.top_k}]")
        if ids.shape[1] == self.num_layers and self.num_layers != len(self.moe_layers):
            ids = ids[:, list(self.moe_layers)]  # SGLang: one slice per decoder layer
        elif ids.shape[1] != len(self.moe_layers):
            raise ValueError(f"routed experts for {ids.shape[1]} layers; the model has "
                             f"{self.num_layers} layers, {len(self.moe_layers)} of them MoE")
        if self.physical_to_logical is not None:
            ids = self.physical_to_logical[ids]
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.num_experts):
            raise ValueError(f"routed expert ids outside [0, {self.num_experts}): "
                             f"{int(ids.min())}..{int(ids.max())}")
        self.parts.append(ids.astype(compact_dtype(self.num_experts)))
        self.tokens += list(tokens) if tokens is not None else [-1] * int(ids.shape[0])
        self.covered += int(ids.shape[0])

    def for_rollout(self, token_ids: Sequence[int]) -> RoutedExperts:
        """The rows of the positions whose tokens match the rollout's (at most all but its
        last token)."""
        self.start_for(token_ids[:-1])
        return self.build()

    def build(self) -> RoutedExperts:
        dtype = compact_dtype(self.num_experts)
        ids = (np.concatenate(self.parts) if self.parts
               else np.zeros((0, len(self.moe_layers), self.top_k), dtype=dtype))
        return RoutedExperts(ids=ids, layers=self.moe_layers, num_experts=self.num_experts)
