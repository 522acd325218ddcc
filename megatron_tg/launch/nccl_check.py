"""Whether the trainer's and the engines' NCCL can form one communicator (the weight-update
group), read from each side's own Python environment.

NCCL refuses it unless every member runs the same NCCL release: at communicator init each
rank compares the others' ``NCCL_VERSION_CODE`` with its own and fails with ``ncclInvalidUsage``
("Mismatched NCCL version detected", ``src/init.cc``). So the rule is equality of the full
version (major.minor.patch), whatever the torch versions around it. On a cluster the two
sides differ when the engines run from SGLang's environment (sglang 0.5.23 pins torch 2.14.1,
with NCCL 2.30.7) and the trainer from another one:
installing both from one environment (``pip install -e .[gpu]``, so the trainer imports the
torch SGLang pinned) keeps them equal. A side without NCCL (a CPU build of torch) syncs over
gloo and is reported, not refused.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

PROBE = (
    "import json, torch\n"
    "out = {'torch': torch.__version__, 'cuda': torch.version.cuda}\n"
    "try:\n"
    "    v = torch.cuda.nccl.version()\n"
    "    out['nccl'] = '.'.join(map(str, v)) if isinstance(v, tuple) else "
    "f'{v // 10000 if v >= 10000 else v // 1000}.{(v % 10000) // 100 if v >= 10000 else (v % 1000) // 100}.{v % 100}'\n"
    "except Exception as exc:\n"
    "    out['nccl'] = None\n"
    "    out['nccl_error'] = f'{type(exc).__name__}: {exc}'\n"
    "print(json.dumps(out))\n"
)
"""Run by each side's interpreter: its torch, CUDA and NCCL versions (``torch.cuda.nccl.version()``,
a tuple on current torch, an integer code on old releases), as JSON."""


def side_versions(python: str, timeout_s: float = 120.0) -> dict[str, Any]:
    """The versions ``python`` (an interpreter path, or a command line's first word) imports."""
    try:
        out = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"{python}: {type(exc).__name__}: {exc}"}
    if out.returncode != 0:
        tail = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"error": f"{python} could not import torch: {tail[0][:300]}"}
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"{python}: unreadable answer {out.stdout[-200:]!r}"}


def describe(v: dict[str, Any]) -> str:
    if "error" in v:
        return v["error"]
    return f"torch {v.get('torch')} (CUDA {v.get('cuda') or '-'}), NCCL {v.get('nccl') or 'none'}"


def check(trainer: dict[str, Any], engines: dict[str, Any]) -> tuple[str, str]:
    """(PASS, FAIL or SKIP, detail) for the two sides' versions."""
    seen = f"trainer: {describe(trainer)}; engines: {describe(engines)}"
    if "error" in trainer or "error" in engines:
        return "FAIL", seen
    a, b = trainer.get("nccl"), engines.get("nccl")
    if a is None or b is None:
        return "SKIP", f"{seen} (no NCCL on a side: the weight sync runs over gloo there)"
    if a != b:
        return "FAIL", (f"{seen}: NCCL refuses a communicator of different releases ('Mismatched NCCL "
                        f"version detected'); run both sides from one environment (pip install -e .[gpu] "
                        f"next to sglang, so both import the torch SGLang pins) or install the same "
                        f"nvidia-nccl wheel in both")
    if trainer.get("torch") != engines.get("torch"):
        seen += " (torch differs, NCCL equal: the weight-update group forms)"
    return "PASS", seen
