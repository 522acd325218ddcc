"""Errors of the rollout data model, in a module of their own so that every part of it (and
the chat package above it) can raise and classify them without import cycles."""

from __future__ import annotations


class FramingError(ValueError):
    """The conversation / template / tokens do not line up as the chat framing requires.

    Raised by :mod:`megatron_tg.chat.framing`; defined with the data model so that the rollout
    manager can classify it without importing the chat package (chat depends on rollout,
    never the reverse)."""


class RolloutFormatError(ValueError):
    """A malformed rollout; ``field`` names the offending field (e.g. ``segments[2].logprobs``)."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")
