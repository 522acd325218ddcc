"""Errors of the rollout package (its data model and its SGLang client), in a module of their
own so that every part of it (and the chat package above it) can raise and classify them
without import cycles: ``client`` and ``weight_client`` both raise :class:`SGLangClientError`
and import it from here, not from each other.
"""

from __future__ import annotations

from typing import Sequence


class FramingError(ValueError):
    """The conversation / template / tokens do not line up as the chat framing requires.

    Raised by :mod:`megatron_tg.chat.template` and :mod:`megatron_tg.chat.feedback`; defined with the data model so that the rollout
    manager can classify it without importing the chat package (chat depends on rollout,
    never the reverse)."""


class RolloutFormatError(ValueError):
    """A malformed rollout; ``field`` names the offending field (e.g. ``segments[2].logprobs``)."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


class SGLangClientError(RuntimeError):
    """A request failed on every server it was tried on (or an admin call failed)."""

    def __init__(self, message: str, rid: str | None = None, errors: Sequence[tuple[str, BaseException]] = ()):
        super().__init__(message)
        self.rid = rid
        self.errors = list(errors)


class SGLangRequestError(SGLangClientError):
    """The server rejected the request (HTTP 4xx): retrying elsewhere would not help."""
