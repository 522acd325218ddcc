"""Every flag the launch scripts pass to ``sglang.launch_server`` parses with SGLang's own
launcher (``sglang.srt.server_args.prepare_server_args``, the function ``launch_server``
calls) and means what the plan meant: TP size, multi-node rendezvous, host/port, the judge's
served name, and ``--enable-deterministic-inference`` when ``rollout.sampling_seed`` is set.

The argv is the one slurm/task.sh builds, read back through a recorder command
(tests/launch/task_argv.py). Runs in the Python 3.12 lane (sglang==0.5.23 installed with
--no-deps plus the light packages listed in tests/sglang/test_requests.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.server_args", reason="sglang==0.5.23 is installed in the Python 3.12 lane only")

from sglang.srt.server_args import prepare_server_args  # noqa: E402

from megatron_tg.launch.plan import Knobs, make_plan  # noqa: E402
from tests.launch.task_argv import task_argv  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
KNOBS = Knobs(judge_model="models/judge", job_dir="JOB")


def parse(argv: list[str]):
    try:
        return prepare_server_args(argv)
    except SystemExit as exc:  # argparse: an unknown or malformed flag
        raise AssertionError(f"sglang rejects the launch flags {argv}: exit {exc.code}") from exc


@pytest.mark.parametrize("recipe", ["tg_30b", "tg_235b", "tg_480b"])
@pytest.mark.parametrize("seed", [None, 5])
def test_engine_flags_parse_with_sglangs_launcher(recipe, seed, tmp_path):
    overrides = [] if seed is None else [f"rollout.sampling_seed={seed}"]
    plan = make_plan(str(ROOT / "recipes" / f"{recipe}.yaml"), overrides, KNOBS)
    engines = [i for i, s in enumerate(plan.steps) if s.role == "engine"]
    server = plan.servers[plan.steps[engines[0]].first]
    args = parse(task_argv(plan, tmp_path, step=engines[0]))
    assert args.model_path == plan.engine_model and args.tp_size == plan.engine_tp
    assert (args.host, args.port) == ("0.0.0.0", server.port)
    assert args.enable_deterministic_inference is (seed is not None)
    if server.dist:  # an engine wider than a node (480B): SGLang's multi-node rendezvous
        assert (args.nnodes, args.node_rank, args.dist_init_addr) == (len(server.hosts), 0, server.dist)
    else:
        assert args.nnodes == 1


def test_judge_flags_parse_with_sglangs_launcher(tmp_path):
    plan = make_plan(str(ROOT / "recipes" / "tg_30b.yaml"), ["rollout.sampling_seed=5"], KNOBS)
    step = next(i for i, s in enumerate(plan.steps) if s.role == "judge")
    judge = plan.servers[plan.steps[step].first]
    args = parse(task_argv(plan, tmp_path, step=step))
    assert (args.model_path, args.served_model_name, args.tp_size) == ("models/judge", plan.judge_name, judge.gpus)
    assert args.enable_deterministic_inference is False  # the judge's sampling is not the policy's


def test_an_unknown_flag_is_refused_by_sglang():
    # The check above can fail: SGLang's parser exits on a flag it does not know.
    with pytest.raises(AssertionError, match="--enable-determinism"):
        parse(["--model-path", "m", "--enable-determinism"])
