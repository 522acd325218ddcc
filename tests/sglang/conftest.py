"""Tests that run SGLang's own code (the released ``sglang`` wheel, installed without its GPU
dependencies) against this project's side of each interface.

The Python 3.12 lane (scripts/test_py312.sh) installs ``sglang==0.5.23 --no-deps`` plus the
light packages its imported modules need, and runs this directory; where sglang does not
import (the Python 3.11 lane), every test module here is reported skipped with the import
error as the reason, without being imported.
"""

from __future__ import annotations

import pytest

try:
    import sglang  # noqa: F401

    REASON = None
except Exception as exc:  # ImportError, or a missing light dependency of sglang itself
    REASON = (f"sglang is not importable here ({type(exc).__name__}: {exc}); the Python 3.12 lane "
              "(scripts/test_py312.sh) installs sglang==0.5.23 and runs these tests")


class _SkippedModule(pytest.Module):
    def collect(self):
        pytest.skip(REASON)


def pytest_pycollect_makemodule(module_path, parent):
    if REASON is not None and module_path.name.startswith("test_"):
        return _SkippedModule.from_parent(parent, path=module_path)
    return None
