"""The Slurm planner: roles, nodes, GPUs and ports for the shipped recipes at several node counts."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest

from megatron_tg.config import ConfigError
from megatron_tg.launch import plan as P
from megatron_tg.launch import render as R
from megatron_tg.launch.plan import Knobs, PlanError, make_plan

ROOT = Path(__file__).resolve().parents[2]
R30, R235, R480, TINY = (str(ROOT / "recipes" / f"{n}.yaml") for n in ("tg_30b", "tg_235b", "tg_480b", "tiny_cpu"))
HF = ROOT / "tests" / "fixtures" / "hf_configs"
JUDGE = Knobs(judge_model="models/judge")


def role_gpus(plan) -> tuple[int, int, int]:
    return plan.gpus("train"), plan.gpus("engine"), plan.gpus("judge")


# ---------------------------------------------------------------- the shipped recipes

def test_tg_30b_default_layout():
    plan = make_plan(R30, knobs=JUDGE)
    assert plan.nodes == 5 and plan.roles == {
        "train": ["node1", "node2"], "rollout": ["node3", "node4"], "judge": ["node5"]}
    assert role_gpus(plan) == (16, 16, 8)
    assert (plan.layout["tp"], plan.layout["ep"], plan.layout["dp"], plan.layout["edp"]) == (2, 8, 8, 2)
    engines = [s for s in plan.servers if s.role == "engine"]
    assert [s.hosts for s in engines] == [["node3"]] * 4 + [["node4"]] * 4
    steps = {s.name: s for s in plan.steps}
    assert steps["tg-engines-node3"].ntasks == 4 and steps["tg-engines-node3"].gpus_per_task == 2
    assert steps["tg-router"].overlap and steps["tg-router"].hosts == ["node3"]
    assert steps["tg-router"].gpus_per_task == steps["tg-router"].gpus_per_node == 0
    assert (steps["tg-judge"].hosts, steps["tg-judge"].gpus_per_node) == (["node5"], 8)
    train = steps["tg-train"]
    assert (train.ntasks, train.tasks_per_node, train.gpus_per_node, train.overlap) == (16, 8, 8, False)
    # GPU steps never overlap: Slurm 22.05's --overlap would share their GPUs
    assert all(not s.overlap for s in plan.steps if s.gpus_per_task or s.gpus_per_node)
    assert plan.master_addr == "node1" and not plan.blockers


def test_tg_235b_default_layout():
    plan = make_plan(R235, knobs=JUDGE)
    assert (len(plan.roles["train"]), len(plan.roles["rollout"]), len(plan.roles["judge"])) == (16, 8, 1)
    assert plan.nodes == 25 and role_gpus(plan) == (128, 64, 8)
    assert (plan.layout["tp"], plan.layout["pp"], plan.layout["ep"], plan.layout["dp"]) == (4, 2, 32, 16)
    engine_steps = [s for s in plan.steps if s.role == "engine"]
    assert len(engine_steps) == 8 and all(s.ntasks == 1 and s.gpus_per_task == 8 for s in engine_steps)


def test_tg_480b_engines_span_two_nodes():
    plan = make_plan(R480, knobs=JUDGE)
    assert plan.nodes == 57 and role_gpus(plan) == (320, 128, 8)
    engines = [s for s in plan.servers if s.role == "engine"]
    assert len(engines) == 8 and all(len(s.hosts) == 2 and s.gpus == 16 for s in engines)
    assert engines[0].hosts == ["node41", "node42"] and engines[0].dist.startswith("node41:")
    steps = [s for s in plan.steps if s.role == "engine"]
    assert all((s.ntasks, s.tasks_per_node, s.gpus_per_node) == (2, 1, 8) for s in steps)
    assert len({s.dist for s in engines}) == 8  # each engine's ranks meet on their own port


@pytest.mark.parametrize("recipe, nodes, rollout", [(R30, 4, 1), (R30, 7, 4), (R235, 20, 3), (R480, 59, 18)])
def test_extra_nodes_go_to_rollout(recipe, nodes, rollout):
    plan = make_plan(recipe, knobs=dataclasses.replace(JUDGE, nodes=nodes))
    assert plan.nodes == nodes and len(plan.roles["rollout"]) == rollout
    assert plan.roles["train"] == plan.hosts[:len(plan.roles["train"])]  # the batch host trains


def test_explicit_sizes_win_and_must_add_up():
    plan = make_plan(R30, knobs=dataclasses.replace(JUDGE, train_nodes=4, rollout_nodes=3, nodes=8))
    assert (len(plan.roles["train"]), len(plan.roles["rollout"])) == (4, 3) and plan.layout["world_size"] == 32
    with pytest.raises(PlanError, match=r"allocation has 9 nodes but the roles need 8.*--nodes=8"):
        make_plan(R30, knobs=dataclasses.replace(JUDGE, train_nodes=4, rollout_nodes=3, nodes=9))


# ---------------------------------------------------------------- refusals

@pytest.mark.parametrize("recipe, knobs, match", [
    (R30, Knobs(nodes=3), r"rollout: 0 rollout nodes \(what 3 nodes leave after train 2 \+ judge 1\)"),
    (R30, Knobs(rollout_nodes=0), r"rollout: 0 rollout nodes \(ROLLOUT_NODES\).*need at least 1.*5 nodes in all"),
    (R235, Knobs(train_nodes=12), r"12 nodes x 8 GPUs = 96 ranks do not fit.*multiple of 8 trainer nodes"),
    (R480, Knobs(train_nodes=30), r"multiple of 20 trainer nodes"),
    (R480, Knobs(nodes=58), r"17 rollout nodes .*need a multiple of 2"),
    (R30, Knobs(gpus_per_node=3), r"engine_tp=2 does not divide gpus_per_node=3"),
    (R30, Knobs(hosts=("a", "b")), r"2 hosts and 2 addresses given for 5 nodes"),
    (R30, Knobs(judge_model="j", judge_tp=16, judge_nodes=1), r"JUDGE_TP=16 needs more than 1 judge nodes"),
])
def test_layouts_that_do_not_fit_are_refused_by_name(recipe, knobs, match):
    with pytest.raises(PlanError, match=match):
        make_plan(recipe, knobs=knobs)


def test_model_shape_is_checked_when_the_hf_config_is_here():
    ok = make_plan(R235, [f"model.hf_config={HF / 'qwen3-235b-a22b.json'}"], JUDGE)
    assert ok.layout["pp"] == 2
    # 94 layers do not split into 4 pipeline stages
    with pytest.raises(PlanError, match=r"num_layers=94 not divisible by pp=4"):
        make_plan(R235, [f"model.hf_config={HF / 'qwen3-235b-a22b.json'}", "parallel.pp=4"], JUDGE)


def test_bad_recipe_override_is_a_config_error():
    with pytest.raises(ConfigError, match="parallel.tpp"):
        make_plan(R30, ["parallel.tpp=2"])


# ---------------------------------------------------------------- judge, router, CPU

def test_judge_model_missing_blocks_the_launch_not_the_plan():
    plan = make_plan(R30)
    assert plan.nodes == 5 and len(plan.blockers) == 1
    assert "JUDGE_MODEL" in plan.blockers[0] and "solution_description" in plan.blockers[0]


def test_external_judge_needs_no_judge_node():
    plan = make_plan(R30, knobs=Knobs(judge_url="http://judge:8000", judge_name="qwen-judge"))
    assert plan.nodes == 4 and plan.roles["judge"] == [] and not plan.blockers
    assert {"judge.endpoint=http://judge:8000", "judge.model=qwen-judge"} <= set(plan.train_args)
    assert make_plan(R30, knobs=Knobs(judge_url="http://judge:8000")).blockers  # no model name


def test_trainer_overrides_carry_servers_and_judge():
    plan = make_plan(R30, ["objective.kl_coef=0.3"], dataclasses.replace(JUDGE, port_base=40000))
    args = plan.train_args
    assert args[:3] == ["--recipe", R30, "objective.kl_coef=0.3"]
    assert {"parallel.nodes=2", "parallel.gpus_per_node=8", "judge.model=judge",
            "judge.endpoint=http://node5:40600"} <= set(args)
    urls = next(a for a in args if a.startswith("rollout.server_urls="))
    assert urls == "rollout.server_urls=[" + ",".join(
        f"http://node{3 + i // 4}:{41500 + i}" for i in range(8)) + "]"
    ports = [s.port for s in plan.servers] + [plan.master_port]
    assert len(ports) == len(set(ports))  # unique even across nodes: test nodes share an address


def test_addresses_are_used_for_urls_and_master():
    hosts = tuple(f"n{i}" for i in range(1, 6))
    addrs = tuple(f"10.0.0.{i}" for i in range(1, 6))
    plan = make_plan(R30, knobs=dataclasses.replace(JUDGE, hosts=hosts, addrs=addrs, nodes=5))
    assert plan.master_addr == "10.0.0.1" and plan.sync_master == "10.0.0.1"
    assert plan.servers[0].url.startswith("http://10.0.0.3:") and plan.servers[0].hosts == ["n3"]


def test_weight_sync_address_and_router_url_reach_the_trainer():
    plan = make_plan(R30, knobs=JUDGE)
    assert "rollout.sync_master_address=node1" in plan.train_args  # trainer rank 0's node
    assert "rollout.router_url=http://node3:30000" in plan.train_args and not plan.notes
    # and the trainer accepts them: they are config fields
    from megatron_tg.config import load_config

    cfg = load_config(R30, [a for a in plan.train_args if a.startswith("rollout.")])
    assert (cfg.rollout.sync_master_address, cfg.rollout.router_url) == ("node1", "http://node3:30000")


def test_router_only_for_several_sglang_engines():
    assert any(s.role == "router" for s in make_plan(R30, knobs=JUDGE).servers)
    assert not any(s.role == "router" for s in make_plan(R30, knobs=dataclasses.replace(JUDGE, router=False)).servers)
    one = make_plan(R30, knobs=dataclasses.replace(JUDGE, rollout_nodes=1, gpus_per_node=2, train_nodes=8))
    assert [s.role for s in one.servers] == ["engine", "judge"]


def test_tiny_recipe_alone_needs_one_node_and_no_servers():
    plan = make_plan(TINY)  # rollout.engine: embedded -> the trainer generates in-process
    assert plan.accel == "cpu" and plan.nodes == 1 and plan.servers == []
    assert [s.role for s in plan.steps] == ["train"]


def test_tiny_cpu_path_has_no_gpu_requests():
    plan = make_plan(TINY, ["rollout.engine=sglang"],
                     Knobs(engine="embedded", gpus_per_node=1, train_nodes=1, rollout_nodes=1))
    assert plan.nodes == 2 and plan.engine == "embedded" and role_gpus(plan) == (0, 0, 0)
    assert all(s.gpus_per_task == 0 and s.gpus_per_node == 0 for s in plan.steps)
    assert [s.role for s in plan.servers] == ["engine"]  # one embedded engine: no router


def test_rollout_service_step_on_the_rollout_node_with_the_trainers_config():
    from megatron_tg.config import load_config
    from megatron_tg.sampling.service.wire import config_fingerprint

    knobs = Knobs(engine="embedded", gpus_per_node=1, train_nodes=1, rollout_nodes=1, service=True)
    plan = make_plan(TINY, ["rollout.engine=sglang", "rollout.group_size=4"], knobs)
    (svc,) = [s for s in plan.servers if s.role == "rollout_service"]
    step = plan.steps[svc.step]
    assert svc.hosts == ["node2"] and svc.gpus == 0 and step.overlap and step.ntasks == 1
    assert svc.port == knobs.port_base + P.PORT_OFFSETS["rollout_service"]
    assert plan.service_url == svc.url and svc.url not in [s.url for s in plan.servers if s is not svc]
    assert plan.train_args[-2:] == ["rollout.service=remote", f"rollout.service_url={svc.url}"]
    assert plan.service_args[-1] == "rollout.service=in_process"
    # both resolve the config the service checks at connect (placement keys aside)
    trainer = load_config(plan.train_args[1], plan.train_args[2:])
    service = load_config(plan.service_args[1], plan.service_args[2:])
    assert config_fingerprint(trainer) == config_fingerprint(service)
    assert (trainer.rollout.service, service.rollout.service) == ("remote", "in_process")
    assert service.rollout.server_urls == trainer.rollout.server_urls == [plan.servers[0].url]
    # without rollout nodes it shares the first trainer node; off unless asked or the recipe says so
    one = make_plan(TINY, [], Knobs(service=True))
    assert [s.hosts for s in one.servers] == [["node1"]] and one.service_url
    assert not make_plan(TINY).service_url and not make_plan(TINY).service_args
    assert make_plan(TINY, ["rollout.service=local"]).service_url
    env = R.render_env(plan)
    assert f"TG_SERVICE_URL={svc.url}" in env and "TG_SERVICE_ARGS=(--recipe" in env
    assert f"rollout service: {svc.url} on node2" in R.render_text(plan)
    # its admission bounds, from the config (max_inflight_rollouts 0 = buffer_size x group_size)
    assert any("at most 16 rollouts in flight" in n and "4 finished groups" in n and
               "node2's CPU count of tool calls" in n for n in plan.notes), plan.notes


def test_gpus_per_node_change_keeps_the_recipes_gpu_count():
    plan = make_plan(R30, knobs=dataclasses.replace(JUDGE, gpus_per_node=4))
    assert len(plan.roles["train"]) == 4 and plan.layout["world_size"] == 16
    assert len([s for s in plan.servers if s.role == "engine"]) == 8  # 2 per 4-GPU node


# ---------------------------------------------------------------- rendering

def test_env_rendering_round_trips_through_bash(tmp_path):
    plan = make_plan(R480, ["objective.kl_coef=0.3", "rollout.tasks=data/it's a file.jsonl"], JUDGE)
    env = tmp_path / "plan.env"
    env.write_text(R.render_env(plan))
    script = ('source "$1"; printf "%s\\n" "${#TG_STEP_NAME[@]}" "${TG_STEP_NODELIST[0]}" '
              '"${TG_SERVER_URL[7]}" "${TG_SERVER_STEP[8]}" "${TG_TRAIN_ARGS[3]}" "$TG_RUN_NAME" "${#TG_BLOCKERS[@]}"')
    out = subprocess.run(["bash", "-c", script, "bash", str(env)], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == [
        str(len(plan.steps)), "node41,node42", plan.servers[7].url, str(plan.servers[8].step),
        "rollout.tasks=data/it's a file.jsonl", "tg_480b", "0"]


def test_json_and_text_rendering():
    plan = make_plan(R30, knobs=JUDGE)
    data = json.loads(R.render_json(plan))
    assert data["nodes"] == 5 and data["gpus"] == {"train": 16, "engine": 16, "judge": 8}
    assert data["servers"][0]["url"] == plan.servers[0].url
    text = R.render_text(plan)
    assert "train        2    16  node1,node2" in text and "total        5    40" in text
    assert "layout: world 16 = tp 2 x cp 1 x pp 1 x dp 8; experts etp 1 x ep 8 x edp 2" in text


def test_cli_errors_are_one_line_and_out_dir_writes_all_formats(tmp_path, capsys):
    from megatron_tg.cli import main

    assert main(["plan", "--recipe", R235, "--train-nodes", "12"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("plan: error: train: 12 nodes") and err.count("\n") == 1
    assert main(["plan", "--recipe", R30, "--judge-model", "j", "--format", "env", "--out-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out == (tmp_path / "plan.env").read_text()
    assert {p.name for p in tmp_path.iterdir()} == {"plan.env", "plan.txt", "plan.json"}


def test_engines_get_the_routed_experts_flag_with_routing_replay(tmp_path):
    env = tmp_path / "plan.env"
    for override, want in (([], "--enable-return-routed-experts"),
                           (["rollout.routing_replay=false"], "")):
        env.write_text(R.render_env(make_plan(R30, override, JUDGE)))
        out = subprocess.run(["bash", "-c", 'source "$1"; printf "%s" "${TG_ENGINE_ARGS[*]}"',
                              "bash", str(env)], capture_output=True, text=True, check=True)
        assert out.stdout == want


# ---- checkpoint size, save time and the USR1 lead time --------------------------------------
BIG = {"tg_30b": "qwen3-coder-30b-a3b-instruct", "tg_235b": "qwen3-235b-a22b",
       "tg_480b": "qwen3-coder-480b-a35b-instruct"}


def _big_plan(name, knobs=JUDGE, *overrides):
    return make_plan(str(ROOT / "recipes" / f"{name}.yaml"),
                     [f"model.hf_config={HF / BIG[name]}.json", *overrides], knobs)


def test_checkpoint_size_save_time_and_lead_follow_the_recipe():
    from megatron_tg.models.describe import param_counts
    from megatron_tg.models.qwen3_moe.config import Qwen3Arch

    plan = _big_plan("tg_30b")
    c = plan.checkpoint
    total = param_counts(Qwen3Arch.from_hf(str(HF / f"{BIG['tg_30b']}.json")))["total_params"]
    assert c["checkpoint_bytes"] == total * (2 + 4 + 8)  # bf16 weights, fp32 main weights, Adam m, v
    nodes = len(plan.roles["train"])
    assert c["save_s"] == pytest.approx(c["checkpoint_bytes"] / (2e9 * nodes), abs=0.1)  # 2 GB/s a node
    assert c["usr1_lead_s"] >= max(c["step_s"], c["save_s"]) + c["save_s"]
    assert c["usr1_lead_s"] % 10 == 0
    # twice the bandwidth: half the save time; a frozen expert adds its bf16 copy
    fast = _big_plan("tg_30b", JUDGE, "checkpoint.write_gbps_per_node=4").checkpoint
    assert fast["save_s"] == pytest.approx(c["save_s"] / 2, abs=0.1)
    frozen = _big_plan("tg_30b", JUDGE, "objective.expert=frozen", "parallel.nodes=4").checkpoint
    assert frozen["checkpoint_bytes"] == total * (14 + 2)
    text = R.render_text(plan)
    assert f"USR1 lead time {c['usr1_lead_s']:,} s" in text
    assert f"TG_USR1_LEAD={c['usr1_lead_s']}" in R.render_env(plan)


def test_a_warning_too_short_for_a_step_and_a_save_is_refused():
    lead = _big_plan("tg_30b").checkpoint["usr1_lead_s"]
    with pytest.raises(PlanError, match=rf"usr1_lead: .*USR1@300\b.*need {lead} s.*USR1@{lead}"):
        _big_plan("tg_30b", dataclasses.replace(JUDGE, usr1_lead_s=300))
    assert _big_plan("tg_30b", dataclasses.replace(JUDGE, usr1_lead_s=lead)).checkpoint["usr1_lead_s"] == lead


@pytest.mark.parametrize("name", sorted(BIG))
def test_each_big_jobs_signal_is_the_lead_its_plan_computes(name):
    import re

    script = (ROOT / "slurm" / f"{name}.sh").read_text()
    signal = int(re.search(r"^#SBATCH --signal=B:USR1@(\d+)$", script, re.M).group(1))
    default = int(re.search(r'USR1_LEAD="\$\{USR1_LEAD:-(\d+)\}"', script).group(1))
    assert signal == default == _big_plan(name).checkpoint["usr1_lead_s"]


# ---------------------------------------------------------------- colocated

COLOCATED = ["rollout.placement=colocated", "rollout.engine_tp=1", "rollout.max_staleness=0"]


def test_colocated_engines_run_on_the_trainer_s_nodes_and_gpus():
    """No rollout nodes: 16 engines on the two trainer nodes, each task seeing the node's GPUs
    (shared with the trainer's step, both --overlap) from its own base GPU, the GPU of the
    trainer rank that writes it; the GPUs are counted once."""
    plan = make_plan(R30, [f"model.hf_config={HF / 'qwen3-coder-30b-a3b-instruct.json'}", *COLOCATED,
                           "rollout.num_engines=16", "rollout.max_context_tokens=32768"], JUDGE)
    assert plan.colocated and plan.roles == {"train": ["node1", "node2"], "rollout": [], "judge": ["node3"]}
    assert role_gpus(plan) == (16, 0, 8)
    engines = [s for s in plan.servers if s.role == "engine"]
    assert [s.hosts for s in engines] == [["node1"]] * 8 + [["node2"]] * 8
    assert [s.base_gpu for s in engines] == list(range(8)) * 2
    steps = {s.name: s for s in plan.steps}
    for name in ("tg-engines-node1", "tg-engines-node2", "tg-train"):
        assert (steps[name].gpus_per_node, steps[name].gpus_per_task, steps[name].overlap) == (8, 0, True), name
    assert steps["tg-engines-node1"].ntasks == 8 and steps["tg-router"].hosts == ["node1"]
    assert "--enable-memory-saver" in plan.engine_args and "--mem-fraction-static" in plan.engine_args
    env = R.render_env(plan)
    assert "TG_SERVER_BASE_GPU=(0 1 2 3 4 5 6 7 0 1 2 3 4 5 6 7 0 0)" in env and "TG_COLOCATED=1" in env
    assert "colocated on the trainer's GPUs" in R.render_text(plan)


def test_the_tiny_job_colocates_its_engine_and_service_on_the_trainer_s_node():
    plan = make_plan(TINY, ["rollout.engine=sglang", "parallel.backend=gloo", "rollout.placement=colocated"],
                     Knobs(accel="cpu", gpus_per_node=1, engine="embedded", service=True))
    assert plan.roles["rollout"] == [] and [s.hosts for s in plan.servers] == [["node1"], ["node1"]]
    assert all(s.overlap for s in plan.steps) and plan.nodes == 1
    assert "rollout.service=remote" in plan.train_args and "--enable-memory-saver" in plan.engine_args


@pytest.mark.parametrize("overrides, knobs, match", [
    (["rollout.num_engines=3"], {}, r"rollout.num_engines=3, but rollout.placement='colocated' .* 1 "
                                    r"trainer nodes x 2 GPUs hold 2 engines .* set rollout.num_engines=2"),
    (["rollout.num_engines=2"], {"rollout_nodes": 1}, r"1 rollout nodes asked for \(ROLLOUT_NODES\), but "
                                                      r"rollout.placement='colocated'"),
])
def test_colocated_layouts_that_cannot_share_the_trainer_s_nodes_are_refused(overrides, knobs, match):
    with pytest.raises(PlanError, match=match):
        make_plan(TINY, ["rollout.engine=sglang", "parallel.backend=gloo", "rollout.placement=colocated",
                         *overrides], Knobs(accel="cpu", gpus_per_node=2, engine="embedded", **knobs))
