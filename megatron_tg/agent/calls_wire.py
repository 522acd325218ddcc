"""The wire between the tests and the tested code when a task is graded by calls.

Contract: a value crosses the boundary only as **plain data** or as an **opaque handle**.
Plain data is ``None``, ``bool``, ``int``, ``float``, ``complex``, ``str``, ``bytes`` and
``list``/``tuple``/``dict``/``set``/``frozenset`` of plain data, each judged by its *exact*
type (``type(x) is int``, never ``isinstance``): a subclass of ``int`` with its own ``__eq__``,
a numpy array, a ``Fraction`` — anything else — is not data but an object of the tested code,
and it crosses as a handle, which the test side can call and read attributes of but which
equals nothing but itself and has no truth value. Decoding is strict: a frame of another
shape is a :class:`WireError`, never a value.

Frames are a 4-byte big-endian length and that many bytes of JSON (ASCII, so lone
surrogates in strings survive as escapes). This module is loaded by both sides: the test
side (the grader's own process tree) and the tested side (inside the sandbox, from the
grader's read-only directory), so it imports nothing but the standard library.
"""

from __future__ import annotations

import json
import os
import select
import time
from typing import Any, Callable

MAX_FRAME = 4 << 20
"""Bytes of one frame; a longer one is refused (the channel ends, the call fails). JSON of
nested empty lists grows about 29-fold when parsed (an independent review measured 463 MB
for a 16 MiB frame), so the bound is what the test side can afford to parse, not more."""
MAX_DEPTH = 200
"""Nesting of one value (deeper is refused on both sides)."""
MAX_NODES = 1_000_000
"""Values in one frame (every element counts)."""
MAX_HASHED = 100_000
"""Elements of one set or dict (each insertion can cost the set's size when hashes collide:
the deadline is checked between insertions)."""
MAX_FROZEN = 10_000
"""Elements of one frozenset: built in one call, where no deadline is checked."""


class WireError(Exception):
    """A frame or value that is not what this protocol sends."""


_ATOMS = {type(None): "n", bool: "b", int: "i", float: "f", complex: "c", str: "s", bytes: "y"}
_SEQS = {list: "l", tuple: "t", set: "S", frozenset: "F"}


def encode(value: Any, handle: Callable[[Any], list]) -> Any:
    """``value`` as a JSON tree; ``handle(obj)`` gives the tree of a non-plain object."""
    count = [0]

    def enc(v: Any, depth: int) -> Any:
        count[0] += 1
        if depth > MAX_DEPTH or count[0] > MAX_NODES:
            raise WireError("a value too deep or too large to send")
        t = type(v)
        tag = _ATOMS.get(t)
        if tag == "n":
            return ["n"]
        if tag in ("b", "s"):
            return [tag, v]
        if tag == "i":
            return ["i", hex(v)]  # no digit limit, exact
        if tag == "f":
            return ["f", v.hex()]
        if tag == "c":
            return ["c", v.real.hex(), v.imag.hex()]
        if tag == "y":
            return ["y", v.hex()]
        tag = _SEQS.get(t)
        if tag is not None:
            return [tag, [enc(x, depth + 1) for x in v]]
        if t is dict:
            return ["d", [[enc(k, depth + 1), enc(x, depth + 1)] for k, x in v.items()]]
        return handle(v)

    return enc(value, 0)


def decode(tree: Any, handle: Callable[[list], Any], deadline: float | None = None) -> Any:
    """The value of a tree :func:`encode` made; ``handle(node)`` for ``["h", ...]`` nodes.
    ``deadline`` (monotonic seconds) is checked as the value is built, every few elements
    and inside sets and dicts between insertions: ints that all hash alike make building
    a set quadratic (an independent review stalled a test side for a minute that way)."""
    count = [0]

    def tick() -> None:
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError("the tested code's value took too long to read")

    def dec(node: Any, depth: int) -> Any:
        count[0] += 1
        if not count[0] & 255:
            tick()
        if depth > MAX_DEPTH or count[0] > MAX_NODES:
            raise WireError("a value too deep or too large")
        if type(node) is not list or not node or type(node[0]) is not str:
            raise WireError("a value that is not a tagged list")
        tag, args = node[0], node[1:]
        try:
            if tag == "n" and not args:
                return None
            if tag == "b" and len(args) == 1 and type(args[0]) is bool:
                return args[0]
            if tag == "s" and len(args) == 1 and type(args[0]) is str:
                return args[0]
            if tag == "i" and len(args) == 1 and type(args[0]) is str:
                return int(args[0], 16)
            if tag == "f" and len(args) == 1 and type(args[0]) is str:
                return float.fromhex(args[0])
            if tag == "c" and len(args) == 2 and all(type(a) is str for a in args):
                return complex(float.fromhex(args[0]), float.fromhex(args[1]))
            if tag == "y" and len(args) == 1 and type(args[0]) is str:
                return bytes.fromhex(args[0])
            if tag in ("l", "t") and len(args) == 1 and type(args[0]) is list:
                items = [dec(x, depth + 1) for x in args[0]]
                return items if tag == "l" else tuple(items)
            if tag in ("S", "F", "d") and len(args) == 1 and type(args[0]) is list and (
                    len(args[0]) > (MAX_FROZEN if tag == "F" else MAX_HASHED)):
                raise WireError(f"a set or dict of {len(args[0])} elements (at most {MAX_HASHED}; "
                                f"a frozenset {MAX_FROZEN})")
            if tag in ("S", "F") and len(args) == 1 and type(args[0]) is list:
                out_set: set = set()
                for i, x in enumerate(args[0]):
                    out_set.add(dec(x, depth + 1))
                    if not i & 15:
                        tick()
                return out_set if tag == "S" else frozenset(out_set)
            if tag == "d" and len(args) == 1 and type(args[0]) is list:
                out = {}
                for i, pair in enumerate(args[0]):
                    if type(pair) is not list or len(pair) != 2:
                        raise WireError("a dict item that is not a pair")
                    out[dec(pair[0], depth + 1)] = dec(pair[1], depth + 1)
                    if not i & 15:
                        tick()
                return out
            if tag == "h":
                return handle(node)
        except (ValueError, TypeError, OverflowError) as e:  # unhashable key, bad hex
            raise WireError(f"a malformed value ({type(e).__name__})") from None
        raise WireError(f"a value of unknown shape (tag {tag[:20]!r})")

    return dec(tree, 0)


def send(fd: int, message: Any) -> None:
    """One frame on ``fd`` (blocking)."""
    data = json.dumps(message, ensure_ascii=True, separators=(",", ":")).encode("ascii")
    if len(data) > MAX_FRAME:
        raise WireError(f"a frame of {len(data)} bytes (at most {MAX_FRAME})")
    view = memoryview(len(data).to_bytes(4, "big") + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    out = bytearray()
    poller = select.poll()  # not select(): a descriptor numbered past 1023 is refused there
    poller.register(fd, select.POLLIN)
    while len(out) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(left * 1000):
                raise TimeoutError("the tested code did not answer in time")
        chunk = os.read(fd, min(n - len(out), 1 << 20))
        if not chunk:
            raise EOFError("the other side closed the channel")
        out += chunk
    return bytes(out)


def receive(fd: int, deadline: float | None = None) -> Any:
    """One frame from ``fd``; ``deadline`` (monotonic seconds) bounds the wait."""
    n = int.from_bytes(_read_exact(fd, 4, deadline), "big")
    if n > MAX_FRAME:
        raise WireError(f"a frame of {n} bytes (at most {MAX_FRAME})")
    try:
        return json.loads(_read_exact(fd, n, deadline).decode("ascii"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise WireError("a frame that is not ASCII JSON") from None
