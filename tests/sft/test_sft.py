"""The warm start: transcripts -> framed examples, ``megatron-tg sft`` on the tiny policy (the
loss falls; the checkpoint loads into the RL trainer both ways: as ``model.megatron_checkpoint``
and resumed by ``megatron-tg eval --checkpoint``, which then runs the held-out evaluation on it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_tg.chat import get_tiny_tokenizer
from megatron_tg.sft.data import TranscriptError, load_transcripts, transcript_example
from tests.chat.convos import SEARCH_TOOL, call, conversation

REPO = Path(__file__).resolve().parents[2]
RECIPE = str(REPO / "recipes" / "tiny_cpu.yaml")


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def _transcripts(path: Path) -> Path:
    c = conversation()  # thinking, multi-call turns, consecutive tool results, a final answer
    with open(path, "w") as f:
        for k in range(4):
            f.write(json.dumps({"messages": c if k % 2 == 0 else c[:6],
                                **({"tools": [SEARCH_TOOL]} if k < 2 else {})}) + "\n")
    return path


def test_example_masks_exactly_the_assistant_turns():
    tok = get_tiny_tokenizer()
    ex = transcript_example(tok, {"messages": conversation()}, "t.jsonl:1", 4096)
    text = tok.decode([t for t, m in zip(ex.token_ids, ex.loss_mask) if m])
    assert text.count("<|im_end|>") == 4 and "<think>\nI should find count first.\n</think>" in text
    assert "Fix the off-by-one" not in text and "3 passed" not in text and "<|im_start|>" not in text


def test_thinking_is_trained_under_qwen3_coders_own_template(tmp_path):
    from tests.chat.qwen3_coder import build_qwen3_coder_tokenizer

    qtok = build_qwen3_coder_tokenizer(tmp_path / "tok")
    msgs = [{"role": "user", "content": "find count"},
            {"role": "assistant", "reasoning_content": "search first", "content": "",
             "tool_calls": [call("search", query="def count", lines=5)]},
            {"role": "tool", "content": "src/util.py:12"},
            {"role": "assistant", "reasoning_content": "answer now", "content": "In src/util.py."}]
    ex = transcript_example(qtok, {"messages": msgs}, "t.jsonl:1", 4096)
    trained = [t for t, m in zip(ex.token_ids, ex.loss_mask) if m]
    assert trained.count(151667) == 2 and trained.count(151668) == 2  # <think>, </think>
    assert trained.count(151657) == 1 and trained.count(151645) == 2  # <tool_call>, <|im_end|>
    assert "search first" in qtok.decode(trained) and "src/util.py:12" not in qtok.decode(trained)


@pytest.mark.parametrize("line,msg", [
    ("not json", "t.jsonl:1: not JSON"),
    ('{"messages": []}', "'messages' must be a non-empty list"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant message"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', "message 0: needs a role"),
    ('{"messages": [{"role": "user", "content": "x"}], "extra": 1}', "unknown field(s) ['extra']"),
    ('{"messages": [{"role": "assistant", "content": "x"}]}', "first message is an assistant turn"),
    ('{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "'
     + "word " * 300 + '"}]}', "more than model.seq_length=64"),
])
def test_bad_transcripts_are_refused_with_file_and_line(tmp_path, line, msg):
    p = tmp_path / "t.jsonl"
    p.write_text(line + "\n")
    with pytest.raises(TranscriptError) as e:
        load_transcripts(p, get_tiny_tokenizer(), 64)
    assert msg in str(e.value) and str(p) in str(e.value)


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    from megatron_tg.models.tiny import build_tiny_policy

    root = tmp_path_factory.mktemp("sft")
    policy = build_tiny_policy(root / "policy")
    data = _transcripts(root / "transcripts.jsonl")
    base = [f"model.hf_config={policy}", f"model.hf_checkpoint={policy}", "logging.progress_bar=false"]
    cmd = [sys.executable, "-m", "megatron_tg.cli", "sft", "--recipe", RECIPE, *base,
           f"logging.run_dir={root / 'run'}", f"sft.data={data}", "sft.epochs=6", "sft.batch_size=4",
           "optimizer.lr=3e-3", "checkpoint.interval=100"]
    p = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = [json.loads(x) for x in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    return SimpleRun(root, policy, data, base, rows)


class SimpleRun:
    def __init__(self, root, policy, data, base, rows):
        self.root, self.policy, self.data, self.base, self.rows = root, policy, data, base, rows
        self.ckpt = root / "run" / "checkpoints"


def test_sft_loss_decreases(sft_run):
    losses = [r["sft/loss"] for r in sft_run.rows]
    assert [r["step"] for r in sft_run.rows] == [1, 2, 3, 4, 5, 6]
    assert losses[0] == pytest.approx(6.93, abs=0.1)  # ln(1024): the random tiny policy
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < losses[0] - 1.0
    assert (sft_run.ckpt / "latest").read_text().strip() == "step_00000006"
    # the policy export and every checkpoint carry the HF config and tokenizer files
    for d in (sft_run.root / "run" / "model", sft_run.ckpt / "step_00000006"):
        assert (d / "hf_config" / "config.json").read_bytes() == \
            (sft_run.policy / "config.json").read_bytes()
        assert (d / "hf_config" / "tokenizer_config.json").exists()


CHECK = r"""
import json, sys, torch
from megatron_tg.config import load_config
from megatron_tg.sft.data import load_transcripts
from megatron_tg.sft.train import group_loss
from megatron_tg.train.trainer import Trainer
cfg = load_config(sys.argv[1], sys.argv[3:])
trainer = Trainer(cfg)
exs = load_transcripts(sys.argv[2], trainer.tokenizer, cfg.model.seq_length)
tokens = float(sum(sum(e.loss_mask[1:]) for e in exs))
with torch.no_grad():
    print(json.dumps({"nll": sum(group_loss(trainer, [e], tokens)[1] for e in exs) / tokens}))
"""


def test_sft_checkpoint_loads_as_the_rl_policy(sft_run):
    """The RL trainer built with model.megatron_checkpoint=the SFT export has the SFT weights:
    its NLL on the transcripts is below the last logged loss (taken before the last update)."""
    cmd = [sys.executable, "-c", CHECK, RECIPE, str(sft_run.data), *sft_run.base,
           f"model.megatron_checkpoint={sft_run.root / 'run' / 'model'}", "checkpoint.resume=false",
           f"logging.run_dir={sft_run.root / 'check'}"]
    p = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    nll = json.loads(p.stdout.strip().splitlines()[-1])["nll"]
    assert nll < sft_run.rows[-1]["sft/loss"] < sft_run.rows[0]["sft/loss"]


def test_eval_runs_the_held_out_evaluation_on_the_sft_checkpoint(sft_run):
    # Held-out tasks of their own (text and tests): copies of training tasks under new ids
    # are refused (tests/eval/test_disjoint.py).
    rows = [{"id": f"heldout-{name}", "instruction": f"Implement {name}(n) in solution.py: {what}.",
             "files": {"solution.py": f"def {name}(n):\n    raise NotImplementedError\n"},
             "hidden_files": {"_hidden_test.py": f"from solution import {name}\n\n\n"
                              f"def test_hidden():\n    assert {name}(3) == {want}\n"},
             "fail_to_pass": ["_hidden_test.py::test_hidden"]}
            for name, what, want in (("double", "return 2 * n", 6), ("negate", "return -n", -3))]
    held = sft_run.root / "heldout.jsonl"
    held.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = sft_run.root / "eval.json"
    cmd = [sys.executable, "-m", "megatron_tg.cli", "eval", "--recipe", RECIPE, "--checkpoint",
           str(sft_run.ckpt), "--out", str(out), *sft_run.base, f"logging.run_dir={sft_run.root / 'eval'}",
           f"evaluation.tasks={held}", "evaluation.samples=2", "rollout.max_new_tokens=16",
           "rollout.max_turns=1"]
    p = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rec = json.loads(out.read_text())
    m = rec["metrics"]
    assert rec["step"] == 6  # resumed the SFT checkpoint
    assert m["eval/tasks"] == 2 and m["eval/n"] + m["eval/judge_errors"] + m["eval/rollout_errors"] == 4
    assert len(rec["rollouts"]) + len(rec["errors"]) == 4
    assert {r["task_id"] for r in rec["rollouts"]} <= {r["id"] for r in rows}
    # pass@k for k up to the fewest judged samples of a task (2 unless a rollout failed),
    # each with its task-clustered interval, printed by the command
    judged = [r["task_id"] for r in rec["rollouts"] if not r["judge_error"]]
    k_max = min(judged.count(t) for t in set(judged))
    keys = [f"eval/pass@{k}" for k in range(1, k_max + 1)]
    assert sorted(k for k in m if k.startswith("eval/pass@") and "_" not in k) == keys
    for key in (*keys, "eval/criteria/tests_pass", "eval/criteria/search_lines"):
        assert m[f"{key}_lo"] <= m[key] <= m[f"{key}_hi"]
        assert f'"{key}"' in p.stdout
    assert m["eval/pass@1"] <= m[keys[-1]]


def test_eval_without_held_out_tasks_or_checkpoint_is_an_error(sft_run, tmp_path):
    cmd = [sys.executable, "-m", "megatron_tg.cli", "eval", "--recipe", RECIPE, *sft_run.base]
    p = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "evaluation.tasks: empty" in p.stderr
    p = subprocess.run(cmd + ["--checkpoint", str(tmp_path)], cwd=REPO, env=_env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and f"--checkpoint {tmp_path}: no trainer checkpoint" in p.stderr


def test_two_data_parallel_ranks_train_the_same_losses(sft_run, comm_rules):  # under NCCL's rules
    """DP=2 (each rank half of every batch, gradients averaged by megatron's DDP) must give the
    single-rank run's losses: the loss is normalised by the whole step's token count."""
    from megatron_tg.parallel.ports import free_port

    run = sft_run.root / "dp2"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), "-m", "megatron_tg.cli", "sft", "--recipe", RECIPE,
           *sft_run.base, f"logging.run_dir={run}", f"sft.data={sft_run.data}", "sft.epochs=2",
           "sft.batch_size=4", "optimizer.lr=3e-3", "checkpoint.interval=100"]
    p = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["sft/loss"] for r in rows] == pytest.approx(
        [r["sft/loss"] for r in sft_run.rows[:2]], rel=1e-5)
