"""Fixtures shared by every test directory."""

from __future__ import annotations

import pytest

from megatron_tg.testing.nccl_rules import ENV, RULES


@pytest.fixture(params=RULES, scope="module")
def comm_rules(request):
    """Runs the test twice: under plain gloo and under NCCL's rules
    (:mod:`megatron_tg.testing.nccl_rules`), through the environment variable that
    :func:`~megatron_tg.testing.distributed.run_distributed` reads. The weight-sync, pipeline
    and checkpoint modules use it for every test (``pytestmark``). Module-scoped, so that a
    module's own module-scoped fixtures that run ranks can depend on it and run under both.
    The trainer processes the kill/resume tests start read the same variable
    (:func:`megatron_tg.parallel.state.init_parallel`)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV, request.param)
        yield request.param
