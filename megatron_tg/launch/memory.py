"""``megatron-tg memory``: the per-GPU memory plan of a recipe, term by term, per role.

    megatron-tg memory --recipe recipes/tg_30b.yaml \\
        model.hf_config=tests/fixtures/hf_configs/qwen3-coder-30b-a3b-instruct.json

Trainer GPU (the most loaded pipeline stage; bytes per GPU):

* ``weights``      local parameters x params_dtype bytes; shards from :func:`rank_shards`
  (TP splits attention/vocabulary, EP x ETP the experts, PP the layers), which the tests hold
  equal to the real builder on the meta device (:func:`~megatron_tg.models.describe.built_shards`);
* ``gradients``    4 B per local parameter: the trainer's DDP reduces in fp32 (``grad_reduce_in_fp32``);
* ``optimizer``    fp32 master weights (bf16 params only) + Adam m and v; with the distributed
  optimizer the dense part is sharded over DP x CP ranks and the experts over expert-DP;
* ``activations``  what autograd keeps for one micro-batch of ``optimizer.micro_batch_tokens``
  (:func:`activation_bytes`), times the micro-batches a 1F1B pipeline holds on stage 0;
* ``kl_chunks``    the vocab-parallel ops' blocks: 4.3 x chunk x V/TP fp32 (measured by
  benchmarks/kl_memory.py, benchmarks/README.md);
* ``expert_states`` the expert's final hidden states ``[G, H]`` bf16 that the KL reads, one
  micro-batch's (upper bound: every token gated). When the expert pass runs ahead of the
  student pass (PP > 1, a frozen/EMA expert, or prefix reuse off) ``run_step`` keeps every
  micro-batch's states until the student pass; on GPU it parks them in pinned host memory and
  moves one micro-batch's back at its loss (:func:`megatron_tg.train.step.park`), so the GPU
  holds one micro-batch's and the host the step's: ``host_expert_states`` in the notes and
  JSON (the DP rank's rollouts of one step x max context, every token gated);
* ``cp_kv_exchange`` context parallelism: TE's p2p ring's send and receive buffers of this
  rank's K and V for one layer (the activations above are already per CP share; the output
  layer's input is gathered to every real token on every CP rank, as the loss reads it);
* ``prefix_kv``    prefix reuse (shared expert, PP 1, CP 1): the student's keys and values of every
  layer of one micro-batch, kept by ``record_kv`` until the expert pass; under full recompute
  they are extra (otherwise autograd keeps the same tensors for the backward: in activations);
* ``expert_copy``  objective.expert=frozen: its bf16 weights (0 otherwise);
* ``ema_*``        objective.expert=ema, term by term (:mod:`megatron_tg.launch.ema_plan`): the
  fp32 shard (or its host placement), the replicated copy or the gathered unit, its gather
  buffer and the held output weight;
* ``weight_sync``  one TP-merged, EP-gathered parameter (the largest) plus one bucket
  (rollout.sync_bucket_mb), when SGLang engines receive weights;
* ``runtime``      CUDA context, NCCL communicators and allocator slack: an assumption
  (:data:`RUNTIME_RESERVE_GIB`), to be replaced by the first GPU run's measurement.

Engine GPU (SGLang preallocates): its share of the bf16 weights, the KV cache that
``mem_fraction_static`` leaves, and whether the in-flight rollouts at full context fit in it.

The plan fits when every role's total is at most :data:`USABLE_FRACTION` of the GPU. The last
line printed is JSON: the terms and ``total_gib`` per role, and the time plan
(:mod:`megatron_tg.launch.timeplan`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megatron_tg.config import ConfigError, TGConfig
from megatron_tg.launch import ema_plan
from megatron_tg.launch.colocated_memory import colocated_roles
from megatron_tg.launch.colocated_memory import layout_refusal as colocated_layout_refusal
from megatron_tg.launch.engine_memory import engine_plan
from megatron_tg.launch.memory_terms import (BF16, FP32, GIB, H100_MEMORY_GIB, KL_BLOCKS,
                                             ROUTING_IMBALANCE, RUNTIME_RESERVE_GIB, RolePlan)
from megatron_tg.parallel.dims import ParallelDims

if TYPE_CHECKING:  # the model module imports torch: only where a plan is computed
    from megatron_tg.models.qwen3_moe.config import Qwen3Arch

@dataclass(frozen=True)
class Shard:
    """Parameters one rank of one pipeline stage holds."""

    pp_stage: int
    dense_params: int
    expert_params: int
    largest_merged_param: int
    """Elements of the largest parameter after TP merge (what weight sync materialises at once)."""
    unit_dense: int = 0
    """Dense parameters of the stage's largest gathered unit (a decoder layer or the
    embedding): what the gathered EMA expert materialises at once (:mod:`ema_plan`)."""
    unit_expert: int = 0
    """Expert parameters of that unit."""
    head_params: int = 0
    """The output weight's parameters on this rank (last stage; the embedding's when tied)."""

    @property
    def params(self) -> int:
        return self.dense_params + self.expert_params


def rank_shards(arch: Qwen3Arch, dims: ParallelDims) -> list[Shard]:
    """Per pipeline stage: the parameters megatron-core gives one rank (analytic; equal to
    :func:`~megatron_tg.models.describe.built_shards`, which builds the model to count)."""
    from megatron_tg.models.qwen3_moe.config import padded_vocab_size

    h, hd, tp = arch.hidden_size, arch.head_dim, dims.tp
    vpad = padded_vocab_size(arch.vocab_size, tp)
    # megatron replicates key/value heads when TP exceeds them (tp % groups == 0).
    kv_local = max(arch.num_key_value_heads // tp, 1)
    attn = (h * (arch.num_attention_heads // tp) * hd * 2          # q and o projections
            + 2 * h * kv_local * hd + 2 * hd + 2 * h)               # k, v, q/k norms, 2 layer norms
    if arch.attention_bias:
        attn += (arch.num_attention_heads // tp + 2 * kv_local) * hd
    per_stage = arch.num_layers // dims.pp
    shards = []
    for stage in range(dims.pp):
        dense = expert = 0
        units = []  # (dense, expert) per gathered unit
        for i in range(stage * per_stage, (stage + 1) * per_stage):
            ld, le = attn, 0
            if arch.is_moe_layer(i):
                ld += arch.num_experts * h  # the router is replicated over TP
                le = (arch.num_experts // dims.ep) * 3 * h * arch.moe_intermediate_size // dims.etp
            else:
                ld += 3 * h * arch.intermediate_size // tp
            dense, expert = dense + ld, expert + le
            units.append((ld, le))
        tied = arch.tie_word_embeddings and dims.pp == 1
        head = 0
        if stage == 0:
            dense += vpad // tp * h
            if not tied:  # tied: the embedding is the head, held, not a gathered unit
                units.append((vpad // tp * h, 0))
        if stage == dims.pp - 1:
            head = vpad // tp * h
            dense += h + (0 if tied else head)
        unit = max(units, key=sum)
        shards.append(Shard(stage, dense, expert, vpad * h, unit_dense=unit[0],
                            unit_expert=unit[1], head_params=head))
    return shards


def _layer_bytes_per_token(arch: Qwen3Arch, dims: ParallelDims, moe: bool, recompute: str) -> float:
    """Bytes autograd keeps for one token of one layer on one rank (bf16 activations, fp32
    router statistics), with sequence parallelism sharding the hidden-sized tensors over TP
    and TP the head- and ffn-sized ones. Flash/fused attention (TE) keeps q, k, v, its
    output and an fp32 log-sum-exp per head: no score matrix."""
    h, hd, tp = arch.hidden_size, arch.head_dim, dims.tp
    nq, nkv = arch.num_attention_heads, arch.num_key_value_heads
    attn = (BF16 * h * 2                          # input norm input, qkv projection input
            + BF16 * (nq + nkv) * hd              # q/k norm inputs
            + BF16 * (2 * nq + 2 * nkv) * hd      # attention q, k, v and output (= o-proj input)
            + FP32 * nq) / tp                     # log-sum-exp
    if moe:
        e, k, f, etp = arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size, dims.etp
        token = (BF16 * 2 * h + FP32 * 2 * e) / tp  # norm input, router input, logits, probs
        # Each rank's tokens are routed top-k times; expert-TP ranks all see their group's tokens.
        copies = k * etp * ROUTING_IMBALANCE / tp
        per_copy = BF16 * (h + 2 * f / etp + f / etp + h)  # fc1 in, fc1 out, act out, fc2 out
        mlp = token + copies * per_copy
        if recompute == "selective":  # "moe": the layer keeps only its input
            mlp = BF16 * 2 * h / tp
    else:
        f = arch.intermediate_size
        mlp = (BF16 * 2 * h + BF16 * 3 * f) / tp  # norm input, fc1 input, fc1 out (2f), act out
        if recompute == "selective":  # "mlp": keeps only its input
            mlp = BF16 * 2 * h / tp
    return attn + mlp


def activation_bytes(arch: Qwen3Arch, dims: ParallelDims, tokens: int, recompute: str,
                     in_flight: int) -> dict[str, float]:
    """Activation memory of the most loaded (first) pipeline stage for micro-batches of
    ``tokens`` tokens, ``in_flight`` of them held at once (1F1B: up to pp)."""
    per_stage = arch.num_layers // dims.pp
    layers = range(per_stage)  # stage 0
    t_rank = tokens / dims.cp
    kinds = [arch.is_moe_layer(i) for i in layers]
    kept = [_layer_bytes_per_token(arch, dims, m, recompute) * t_rank for m in kinds]
    if recompute == "full":
        stored = BF16 * arch.hidden_size * t_rank / dims.tp * len(kinds)  # each layer's input
        # backward reruns one layer at a time, holding all of its activations
        working = max(_layer_bytes_per_token(arch, dims, m, "none") * t_rank for m in set(kinds))
    else:
        stored, working = sum(kept), 0.0
    # the last norm's output feeds the (chunked) output layer, gathered over SP; under CP the
    # rank's share is then all-gathered over CP, so the loss reads every real token's states
    # on every CP rank (train/policy.py)
    gathered = tokens if dims.cp > 1 else 0
    outside = BF16 * arch.hidden_size * (t_rank + gathered)  # last stage; counted as on stage 0
    return {"layers": stored * in_flight, "recompute_working_set": working, "output_input": outside}


def korthikanti_layer_bytes(tokens: int, hidden: int, heads: int, tp: int, recompute: str) -> float:
    """Activation bytes per transformer layer from Korthikanti et al. 2022, "Reducing Activation
    Recomputation in Large Transformer Models", Table 2, with tensor + sequence parallelism
    (s·b = ``tokens``): none = sbh(34 + 5as/h)/t; selective = 34 sbh/t; full = 2 sbh/t.
    Its GPT layer has a 4h GELU MLP, dropout and an unfused softmax; megatron's
    ``theoretical_memory_usage.compute_activation_memory`` uses the same 34 (as 18 + 4 ffn/h)."""
    sbh = tokens * hidden
    if recompute == "full":
        return 2 * sbh / tp
    if recompute == "selective":
        return 34 * sbh / tp
    return sbh * (34 + 5 * heads * tokens / hidden) / tp


def _in_flight(cfg: TGConfig, dims: ParallelDims, rollout_tokens: int) -> int:
    """Micro-batches a 1F1B schedule holds on stage 0: min(pp, micro-batches per step)."""
    r = cfg.rollout
    per_rank = r.prompts_per_step * r.group_size * rollout_tokens / dims.dp
    return min(dims.pp, max(1, math.ceil(per_rank / cfg.optimizer.micro_batch_tokens)))


def train_plan(cfg: TGConfig, arch: Qwen3Arch, dims: ParallelDims) -> RolePlan:
    from megatron_tg.models.qwen3_moe.config import padded_vocab_size

    shards = rank_shards(arch, dims)
    s = max(shards, key=lambda x: x.params)
    wb = BF16 if cfg.model.params_dtype == "bfloat16" else FP32
    opt_per_param = (FP32 if wb == BF16 else 0) + 2 * FP32  # master copy + Adam m, v
    dense_shard = dims.dp * dims.cp if cfg.parallel.use_distributed_optimizer else 1
    expert_shard = dims.edp if cfg.parallel.use_distributed_optimizer else 1
    sharded = s.dense_params / dense_shard + s.expert_params / expert_shard
    mbt = cfg.optimizer.micro_batch_tokens
    act = activation_bytes(arch, dims, mbt, cfg.model.recompute,
                           _in_flight(cfg, dims, cfg.rollout.max_context_tokens))
    vpad = padded_vocab_size(arch.vocab_size, dims.tp)
    chunk = min(cfg.objective.logits_chunk_size, mbt)
    kl = KL_BLOCKS * chunk * vpad / dims.tp * FP32
    guided = cfg.objective.mode not in ("grpo",)
    # The expert's states at the gated rows, gathered over CP like the student's: every CP
    # rank keeps the micro-batch's (not its share's).
    expert_states = BF16 * arch.hidden_size * mbt if guided else 0.0
    # The trainer turns prefix reuse off under PP and under CP (train/trainer.py).
    prefix_reuse = (guided and cfg.objective.expert == "shared" and cfg.objective.expert_prefix_reuse
                    and dims.pp == 1 and dims.cp == 1)
    r = cfg.rollout
    step_tokens = r.prompts_per_step * r.group_size * r.max_context_tokens / dims.dp
    host_states = BF16 * arch.hidden_size * step_tokens if guided and not prefix_reuse else 0.0
    kv_local = max(arch.num_key_value_heads // dims.tp, 1)
    # TE's p2p CP attention passes K/V chunks around the CP ring, double-buffered: a send and
    # a receive buffer of this rank's K and V, for the layer being computed.
    cp_kv = (2 * 2 * (mbt / dims.cp) * kv_local * arch.head_dim * BF16) if dims.cp > 1 else 0.0
    prefix_kv = (2 * (arch.num_layers // dims.pp) * mbt * kv_local * arch.head_dim * BF16
                 if prefix_reuse and cfg.model.recompute == "full" else 0.0)
    expert = wb * s.params if cfg.objective.expert == "frozen" else 0.0
    ema, ema_host = ema_plan.ema_terms(cfg, dims, _stage_sizes(s), wb)
    syncs = cfg.rollout.engine == "sglang"
    sync = (BF16 * s.largest_merged_param + cfg.rollout.sync_bucket_mb * 2 ** 20) if syncs else 0.0
    terms = {"weights": wb * s.params, "gradients": FP32 * s.params,
             "optimizer": opt_per_param * sharded, "activations": act["layers"],
             "recompute_working_set": act["recompute_working_set"],
             "output_layer_input": act["output_input"], "kl_chunks": kl,
             "expert_states": expert_states, "prefix_kv": prefix_kv, "cp_kv_exchange": cp_kv,
             "expert_copy": expert,
             **ema, "weight_sync": sync, "runtime": RUNTIME_RESERVE_GIB * GIB}
    notes = [f"stage {s.pp_stage} of {dims.pp}: {s.dense_params:,} dense + {s.expert_params:,} "
             f"expert params per GPU; recompute={cfg.model.recompute}, micro-batch {mbt:,} tokens"]
    if host_states:
        notes.append(f"host memory: the step's expert states, parked in pinned memory between the "
                     f"expert and student passes: {host_states / GIB:.1f} GiB per GPU (upper bound: "
                     f"{step_tokens:,.0f} tokens per DP rank, every one gated)")
    if ema_host:
        notes.append(f"host memory: the EMA's fp32 shard in pinned memory "
                     f"(objective.ema_placement=host): {ema_host['ema_shard'] / GIB:.2f} GiB per GPU")
    fixes = {}
    if cfg.parallel.use_distributed_optimizer:
        fixes["optimizer"] = (f"more trainer nodes (parallel.nodes={cfg.parallel.nodes}: the optimizer "
                              f"already shards over dp={dims.dp * dims.cp}, edp={dims.edp})")
    return RolePlan("train", terms, notes, fixes=fixes,
                    host={"expert_states": host_states, **ema_host})


def _stage_sizes(s: Shard) -> ema_plan.StageSizes:
    return ema_plan.StageSizes(s.dense_params, s.expert_params, s.unit_dense, s.unit_expert,
                               s.head_params)


def planned_stage(cfg: TGConfig, arch: Qwen3Arch, dims: ParallelDims) -> ema_plan.StageSizes:
    """The most loaded stage's sizes, as :func:`train_plan` counts them (for the time plan)."""
    return _stage_sizes(max(rank_shards(arch, dims), key=lambda x: x.params))


# settings that shrink each term, for the refusal message.
FIXES = {
    "weights": "parallel.ep / parallel.tp / parallel.pp (shard the weights over more GPUs)",
    "gradients": "parallel.ep / parallel.tp / parallel.pp (fewer local parameters)",
    "optimizer": "parallel.use_distributed_optimizer=true or more trainer nodes (larger DP / expert-DP)",
    "activations": "model.recompute=full, a smaller optimizer.micro_batch_tokens, parallel.cp or "
                   "parallel.tp",
    "recompute_working_set": "a smaller optimizer.micro_batch_tokens, parallel.cp or parallel.tp",
    "cp_kv_exchange": "a smaller optimizer.micro_batch_tokens or parallel.tp",
    "output_layer_input": "a smaller optimizer.micro_batch_tokens",
    "kl_chunks": "a smaller objective.logits_chunk_size",
    "expert_states": "a smaller optimizer.micro_batch_tokens",
    "prefix_kv": "a smaller optimizer.micro_batch_tokens, or objective.expert_prefix_reuse=false",
    "expert_copy": "objective.expert=shared (the frozen expert's copy), or objective.expert=ema "
                   "with objective.ema_weights=gathered",
    "ema_shard": "objective.ema_placement=host, or more trainer nodes (the fp32 EMA shards over DP)",
    "ema_shard_staging": "parallel.ep / parallel.tp (smaller layers)",
    "ema_copy": "objective.ema_weights=gathered (no persistent bf16 copy)",
    "ema_gathered": "objective.ema_gather_scope=layer (one layer at a time)",
    "ema_gather_buffer": "parallel.ep / parallel.tp (smaller layers)",
    "ema_head": "parallel.tp (a smaller vocabulary shard)",
    "weight_sync": "a smaller rollout.sync_bucket_mb",
    "runtime": "nothing in the recipe (CUDA/NCCL reserve)",
    "kv_cache": "rollout.engine_tp (more GPUs per engine)",
    "sglang_reserved": "SGLang's --mem-fraction-static",
}


@dataclass
class MemoryPlan:
    recipe: str
    layout: dict[str, int]
    total_params: int
    active_params: int
    roles: dict[str, RolePlan]
    ema_time: dict[str, Any] | None = None
    """The gathered EMA expert's transfer time per step (:func:`ema_plan.ema_time`)."""
    layout_refusal: str | None = None
    """Why the layout cannot run as placed (colocated: :func:`colocated_memory.layout_refusal`)."""

    def refusal(self) -> str | None:
        """None when every role fits; else a sentence naming the largest term and its fix."""
        if self.layout_refusal:
            return self.layout_refusal
        for plan in self.roles.values():
            if not plan.fits():
                big = plan.largest()
                if plan.kv and plan.kv["rollouts_at_full_context"] < 1:
                    return (f"memory: an engine's KV cache holds {plan.kv['kv_tokens']:,} tokens, less "
                            f"than one rollout of rollout.max_context_tokens: set "
                            f"{plan.fixes.get('kv_cache', FIXES['kv_cache'])}")
                return (f"memory: the {plan.role} GPU needs {plan.total / GIB:.1f} GiB, more than "
                        f"{plan.usable_fraction:.0%} of {plan.capacity_gib:.1f} GiB; largest term {big} = "
                        f"{plan.terms[big] / GIB:.1f} GiB: set {plan.fixes.get(big, FIXES[big])}")
        return None


def memory_plan(cfg: TGConfig, recipe: str = "", world_size: int | None = None,
                mem_fraction: float | None = None) -> MemoryPlan:
    """The plan of ``cfg``; the HF config must be on this machine (model.hf_config)."""
    from megatron_tg.models.describe import param_counts
    from megatron_tg.models.qwen3_moe.config import Qwen3Arch

    if cfg.model.read_hf_config() is None:
        raise ConfigError(f"model.hf_config: {str(cfg.model.hf_config_file())!r} not found; the memory "
                          "plan needs the model's config.json (e.g. model.hf_config=PATH)")
    arch = Qwen3Arch.from_hf(str(cfg.model.hf_config_file()))
    dims = cfg.layout(world_size or cfg.parallel.default_world_size())
    counts = param_counts(arch)
    roles = {"train": train_plan(cfg, arch, dims)}
    layout = None
    if cfg.rollout.engine == "sglang" and cfg.rollout.placement == "colocated":
        # one GPU, two phases: roles["train"] is the train phase, roles["engine"] the generate phase
        roles = colocated_roles(cfg, arch, counts["total_params"], roles["train"], mem_fraction)
        layout = colocated_layout_refusal(cfg, dims.world_size)
    elif cfg.rollout.engine == "sglang":
        roles["engine"] = engine_plan(cfg, arch, counts["total_params"], mem_fraction)
    wb = BF16 if cfg.model.params_dtype == "bfloat16" else FP32
    return MemoryPlan(recipe, dims.describe(), counts["total_params"], counts["active_params"], roles,
                      ema_time=ema_plan.ema_time(cfg, dims, planned_stage(cfg, arch, dims), wb),
                      layout_refusal=layout)


class DoesNotFit(ConfigError):
    """A recipe whose memory plan exceeds a GPU; the message names the term and the fix."""


def launch_check(cfg: TGConfig, world_size: int, accel: str,
                 checkpoint: dict[str, Any] | None = None) -> list[str]:
    """The launch planner's hook: raise :class:`DoesNotFit` for a plan that does not fit, else
    the plan's one-line summary and its time per step, as notes; ``checkpoint`` (when given)
    receives the checkpoint plan (size, save time, USR1 lead: ``timeplan.checkpoint_plan``).
    Nothing for CPU plans, nor when the model's config.json is not on this machine
    (``megatron-tg memory`` says so)."""
    if accel != "gpu" or cfg.model.read_hf_config() is None:
        return []
    from megatron_tg.launch import timeplan

    plan = memory_plan(cfg, world_size=world_size)
    refusal = plan.refusal()
    if refusal:
        raise DoesNotFit(refusal)
    train = plan.roles["train"]
    summary = f"train {train.total / GIB:.1f} of {H100_MEMORY_GIB:.1f} GiB"
    engine = plan.roles.get("engine")
    if engine is not None:
        kv = engine.kv
        summary += (f"; engine weights {engine.terms['weights'] / GIB:.1f} GiB, KV cache "
                    f"{kv['kv_tokens']:,} tokens ({kv['rollouts_at_full_context']} rollouts at full "
                    f"context; in-flight rollouts {kv['in_flight']})")
    notes = [f"memory per GPU: {summary} (megatron-tg memory for the terms)"]
    times = timeplan.time_plan(cfg, plan)
    if checkpoint is not None:
        checkpoint.update(timeplan.checkpoint_plan(cfg, world_size, plan.total_params,
                                                   timeplan.step_seconds(times)))
    return notes + [line.strip() for line in timeplan.render(times) + ema_plan.render(plan.ema_time)]
