"""``megatron-tg memory``: the per-GPU plan's static terms against what megatron-core really
allocates, its activation terms against the published formula, the shipped recipes fitting,
and the launch planner refusing a plan that does not.

Measured (gloo ranks, CPU, two tiny Qwen3-MoE sizes): weights = this rank's parameter bytes;
gradients = megatron DDP's fp32 grad buffers; optimizer = 12 B x the elements of the grad
buffers' distributed-optimizer shard this rank owns (megatron's DDP with
``use_distributed_optimizer`` pads and splits its buffers over DP / expert-DP; the fp32
master + Adam state is allocated on GPU only, so its per-element size is the one thing
taken from megatron's code rather than measured); expert copy = a second model's bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_tg.config import load_config
from megatron_tg.launch.memory import (GIB, activation_bytes, korthikanti_layer_bytes,
                                       memory_plan, rank_shards)
from megatron_tg.models.qwen3_moe.config import Qwen3Arch
from megatron_tg.parallel.dims import ParallelDims
from megatron_tg.testing.distributed import run_distributed
from tests.models.qwen3_moe.common import TINY

ROOT = Path(__file__).resolve().parents[2]
HF = ROOT / "tests" / "fixtures" / "hf_configs"
RECIPES = {"tg_30b": "qwen3-coder-30b-a3b-instruct.json", "tg_235b": "qwen3-235b-a22b.json",
           "tg_480b": "qwen3-coder-480b-a35b-instruct.json",
           "tg_30b_128k": "qwen3-coder-30b-a3b-instruct.json"}
SMALL = dict(TINY, model_type="qwen3_moe")
LARGER = dict(SMALL, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, head_dim=32,
              moe_intermediate_size=128, intermediate_size=512, num_experts=8, vocab_size=2048)


def _hf_file(tmp_path, d, name):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(d))
    return path


@pytest.mark.parametrize("d,layout", [
    (SMALL, dict(tp=1)), (SMALL, dict(tp=2, ep=2, etp=1)), (LARGER, dict(tp=2, ep=4, etp=1, pp=2)),
    (LARGER, dict(tp=2, ep=2, etp=2, pp=2))])
def test_analytic_shards_equal_the_builder(d, layout):
    from megatron_tg.models.describe import built_shards

    arch = Qwen3Arch.from_hf(d)
    dims = ParallelDims.smallest(**layout)
    built = built_shards(arch, **layout)
    ours = rank_shards(arch, dims)
    assert [(s["dense_params"], s["expert_params"]) for s in built] == \
        [(s.dense_params, s.expert_params) for s in ours]


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_shards_equal_the_builder_at_the_recipe_layout(recipe):
    from megatron_tg.models.describe import built_shards

    cfg = load_config(ROOT / "recipes" / f"{recipe}.yaml", [f"model.hf_config={HF / RECIPES[recipe]}"])
    dims = cfg.layout(cfg.parallel.default_world_size())
    arch = Qwen3Arch.from_hf(str(HF / RECIPES[recipe]))
    built = built_shards(arch, tp=dims.tp, ep=dims.ep, pp=dims.pp, etp=dims.etp)
    assert [(s["dense_params"], s["expert_params"]) for s in built] == \
        [(s.dense_params, s.expert_params) for s in rank_shards(arch, dims)]


def _measure_rank(rank, world, hfs, layout):
    from megatron.core import parallel_state as mps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_tg.models.qwen3_moe import Qwen3Arch, build_model
    from megatron_tg.parallel.state import init_parallel

    out = []
    for hf in hfs:
        init_parallel(**layout)
        arch = Qwen3Arch.from_hf(hf)
        model = build_model(arch, params_dtype=torch.bfloat16, **layout)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        ddp = DistributedDataParallel(
            config=model.config, module=model,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                     use_distributed_optimizer=True))
        grads = shard_elems = 0
        for buf in ddp.buffers + ddp.expert_parallel_buffers:
            grads += buf.grad_data.numel() * buf.grad_data.element_size()
            shard_elems += buf.grad_data.numel() // buf.data_parallel_world_size
        expert = build_model(arch, params_dtype=torch.bfloat16, **layout)
        copy = sum(p.numel() * p.element_size() for p in expert.parameters())
        out.append(dict(weights=weights, gradients=grads, optimizer=12 * shard_elems,
                        expert_copy=copy))
        mps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    hfs = [str(_hf_file(d, cfg, name)) for cfg, name in ((SMALL, "small"), (LARGER, "larger"))]
    per_rank = run_distributed(_measure_rank, 4, hfs, dict(tp=1, ep=2, etp=1))  # dp 4, edp 2
    return hfs, per_rank


@pytest.mark.parametrize("size", [0, 1], ids=["small", "larger"])
def test_static_terms_match_megatron_within_10_percent(measured, size):
    hfs, per_rank = measured
    cfg = load_config(None, [f"model.hf_config={hfs[size]}", "parallel.ep=2", "parallel.etp=1",
                             "parallel.use_distributed_optimizer=true", "objective.expert=frozen"])
    plan = memory_plan(cfg, world_size=4).roles["train"].terms
    worst = max((r[size] for r in per_rank), key=lambda m: m["optimizer"])
    ratios = {k: plan[k] / worst[k] for k in worst}
    print(f"{Path(hfs[size]).stem}: predicted/measured", {k: round(v, 4) for k, v in ratios.items()})
    for term, ratio in ratios.items():
        assert 0.9 <= ratio <= 1.1, (term, ratio, plan[term], worst[term])


def test_full_recompute_stores_what_the_paper_says():
    """Full recompute keeps each layer's input: Korthikanti's 2sbh/t per layer, exactly."""
    arch = Qwen3Arch.from_hf(str(HF / RECIPES["tg_30b"]))
    dims = ParallelDims(16, tp=2, ep=8, etp=1)
    act = activation_bytes(arch, dims, 65536, "full", in_flight=1)
    paper = korthikanti_layer_bytes(65536, arch.hidden_size, arch.num_attention_heads, 2, "full")
    assert act["layers"] == pytest.approx(paper * arch.num_layers, rel=1e-9)


def test_per_layer_bytes_reconcile_with_the_published_formula_for_a_dense_gpt():
    """For a GPT-shaped dense layer (MHA, heads x head_dim = hidden, ffn = 4h) without
    recompute, under flash attention (no score matrix: Korthikanti's selective row, 34 sbh/t),
    ours differs by exactly what the architectures differ by, in units of sbh/t bytes:
    - 2 (no dropout masks: attention and MLP dropout are 0), + 4 (Qwen3's QK-norm keeps its
    q and k inputs), + 8 (SwiGLU keeps gate, up and their product: 3 x 4h wide, against GELU's
    input and output of 4h each); flash's fp32 log-sum-exp adds 4 x heads / hidden."""
    h, heads, t, tokens = 4096, 32, 8, 8192
    d = dict(model_type="qwen3", vocab_size=1024, hidden_size=h, num_hidden_layers=2,
             num_attention_heads=heads, num_key_value_heads=heads, head_dim=h // heads,
             intermediate_size=4 * h)
    arch = Qwen3Arch.from_hf(d)
    ours = activation_bytes(arch, ParallelDims(t, tp=t), tokens, "none", in_flight=1)["layers"] / 2
    paper = korthikanti_layer_bytes(tokens, h, heads, t, "selective")
    unit = tokens * h / t
    assert paper / unit == 34
    assert ours / unit == pytest.approx(34 - 2 + 4 + 8 + 4 * heads / h, rel=1e-12)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_shipped_recipes_fit_80gb_with_headroom(recipe):
    cfg = load_config(ROOT / "recipes" / f"{recipe}.yaml", [f"model.hf_config={HF / RECIPES[recipe]}"])
    plan = memory_plan(cfg)
    assert plan.refusal() is None
    for role in plan.roles.values():
        assert role.fits(), (role.role, role.total / GIB)
    assert plan.roles["train"].total / GIB <= 0.9 * 79.6


def test_planner_refuses_a_plan_that_does_not_fit_naming_term_and_fix():
    from megatron_tg.launch.plan import Knobs, make_plan

    with pytest.raises(Exception, match=r"largest term activations .*model\.recompute=full"):
        make_plan(str(ROOT / "recipes" / "tg_30b.yaml"),
                  [f"model.hf_config={HF / RECIPES['tg_30b']}", "model.recompute=none"],
                  Knobs(judge_url="http://judge:1", judge_name="j"))
    ok = make_plan(str(ROOT / "recipes" / "tg_30b.yaml"), [f"model.hf_config={HF / RECIPES['tg_30b']}"],
                   Knobs(judge_url="http://judge:1", judge_name="j"))
    assert any(n.startswith("memory per GPU: train") for n in ok.notes)
    assert any("bottleneck" in n for n in ok.notes)


def test_command_prints_terms_and_json_last(capsys):
    from megatron_tg.cli import main

    rc = main(["memory", "--recipe", str(ROOT / "recipes" / "tg_30b.yaml"),
               f"model.hf_config={HF / RECIPES['tg_30b']}", "--rollout-tokens", "16384"])
    assert rc == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(last["train"]["terms_gib"]) >= {"weights", "gradients", "optimizer", "activations",
                                               "kl_chunks", "expert_copy", "weight_sync"}
    assert last["train"]["total_gib"] == pytest.approx(sum(last["train"]["terms_gib"].values()), abs=0.01)
    assert last["engine"]["kv"]["in_flight"] in ("fit", "queue")
    assert last["time"]["tokens_per_rollout"] == 16384 and last["time"]["bottleneck"] in ("train", "generate")


def test_a_plan_that_does_not_fit_exits_1_naming_the_term(capsys):
    from megatron_tg.cli import main

    rc = main(["memory", "--recipe", str(ROOT / "recipes" / "tg_30b.yaml"),
               f"model.hf_config={HF / RECIPES['tg_30b']}", "objective.expert=ema",
               "objective.ema_weights=replicated"])  # the gathered EMA expert fits
    out = capsys.readouterr().out
    refusal = out.strip().splitlines()[-2]
    assert rc == 1 and "DOES NOT FIT" in out
    assert "largest term optimizer" in refusal and "more trainer nodes" in refusal, refusal
    assert json.loads(out.strip().splitlines()[-1])["train"]["fits"] is False


def test_missing_hf_config_is_a_clear_error(capsys):
    from megatron_tg.cli import main

    rc = main(["memory", "--recipe", str(ROOT / "recipes" / "tg_30b.yaml"),
               "model.hf_config=nowhere/config.json"])
    err = capsys.readouterr().err
    assert rc == 2 and "model.hf_config" in err and "nowhere" in err


def test_coverage_check_host_memory_is_checksums_not_a_snapshot():
    """The first-sync coverage check costs hashes in host memory, not SGLang's snapshot of the
    whole model per engine (~244 GB per rollout node at 30B, ~470 GB at 235B)."""
    from megatron_tg.config import load_config
    from megatron_tg.launch.memory import memory_plan

    fixtures = Path(__file__).resolve().parents[1] / "fixtures" / "hf_configs"
    for recipe, hf, snapshot_gb in (("tg_30b", "qwen3-coder-30b-a3b-instruct", 244),
                                    ("tg_235b", "qwen3-235b-a22b", 470)):
        cfg = load_config(f"recipes/{recipe}.yaml", [f"model.hf_config={fixtures / hf}.json"])
        engine = memory_plan(cfg).roles["engine"]
        cov = engine.kv["coverage_check"]
        assert round(cov["snapshot_bytes"] / 1e9) == snapshot_gb
        assert cov["checksum_bytes"] < 100 * 2**20
        assert any(n.startswith("first-sync coverage check") and f"{snapshot_gb} GB" in n for n in engine.notes)
    off = load_config("recipes/tg_30b.yaml", [f"model.hf_config={fixtures}/qwen3-coder-30b-a3b-instruct.json",
                                              "rollout.sync_verify_coverage=false"])
    engine = memory_plan(off).roles["engine"]
    assert "coverage_check" not in engine.kv and not any("coverage" in n for n in engine.notes)


def test_expert_states_and_prefix_kv_are_counted():
    """The expert's final hidden states and the prefix-reuse key/value store have terms: at
    tg_30b (shared expert, prefix reuse, full recompute) the store of one 64k micro-batch is
    2 x 48 layers x 65,536 tokens x 2 KV heads per TP rank x 128 x 2 B = 3.0 GiB; at tg_235b
    and tg_480b (PP 2: the expert pass runs ahead) the GPU holds one micro-batch's expert
    states and the host the step's (parked by the step): 1,024 rollouts x 65,536 tokens / DP
    16 x 4,096 x 2 B = 32 GiB, and 38.4 GiB at 480B (DP 20, H 6,144)."""
    from megatron_tg.config import load_config
    from megatron_tg.launch.memory import GIB, memory_plan

    plans = {name: memory_plan(load_config(str(ROOT / "recipes" / f"{name}.yaml"),
                                           [f"model.hf_config={HF / fixture}"]))
             for name, fixture in RECIPES.items()}
    t30, t235, t480 = (plans[n].roles["train"] for n in ("tg_30b", "tg_235b", "tg_480b"))
    assert t30.terms["prefix_kv"] == 2 * 48 * 65536 * 2 * 128 * 2 == 3 * GIB
    assert t30.terms["expert_states"] == 2 * 2048 * 65536 and not t30.host["expert_states"]
    assert t235.terms["prefix_kv"] == 0 and t235.terms["expert_states"] == 2 * 4096 * 65536
    assert t235.host["expert_states"] == 32 * 32 * 65536 / 16 * 4096 * 2 == 32 * GIB
    assert t480.host["expert_states"] == pytest.approx(32 * 32 * 65536 / 20 * 6144 * 2)
    assert any("host memory" in n and "32.0 GiB" in n for n in t235.notes)
    # the store is the activations' own tensors unless recompute frees those
    sel = memory_plan(load_config(str(ROOT / "recipes" / "tg_30b.yaml"),
                                  [f"model.hf_config={HF / RECIPES['tg_30b']}",
                                   "model.recompute=selective"])).roles["train"]
    assert sel.terms["prefix_kv"] == 0
    assert all(p.fits() for p in plans["tg_30b"].roles.values())
    assert t235.fits() and t480.fits()


@pytest.mark.parametrize("recipe", ["tg_30b", "tg_235b", "tg_480b"])
def test_the_ema_expert_fits_every_recipe_term_by_term(recipe):
    """objective.expert=ema with the recipe's EMA settings fits 90 % of an H100; the terms
    are the fp32 shard (device or host), the gathered unit, its buffer and the held output
    weight, and the replicated copy would not fit the 30B and 235B layouts."""
    path = str(ROOT / "recipes" / f"{recipe}.yaml")
    over = [f"model.hf_config={HF / RECIPES[recipe]}", "objective.expert=ema"]
    plan = memory_plan(load_config(path, over)).roles["train"]
    base = memory_plan(load_config(path, over[:1])).roles["train"]
    ema = {k: v for k, v in plan.terms.items() if k.startswith("ema_")}
    assert plan.fits(), (recipe, plan.total / GIB)
    assert set(ema) >= {"ema_shard", "ema_gathered", "ema_gather_buffer", "ema_head"}
    # The shared expert's plan plus the EMA terms, less the prefix-reuse store (shared only).
    assert plan.total == pytest.approx(base.total - base.terms["prefix_kv"] + sum(ema.values()))
    cfg = load_config(path, over)
    if cfg.objective.ema_placement == "host":
        assert ema["ema_shard"] == 0 and plan.host["ema_shard"] > 5 * GIB
    replicated = memory_plan(load_config(path, over + ["objective.ema_weights=replicated"]))
    if recipe != "tg_480b":
        assert not replicated.roles["train"].fits()
    t = memory_plan(cfg).ema_time
    assert t is not None and t["gather_s"] > 0
    print(f"{recipe}: {plan.total / GIB:.2f} GiB with the EMA expert ("
          + ", ".join(f"{k} {v / GIB:.2f}" for k, v in ema.items())
          + f"; host {plan.host.get('ema_shard', 0) / GIB:.2f}); replicated "
          f"{replicated.roles['train'].total / GIB:.2f}; gathers {t['gather_s']} s/step")


def test_the_128k_recipe_under_cp_term_by_term():
    """tg_30b_128k (131,072-token micro-batches, CP 2): the activations are one CP share's, the
    output layer's input is the share plus every real token (gathered for the loss), the
    expert states are the whole micro-batch's on every CP rank and parked on the host for the
    step, prefix reuse is off (no store) and TE's p2p ring adds its K/V buffers; at CP 1 the
    same micro-batch does not fit (without prefix reuse either)."""
    from megatron_tg.config import load_config
    from megatron_tg.launch.memory import GIB, memory_plan

    over = [f"model.hf_config={HF / RECIPES['tg_30b_128k']}"]
    path = str(ROOT / "recipes" / "tg_30b_128k.yaml")
    cfg = load_config(path, over)
    t, h, cp = 131072, 2048, 2
    assert (cfg.parallel.cp, cfg.optimizer.micro_batch_tokens, cfg.rollout.max_context_tokens) == (cp, t, t)
    plan = memory_plan(cfg).roles["train"]
    one = memory_plan(load_config(path, over + ["parallel.cp=1", "parallel.nodes=2"])).roles["train"]
    assert plan.fits() and plan.total / GIB < 0.9 * 79.6
    assert plan.terms["prefix_kv"] == 0 and one.terms["prefix_kv"] > 0
    assert plan.terms["activations"] == pytest.approx(one.terms["activations"] / cp)
    assert plan.terms["output_layer_input"] == 2 * h * (t // cp + t)
    assert plan.terms["expert_states"] == 2 * h * t == one.terms["expert_states"]
    assert plan.terms["cp_kv_exchange"] == 2 * 2 * (t // cp) * (4 // 2) * 128 * 2
    assert plan.host["expert_states"] == 32 * 32 * t / cfg.layout(32).dp * h * 2 == 64 * GIB
    assert not one.fits()
    refusal = memory_plan(load_config(path, over + ["parallel.cp=1", "parallel.nodes=2",
                                                    "objective.expert_prefix_reuse=false"])).refusal()
    assert refusal is not None
    print(f"\n128k: CP 2 {plan.total / GIB:.2f} GiB, CP 1 {one.total / GIB:.2f} GiB; {refusal}")
