"""tools/plot_run.py draws several runs' curves into one PNG: the curves it draws are the
runs' metrics (NaN and a cut last line skipped, smoothing as asked), and the PNG shows them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_tg.plot.command import curves

REPO = Path(__file__).resolve().parents[2]


def _run(d: Path, rate: float):
    d.mkdir()
    rows = [{"step": s, "criteria/search_lines": rate * s / 10, "criteria/primary": 0.9,
             "entropy/all": 1.0 - s / 20, "kl/mean_gated": 0.5 / s} for s in range(1, 11)]
    rows.append({"step": 11, "criteria/primary": float("nan")})  # NaN is skipped, not drawn
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 12, "cut')


def test_curves_are_the_runs_metrics(tmp_path):
    _run(tmp_path / "grpo", 0.0)
    _run(tmp_path / "tg", 1.0)
    data = curves([tmp_path / "grpo", tmp_path / "tg"], smooth=2)
    assert list(data) == ["criterion pass rates", "primary (task) pass rate",
                          "token entropy (all assistant tokens)", "KL on gated tokens"]
    # one line per run; a family panel names the criterion, and leaves the primary rate out
    assert sorted(data["criterion pass rates"]) == ["grpo", "tg"]
    xs, ys = data["criterion pass rates"]["tg"]
    assert xs == list(range(1, 11))
    assert ys[0] == pytest.approx(0.1) and ys[1] == pytest.approx(0.15)  # trailing mean of 2
    assert ys[-1] == pytest.approx((0.9 + 1.0) / 2)
    assert data["criterion pass rates"]["grpo"][1] == [0.0] * 10
    # step 11's NaN and the cut step-12 line are not drawn
    assert data["primary (task) pass rate"]["tg"][0] == list(range(1, 11))
    unsmoothed = curves([tmp_path / "tg"], labels=["x"])
    assert unsmoothed["KL on gated tokens"]["x"][1] == pytest.approx([0.5 / s for s in range(1, 11)])
    with pytest.raises(ValueError, match="1 labels for 2 runs"):
        curves([tmp_path / "grpo", tmp_path / "tg"], labels=["a"])


def test_plot_two_runs_draws_both_lines(tmp_path):
    import matplotlib.image as mpimg
    import numpy as np

    _run(tmp_path / "grpo", 0.0)
    _run(tmp_path / "tg", 1.0)
    out = tmp_path / "curves.png"
    r = subprocess.run([sys.executable, str(REPO / "tools" / "plot_run.py"), str(tmp_path / "grpo"),
                        str(tmp_path / "tg"), "--out", str(out), "--smooth", "2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    img = mpimg.imread(out)[..., :3]
    # matplotlib's first two line colours (C0 blue, C1 orange) both appear in the picture
    for rgb in ((0x1f, 0x77, 0xb4), (0xff, 0x7f, 0x0e)):
        near = np.abs(img - np.array(rgb) / 255.0).max(axis=-1) < 0.02
        assert near.sum() > 200, f"colour {rgb} drawn on only {near.sum()} pixels"
