"""The quick demo base model, built once per test run (~55 s of CPU) and shared by the
base-model tests and the demo's end-to-end test.

``TG_TEST_QUICK_BASE=DIR`` names a quick base built earlier (CI sets it to the front door's
``runs/ci-quick/base``, which the README's quick demo has just built): it is copied into the
test's own directory, and :func:`build_base_model` reuses it only if its ``build_hash`` is
this tree's quick build's (any other directory is rebuilt from scratch there, so a stale or
foreign build cannot stand in). The build's own metrics are the ones it stored when it was
made; the tests assert on them either way.
"""

from __future__ import annotations

import os
import shutil

import pytest


@pytest.fixture(scope="session")
def quick_base(tmp_path_factory):
    """(directory, metrics of the build that made it)."""
    import torch

    from megatron_tg.demo import base_config as BC
    from megatron_tg.demo import base_model as B

    out = tmp_path_factory.mktemp("demo_base")
    earlier = os.environ.get("TG_TEST_QUICK_BASE")
    if earlier:
        if not os.path.isdir(earlier):
            raise FileNotFoundError(f"TG_TEST_QUICK_BASE={earlier!r} is not a directory")
        shutil.copytree(earlier, out, dirs_exist_ok=True)
    n = torch.get_num_threads()
    try:
        return out, B.build_base_model(out, seed=0, **BC.QUICK)
    finally:
        torch.set_num_threads(n)
