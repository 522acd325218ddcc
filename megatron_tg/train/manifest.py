"""``RUN_DIR/manifest.json``: what produced a run, written at its start and at every resume.

A run's numbers are only comparable with another's when the same code, packages, config,
judge and engines produced them. The manifest records, per start of the job (the first and
every requeue/resume):

* ``packages``: versions of torch, megatron-core, transformers, sglang, transformer-engine,
  safetensors and this package (None for what is not installed);
* ``git``: the checkout's revision and whether it had uncommitted changes (None outside git);
* ``config``: the resolved config (the same as ``config.yaml``);
* ``judge``: rubric file and sha256, LLM endpoint and model, the judge prompt's sha256 and
  text, and the criteria that are LLM-judged;
* ``engines``: each engine's URL and what it says about itself (``/server_info`` fields such
  as its version and model path), when the rollout side can reach it.

The file holds ``{"starts": [...]}`` in order; a resume appends and lists, in
``changed_since_first``, every package, git or config entry that differs from the first
start (a job requeued onto a node with another torch shows up here). Written atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

NAME = "manifest.json"
PACKAGES = ("torch", "megatron-core", "transformers", "sglang", "sglang-router",
            "transformer-engine", "safetensors", "megatron-tg")


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_state(path: str | os.PathLike | None = None) -> dict[str, Any] | None:
    """Revision and dirtiness of the git checkout holding ``path`` (default: this package)."""
    where = Path(path) if path is not None else Path(__file__).resolve().parent
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True,
                             text=True, timeout=10)
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=where, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return {"revision": rev.stdout.strip(), "dirty": bool(dirty.stdout.strip())}


def judge_identity(cfg, rubric_path: str | None) -> dict[str, Any]:
    from megatron_tg.judge.llm import SYSTEM_PROMPT

    out: dict[str, Any] = {"rubric": rubric_path, "endpoint": cfg.judge.endpoint,
                           "model": cfg.judge.model}
    if rubric_path and Path(rubric_path).is_file():
        out["rubric_sha256"] = hashlib.sha256(Path(rubric_path).read_bytes()).hexdigest()
    if cfg.judge.endpoint:
        out["prompt_sha256"] = hashlib.sha256(SYSTEM_PROMPT.encode()).hexdigest()
        out["prompt"] = SYSTEM_PROMPT
    return out


def write_manifest(run_dir: str | os.PathLike, cfg, *, step: int,
                   judge: dict[str, Any] | None = None,
                   engines: list[dict[str, Any]] | None = None,
                   rollout_service: dict[str, Any] | None = None) -> Path:
    """Append this start to ``run_dir/manifest.json`` (creating it); returns its path.
    ``rollout_service``: where the rollout side ran when it is a service (url, pid, host)."""
    from megatron_tg.config import to_yaml

    import yaml

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / NAME
    entry = {
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": socket.gethostname(),
        "step": int(step), "packages": package_versions(), "git": git_state(),
        "config": yaml.safe_load(to_yaml(cfg)),
        "judge": judge if judge is not None else judge_identity(cfg, cfg.judge.rubric),
        "engines": engines or [],
        **({"rollout_service": rollout_service} if rollout_service else {}),
    }
    doc = {"starts": []}
    if path.exists():
        try:
            doc = json.loads(path.read_text())
        except ValueError as exc:  # never overwrite a record we cannot read
            raise RuntimeError(f"{path}: unreadable run manifest ({exc}); move it away to "
                               "start a new one") from None
    if doc["starts"]:
        first = doc["starts"][0]
        entry["changed_since_first"] = sorted(
            [f"packages.{k}" for k, v in entry["packages"].items() if first["packages"].get(k) != v]
            + (["git"] if first.get("git") != entry["git"] else [])
            + [f"config.{k}" for k in entry["config"] if first["config"].get(k) != entry["config"][k]])
    doc["starts"].append(entry)
    fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=f".{NAME}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
