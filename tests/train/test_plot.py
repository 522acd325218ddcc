"""tools/plot_run.py draws several runs' curves into one PNG."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(d: Path, rate: float):
    d.mkdir()
    rows = [{"step": s, "criteria/search_lines": rate * s / 10, "criteria/primary": 0.9,
             "entropy/all": 1.0 - s / 20, "kl/mean_gated": 0.5 / s} for s in range(1, 11)]
    rows.append({"step": 11, "criteria/primary": float("nan")})  # NaN is skipped, not drawn
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 12, "cut')


def test_plot_two_runs(tmp_path):
    _run(tmp_path / "grpo", 0.0)
    _run(tmp_path / "tg", 1.0)
    out = tmp_path / "curves.png"
    r = subprocess.run([sys.executable, str(REPO / "tools" / "plot_run.py"), str(tmp_path / "grpo"),
                        str(tmp_path / "tg"), "--out", str(out), "--smooth", "2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
