"""Fixtures shared by every test directory."""

from __future__ import annotations

import pytest

from megatron_tg.testing.nccl_rules import ENV, RULES


@pytest.fixture(params=RULES)
def comm_rules(request, monkeypatch):
    """Runs the test twice: under plain gloo and under NCCL's rules
    (:mod:`megatron_tg.testing.nccl_rules`), through the environment variable that
    :func:`~megatron_tg.testing.distributed.run_distributed` reads. The weight-sync, pipeline
    and checkpoint modules use it for every test (``pytestmark``)."""
    monkeypatch.setenv(ENV, request.param)
    return request.param
