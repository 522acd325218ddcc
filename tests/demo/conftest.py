"""The quick demo base model, built once per test run (~55 s of CPU) and shared by the
base-model tests and the demo's end-to-end test."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def quick_base(tmp_path_factory):
    """(directory, metrics of the build that made it)."""
    import torch

    from megatron_tg.demo import base_model as B

    out = tmp_path_factory.mktemp("demo_base")
    n = torch.get_num_threads()
    try:
        return out, B.build_base_model(out, seed=0, **B.QUICK)
    finally:
        torch.set_num_threads(n)
