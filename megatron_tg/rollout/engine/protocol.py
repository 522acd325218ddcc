"""SGLang's /generate wire format: request parsing and response building.

The embedded engine must be indistinguishable from an SGLang server to a client, so
the shapes here follow sglang 0.5.x (``GenerateReqInput`` and ``SamplingParams`` in
``srt/managers/io_struct.py`` / ``srt/sampling/sampling_params.py``, the meta_info
built in ``TokenizerManager._handle_batch_output``, finish reasons ``to_json`` in
``schedule_batch.py``). Only what an RL rollout needs is supported; a request that
asks for a feature with output-changing semantics we do not implement (penalties,
grammars, logit bias, streaming) gets a 400 instead of silently different samples.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from .errors import RequestError

# SGLang: temperatures below this are greedy (top_k=1, temperature=1).
SAMPLING_EPS = 1e-6
TOP_K_ALL = 1 << 30

# The API fields of sglang 0.5.23's ``SamplingParams`` (a msgspec Struct built with
# ``SamplingParams(**sampling_params)``, so any other key is a 400 there). The 3.12 test
# lane checks this set against SGLang's own class (tests/sglang/test_requests.py).
SGLANG_SAMPLING_KEYS = frozenset({
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "beam_width",
    "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed",
    "custom_params", "watermark",
})


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    min_p: float = 0.0
    min_new_tokens: int = 0
    stop_strs: list[str] = field(default_factory=list)
    stop_token_ids: set[int] = field(default_factory=set)
    ignore_eos: bool = False
    n: int = 1
    sampling_seed: int | None = None
    no_stop_trim: bool = False
    skip_special_tokens: bool = True

    @property
    def greedy(self) -> bool:
        return self.top_k == 1

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "SamplingParams":
        d = dict(d or {})
        unknown = sorted(set(d) - SGLANG_SAMPLING_KEYS)
        if unknown:
            # A 400 with the wording of SGLang's JSON contract gate: a misspelt key must
            # not silently sample with the default instead.
            raise RequestError(f"unknown field `{unknown[0]}` in sampling_params, expected one of "
                               + ", ".join(f"`{k}`" for k in sorted(SGLANG_SAMPLING_KEYS)))
        # Parameters whose non-default values change the output distribution. We refuse
        # them loudly: an RL trainer must never get samples from a different policy
        # than the one it asked for.
        unsupported = {
            "frequency_penalty": 0.0,
            "presence_penalty": 0.0,
            "repetition_penalty": 1.0,
            "json_schema": None,
            "regex": None,
            "ebnf": None,
            "structural_tag": None,
            "logit_bias": None,
            "stop_regex": None,
            "custom_params": None,
            "watermark": None,
            "spaces_between_special_tokens": True,
        }
        for key, default in unsupported.items():
            value = d.get(key)
            if value is not None and value != default and value != {} and value != []:
                raise RequestError(f"sampling_params.{key}={value!r} is not supported by the embedded engine")
        if (d.get("beam_width") or 1) > 1:
            raise RequestError("beam search is not supported by the embedded engine")

        p = cls()

        def get(name, default):
            v = d.get(name)
            return default if v is None else v

        p.max_new_tokens = int(get("max_new_tokens", 128))
        p.temperature = float(get("temperature", 1.0))
        p.top_p = float(get("top_p", 1.0))
        p.top_k = int(get("top_k", -1))
        p.min_p = float(get("min_p", 0.0))
        p.min_new_tokens = int(get("min_new_tokens", 0))
        p.ignore_eos = bool(get("ignore_eos", False))
        p.n = int(get("n", 1))
        p.no_stop_trim = bool(get("no_stop_trim", False))
        p.skip_special_tokens = bool(get("skip_special_tokens", True))
        seed = d.get("sampling_seed")
        p.sampling_seed = None if seed is None else int(seed)
        stop = d.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        p.stop_strs = [s for s in (stop or []) if s]
        p.stop_token_ids = {int(t) for t in (d.get("stop_token_ids") or []) if t is not None}

        # Same normalisation as SGLang: temperature ~0 means greedy, expressed as top_k=1
        # with temperature 1 (so greedy log-probs are those of the raw distribution).
        if 0 <= p.temperature < SAMPLING_EPS:
            p.temperature = 1.0
            p.top_k = 1
        if p.top_k == -1:
            p.top_k = TOP_K_ALL
        p.verify()
        return p

    def verify(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise RequestError(f"temperature must be a non-negative finite number, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < 1:
            raise RequestError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}")
        if self.max_new_tokens < 0:
            raise RequestError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise RequestError(f"min_new_tokens must be in [0, max_new_tokens], got {self.min_new_tokens}")
        if self.n < 1:
            raise RequestError(f"n must be at least 1, got {self.n}")


@dataclass
class GenRequest:
    """One sequence to generate (a batch or n>1 request is split into several)."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    created: float = field(default_factory=time.time)
    # Filled in by the scheduler.
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    num_retractions: int = 0
    weight_version: str = ""  # the engine's version when the request finished
    # Routed experts (see routing.py): asked for, from which position, and the result.
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    routed_experts: Any = None  # [rows, moe_layers, top_k] tensor once finished


def finish_stop(matched: int | str) -> dict[str, Any]:
    return {"type": "stop", "matched": matched}


def finish_length(length: int) -> dict[str, Any]:
    return {"type": "length", "length": length}


def finish_abort(message: str = "Aborted", status_code: int | None = None) -> dict[str, Any]:
    # status_code None: SGLang returns such an abort as a normal 200 response with the
    # tokens generated so far; an abort carrying a 4xx/5xx status becomes that HTTP error.
    return {"type": "abort", "message": message, "status_code": status_code,
            "err_type": None if status_code is None else "InternalServerError"}


def _as_list(value, n: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != n:
            raise RequestError(f"{name} has {len(value)} entries for a batch of {n}")
        return value
    return [value] * n


def parse_generate(body: dict[str, Any], tokenizer) -> tuple[list[GenRequest], bool]:
    """Split a /generate body into per-sequence requests.

    Returns (requests, is_single): a single prompt with n=1 answers with one object,
    anything else (a batch, or n>1) with a list, as SGLang does.
    """
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    if body.get("stream"):
        raise RequestError("stream=true is not supported by the embedded engine")
    for key in ("input_embeds", "image_data", "video_data", "audio_data", "lora_path"):
        if body.get(key) is not None:
            raise RequestError(f"{key} is not supported by the embedded engine")
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise RequestError("Either text or input_ids should be provided (exactly one).")
    if text is not None:
        if tokenizer is None:
            raise RequestError("text input needs a tokenizer; this model directory has none (send input_ids)")
        texts = [text] if isinstance(text, str) else list(text)
        prompts = [tokenizer.encode(t) for t in texts]
        batched = not isinstance(text, str)
    else:
        if not isinstance(input_ids, list) or not input_ids:
            raise RequestError("input_ids must be a non-empty list of ints or a list of such lists")
        batched = isinstance(input_ids[0], list)
        prompts = [list(map(int, p)) for p in input_ids] if batched else [list(map(int, input_ids))]
    if any(len(p) == 0 for p in prompts):
        raise RequestError("empty prompt")
    n_prompts = len(prompts)

    sp = body.get("sampling_params")
    sps = _as_list(sp if sp is not None else {}, n_prompts, "sampling_params") if batched else [sp or {}]
    params = [SamplingParams.from_dict(s) for s in sps]
    rl = body.get("return_logprob") or False
    rls = _as_list(rl, n_prompts, "return_logprob") if batched else [rl]
    ls = body.get("logprob_start_len")
    lss = _as_list(-1 if ls is None else ls, n_prompts, "logprob_start_len") if batched else [-1 if ls is None else ls]
    tn = body.get("top_logprobs_num")
    tns = _as_list(0 if tn is None else tn, n_prompts, "top_logprobs_num") if batched else [0 if tn is None else tn]

    from .routing import parse_routing_fields

    routing = parse_routing_fields(body, n_prompts, batched)
    rid = body.get("rid")
    if isinstance(rid, list):
        if len(rid) != n_prompts:
            raise RequestError(f"rid has {len(rid)} entries for a batch of {n_prompts}")
        rids = [str(r) for r in rid]
    elif rid is None:
        rids = [uuid.uuid4().hex for _ in range(n_prompts)]
    else:
        rids = [str(rid)] if not batched else [f"{rid}_{i}" for i in range(n_prompts)]

    reqs: list[GenRequest] = []
    any_n = False
    for i in range(n_prompts):
        n = params[i].n
        any_n |= n > 1
        for j in range(n):
            p = params[i]
            if n > 1:
                # Deliberate deviation: SGLang seeds every copy identically (identical
                # samples); distinct seeds make n>1 with a seed useful for RL groups.
                p = SamplingParams(**{**p.__dict__, "stop_token_ids": set(p.stop_token_ids),
                                      "stop_strs": list(p.stop_strs)})
                p.n = 1
                if p.sampling_seed is not None:
                    p.sampling_seed += j
            reqs.append(
                GenRequest(
                    rid=rids[i] if n == 1 else f"{rids[i]}_{j}",
                    input_ids=prompts[i],
                    params=p,
                    return_logprob=bool(rls[i]),
                    logprob_start_len=int(lss[i]),
                    top_logprobs_num=int(tns[i] or 0),
                    return_routed_experts=routing[i][0],
                    routed_experts_start_len=routing[i][1],
                )
            )
    return reqs, not batched and not any_n


def _finite(x: float) -> float:
    # JSON has no -inf; SGLang clamps log-probs to the dtype's min the same way.
    return x if x > -3.4028234663852886e38 else -3.4028234663852886e38


def build_response(req: GenRequest, weight_version: str, tokenizer) -> dict[str, Any]:
    """The JSON object SGLang returns for one finished sequence."""
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finish_reason,
        "prompt_tokens": len(req.input_ids),
        "weight_version": weight_version,
        "num_retractions": req.num_retractions,
        "completion_tokens": len(req.output_ids),
        "cached_tokens": 0,
        "e2e_latency": time.time() - req.created,
    }
    if req.return_logprob:
        # [logprob, token_id, text]; text is null unless return_text_in_logprobs.
        start = max(req.logprob_start_len, 0)
        meta["input_token_logprobs"] = [
            [None if lp is None else _finite(lp), tok, None]
            for lp, tok in zip(req.input_logprobs, req.input_ids[start:])
        ]
        meta["output_token_logprobs"] = [
            [_finite(lp), tok, None] for lp, tok in zip(req.output_logprobs, req.output_ids)
        ]
        meta["output_token_logprobs_length"] = len(req.output_ids)
        if req.top_logprobs_num > 0:
            meta["input_top_logprobs"] = [
                None if row is None else [[_finite(lp), t, None] for lp, t in row] for row in req.input_top_logprobs
            ]
            meta["output_top_logprobs"] = [[[_finite(lp), t, None] for lp, t in row] for row in req.output_top_logprobs]
    if req.return_routed_experts and req.routed_experts is not None:
        from .routing import encode_routed_experts

        meta["routed_experts"] = encode_routed_experts(req.routed_experts)
    out: dict[str, Any] = {}
    if tokenizer is not None:
        # Without a tokenizer the engine behaves like SGLang's --skip-tokenizer-init:
        # the response carries output_ids and meta_info only.
        out["text"] = decode_output_text(req, tokenizer)
    out["output_ids"] = list(req.output_ids)
    out["meta_info"] = meta
    return out


def decode_output_text(req: GenRequest, tokenizer) -> str:
    ids = list(req.output_ids)
    fr = req.finish_reason or {}
    trim = not req.params.no_stop_trim
    if trim and fr.get("type") == "stop" and isinstance(fr.get("matched"), int) and ids:
        ids = ids[:-1]  # SGLang drops the matched stop token from the text.
    text = tokenizer.decode(ids, skip_special_tokens=req.params.skip_special_tokens)
    if trim and fr.get("type") == "stop" and isinstance(fr.get("matched"), str):
        pos = text.find(fr["matched"])
        if pos >= 0:
            text = text[:pos]
    return text
