"""Rollouts as JSON Lines files: one :class:`~megatron_tg.rollout.types.Rollout` per line
(:meth:`Rollout.to_json`), read back with every bad line reported by its number (never dropped
silently), written only once every rollout validates.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Iterable, Iterator, Literal

from megatron_tg.rollout.errors import RolloutFormatError
from megatron_tg.rollout.types import Rollout


@dataclass
class LineError:
    line_no: int  # 1-based
    message: str
    field: str | None = None


@dataclass
class ReadResult:
    rollouts: list[Rollout]
    errors: list[LineError]
    """Empty unless ``on_error="collect"``; every non-blank line is either a rollout or an error."""


def iter_jsonl(path: str | os.PathLike, validate: bool = True,
               vocab_size: int | None = None) -> Iterator[tuple[int, Rollout | LineError]]:
    """Yield ``(line_no, Rollout or LineError)`` for every non-blank line, in order."""
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue  # blank lines (e.g. a trailing newline) hold no rollout
            try:
                r = Rollout.from_json(line, validate=False)
                if validate:
                    r.validate(vocab_size=vocab_size)
                yield line_no, r
            except RolloutFormatError as e:
                yield line_no, LineError(line_no, str(e), e.field)


def read_jsonl(path: str | os.PathLike, *, on_error: Literal["raise", "collect"] = "raise",
               validate: bool = True, vocab_size: int | None = None) -> ReadResult:
    """Read one rollout per line. A bad line is never dropped silently: with
    ``on_error="raise"`` the first one raises ``RolloutFormatError("path:LINE: ...")``; with
    ``"collect"`` it is returned in ``ReadResult.errors`` with its line number."""
    if on_error not in ("raise", "collect"):
        raise ValueError(f"on_error must be 'raise' or 'collect', got {on_error!r}")
    out = ReadResult([], [])
    for line_no, item in iter_jsonl(path, validate=validate, vocab_size=vocab_size):
        if isinstance(item, LineError):
            if on_error == "raise":
                raise RolloutFormatError(item.field or "<line>", f"{os.fspath(path)}:{line_no}: "
                                         f"{item.message}")
            out.errors.append(item)
        else:
            out.rollouts.append(item)
    return out


def write_jsonl(path: str | os.PathLike, rollouts: Iterable[Rollout], *, append: bool = False,
                validate: bool = True) -> int:
    """Write one rollout per line; returns the count. Every rollout is validated before anything
    is written, and a non-append write goes through a temp file + rename, so a crash never
    leaves a half-written file behind."""
    lines = []
    for i, r in enumerate(rollouts):
        if validate:
            try:
                r.validate()
            except RolloutFormatError as e:
                raise RolloutFormatError(e.field, f"rollout #{i} ({r.rollout_id!r}): {e}") from e
        lines.append(r.to_json() + "\n")
    path = os.fspath(path)
    if append:
        with open(path, "a", encoding="utf-8") as f:
            f.writelines(lines)
        return len(lines)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(lines)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return len(lines)
