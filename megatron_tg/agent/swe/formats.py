"""The SWE task formats labs train on, read into :class:`~megatron_tg.agent.tasks.Task`.

* **SWE-bench** (and **SWE-Gym**, which publishes the same schema): ``instance_id``,
  ``repo`` (``owner/name``), ``base_commit``, ``problem_statement``, ``test_patch``,
  ``FAIL_TO_PASS``, ``PASS_TO_PASS`` (lists, or JSON strings of lists as the Hugging Face
  rows have them); ``patch`` (the gold fix), ``hints_text``, ``version``,
  ``environment_setup_commit``, ``created_at`` are kept as metadata / privileged.
  Image: SWE-bench's per-instance evaluation image name unless the row names one.
* **SWE-rebench**: the SWE-bench fields plus ``install_config`` (its ``test_cmd`` is kept)
  and ``docker_image``.
* **SWE-smith**: ``instance_id``, ``repo`` (``swesmith/owner__name.hash``), ``patch`` (the
  bug it introduced), ``FAIL_TO_PASS``, ``PASS_TO_PASS``, ``image_name``; the buggy tree is
  the mirror's branch named after the instance (``base_commit`` when the row has one).
* **R2E-Gym**: ``repo_name``, ``commit_hash``, ``docker_image``, ``problem_statement`` and
  ``expected_output_json`` (``{test id: "PASSED" | "FAILED"}`` after the fix); the tests
  expected to pass become FAIL_TO_PASS (R2E-Gym does not split them).

Repositories come from local git mirrors under a configured root (``rollout.repos_root``);
a row naming a repository outside it is refused. Test ids must be pytest node ids
(``path::name``): the grader reads per-test results from pytest's own report, so a row of a
repository run by another runner is refused with that reason rather than graded wrongly.
"""

from __future__ import annotations

import json
import os
from typing import Any

from megatron_tg.agent.swe.repos import find_mirror
from megatron_tg.agent.task_types import Task, TaskFormatError, resolve_repo, test_ids

SWEBENCH_IMAGE = "docker.io/swebench/sweb.eval.x86_64.{id}:latest"
"""SWE-bench's published evaluation images; ``__`` in the id is spelled ``_1776_`` there."""


def is_swe_row(row: Any) -> bool:
    return isinstance(row, dict) and ("instance_id" in row or ("repo_name" in row and "commit_hash" in row))


def _str(row: dict, key: str, required: bool = True) -> str | None:
    v = row.get(key)
    if v is None and not required:
        return None
    if not isinstance(v, str) or (required and not v.strip()):
        raise TaskFormatError(f"{key}: must be a non-empty string, got {v!r}")
    return v


def _id_list(row: dict, key: str) -> list[str]:
    v = row.get(key, [])
    if isinstance(v, str):  # the Hugging Face rows store these lists JSON-encoded
        try:
            v = json.loads(v) if v.strip() else []
        except json.JSONDecodeError as e:
            raise TaskFormatError(f"{key}: not a JSON list ({e})") from None
    try:
        return test_ids(v, key)
    except TaskFormatError as e:
        raise TaskFormatError(f"{e} (only pytest-run repositories are supported: the grader reads "
                              "pytest's own per-test report)") from None


def detect_format(row: dict) -> str:
    if "repo_name" in row and "commit_hash" in row:
        return "r2e-gym"
    if "install_config" in row or "docker_image" in row:
        return "swe-rebench"
    if "image_name" in row or str(row.get("repo", "")).startswith("swesmith/"):
        return "swe-smith"
    return "swe-bench"


def task_from_swe_row(row: dict, *, repos_root: str | os.PathLike, source: str | None = None,
                      image_template: str = SWEBENCH_IMAGE) -> Task:
    """One instance row of any format above as a Task (errors name the field)."""
    fmt = detect_format(row)
    meta: dict[str, Any] = {"format": fmt}
    if fmt == "r2e-gym":
        name, commit = _str(row, "repo_name"), _str(row, "commit_hash")
        iid = row.get("instance_id") or f"{name.replace('/', '__')}-{commit[:12]}"
        expected = row.get("expected_output_json")
        if isinstance(expected, str):
            try:
                expected = json.loads(expected)
            except json.JSONDecodeError as e:
                raise TaskFormatError(f"expected_output_json: not JSON ({e})") from None
        if not isinstance(expected, dict) or not expected:
            raise TaskFormatError("expected_output_json: must be a non-empty object {test id: status}")
        f2p = _id_list({"expected_output_json": [k for k, v in expected.items() if v == "PASSED"]},
                       "expected_output_json")
        p2p: list[str] = []
        image = _str(row, "docker_image")
        test_patch = None
    else:
        iid, name = _str(row, "instance_id"), _str(row, "repo")
        f2p, p2p = _id_list(row, "FAIL_TO_PASS"), _id_list(row, "PASS_TO_PASS")
        commit = _str(row, "base_commit", required=fmt != "swe-smith") or iid  # SWE-smith: branch = id
        test_patch = _str(row, "test_patch", required=False) or None  # "" = the tests are unchanged
        image = (_str(row, "docker_image", required=False) or _str(row, "image_name", required=False)
                 or (image_template.format(id=iid.replace("__", "_1776_")) if fmt == "swe-bench" else None))
        for k in ("version", "environment_setup_commit", "created_at", "hints_text"):
            if row.get(k) is not None:
                meta[k] = row[k]
        cfg = row.get("install_config")
        if isinstance(cfg, dict) and cfg.get("test_cmd"):
            meta["test_cmd"] = cfg["test_cmd"]
    if not f2p:
        raise TaskFormatError("FAIL_TO_PASS: empty (nothing would show the instance is solved)")
    statement = _str(row, "problem_statement", required=fmt != "swe-smith") or ""
    if not statement.strip():
        raise TaskFormatError("problem_statement: empty (SWE-smith rows need one written before training)")
    repo = resolve_repo(find_mirror(repos_root, name), repos_root)
    meta["repo"] = name
    privileged = {"patch": row["patch"]} if isinstance(row.get("patch"), str) and fmt != "swe-smith" else None
    task = Task(id=iid, instruction=statement, fail_to_pass=f2p, pass_to_pass=p2p, repo=repo, base_commit=commit,
                test_patch=test_patch, image=image, privileged=privileged, metadata=meta, source=source)
    return task


__all__ = ["SWEBENCH_IMAGE", "detect_format", "is_swe_row", "task_from_swe_row"]
