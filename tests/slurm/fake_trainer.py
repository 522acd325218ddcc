"""A stand-in trainer that honours the trainer's contract, for the Slurm tests.

    fake_trainer.py --recipe FILE [key=value ...]      (one process per rank, under srun)

The contract it honours (the real one is ``python -m megatron_tg.train``):
* resumes from ``checkpoint.dir`` when a checkpoint exists (here: a counter file);
* on SIGUSR1 or SIGTERM finishes the current step, checkpoints and exits 75;
* exits 0 after ``steps`` steps.

"Training" is counting: each step sleeps ``FAKE_STEP_S`` seconds (default 0.2) and rank 0
writes the step reached to ``checkpoint.dir/progress``. Every launch of every rank appends
one JSON line to ``checkpoint.dir/launches.jsonl`` with what it was given (arguments, rank
variables, MASTER_ADDR/PORT, restart count, which rollout servers answered /health), so a
test can assert on all of it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.request
from pathlib import Path

EX_REQUEUE = 75


def overrides(argv: list[str]) -> dict[str, str]:
    return dict(a.split("=", 1) for a in argv if "=" in a and not a.startswith("-"))


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def main() -> int:
    argv = sys.argv[1:]
    ov = overrides(argv)
    ckpt = Path(ov["checkpoint.dir"])
    ckpt.mkdir(parents=True, exist_ok=True)
    steps = int(ov.get("steps", 10))
    step_s = float(os.environ.get("FAKE_STEP_S", "0.2"))
    rank = int(os.environ.get("SLURM_PROCID", "0"))
    stop: list[int] = []
    signal.signal(signal.SIGUSR1, lambda s, f: stop.append(s))
    signal.signal(signal.SIGTERM, lambda s, f: stop.append(s))

    counter = ckpt / "counter"
    start = int(counter.read_text()) if counter.exists() else 0
    urls = ov.get("rollout.server_urls", "[]").strip("[]")
    urls = [u for u in urls.split(",") if u]
    launch = {
        "rank": rank, "start": start, "argv": argv,
        "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
        "node": os.environ.get("SLURMD_NODENAME"),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "healthy_servers": [u for u in urls if healthy(u)] if rank == 0 else None,
        **{k: os.environ.get(k) for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "MASTER_ADDR",
                                          "MASTER_PORT", "TG_SYNC_MASTER", "TG_ROUTER_URL", "TG_JUDGE_URL")},
    }
    with open(ckpt / "launches.jsonl", "a") as f:
        f.write(json.dumps(launch) + "\n")
    print(f"fake trainer rank {rank}: resuming at step {start} of {steps}", flush=True)

    step = start
    while step < steps:
        time.sleep(step_s)  # the step; a signal during it lets it finish first
        step += 1
        if rank == 0:
            (ckpt / "progress").write_text(str(step))
        if stop:
            if rank == 0:
                counter.write_text(str(step))
            print(f"fake trainer rank {rank}: signal {stop[0]} -> checkpointed step {step}, exit 75",
                  flush=True)
            return EX_REQUEUE
    if rank == 0:
        counter.write_text(str(step))
    print(f"fake trainer rank {rank}: done at step {step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
