"""Throughput and memory of the checkpoint converters, HF -> megatron -> HF.

Builds a random Qwen3-MoE (~150 MB in bf16 by default, like real checkpoints' dtype),
converts it to a megatron torch_dist checkpoint and back at each layout given, checks the
round trip is bit-exact, and prints per direction and layout:
- wall time and MB/s end to end (includes spawning workers and importing torch/megatron,
  a fixed ~10-20 s on a 2-core machine),
- the data phase of the slowest rank (read + save, or load + export) and its MB/s,
- per rank: shard size, peak RSS (VmHWM), peak anonymous memory and the baseline
  anonymous memory of an idle rank (imports), and (peak - baseline) / shard.
Then an estimate for Qwen3-Coder-30B-A3B (61 GB bf16) from those rates; the assumptions
are printed with it.

    python benchmarks/convert_throughput.py [--layers 8 --experts 16 ...] [--layouts 1,1 2,2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

# torch is imported inside the functions: workers and megatron's checkpoint-writer manager
# are spawned and re-import this file, and should not pay for torch twice.

ROOT = Path(__file__).resolve().parents[1]
CFG_30B = ROOT / "tests" / "fixtures" / "hf_configs" / "qwen3-coder-30b-a3b-instruct.json"


def build_model(args) -> tuple[Path, int, int]:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=4, head_dim=args.hidden // 8,
        intermediate_size=3 * args.hidden, moe_intermediate_size=args.moe_intermediate,
        num_experts=args.experts, num_experts_per_tok=4, mlp_only_layers=[0],
        tie_word_embeddings=False, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    path = Path(args.work_dir) / "hf"
    model.save_pretrained(path, max_shard_size="10GB")  # one file: the simplest source
    n = sum(p.numel() for p in model.parameters())
    return path, n, n * 2


def bit_exact(a: Path, b: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    def load(d: Path) -> dict:
        out = {}
        for f in sorted(d.glob("*.safetensors")):
            out.update(load_file(f))
        return out

    x, y = load(a), load(b)
    return set(x) == set(y) and all(torch.equal(x[k], y[k]) for k in x)


def row(direction: str, layout: tuple[int, int], result, phases: tuple[str, str],
        first_peak: str) -> dict:
    """One table row; the slowest rank's phases, the largest rank's memory."""
    ranks = result.ranks
    slow = max(ranks, key=lambda r: sum(r["seconds"][k] for k in phases))
    data = sum(slow["seconds"][k] for k in phases)
    worst = max(ranks, key=lambda r: r["memory"]["peak_anon"] - r["memory"]["baseline_anon"])
    mem = worst["memory"]
    return {"direction": direction, "tp": layout[0], "ep": layout[1], "world": len(ranks),
            "wall_s": result.seconds, "bytes": result.bytes,
            "mbps_wall": result.bytes / 1e6 / result.seconds,
            "phase_s": [slow["seconds"][k] for k in phases], "data_s": data,
            "mbps_data": result.bytes / 1e6 / data, "shard": worst["shard_bytes"],
            "peak_rss": mem["peak_rss"], "peak_anon": mem["peak_anon"],
            "baseline": mem["baseline_anon"],
            "first": mem[f"peak_anon_{first_peak}"] - mem["baseline_anon"],
            "work": mem["peak_anon"] - mem["baseline_anon"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--moe-intermediate", type=int, default=320)
    ap.add_argument("--layouts", nargs="+", default=["1,1", "2,2"], help="tp,ep pairs")
    ap.add_argument("--work-dir", default=None, help="default: a temporary dir, removed after")
    args = ap.parse_args()
    keep = args.work_dir is not None
    args.work_dir = args.work_dir or tempfile.mkdtemp(prefix="convert-bench-")
    layouts = [tuple(int(x) for x in s.split(",")) for s in args.layouts]

    from megatron_tg.convert import convert_hf_to_megatron, convert_megatron_to_hf
    from megatron_tg.convert.common import human_bytes
    from megatron_tg.convert.plan import shard_plan

    try:
        t = time.perf_counter()
        hf_dir, n_params, n_bytes = build_model(args)
        os.sync()  # the model file is written: keep its writeback out of the timings
        print(f"model: {n_params / 1e6:.1f}M params, {human_bytes(n_bytes)} bf16 "
              f"({args.layers} layers, {args.experts} experts, hidden {args.hidden}, vocab "
              f"{args.vocab}); built in {time.perf_counter() - t:.1f} s; {os.cpu_count()} CPUs, "
              f"load average {os.getloadavg()[0]:.1f}")
        rows = []
        for tp, ep in layouts:
            mg = Path(args.work_dir) / f"mg_tp{tp}_ep{ep}"
            back = Path(args.work_dir) / f"hf_back_tp{tp}_ep{ep}"
            res = convert_hf_to_megatron(hf_dir, mg, tp=tp, ep=ep, progress=False)
            print(res.summary)
            rows.append(row("hf->megatron", (tp, ep), res, ("read", "save"), "read"))
            res = convert_megatron_to_hf(mg, back, tp=tp, ep=ep, progress=False)
            print(res.summary)
            rows.append(row("megatron->hf", (tp, ep), res, ("load", "export"), "load"))
            assert bit_exact(hf_dir, back), f"round trip at tp={tp} ep={ep} is not bit-exact"
            print(f"round trip tp={tp} ep={ep}: bit-exact")
            shutil.rmtree(back)
            shutil.rmtree(mg)

        mb = 1e6
        print()
        print("phases: hf->megatron = read HF into the shard | torch_dist save; "
              "megatron->hf = torch_dist load | gather + write safetensors (slowest rank)")
        print("memory (MB, the rank with the most): shard = its parameters; idle = RssAnon "
              "after imports + process groups; 1st = peak above idle after read/load; "
              "peak = overall peak above idle; RSS = VmHWM (includes mapped file pages)")
        print(f"{'direction':<13} {'tp':>2} {'ep':>2} {'ranks':>5} {'wall s':>7} {'MB/s':>6} "
              f"{'phases s':>11} {'MB/s':>6} | {'shard':>6} {'idle':>5} {'1st':>5} "
              f"{'peak':>5} {'RSS':>5} {'peak/shard':>10}")
        for r in rows:
            ph = "+".join(f"{x:.2f}" for x in r["phase_s"])
            print(f"{r['direction']:<13} {r['tp']:>2} {r['ep']:>2} {r['world']:>5} "
                  f"{r['wall_s']:>7.1f} {r['mbps_wall']:>6.1f} {ph:>11} {r['mbps_data']:>6.1f} | "
                  f"{r['shard'] / mb:>6.0f} {r['baseline'] / mb:>5.0f} {r['first'] / mb:>5.0f} "
                  f"{r['work'] / mb:>5.0f} {r['peak_rss'] / mb:>5.0f} "
                  f"{r['work'] / r['shard']:>10.2f}")
        print(f"checkpoint size: {human_bytes(n_bytes)}")

        # --- estimate for the 30B model ------------------------------------------------
        print()
        print("estimate for Qwen3-Coder-30B-A3B (61 GB bf16) from the world-1 rows:")
        by = {(r["direction"], r["world"]): r for r in rows}
        embed_30b = 151936 * 2048 * 2  # the largest tensor an export writer gathers whole
        for direction in ("hf->megatron", "megatron->hf"):
            r1 = by.get((direction, 1))
            if r1 is None:
                continue
            rate = r1["bytes"] / r1["data_s"]       # bytes/s of one rank, phases only
            fixed = r1["wall_s"] - r1["data_s"]     # spawn, imports, checks, metadata
            factor = max(r["first"] / r["shard"] for r in rows if r["direction"] == direction)
            if direction == "hf->megatron":
                factor = max(r["work"] / r["shard"] for r in rows if r["direction"] == direction)
            for tp, ep in ((1, 1), (1, 8), (2, 8)):
                plan = shard_plan(CFG_30B, tp=tp, ep=ep)
                shard = plan["per_rank"][0]["bytes"]
                ram = shard * factor + (2 * embed_30b if direction == "megatron->hf" else 0)
                world = plan["layout"]["world_size"]
                minutes = (fixed + shard / rate) / 60
                print(f"  {direction:<13} tp={tp} ep={ep} ({world:>2} ranks): ~{minutes:.1f} min; "
                      f"shard {human_bytes(shard)}, RAM ~{human_bytes(ram)} per rank above idle")
        print("  assumes: the per-rank rate of the world-1 rows holds at 30B scale with one "
              "free core per rank and storage faster than ranks x that rate (else 61 GB / "
              "storage bandwidth); the fixed cost (spawn, imports) of the world-1 rows; RAM = "
              "shard x the measured peak/shard (writer: whole run; export: the load phase) "
              "+ on export writers 2 x the 0.62 GB embedding (gathered shards + merged copy)")
    finally:
        if not keep:
            shutil.rmtree(args.work_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
