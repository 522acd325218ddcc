"""What the SGLang client reads from a server's answers: the result of one ``/generate``
(:class:`GenerateResult`, built by :func:`decode_generate`), a reply body that is JSON or
plain text (:func:`decode_body`), and the hint added to an HTTP 401 / 403 (:func:`auth_hint`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class GenerateResult:
    rid: str  # the logical request id (the server saw f"{rid}@{attempt}")
    output_ids: list[int]
    output_logprobs: list[float] | None
    finish_reason: dict[str, Any]
    weight_version: str | None
    server: str
    text: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    attempts: int = 1
    meta_info: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def finish_type(self) -> str:
        return str((self.finish_reason or {}).get("type"))


def decode_generate(data: Any, rid: str, server: str) -> GenerateResult:
    """``/generate``'s decoded JSON answer for logical request ``rid``, from ``server``."""
    if isinstance(data, list):  # a router may wrap single answers; take ours
        data = data[0]
    meta = data.get("meta_info", {})
    lps = meta.get("output_token_logprobs")
    return GenerateResult(
        rid=rid,
        output_ids=list(data.get("output_ids") or []),
        output_logprobs=None if lps is None else [float(x[0]) for x in lps],
        finish_reason=meta.get("finish_reason") or {},
        weight_version=meta.get("weight_version"),
        server=server,
        text=data.get("text"),
        prompt_tokens=int(meta.get("prompt_tokens") or 0),
        completion_tokens=int(meta.get("completion_tokens") or 0),
        meta_info=meta,
    )


def decode_body(text: str) -> Any:
    """An admin call's reply: its JSON, the text itself where it is not JSON, None when empty."""
    try:
        return json.loads(text) if text else None
    except ValueError:  # some endpoints (/flush_cache) answer plain text
        return text


def auth_hint(status: int, sent_key: bool) -> str:
    if status not in (401, 403):
        return ""
    return (" (the server refused this client's API key: is it the job's key, rollout.api_key_file?)"
            if sent_key else " (the server requires an API key: set rollout.api_key_file)")
