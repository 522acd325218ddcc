"""Rollout-manager throughput vs raw engine throughput, side by side, on the embedded engine.

One engine subprocess (tiny random Qwen3-MoE, CPU) serves both measurements, alternated
round by round so machine load drifts hit both equally:

* ``raw``     — the same prompts sent straight through ``SGLangClient.generate``, G requests
                per prompt, at most ``buffer_size * G`` in flight (the manager's ceiling);
* ``manager`` — :class:`~megatron_tg.rollout.manager.RolloutManager` generating GRPO groups
                of G (single-turn rollout function that builds and validates a ``Rollout``
                per request) while a trainer loop pulls batches of ``prompts_per_step``
                groups as fast as they come.

Throughput = generated tokens / wall-clock seconds. Every request samples exactly
``--tokens`` tokens (``ignore_eos``), so both sides do identical engine work; the ratio
shows the manager's overhead (bookkeeping, group synchronisation, buffer hand-off). The
target is >= 0.95 (median of the per-round ratios; the pooled ratio is total tokens / total
time). On a shared machine wall-clock swings by tens of percent between identical runs, so
steadier figures are printed too: CPU time per 1k tokens of the client process (the manager's
own cost) and of the engine (its batching efficiency: fewer requests in flight cost more CPU
per token), and the time from the start to the first request and from the last answer to the
end of a run (what the manager adds to the critical path).

    python benchmarks/rollout_manager.py                 # 12 prompts x G=8 x 64 tokens, 10 rounds
    python benchmarks/rollout_manager.py --quick         # 8 prompts, 1 round
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from megatron_tg.config.rollout import RolloutConfig
from megatron_tg.rollout.client import SGLangClient
from megatron_tg.rollout.manager import RolloutManager
from megatron_tg.rollout.types import Rollout, Segment
from megatron_tg.parallel.ports import free_port

VOCAB = 300


def build_model(path: Path) -> Path:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, moe_intermediate_size=32, intermediate_size=64, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=1024, initializer_range=0.2, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(path)
    return path


def start_engine(model: Path, threads: int, max_running: int, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), ENGINE_LOG_LEVEL="WARNING", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatron_tg.rollout.engine", "--model", str(model), "--port", str(port),
         "--threads", str(threads), "--max-running-requests", str(max_running)],
        stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited: {log_path.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("engine did not become healthy")
        time.sleep(0.2)


async def single_turn(ctx) -> Rollout:
    """The cheapest realistic rollout function: one generation, a validated token-exact rollout."""
    prompt = ctx.task["prompt"]
    out = await ctx.generate(prompt)
    n = len(prompt)
    return Rollout(task_id=ctx.task["id"], group_id=ctx.group_id, token_ids=prompt + out.ids,
                   segments=[Segment("prompt", 0, n),
                             Segment("assistant", n, n + len(out.ids), logprobs=out.logprobs,
                                     policy_version=out.version, meta=out.segment_meta())],
                   finish_reason="length" if out.finish_type == "length" else "stop")


class Timed:
    """Wraps the client to time the first request and the last answer of a run: whatever the
    manager adds before the first request or after the last answer is its critical-path cost."""

    def __init__(self, client):
        self.client, self.first, self.last = client, None, None

    async def generate(self, *a, **k):
        now = time.perf_counter()
        self.first = now if self.first is None else min(self.first, now)
        res = await self.client.generate(*a, **k)
        self.last = time.perf_counter()
        return res

    def __getattr__(self, name):  # pause/continue etc. go straight through
        return getattr(self.client, name)


async def run_raw(client, prompts, params, group_size, concurrency) -> tuple[int, float]:
    sem = asyncio.Semaphore(concurrency)

    async def one(p):
        async with sem:
            return len((await client.generate(p, params, return_logprob=True)).output_ids)

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts for _ in range(group_size)))
    return sum(counts), time.perf_counter() - t0


async def run_manager(client, prompts, params, cfg) -> tuple[int, float]:
    tasks = [{"id": f"p{i}", "prompt": p} for i, p in enumerate(prompts)]
    m = RolloutManager(client, single_turn, tasks, cfg, sampling_params=params, vocab_size=VOCAB)
    tokens = 0
    t0 = time.perf_counter()
    async with m:
        while True:
            batch = await m.get_batch(0)
            if not batch:
                break
            tokens += sum(s.end - s.start for g in batch for r in g.rollouts for s in r.assistant_turns())
    dt = time.perf_counter() - t0
    m.check_invariants()
    c = m.counters()
    assert c["trained"] == len(prompts) and c["dropped"] == 0, c
    return tokens, dt


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) a process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def bench(url, engine_pid, args) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(16, 65))] for _ in range(args.prompts)]
    params = {"max_new_tokens": args.tokens, "ignore_eos": True, "temperature": 1.0}
    cfg = RolloutConfig(group_size=args.group_size, prompts_per_step=args.prompts_per_step,
                        buffer_size=args.buffer_size, max_new_tokens=args.tokens)
    cfg.validate()
    concurrency = args.buffer_size * args.group_size
    print(f"engine: tiny Qwen3-MoE (vocab {VOCAB}, 2 layers, 4 experts), {args.threads} thread(s), "
          f"max_running={args.max_running}")
    print(f"workload: {args.prompts} prompts x G={args.group_size} x {args.tokens} tokens; buffer_size="
          f"{args.buffer_size} groups (<= {concurrency} requests in flight); prompts_per_step={args.prompts_per_step}")
    async with SGLangClient([url]) as client:
        await run_raw(client, prompts[:2], params, args.group_size, concurrency)  # warm-up
        ratios, cpu_ratios, edges = [], [], {"raw": [], "manager": []}
        tot = {"raw": [0, 0.0, 0.0, 0.0], "manager": [0, 0.0, 0.0, 0.0]}
        for k in range(args.rounds):
            res = {}
            # alternate which side goes first, so load drifts within a round cancel out
            for side in (("raw", "manager") if k % 2 == 0 else ("manager", "raw")):
                c0, e0 = time.process_time(), cpu_seconds(engine_pid)
                timed = Timed(client)
                t0 = time.perf_counter()
                if side == "raw":
                    n, dt = await run_raw(timed, prompts, params, args.group_size, concurrency)
                else:
                    n, dt = await run_manager(timed, prompts, params, cfg)
                assert n == args.prompts * args.group_size * args.tokens
                res[side] = (n, dt, time.process_time() - c0, cpu_seconds(engine_pid) - e0)
                edges[side].append(((timed.first - t0) * 1e3, (t0 + dt - timed.last) * 1e3))
                for i, x in enumerate(res[side]):
                    tot[side][i] += x
            (rt, rdt, rcpu, recpu), (mt, mdt, mcpu, mecpu) = res["raw"], res["manager"]
            ratios.append((mt / mdt) / (rt / rdt))
            cpu_ratios.append(recpu / mecpu)
            print(f"round {k + 1:2d}: raw {rt / rdt:7.1f} tok/s ({rdt:.2f} s; CPU engine {recpu:.2f} s, client "
                  f"{rcpu:.2f} s) | manager {mt / mdt:7.1f} tok/s ({mdt:.2f} s; CPU engine {mecpu:.2f} s, client "
                  f"{mcpu:.2f} s) | ratio {ratios[-1]:.3f}")
    med = statistics.median(ratios)
    pooled = (tot["manager"][0] / tot["manager"][1]) / (tot["raw"][0] / tot["raw"][1])
    for what, i in (("client", 2), ("engine", 3)):
        print(f"{what} CPU per 1k tokens: raw {1000 * tot['raw'][i] / tot['raw'][0]:.3f} s, manager "
              f"{1000 * tot['manager'][i] / tot['manager'][0]:.3f} s")
    for side in ("raw", "manager"):
        print(f"{side}: median {statistics.median(e[0] for e in edges[side]):.1f} ms to the first request, "
              f"{statistics.median(e[1] for e in edges[side]):.1f} ms from the last answer to the end")
    print(f"engine-CPU-normalised ratio (tokens per engine CPU-second, manager / raw; insensitive to "
          f"other load): median {statistics.median(cpu_ratios):.3f}")
    print(f"manager / raw throughput: median {med:.3f} over {len(ratios)} rounds (min {min(ratios):.3f}, "
          f"max {max(ratios):.3f}), pooled {pooled:.3f}; target >= 0.95: {'PASS' if med >= 0.95 else 'FAIL'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--buffer-size", type=int, default=8)
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1, help="engine torch threads")
    ap.add_argument("--max-running", type=int, default=64, help="engine batch rows")
    ap.add_argument("--quick", action="store_true", help="8 prompts, 1 round")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.rounds = 8, 1
    with tempfile.TemporaryDirectory(prefix="bench_rollout_manager_") as d:
        model = build_model(Path(d) / "model")
        proc, url = start_engine(model, args.threads, args.max_running, Path(d) / "engine.log")
        try:
            asyncio.run(bench(url, proc.pid, args))
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
