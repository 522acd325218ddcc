"""Token sampling and the log-probs returned with each sampled token.

Log-prob convention (matches sglang 0.5.x ``srt/layers/sampler.py`` defaults):

* sampled requests: ``log_softmax(logits / temperature)`` over the full vocabulary,
  evaluated at the sampled token, *before* top-k / top-p / min-p filtering and
  renormalisation (SGLang takes ``log(probs)`` of the temperature-scaled softmax and
  filters a sorted copy for sampling);
* greedy requests (temperature < 1e-6, normalised to top_k=1, temperature=1): the raw
  ``log_softmax(logits)``;
* with the environment variable ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` (same name as
  SGLang's switch) the raw ``log_softmax(logits)`` is returned for every request.

Prompt log-probs (``logprob_start_len >= 0``) are the raw ``log_softmax(logits)``, as
SGLang's logits processor computes them without temperature.

A trainer recomputing log-probs of the rollout policy must therefore divide its
logits by the same temperature (or run the engine with the env switch at T != 1).
"""

from __future__ import annotations

import os

import torch

from .protocol import GenRequest

RETURN_ORIGINAL_LOGPROB = os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true", "yes")


def _filter_probs(probs: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Zero out tokens outside top-k / top-p / min-p (SGLang's joint torch rule)."""
    sorted_p, idx = probs.sort(descending=True)
    if top_k < sorted_p.numel():
        sorted_p[top_k:] = 0.0
    if top_p < 1.0:
        # Same predicate as SGLang: drop a token once the mass strictly before it exceeds p.
        cum = torch.cumsum(sorted_p, dim=0)
        sorted_p[(cum - sorted_p) > top_p] = 0.0
    if min_p > 0.0:
        sorted_p[sorted_p < sorted_p[0] * min_p] = 0.0
    out = torch.zeros_like(probs)
    out.scatter_(0, idx, sorted_p)
    return out


def sample_next(
    logits: torch.Tensor,
    reqs: list[GenRequest],
    generators: list[torch.Generator | None],
    fallback: torch.Generator,
    eos_ids: set[int],
) -> tuple[list[int], list[float], list[list[tuple[float, int]] | None]]:
    """Sample one token per row of ``logits`` [B, V].

    Returns (token ids, their log-probs under the convention above, top log-probs for
    rows that asked for them).
    """
    logits = logits.float()
    tokens: list[int] = []
    lps: list[float] = []
    tops: list[list[tuple[float, int]] | None] = []
    for i, req in enumerate(reqs):
        row = logits[i]
        p = req.params
        if len(req.output_ids) < p.min_new_tokens:
            # SGLang's min_new_tokens penalizer: stop tokens are impossible until then.
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else eos_ids)
            if banned:
                row = row.clone()
                row[torch.tensor(sorted(banned), dtype=torch.long)] = float("-inf")
        raw_logprobs = torch.log_softmax(row, dim=-1)
        if p.greedy:
            tok = int(torch.argmax(row))
            ret_logprobs = raw_logprobs
        else:
            scaled = torch.log_softmax(row / p.temperature, dim=-1)
            probs = _filter_probs(scaled.exp(), p.top_k, p.top_p, p.min_p)
            gen = generators[i] if generators[i] is not None else fallback
            tok = int(torch.multinomial(probs, 1, generator=gen))
            ret_logprobs = raw_logprobs if RETURN_ORIGINAL_LOGPROB else scaled
        tokens.append(tok)
        lps.append(float(ret_logprobs[tok]))
        if req.return_logprob and req.top_logprobs_num > 0:
            v, ix = torch.topk(ret_logprobs, min(req.top_logprobs_num, ret_logprobs.numel()))
            tops.append(list(zip(v.tolist(), ix.tolist())))
        else:
            tops.append(None)
    return tokens, lps, tops


def prompt_logprobs(
    logits: torch.Tensor, prompt: list[int], start: int, top_n: int
) -> tuple[list[float | None], list[list[tuple[float, int]] | None]]:
    """Raw log-probs of prompt tokens ``prompt[start:]`` from prefill logits [T, V].

    The first prompt token has no prediction, so it gets ``None`` (SGLang does the same).
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    vals: list[float | None] = []
    tops: list[list[tuple[float, int]] | None] = []
    for pos in range(start, len(prompt)):
        if pos == 0:
            vals.append(None)
            tops.append(None)
            continue
        row = logprobs[pos - 1]
        vals.append(float(row[prompt[pos]]))
        if top_n > 0:
            v, ix = torch.topk(row, min(top_n, row.numel()))
            tops.append(list(zip(v.tolist(), ix.tolist())))
        else:
            tops.append(None)
    return vals, tops
