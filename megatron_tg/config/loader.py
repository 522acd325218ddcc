"""Build a :class:`TGConfig` from defaults <- recipe YAML (with includes) <- ``key=value`` overrides.

A recipe is a YAML mapping shaped like :class:`TGConfig`. It may start with
``defaults: [base.yaml, ...]``: paths relative to the recipe's own directory, merged in
order before the recipe's keys, each recursively with its own includes; a file reached twice
(a diamond) is merged once, at its first appearance, so it cannot undo a later file.

Every layer is merged onto the typed schema separately, so an unknown key or a value of the
wrong type is reported with the file (or override) it came from.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import tempfile
import typing
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from megatron_tg.config.base import ConfigError
from megatron_tg.config.schema import TGConfig

INCLUDE_KEY = "defaults"
RESOLVED_NAME = "config.yaml"


def load_config(recipe: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> TGConfig:
    """The validated config of ``recipe`` (None = schema defaults only) with ``overrides``
    (``"parallel.tp=2"``; values parsed as YAML) applied last. Raises :class:`ConfigError`."""
    cfg = OmegaConf.structured(TGConfig)
    if recipe is not None:
        for path, data in _recipe_layers(Path(recipe), stack=(), seen=set()):
            cfg = _merge(cfg, data, source=str(path))
    for item in overrides:
        cfg = _merge(cfg, _parse_override(item), source=f"override {item!r}")
    try:
        obj = OmegaConf.to_object(cfg)
    except MissingMandatoryValue as exc:
        raise ConfigError(f"{exc.full_key}: required but not set; set it in the recipe or "
                          f"as an override ({exc.full_key}=...)") from exc
    except OmegaConfBaseException as exc:  # e.g. an interpolation to a key that does not exist
        raise ConfigError(f"{exc.full_key or 'config'}: {_first_line(exc)}") from exc
    assert isinstance(obj, TGConfig)
    obj.validate()
    return obj


def to_yaml(cfg: TGConfig) -> str:
    """The config as YAML, every interpolation already resolved."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_resolved(cfg: TGConfig, run_dir: str | os.PathLike | None = None) -> Path:
    """Write ``run_dir/config.yaml`` (default run dir: ``cfg.logging.run_dir``); return its path.

    The file is a complete recipe: ``load_config(path)`` gives back an equal config. It is
    written to a temporary file and renamed, so a crash never leaves half a config behind.
    """
    run_dir = Path(cfg.logging.run_dir if run_dir is None else run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / RESOLVED_NAME
    fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=f".{RESOLVED_NAME}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write("# Resolved megatron-tg config; reload with: megatron-tg config --recipe <this file>\n")
            f.write(to_yaml(cfg))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


# --------------------------------------------------------------------------- recipe files

def _recipe_layers(path: Path, stack: tuple[Path, ...], seen: set[Path]) -> Iterator[tuple[Path, dict]]:
    """(file, its keys without ``defaults``) for ``path`` and its includes, in merge order."""
    real = path.resolve()
    if real in stack:
        chain = " -> ".join(str(p) for p in (*stack, real))
        raise ConfigError(f"{path}: recipe include cycle: {chain}")
    if real in seen:
        return
    seen.add(real)
    if not path.is_file():
        where = f" (included from {stack[-1]})" if stack else ""
        raise ConfigError(f"{path}: recipe file not found{where}")
    try:
        loaded = OmegaConf.load(path)  # OmegaConf's YAML loader also reads 3e-6 as a float
    except Exception as exc:  # yaml.YAMLError and friends: report, naming the file
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"{path}: a recipe must be a YAML mapping; got a {type(loaded).__name__}")
    data = OmegaConf.to_container(loaded, resolve=False)
    includes = data.pop(INCLUDE_KEY, None) or []
    if isinstance(includes, str):
        includes = [includes]
    if not isinstance(includes, list) or not all(isinstance(i, str) for i in includes):
        raise ConfigError(f"{path}: {INCLUDE_KEY}: expected a list of recipe paths; got {includes!r}")
    for include in includes:
        yield from _recipe_layers(path.parent / include, (*stack, real), seen)
    yield path, data


def _parse_override(item: str) -> dict:
    key, sep, _ = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r}: expected key=value, e.g. parallel.tp=2")
    if key.strip() == INCLUDE_KEY:
        raise ConfigError(f"override {item!r}: includes belong in a recipe file, not an override")
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist([item]), resolve=False)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"override {item!r}: {_first_line(exc)}") from exc


# --------------------------------------------------------------------------- merging

def _merge(cfg: DictConfig, data: Mapping, source: str) -> DictConfig:
    _check_keys(data, TGConfig, prefix="", source=source)
    try:
        return OmegaConf.merge(cfg, data)
    except OmegaConfBaseException as exc:
        key = exc.full_key
        if not key:
            raise ConfigError(f"{source}: {_first_line(exc)}") from exc
        expected = _field_type(key)
        found, value = _lookup(data, key)
        if expected is not None and found:
            raise ConfigError(f"{source}: {key}: expected {expected}, got {value!r}") from exc
        raise ConfigError(f"{source}: {key}: {_first_line(exc)}") from exc


def _check_keys(data: Mapping, cls: type, prefix: str, source: str) -> None:
    """Unknown keys and scalars given where a section belongs, named by their dotted path.

    OmegaConf would reject both as well, but without a path for the second and without a
    suggestion for the first.
    """
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            raise ConfigError(f"{source}: unknown key {path!r}{hint}")
        sub = hints[key]
        if dataclasses.is_dataclass(sub):
            if not isinstance(value, Mapping):
                raise ConfigError(f"{source}: {path}: expected a mapping of {sub.__name__} fields, "
                                  f"got {value!r}")
            _check_keys(value, sub, f"{path}.", source)


def _field_type(dotted: str) -> str | None:
    """Readable type of a schema field (``"int"``, ``"str or null"``), None if not a field."""
    cls: Any = TGConfig
    tp: Any = None
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(cls):
            return None
        tp = typing.get_type_hints(cls).get(part)
        if tp is None:
            return None
        cls = tp
    return _type_name(tp)


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:
        rest = [a for a in args if a is not type(None)]
        return " or ".join(_type_name(a) for a in rest) + (" or null" if len(rest) < len(args) else "")
    if origin is list:
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin is dict:
        return f"mapping of {_type_name(args[0])} to {_type_name(args[1])}" if args else "mapping"
    return getattr(tp, "__name__", str(tp))


def _lookup(data: Mapping, dotted: str) -> tuple[bool, Any]:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _first_line(exc: BaseException) -> str:
    msg = getattr(exc, "msg", None) or str(exc)
    return msg.splitlines()[0] if msg else type(exc).__name__
