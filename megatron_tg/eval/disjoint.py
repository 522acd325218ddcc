"""Held-out tasks must be unseen: content-based disjointness from training tasks and SFT data.

A held-out number on tasks the policy trained on measures memorisation. Task ids do not
show it: the same problem reappears under another id in another file, or as an SFT
transcript. So every held-out task is compared by content:

* its **text**: the instruction, normalised (Unicode NFKC, case-folded, whitespace runs
  collapsed to one space, trimmed) and hashed (sha256);
* its **tests**: the fail-to-pass / pass-to-pass test ids, the test patch and the hidden
  test files (each normalised likewise, the id lists sorted), hashed together; a task
  without any test content has no tests fingerprint;
* for SWE tasks (those read from SWE-bench / SWE-smith / R2E-Gym rows, which record
  ``metadata["repo"]``, ``owner/name``): the **repository**, split at the repository level,
  since tasks of one repository share its code, tests and conventions;

against every training task (same three keys), and against every SFT transcript, whose
user messages are hashed like task text (a transcript of a held-out task contains its
instruction as a user turn). Any match is refused with a :class:`ConfigError` naming the
held-out ids, the ids / transcript lines they overlap, and which key matched.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from typing import Any, Iterable, Sequence

_WS = re.compile(r"\s+")


def normalise(text: str) -> str:
    return _WS.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


def text_hash(text: str) -> str:
    return hashlib.sha256(normalise(text).encode("utf-8")).hexdigest()


def tests_hash(task: Any) -> str | None:
    """The hash of a task's test content, or None when it has none."""
    parts = {
        "fail_to_pass": sorted(normalise(t) for t in getattr(task, "fail_to_pass", None) or []),
        "pass_to_pass": sorted(normalise(t) for t in getattr(task, "pass_to_pass", None) or []),
        "test_patch": normalise(getattr(task, "test_patch", None) or ""),
        "hidden_files": {normalise(k): normalise(v) for k, v in
                         sorted((getattr(task, "hidden_files", None) or {}).items())},
    }
    if not any(parts.values()):
        return None
    blob = json.dumps(parts, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def swe_repo(task: Any) -> str | None:
    meta = getattr(task, "metadata", None) or {}
    repo = meta.get("repo") if isinstance(meta, dict) else None
    return repo.strip().lower() if isinstance(repo, str) and repo.strip() else None


def _task_keys(task: Any) -> dict[str, str | None]:
    text = getattr(task, "instruction", None) or ""
    return {"text": text_hash(text) if normalise(text) else None, "tests": tests_hash(task),
            "repository": swe_repo(task)}


def transcript_texts(path: str) -> list[tuple[str, str]]:
    """(``file:line``, user message text) of every user turn of an SFT transcript file."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # the SFT loader refuses it, naming the line; not our concern here
            for m in record.get("messages", []) if isinstance(record, dict) else []:
                if isinstance(m, dict) and m.get("role") == "user" and isinstance(
                        m.get("content"), str):
                    out.append((f"{path}:{n}", m["content"]))
    return out


def overlaps(held_out: Sequence[Any], train: Sequence[Any] = (),
             transcripts: Iterable[tuple[str, str]] = ()) -> list[tuple[str, str, str]]:
    """(held-out id, training id or transcript line, key) for every overlap found."""
    index: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for t in train:
        for key, value in _task_keys(t).items():
            if value is not None:
                index.setdefault((key, value), []).append((str(t.id), f"same {key}"))
    for where, text in transcripts:
        if normalise(text):
            index.setdefault(("text", text_hash(text)), []).append(
                (where, "task text is an SFT user turn"))
    found = []
    for t in held_out:
        for key, value in _task_keys(t).items():
            if value is not None:
                found += [(str(t.id), other, why) for other, why in index.get((key, value), [])]
    return found


def check_disjoint(held_out: Sequence[Any], *, train: Sequence[Any] = (),
                   transcripts_path: str | None = None, source: str = "evaluation.tasks") -> list[Any]:
    """``held_out``, refused if any task shares an id, its text, its tests or (SWE) its
    repository with a training task, or its text with a user turn of ``transcripts_path``."""
    from megatron_tg.config.base import ConfigError

    problems = []
    shared = sorted({str(t.id) for t in held_out} & {str(t.id) for t in train})
    if shared:
        problems.append(f"{len(shared)} task id(s) are also training task ids: {shared[:5]}")
    found = overlaps(held_out, train,
                     transcript_texts(transcripts_path) if transcripts_path else ())
    if found:
        pairs = [f"{h} ~ {o} ({k})" for h, o, k in found]
        ids = sorted({h for h, _, _ in found})
        problems.append(f"{len(ids)} held-out task(s) overlap training data by content: "
                        f"{ids[:10]}; matches: {pairs[:10]}"
                        + (f" and {len(pairs) - 10} more" if len(pairs) > 10 else ""))
    if problems:
        raise ConfigError(f"{source}: held-out tasks are not disjoint from the training data "
                          "(rollout.tasks" + (", sft.data" if transcripts_path else "") + "): "
                          + "; ".join(problems))
    return list(held_out)


def check_recipe(cfg) -> list[Any]:
    """The held-out tasks of a config (``evaluation.tasks``), checked against its training
    tasks (``rollout.tasks``, or the built-in tasks when unset) and its SFT transcripts
    (``sft.data``), before any model is built; [] when there is no held-out file."""
    from megatron_tg.agent.tasks import builtin_tasks, load_tasks

    if not cfg.evaluation.tasks:
        return []
    r = cfg.rollout
    train = load_tasks(r.tasks, repos_root=r.repos_root) if r.tasks else builtin_tasks()
    return check_disjoint(load_tasks(cfg.evaluation.tasks, repos_root=r.repos_root), train=train,
                          transcripts_path=cfg.sft.data or None,
                          source=f"evaluation.tasks ({cfg.evaluation.tasks})")
