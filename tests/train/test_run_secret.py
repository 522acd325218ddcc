"""A tiny training run keeps its API key to itself: the embedded engine it starts requires a
key the run made (0600, in the run dir), and the key is in no log, manifest, sample record,
metrics row or saved config of the run, nor on any process's command line while it runs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from megatron_tg.auth import read_key
from tests.train.test_loop import REPO, _port, policy_dir  # noqa: F401 (fixture)


def _cmdlines(marker: str) -> list[bytes]:
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    line = f.read()
            except OSError:
                continue
            if marker.encode() in line:
                out.append(line)
    return out


def test_a_tiny_run_leaks_its_key_nowhere(policy_dir, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "TG_API_KEY_FILE"}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()))
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatron_tg.train", "--recipe", "recipes/tiny_cpu.yaml",
         f"model.hf_config={policy_dir}", f"model.hf_checkpoint={policy_dir}",
         f"logging.run_dir={run_dir}", f"checkpoint.dir={run_dir}/ckpt", "steps=1",
         "checkpoint.interval=100", "rollout.prompts_per_step=2", "rollout.group_size=2",
         "rollout.buffer_size=2", "rollout.max_new_tokens=32", "rollout.max_turns=2",
         "logging.progress_bar=false"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seen: list[bytes] = []
    deadline = time.monotonic() + 900
    while proc.poll() is None:  # every command line of the run's processes, while it runs
        seen += _cmdlines(str(run_dir))
        assert time.monotonic() < deadline, "the tiny run did not finish in 900 s"
        time.sleep(0.5)
    output = proc.stdout.read()
    assert proc.returncode == 0, output[-4000:].decode(errors="replace")
    key_file = run_dir / "engines" / "secret" / "api_key"
    key = read_key(key_file).encode()
    assert any(b"--api-key-file" in c for c in seen), "the engine was never seen running"
    assert not any(key in c for c in seen)
    assert key not in output
    files = [p for p in run_dir.rglob("*") if p.is_file() and p.parent != key_file.parent]
    assert {"manifest.json", "config.yaml", "metrics.jsonl"} <= {p.name for p in files}
    assert any(p.suffix == ".log" for p in files) and any("samples" in str(p) for p in files)
    assert [str(p) for p in files if key in p.read_bytes()] == []
