"""scripts/gpu_check.sh's checks on CPU at test sizes: the same code (``--tiny``) writes one
JSON whose every check passes, with the figures the GPU run reports; without a GPU and
without ``--tiny`` it refuses, saying so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "megatron_tg.testing.gpu_check", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_every_check_runs_on_cpu_at_test_sizes(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = _run("--tiny", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    print(json.dumps({k: v for k, v in res.items() if k != "not_covered"}, indent=1)[:4000])
    for name in ("thd_bf16_vs_fp32", "fused_kl", "distopt_resume", "ema", "tg_step"):
        assert res[name]["ok"] is True, (name, res[name])
    assert res["thd_bf16_vs_fp32"]["grad_cosine"] > 0.98
    assert 0 < res["thd_bf16_vs_fp32"]["max_abs_logprob_diff"] < 0.5  # bf16 is not fp32
    assert res["fused_kl"]["loss_diff"] < 1e-4 and res["fused_kl"]["vocab"] == 1024
    assert res["distopt_resume"]["moments_bit_exact"] and res["distopt_resume"]["next_step_bit_exact"]
    assert res["distopt_resume"]["state_tensors"] > 0
    assert "FusedAdam" in res["distopt_resume"]["note"]
    assert res["ema"]["max_abs_err_vs_closed_form"] <= 1e-6
    step = res["tg_step"]
    assert step["tokens_per_s"] > 0 and step["tflops"] > 0 and step["expert_tokens"] > 0
    assert "Transformer Engine" in res["not_covered"] and "SGLang" in res["not_covered"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is the CPU's")
def test_without_a_gpu_it_refuses_unless_tiny(tmp_path):
    proc = _run("--out", str(tmp_path / "x.json"), timeout=120)
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr
    assert not (tmp_path / "x.json").exists()
