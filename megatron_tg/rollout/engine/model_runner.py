"""A Hugging Face causal LM driven step by step with a batched, left-padded KV cache.

The scheduler keeps one running batch. Every row is ``[padding | real tokens]``: new
requests are prefilled as their own left-padded sub-batch and then merged into the
running batch by left-padding the shorter cache, so requests join and leave between
any two decode steps (continuous batching) without recomputing anyone's prefix.
Positions are passed explicitly (``position_ids``) so padding never shifts RoPE, and
the attention mask hides padded columns.

Padded key/value slots are zeroed after prefill: with SDPA a fully masked query row
can produce non-finite values, and even a masked NaN poisons ``softmax @ V``.

With ``capture_routing`` every forward also records the experts each MoE router picked
for each fed token (``last_routing``: [B, T, moe_layers, top_k], the model's own top-k, read
from its router modules by forward hooks), which the scheduler returns like SGLang's
``return_routed_experts``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch


@dataclass
class BatchState:
    cache: object  # transformers Cache (DynamicCache)
    mask: torch.Tensor  # [B, L] long, 1 = real token
    next_pos: torch.Tensor  # [B] long, position id of the next token per row

    @property
    def size(self) -> int:
        return int(self.mask.shape[0])


def _layers(cache) -> list[tuple[object, str, str]]:
    """(holder, key_attr, value_attr) triples for each layer, across transformers versions."""
    if hasattr(cache, "layers"):
        return [(layer, "keys", "values") for layer in cache.layers]
    # transformers < 4.56 keeps parallel lists on the cache itself.
    return [(_ListSlot(cache.key_cache, cache.value_cache, i), "k", "v") for i in range(len(cache.key_cache))]


class _ListSlot:
    def __init__(self, ks, vs, i):
        self._ks, self._vs, self._i = ks, vs, i

    @property
    def k(self):
        return self._ks[self._i]

    @k.setter
    def k(self, t):
        self._ks[self._i] = t

    @property
    def v(self):
        return self._vs[self._i]

    @v.setter
    def v(self, t):
        self._vs[self._i] = t


def _map_kv(cache, fn) -> None:
    for holder, ka, va in _layers(cache):
        setattr(holder, ka, fn(getattr(holder, ka)))
        setattr(holder, va, fn(getattr(holder, va)))


class _RoutingCapture:
    """Forward hooks on every MoE router: the top-k expert ids of the last forward.

    transformers 5 routes in a ``*TopKRouter`` module returning (logits, scores, indices);
    older versions expose only the gate ``Linear`` of the sparse MoE block, whose top-k of
    the softmax is what those versions' block computes."""

    def __init__(self, model: torch.nn.Module, top_k: int) -> None:
        self.top_k = top_k
        self.captured: list[torch.Tensor | None] = []
        routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
        if routers:
            hooks = [(m, self._from_router) for m in routers]
        else:
            hooks = [(m.gate, self._from_gate) for m in model.modules()
                     if type(m).__name__.endswith("SparseMoeBlock") and hasattr(m, "gate")]
        if not hooks:
            raise ValueError(f"{type(model).__name__} has no MoE router to capture routing from")
        self.num_layers = len(hooks)
        for i, (module, fn) in enumerate(hooks):
            module.register_forward_hook(lambda mod, args, out, i=i, fn=fn: fn(i, out))

    def _from_router(self, i: int, out) -> None:
        self.captured[i] = out[2].detach().clone()

    def _from_gate(self, i: int, out) -> None:
        probs = torch.softmax(out.detach().float(), dim=-1)
        self.captured[i] = torch.topk(probs, self.top_k, dim=-1).indices

    def start(self) -> None:
        self.captured = [None] * self.num_layers

    def result(self, batch: int, tokens: int) -> torch.Tensor:
        """[B, T, layers, top_k] int16 of the forward since :meth:`start`."""
        if any(c is None for c in self.captured):
            raise RuntimeError("a MoE router did not run in this forward")
        return torch.stack(self.captured, dim=1).to(torch.int16).view(
            batch, tokens, self.num_layers, self.top_k)


class ModelRunner:
    def __init__(self, model_path: str, dtype: torch.dtype = torch.float32,
                 attn_implementation: str | None = None, capture_routing: bool = False):
        from transformers import AutoModelForCausalLM

        kwargs = {}
        if attn_implementation:
            kwargs["attn_implementation"] = attn_implementation
        try:
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, **kwargs)
        except TypeError:  # transformers < 4.56 spells it torch_dtype
            model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=dtype, **kwargs)
        self.model = model.eval()
        self.config = model.config
        params = inspect.signature(model.forward).parameters
        # transformers 5.x renamed past_key_values -> cache (the old name warns).
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.routing = (_RoutingCapture(model, int(self.config.num_experts_per_tok))
                        if capture_routing else None)
        self.last_routing: torch.Tensor | None = None
        """[B, T, moe_layers, top_k] routed experts of the last prefill/decode (capture on)."""

    def _forward(self, ids: torch.Tensor, **kw):
        if self.routing is not None:
            self.routing.start()
        out = self.model(input_ids=ids, **kw)
        if self.routing is not None:
            self.last_routing = self.routing.result(*ids.shape)
        return out

    def _new_cache(self):
        from transformers import DynamicCache

        try:
            return DynamicCache(config=self.config)
        except TypeError:
            return DynamicCache()

    @torch.inference_mode()
    def prefill(self, seqs: list[list[int]], full_logits: bool) -> tuple[BatchState, torch.Tensor]:
        """Run the prompts; return the new batch and logits.

        logits: [B, V] for the last position, or [B, T, V] (aligned to the right-aligned
        sequences, i.e. row b's real tokens occupy the last len(seqs[b]) positions) when
        ``full_logits`` (prompt log-probs were requested).
        """
        lens = [len(s) for s in seqs]
        t = max(lens)
        ids = torch.zeros(len(seqs), t, dtype=torch.long)
        mask = torch.zeros(len(seqs), t, dtype=torch.long)
        for b, s in enumerate(seqs):
            ids[b, t - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[b, t - len(s):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = self._new_cache()
        out = self._forward(
            ids,
            attention_mask=mask,
            position_ids=pos,
            use_cache=True,
            logits_to_keep=0 if full_logits else 1,
            **{self._cache_kw: cache},
        )
        pad = (mask == 0)[:, None, :, None]  # broadcast over heads and head_dim
        if bool(pad.any()):
            _map_kv(cache, lambda x: x.masked_fill(pad, 0.0))
        state = BatchState(cache=cache, mask=mask, next_pos=torch.tensor(lens, dtype=torch.long))
        logits = out.logits if full_logits else out.logits[:, -1, :]
        return state, logits

    @torch.inference_mode()
    def decode(self, state: BatchState, tokens: list[int]) -> torch.Tensor:
        """Feed one token per row; return next-token logits [B, V]."""
        ids = torch.tensor(tokens, dtype=torch.long).view(-1, 1)
        state.mask = torch.cat([state.mask, torch.ones(state.size, 1, dtype=torch.long)], dim=1)
        out = self._forward(
            ids,
            attention_mask=state.mask,
            position_ids=state.next_pos.view(-1, 1),
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kw: state.cache},
        )
        state.next_pos = state.next_pos + 1
        return out.logits[:, -1, :]

    @staticmethod
    def merge(a: BatchState | None, b: BatchState) -> BatchState:
        """Concatenate two batches along the batch dim, left-padding the shorter one."""
        if a is None or a.size == 0:
            return b
        la, lb = a.mask.shape[1], b.mask.shape[1]
        L = max(la, lb)

        def lpad(x: torch.Tensor, extra: int) -> torch.Tensor:
            if extra == 0:
                return x
            shape = list(x.shape)
            shape[-2] = extra
            return torch.cat([x.new_zeros(shape), x], dim=-2)

        for (ha, ka, va), (hb, kb, vb) in zip(_layers(a.cache), _layers(b.cache)):
            setattr(ha, ka, torch.cat([lpad(getattr(ha, ka), L - la), lpad(getattr(hb, kb), L - lb)], dim=0))
            setattr(ha, va, torch.cat([lpad(getattr(ha, va), L - la), lpad(getattr(hb, vb), L - lb)], dim=0))
        mask = torch.cat(
            [
                torch.cat([a.mask.new_zeros(a.size, L - la), a.mask], dim=1),
                torch.cat([b.mask.new_zeros(b.size, L - lb), b.mask], dim=1),
            ],
            dim=0,
        )
        return BatchState(cache=a.cache, mask=mask, next_pos=torch.cat([a.next_pos, b.next_pos]))

    @staticmethod
    def select(state: BatchState, keep: list[int]) -> BatchState:
        """Keep only rows ``keep`` and drop leading columns that are padding in every row."""
        idx = torch.tensor(keep, dtype=torch.long)
        mask = state.mask.index_select(0, idx)
        real_cols = mask.any(dim=0).nonzero()
        start = int(real_cols[0]) if real_cols.numel() else mask.shape[1]
        _map_kv(state.cache, lambda x: x.index_select(0, idx)[..., start:, :])
        return BatchState(cache=state.cache, mask=mask[:, start:], next_pos=state.next_pos.index_select(0, idx))
