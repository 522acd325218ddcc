"""The error every config check raises, and the few checks the config groups share.

Messages always start with the dotted field path (``parallel.tp: ...``) and end with the
offending value, so a failing recipe or override can be fixed without reading the code.
"""

from __future__ import annotations

import math
from typing import Any, Iterable


class ConfigError(ValueError):
    """An invalid configuration. The message names the field (dotted path) and the bad value;
    errors found while loading a file also name the file."""


def check_choice(path: str, value: Any, choices: Iterable[Any]) -> None:
    """``value`` must be one of ``choices`` (stand-in for ``Literal``, which OmegaConf lacks)."""
    choices = tuple(choices)
    if value not in choices:
        raise ConfigError(f"{path}: must be one of {', '.join(map(repr, choices))}; got {value!r}")


def check_range(path: str, value: Any, *, ge: float | None = None, gt: float | None = None,
                le: float | None = None, lt: float | None = None) -> None:
    """``value`` must be a finite number satisfying every bound given (``ge``: >=, ``gt``: >,
    ``le``: <=, ``lt``: <). Infinity and NaN are refused: YAML's ``.inf`` passes ``gt=0`` and
    then overflows wherever the value becomes an integer (a timeout in seconds, a limit)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{path}: must be a finite number; got {value!r}")
    for bound, ok, sign in ((ge, lambda b: value >= b, ">="), (gt, lambda b: value > b, ">"),
                            (le, lambda b: value <= b, "<="), (lt, lambda b: value < b, "<")):
        if bound is not None and not ok(bound):
            raise ConfigError(f"{path}: must be {sign} {bound}; got {value!r}")
