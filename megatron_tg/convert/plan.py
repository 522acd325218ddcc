"""``--dry-run``: the shard plan of an HF -> megatron conversion, from config.json alone.

Megatron tensors and bytes per rank come from the real builder (``describe.built_shards``
builds rank 0 of each pipeline stage on the meta device); the HF tensors each rank reads
are counted from the architecture. Every rank of a stage holds the same amount (TP and
EP split evenly), so one line per stage describes them all.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from megatron_tg.convert.common import config_dtype, dtype_name, human_bytes, quiet_megatron
from megatron_tg.models.qwen3_moe.config import Qwen3Arch, load_hf_config_dict
from megatron_tg.parallel.dims import ParallelDims

# Measured in benchmarks/convert_throughput.py: a writer's peak heap above an idle rank is
# about its shard times this (1.53-1.56 measured): megatron's torch_dist save clones the
# gate/up halves of every fc1 it checkpoints. HF tensors add nothing: they are copied from
# the file's memory map straight into the parameters.
SAVE_OVERHEAD = 1.6
IDLE_RANK_BYTES = 300 * 10**6  # torch + megatron imported, process groups up (measured)


def _hf_tensors_read(arch: Qwen3Arch, stage: int, pp: int, ep: int) -> int:
    per_stage = arch.num_layers // pp
    n = 0
    for i in range(stage * per_stage, (stage + 1) * per_stage):
        n += 2 + 6 + (3 if arch.attention_bias else 0)  # norms, q/k/v/o, q/k norm, biases
        n += 1 + 3 * (arch.num_experts // ep) if arch.is_moe_layer(i) else 3
    if stage == 0:
        n += 1  # embed_tokens
    if stage == pp - 1:
        n += 2 if (not arch.tie_word_embeddings or pp > 1) else 1  # final norm (+ lm_head)
    return n


def shard_plan(hf_config: Any, *, tp: int = 1, ep: int = 1, pp: int = 1,
               etp: int | None = None) -> dict[str, Any]:
    from megatron_tg.models.describe import built_shards, param_counts


    cfg = load_hf_config_dict(hf_config)
    arch = Qwen3Arch.from_hf(cfg)
    layout = ParallelDims.smallest(tp=tp, ep=ep, pp=pp, etp=etp)
    layout.check_arch(arch)
    dtype = config_dtype(cfg) or torch.bfloat16
    item = torch.empty((), dtype=dtype).element_size()
    with quiet_megatron():
        stages = built_shards(arch, tp=tp, ep=ep, pp=pp, etp=layout.etp, bytes_per_param=item)
    per_rank = [{
        "pp_stage": s["pp_stage"], "ranks": layout.world_size // pp,
        "megatron_tensors": s["tensors"],
        "hf_tensors_read": _hf_tensors_read(arch, s["pp_stage"], pp, ep),
        "params": s["params"], "bytes": s["bytes"],
        "est_peak_bytes": int(s["bytes"] * SAVE_OVERHEAD) + IDLE_RANK_BYTES,
    } for s in stages]
    total = param_counts(arch)["total_params"] * item
    return {"model_type": arch.model_type, "dtype": dtype_name(dtype), "layout": layout.sizes(),
            "checkpoint_bytes": total, "per_rank": per_rank}


def print_plan(hf_config: Any, **layout: Any) -> dict[str, Any]:
    plan = shard_plan(hf_config, **layout)
    lay = plan["layout"]
    print(f"dry run: {plan['model_type']} in {plan['dtype']}, "
          f"{human_bytes(plan['checkpoint_bytes'])} of HF tensors; writer layout "
          f"tp={lay['tp']} ep={lay['ep']} etp={lay['etp']} pp={lay['pp']} -> "
          f"{lay['world_size']} processes")
    for s in plan["per_rank"]:
        print(f"  pp stage {s['pp_stage']} ({s['ranks']} ranks), per rank: "
              f"{s['megatron_tensors']} megatron tensors from {s['hf_tensors_read']} HF tensors, "
              f"{human_bytes(s['bytes'])}; est. peak RAM {human_bytes(s['est_peak_bytes'])}")
    print(json.dumps(plan))
    return plan
