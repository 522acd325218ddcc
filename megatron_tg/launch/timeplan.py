"""The time side of a recipe's plan: per optimizer step, what each role must process and how
long that takes at stated rates, so the bottleneck role is visible before a job is submitted.

Every rate below is an assumption with its source; each can be overridden on the command
line. Token counts are upper bounds by default: every rollout is taken at
``rollout.max_context_tokens`` and every token is counted as generated (tool output is in
fact prefilled, not decoded) and as failing (the expert pass runs over all of it).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from megatron_tg.config import TGConfig


class SizedPlan(Protocol):
    """What :func:`time_plan` reads of a memory plan (a
    :class:`~megatron_tg.launch.memory.MemoryPlan`: the memory module imports this one,
    never the reverse)."""

    layout: dict[str, int]
    total_params: int
    active_params: int

REPO_ROOT = Path(__file__).resolve().parents[2]

# NVIDIA H100 SXM5 datasheet: 989 TFLOP/s dense BF16 (1,979 is the 2:4-sparse figure).
H100_BF16_PEAK_FLOPS = 989e12
# Megatron-Bridge's published Qwen3-30B-A3B pretraining on 16 x H100 (container 25.11, PP2
# VP24 EP8): 121 TFLOP/s per GPU, i.e. 0.12 of the bf16 peak. RL micro-batches of 64k-token
# rollouts are not that benchmark; the first GPU run must measure ours.
ASSUMED_MFU = 0.12
# SGLang serving Qwen3-30B-A3B on H100: 1,627 output tokens/s (Neural Nova's published
# baseline sweep, "Getting More Out of SGLang", 2026; its GPU count per server is not
# stated, so it is taken as one engine's rate). Decode is bound by reading the active
# weights, so other models are scaled by active parameters. A rough figure: --engine-tokens-per-s
# replaces it, and the first GPU run must measure it.
ENGINE_TOKENS_PER_S_30B = 1627.0
ACTIVE_PARAMS_30B = 3.35e9
# Host <-> GPU copies of the colocated offload (pinned buffers, PCIe Gen5 x16: 64 GB/s per
# direction on paper); half of it assumed reachable. Not measured (docs/colocated.md).
ASSUMED_PCIE_GBPS = 32.0
# Judge transcripts: characters per token of English text and code (tiktoken-style BPE rule of
# thumb); the judge truncates transcripts at judge.max_transcript_chars.
CHARS_PER_TOKEN = 4.0


@dataclass(frozen=True)
class Assumptions:
    mfu: float = ASSUMED_MFU
    peak_flops: float = H100_BF16_PEAK_FLOPS
    engine_tokens_per_s: float | None = None
    """Per engine; None = the 30B figure scaled by active parameters."""
    rollout_tokens: int | None = None
    """Tokens per rollout; None = rollout.max_context_tokens (upper bound)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("time plan assumptions")
    g.add_argument("--mfu", type=float, default=ASSUMED_MFU,
                   help=f"trainer model-FLOPs utilisation (default {ASSUMED_MFU}: Megatron-Bridge, see timeplan.py)")
    g.add_argument("--engine-tokens-per-s", type=float,
                   help="decode tokens/s of one engine (default: 1,627 for 30B-A3B scaled by active params)")
    g.add_argument("--rollout-tokens", type=int,
                   help="mean tokens per rollout (default: rollout.max_context_tokens, an upper bound)")


def assumptions_from(args: argparse.Namespace) -> Assumptions:
    return Assumptions(mfu=args.mfu, engine_tokens_per_s=args.engine_tokens_per_s,
                       rollout_tokens=args.rollout_tokens)


def _llm_criteria(cfg: TGConfig) -> int:
    if cfg.judge.rubric is None:
        return 0
    path = Path(cfg.judge.rubric)
    if not path.is_file() and not path.is_absolute() and (REPO_ROOT / path).is_file():
        path = REPO_ROOT / path
    if not path.is_file():
        return 0
    from megatron_tg.judge.rubric import load_rubric

    return len(load_rubric(path).llm_criteria())


def time_plan(cfg: TGConfig, plan: SizedPlan, a: Assumptions = Assumptions()) -> dict[str, Any]:
    """Per-step token counts, FLOPs, seconds per role and the bottleneck."""
    from megatron_tg.models.qwen3_moe.config import Qwen3Arch

    arch = Qwen3Arch.from_hf(str(cfg.model.hf_config_file()))
    r = cfg.rollout
    rollouts = r.prompts_per_step * r.group_size
    per_rollout = a.rollout_tokens or r.max_context_tokens
    train_tokens = rollouts * per_rollout
    generated = rollouts * min(per_rollout, r.max_turns * r.max_new_tokens)
    n = plan.active_params
    # causal attention: QK^T and AV at 2 FLOPs per multiply-add over half the context on average
    attn_fwd = 2 * 2 * arch.num_layers * arch.num_attention_heads * arch.head_dim * per_rollout / 2
    fwd = 2 * n + attn_fwd
    passes = 3 + (1 if cfg.model.recompute == "full" else 0)  # fwd + 2x bwd (+ recompute fwd)
    expert = 0 if cfg.objective.mode == "grpo" else 1  # a forward pass, no backward (upper bound)
    train_flops = train_tokens * fwd * (passes + expert)
    world = plan.layout["world_size"]
    train_s = train_flops / (world * a.peak_flops * a.mfu)
    eng_tps = a.engine_tokens_per_s or ENGINE_TOKENS_PER_S_30B * ACTIVE_PARAMS_30B / n
    engines = max(r.num_engines, 1)
    gen_s = generated / (engines * eng_tps)
    criteria = _llm_criteria(cfg)
    judge_tokens = rollouts * criteria * min(per_rollout, math.ceil(cfg.judge.max_transcript_chars
                                                                     / CHARS_PER_TOKEN))
    sync_bytes = 2 * plan.total_params  # bf16, every parameter once per sync
    ckpt = checkpoint_bytes(cfg, plan.total_params)
    rates = {"train": train_s, "generate": gen_s}
    colocated = None
    if r.placement == "colocated":  # one GPU, phases in turn: the step is their sum
        train_role = getattr(plan, "roles", {}).get("train")
        moved = train_role.host.get("colocated_offload", 0.0) if train_role is not None else 0.0
        swap_s = 2 * moved / (ASSUMED_PCIE_GBPS * 1e9)  # offload before generating, onload after
        colocated = {"offload_bytes_per_gpu": moved, "offload_onload_s": round(swap_s, 1),
                     "step_s": round(gen_s + swap_s + train_s, 1),
                     "disaggregated_step_s": round(max(train_s, gen_s), 1), "pcie_gbps": ASSUMED_PCIE_GBPS}
    return {
        "colocated": colocated,
        "rollouts_per_step": rollouts, "tokens_per_rollout": per_rollout,
        "train_tokens": train_tokens, "train_flops": train_flops, "train_s": round(train_s, 1),
        "generated_tokens": generated, "engine_tokens_per_s": round(eng_tps, 1),
        "generate_s": round(gen_s, 1), "judge_llm_criteria": criteria,
        "judge_prefill_tokens": judge_tokens, "sync_bytes": sync_bytes, "checkpoint_bytes": ckpt,
        "bottleneck": max(rates, key=rates.get),
        "assumptions": {"mfu": a.mfu, "peak_flops": a.peak_flops, "engine_tokens_per_s": eng_tps,
                        "chars_per_token": CHARS_PER_TOKEN},
    }


# After the last save: the trainer's exit, the engines' teardown and the requeue (scontrol)
# in slurm/lib.sh. A rough allowance, not a measurement.
EXIT_MARGIN_S = 60.0


def checkpoint_bytes(cfg: TGConfig, total_params: int) -> int:
    """Bytes of one checkpoint: the model in its dtype, fp32 main parameters (bf16 models
    only; megatron's optimizer keeps fp32 weights in place), Adam's two fp32 moments, and
    the expert copy (frozen: the model's dtype; EMA: fp32, checkpoint.py saves the average)."""
    model = 2 if cfg.model.params_dtype == "bfloat16" else 4
    main = 4 if model == 2 else 0
    expert = {"shared": 0, "frozen": model, "ema": 4}[cfg.objective.expert]
    return total_params * (model + main + 8 + expert)


def checkpoint_plan(cfg: TGConfig, world: int, total_params: int, step_s: float) -> dict[str, Any]:
    """Checkpoint size, expected save time at ``checkpoint.write_gbps_per_node`` per trainer
    node, and the USR1 lead time that covers a stop signal arriving at the start of a step.

    Lead time = max(step, save) + save + :data:`EXIT_MARGIN_S`, rounded up to 10 s: the step in
    progress finishes (while an earlier asynchronous save may still be writing, which delays
    the last save by what outlasts the step), then the last save is written and waited for,
    then the job exits and requeues."""
    size = checkpoint_bytes(cfg, total_params)
    nodes = max(1, math.ceil(world / cfg.parallel.gpus_per_node))
    save_s = size / (cfg.checkpoint.write_gbps_per_node * 1e9 * nodes)
    lead = max(step_s, save_s) + save_s + EXIT_MARGIN_S
    return {"checkpoint_bytes": size, "write_gbps": cfg.checkpoint.write_gbps_per_node * nodes,
            "save_s": round(save_s, 1), "step_s": round(step_s, 1),
            "usr1_lead_s": int(math.ceil(lead / 10) * 10)}


def step_seconds(t: dict[str, Any]) -> float:
    """One step's seconds: the slower role disaggregated (they overlap), the sum of the
    phases colocated (they take turns)."""
    return t["colocated"]["step_s"] if t.get("colocated") else max(t["train_s"], t["generate_s"])


def render(t: dict[str, Any]) -> list[str]:
    a = t["assumptions"]
    return [
        f"time per step ({t['rollouts_per_step']} rollouts x {t['tokens_per_rollout']:,} tokens):",
        f"  train     {t['train_tokens']:,} tokens, {t['train_flops']:.3g} FLOPs -> {t['train_s']:,} s "
        f"at MFU {a['mfu']} of {a['peak_flops'] / 1e12:.0f} TFLOP/s per GPU",
        f"  generate  {t['generated_tokens']:,} tokens -> {t['generate_s']:,} s at "
        f"{a['engine_tokens_per_s']:,.0f} tokens/s per engine",
        f"  judge     {t['judge_prefill_tokens']:,} prefill tokens ({t['judge_llm_criteria']} LLM criteria)",
        f"  sync      {t['sync_bytes'] / 1e9:.1f} GB per weight update; checkpoint "
        f"{t['checkpoint_bytes'] / 1e9:.1f} GB",
        f"  bottleneck: {t['bottleneck']}",
    ] + ([] if not t.get("colocated") else [
        f"  colocated step: generate {t['generate_s']:,} s + offload/onload {t['colocated']['offload_onload_s']:,} s "
        f"({t['colocated']['offload_bytes_per_gpu'] / 1e9:.1f} GB per GPU each way at an assumed "
        f"{t['colocated']['pcie_gbps']:.0f} GB/s) + train {t['train_s']:,} s = {t['colocated']['step_s']:,} s "
        f"(the same GPUs disaggregated into two roles would overlap them: max = "
        f"{t['colocated']['disaggregated_step_s']:,} s at these rates); sync: CUDA IPC inside the node, not modelled"])


def render_checkpoint(c: dict[str, Any]) -> str:
    return (f"checkpoint {c['checkpoint_bytes'] / 1e9:,.0f} GB, save {c['save_s']:,} s at "
            f"{c['write_gbps']:g} GB/s (checkpoint.write_gbps_per_node x trainer nodes); step "
            f"{c['step_s']:,} s -> USR1 lead time {c['usr1_lead_s']:,} s (--signal=B:USR1@"
            f"{c['usr1_lead_s']})")
