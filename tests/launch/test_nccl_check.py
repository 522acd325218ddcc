"""The preflight's NCCL line: each side's torch and NCCL as its own interpreter imports them,
and the rule NCCL itself enforces (every member of a communicator on the same release)."""

from __future__ import annotations

import subprocess
import sys

import torch

from megatron_tg.launch.nccl_check import check, side_versions


def side(torch_v: str, nccl: str | None) -> dict:
    return {"torch": torch_v, "cuda": "12.8" if nccl else None, "nccl": nccl}


def test_only_equal_nccl_releases_pass():
    state, detail = check(side("2.9.1+cu128", "2.27.5"), side("2.14.1+cu130", "2.30.7"))
    assert state == "FAIL"
    assert "trainer: torch 2.9.1+cu128 (CUDA 12.8), NCCL 2.27.5" in detail
    assert "engines: torch 2.14.1+cu130 (CUDA 12.8), NCCL 2.30.7" in detail
    assert "Mismatched NCCL version detected" in detail and "one environment" in detail
    assert check(side("2.14.1", "2.30.7"), side("2.14.1", "2.30.6"))[0] == "FAIL"  # a patch release apart
    state, detail = check(side("2.14.0", "2.30.7"), side("2.14.1", "2.30.7"))
    assert state == "PASS" and "torch differs, NCCL equal" in detail
    assert check(side("2.14.1", "2.30.7"), side("2.14.1", "2.30.7")) == (
        "PASS", "trainer: torch 2.14.1 (CUDA 12.8), NCCL 2.30.7; engines: torch 2.14.1 (CUDA 12.8), NCCL 2.30.7")
    assert check(side("2.13.0+cpu", None), side("2.14.1", "2.30.7"))[0] == "SKIP"
    assert check({"error": "python9: FileNotFoundError"}, side("2.14.1", "2.30.7"))[0] == "FAIL"


def test_versions_come_from_each_sides_interpreter(tmp_path):
    mine = side_versions(sys.executable)
    assert mine["torch"] == torch.__version__ and mine["cuda"] == torch.version.cuda
    if not torch.cuda.is_available() and torch.version.cuda is None:  # the CPU wheel: no NCCL
        assert mine["nccl"] is None and mine["nccl_error"]
    missing = side_versions(str(tmp_path / "no-python"))
    assert "no-python" in missing["error"]
    results = tmp_path / "pf.tsv"
    subprocess.run([sys.executable, "-m", "megatron_tg.launch.preflight", "nccl", "--results", str(results),
                    "--trainer-python", sys.executable, "--engine-python", str(tmp_path / "no-python")],
                   check=True, timeout=120)
    name, state, detail = results.read_text().strip().split("\t")
    assert (name, state) == ("NCCL versions", "FAIL")
    assert f"trainer: torch {torch.__version__}" in detail and "no-python" in detail
