"""What a runtime-only install must do, checked the way a newcomer meets it (CI runs this in
the venv that ``bash scripts/demo.sh`` built, before and after the quick demo).

    python scripts/check_runtime.py            # every check below; exit 1 naming each failure

1. The venv holds no test or dev extra (the packages only ``.[test]`` installs): a runtime
   import of one of them would pass here unnoticed otherwise.
2. Every module of the package imports (GPU-only packages are import-guarded inside the
   package; a module that needs one at import time is a failure); ``__main__`` modules are
   entry points, run by check 3 instead.
3. ``megatron-tg --help`` and every subcommand's ``--help`` (and ``convert``'s two verbs)
   exit 0 and print a usage line; so does every ``python -m`` entry point of the package that
   the README, docs, scripts, Slurm files, recipes, CI, tools, benchmarks, tests or the
   package's own code name (``tests/test_cli.py`` runs the same check).
4. Grading works: a built-in task graded with its reference solution passes, and the
   untouched starting files fail (needs bubblewrap: ``bash scripts/system_deps.sh --runtime``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import importlib.util
import os
import pkgutil
import re
import shutil
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

TEST_ONLY = ("hypothesis", "pytest_timeout", "sglang_router")
"""Import names of the test extra's packages (pyproject ``[project.optional-dependencies]
test``) that no runtime path may need. pytest itself is a runtime dependency: grading runs it."""


def check_no_test_extras() -> list[str]:
    present = [m for m in TEST_ONLY if importlib.util.find_spec(m) is not None]
    return [f"test-only package {m!r} is installed in this venv ({sys.prefix}): this check "
            "needs a runtime-only install (bash scripts/setup.sh, without --dev)" for m in present]


def check_imports() -> list[str]:
    import megatron_tg

    failures = []
    # ``__main__`` modules are entry points: importing one runs it (``python -m``); the
    # --help check below runs them instead.
    names = [m.name for m in pkgutil.walk_packages(megatron_tg.__path__, "megatron_tg.")
             if not m.name.endswith(".__main__")]
    for name in names:
        try:
            importlib.import_module(name)
        except BaseException as exc:  # noqa: BLE001 - SystemExit at import is a failure too
            last = traceback.format_exception_only(type(exc), exc)[-1].strip()
            failures.append(f"import {name}: {last}")
    print(f"check_runtime: imported {len(names) - len(failures)} of {len(names)} modules")
    return failures


def check_cli_help() -> list[str]:
    from megatron_tg.cli import SUBCOMMANDS

    exe = shutil.which("megatron-tg", path=os.path.dirname(sys.executable))
    if exe is None:
        return [f"no megatron-tg console script next to {sys.executable}"]
    commands = [[]] + [[name] for name in SUBCOMMANDS] + [["convert", "hf-to-megatron"],
                                                          ["convert", "megatron-to-hf"]]
    failures = []
    for words in commands:
        res = subprocess.run([exe, *words, "--help"], capture_output=True, text=True, timeout=300)
        if res.returncode != 0 or "usage:" not in res.stdout:
            failures.append(f"megatron-tg {' '.join(words + ['--help'])}: exit {res.returncode}: "
                            f"{(res.stderr or res.stdout).strip()[-400:]}")
    print(f"check_runtime: {len(commands) - len(failures)} of {len(commands)} --help commands ran")
    return failures


ENTRY_POINT_VERBS = {"megatron_tg.agent.remote": ["serve"]}
"""Modules whose documented invocation puts a verb before the options."""


ENTRY_POINT_RES = (
    # a shell or documented command: python -m X, "$PYTHON" -m X, torchrun ... -m X
    re.compile(r"(?<![\w-])-m\s+(megatron_tg(?:\.[a-z_][a-z0-9_]*)*)\b"),
    # an argv list in Python: [sys.executable, "-m", "X", ...]
    re.compile(r"[\"']-m[\"'],\s*[\"'](megatron_tg(?:\.[a-z_][a-z0-9_]*)*)[\"']"),
)


def documented_entry_points(root: Path) -> list[str]:
    """Every ``-m`` module of the package that the README, docs, scripts, Slurm files, recipes,
    CI, tools, benchmarks, tests or the package's own code name: each must still run (a move
    of a module takes its callers)."""
    found: set[str] = set()
    files = [root / "README.md", *root.glob("docs/*.md")]
    for sub, pattern in (("scripts", "*"), ("slurm", "*"), ("recipes", "**/*.yaml"), ("tools", "*.py"),
                         (".ci", "*"), ("benchmarks", "*"), ("tests", "**/*.py"), ("megatron_tg", "**/*.py")):
        files += [f for f in (root / sub).glob(pattern) if f.is_file()]
    for f in files:
        text = f.read_text(errors="replace")
        for pattern in ENTRY_POINT_RES:
            found.update(pattern.findall(text))
    return sorted(found)


def check_entry_points() -> list[str]:
    root = Path(__file__).resolve().parents[1]
    modules = documented_entry_points(root)
    failures = []
    for mod in modules:
        argv = [sys.executable, "-m", mod, *ENTRY_POINT_VERBS.get(mod, []), "--help"]
        res = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=root)
        if res.returncode != 0 or "usage:" not in res.stdout:
            failures.append(f"python -m {mod} --help: exit {res.returncode}: "
                            f"{(res.stderr or res.stdout).strip()[-400:]}")
    print(f"check_runtime: {len(modules) - len(failures)} of {len(modules)} documented "
          "python -m entry points ran --help")
    return failures


def check_grading() -> list[str]:
    from megatron_tg.agent.grading import Grader
    from megatron_tg.agent.sandbox import Limits, Sandbox, bwrap_path
    from megatron_tg.agent.tasks import builtin_tasks, materialize, write_files

    if bwrap_path() is None:
        return ["bubblewrap (bwrap) is not installed: grading cannot run "
                "(bash scripts/system_deps.sh --runtime installs it)"]
    task = next(t for t in builtin_tasks() if t.privileged.get("reference"))
    limits = Limits(wall_s=60.0, cpu_s=30)
    grader = Grader(Sandbox("bwrap", limits=limits), limits)
    failures = []
    # both ways of running the tests: by calls (the built-in tasks') and by the runner (SWE rows')
    for label, files, want, how in (("reference solution", task.privileged["reference"], True, "calls"),
                                    ("starting files", {}, False, "calls"),
                                    ("reference solution", task.privileged["reference"], True, "runner"),
                                    ("starting files", {}, False, "runner")):
        t = dataclasses.replace(task, grading=how)
        ws = tempfile.mkdtemp(prefix="tg-check-ws-")
        try:
            materialize(t, ws)
            write_files(ws, files)
            res = asyncio.run(grader.grade(t, ws))
        finally:
            shutil.rmtree(ws, ignore_errors=True)
        verdict = "PASS" if res.passed else "FAIL"
        print(f"check_runtime: grading {task.id} by {how} with its {label}: {verdict} {res.reason}".rstrip())
        if res.passed is not want:
            failures.append(f"grading {task.id} with its {label} gave {verdict}, expected "
                            f"{'PASS' if want else 'FAIL'}: {res.reason} {res.output[-600:]}")
    return failures


def main() -> int:
    failures: list[str] = []
    for check in (check_no_test_extras, check_imports, check_cli_help, check_entry_points, check_grading):
        try:
            failures += check()
        except Exception:  # noqa: BLE001 - report every check, not only the first to crash
            failures.append(f"{check.__name__} crashed:\n{traceback.format_exc()}")
    for f in failures:
        print(f"check_runtime: FAILED: {f}", file=sys.stderr)
    print(f"check_runtime: {'ok' if not failures else f'{len(failures)} failure(s)'} "
          f"({Path(sys.prefix).name}, Python {sys.version.split()[0]})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
