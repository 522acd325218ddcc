"""The SGLang command line slurm/task.sh builds from the plan: the recipe's engine flags
(``--enable-deterministic-inference`` when ``rollout.sampling_seed`` is set) reach the
server process. The 3.12 lane parses the same command line with SGLang's own argument
parser (tests/sglang/test_server_args.py)."""

from __future__ import annotations

from pathlib import Path

from megatron_tg.launch import render as R
from megatron_tg.launch.plan import Knobs, make_plan
from tests.launch.task_argv import task_argv

ROOT = Path(__file__).resolve().parents[2]
R30 = str(ROOT / "recipes" / "tg_30b.yaml")
TINY = str(ROOT / "recipes" / "tiny_cpu.yaml")
JUDGE = Knobs(judge_model="models/judge", job_dir="JOB")


def test_sampling_seed_turns_on_deterministic_inference(tmp_path):
    seeded = make_plan(R30, ["rollout.sampling_seed=11"], JUDGE)
    plain = make_plan(R30, [], JUDGE)
    assert seeded.engine_args == ["--enable-return-routed-experts", "--enable-deterministic-inference"]
    assert plain.engine_args == ["--enable-return-routed-experts"]  # routing replay is on by default
    assert "flags --enable-return-routed-experts --enable-deterministic-inference" in R.render_text(seeded)
    argv = task_argv(seeded, tmp_path, step=0, local_id=3)
    assert argv[:4] == ["--model-path", seeded.engine_model, "--tp-size", "2"]
    assert "--enable-deterministic-inference" in argv
    assert argv[-4:] == ["--host", "0.0.0.0", "--port", str(seeded.servers[3].port)]
    assert "--enable-deterministic-inference" not in task_argv(plain, tmp_path / "plain")


def test_judge_and_router_do_not_get_engine_flags(tmp_path):
    plan = make_plan(R30, ["rollout.sampling_seed=11"], JUDGE)
    steps = {s.role: i for i, s in enumerate(plan.steps)}
    judge = task_argv(plan, tmp_path / "judge", step=steps["judge"])
    router = task_argv(plan, tmp_path / "router", step=steps["router"])
    assert "--enable-deterministic-inference" not in judge + router
    assert router[0] == "--worker-urls" and router[1:9] == [s.url for s in plan.servers if s.role == "engine"]


def test_embedded_engines_need_no_flag():
    # The CPU engine honours sampling_seed always; SGLang's flag would be an unknown argument.
    # It does take the routed-experts flag (it records its routers' choices only with it).
    plan = make_plan(TINY, ["rollout.engine=sglang", "rollout.sampling_seed=3", "parallel.backend=gloo"],
                     Knobs(engine="embedded", accel="cpu", gpus_per_node=1, train_nodes=1, rollout_nodes=1))
    assert plan.engine == "embedded" and plan.engine_args == ["--enable-return-routed-experts"]
