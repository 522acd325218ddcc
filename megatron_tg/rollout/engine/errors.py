"""The embedded engine's request error, in a module of its own: the request parser
(:mod:`.protocol`) and the routed-experts fields it delegates to (:mod:`.routing`) both raise
it, and :mod:`.routing` must not import :mod:`.protocol`, which imports it."""

from __future__ import annotations


class RequestError(ValueError):
    """A malformed or unsupported request: the server answers 400 with this message."""
