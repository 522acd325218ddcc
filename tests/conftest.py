"""Fixtures shared by every test directory."""

from __future__ import annotations

import os

import pytest

from megatron_tg.testing.nccl_rules import ENV, RULES

# Which rule sets the comm_rules modules run under: NCCL's by default, a comma list to choose
# (``MEGATRON_TG_TEST_RULES=gloo,nccl bash scripts/test.sh tests/train`` runs both).
TEST_RULES_ENV = "MEGATRON_TG_TEST_RULES"


def _test_rules() -> tuple[str, ...]:
    raw = os.environ.get(TEST_RULES_ENV, "nccl")
    rules = tuple(r.strip() for r in raw.split(",") if r.strip())
    bad = [r for r in rules if r not in RULES]
    if bad or not rules:
        raise pytest.UsageError(f"{TEST_RULES_ENV}={raw!r}: expected a comma list of {RULES}")
    return rules


# optionalhook: without pytest-xdist installed (a plain `pytest` run) the hook is unknown to pytest.
@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist with ``--dist loadfile`` (``scripts/test.sh`` runs two workers): a
    module's tests stay on one worker, so its module-scoped fixtures (training runs shared by
    its tests) run once, and all of ``tests/slurm`` shares one worker, since the local Slurm
    controller is a session fixture and its jobs' port bases are counted per process."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "tests/slurm" if path.startswith("tests/slurm/") else path

    return ByModule(config, log)


@pytest.fixture(autouse=True)
def _own_master_port(monkeypatch):
    """Each test's processes get a free MASTER_PORT unless the environment names one: a
    trainer started without it takes torch's 29500, which two tests on two workers would
    share (measured: the SFT run failed with EADDRINUSE on 29500)."""
    if "MASTER_PORT" not in os.environ:
        from megatron_tg.parallel.ports import free_port

        monkeypatch.setenv("MASTER_PORT", str(free_port()))


@pytest.fixture(params=_test_rules(), scope="module")
def comm_rules(request):
    """Runs the test under NCCL's rules (:mod:`megatron_tg.testing.nccl_rules`), through the
    environment variable that :func:`~megatron_tg.testing.distributed.run_distributed` reads;
    ``MEGATRON_TG_TEST_RULES`` adds plain gloo (or picks it alone). The weight-sync, pipeline,
    optimizer and checkpoint modules use it for every test (``pytestmark``). Module-scoped, so
    that a module's own module-scoped fixtures that run ranks can depend on it. The trainer
    processes the kill/resume tests start read the same variable
    (:func:`megatron_tg.parallel.state.init_parallel`).

    Why NCCL's rules alone by default: they are plain gloo plus checks, so a run that passes
    under them passes under plain gloo, but for the one thing the policy changes, ``.cpu()``
    of a device tensor returning a copy as it does on GPU, so the rules' run is the GPU's
    behaviour and plain gloo's adds nothing a GPU job meets. Plain gloo is still what every
    other multi-rank test and the CPU main job run. Running both doubled these modules, the
    slowest of the suite."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV, request.param)
        yield request.param
