"""Held-out tasks are refused when they overlap the training data by content, not only by id:
the same instruction (modulo case and whitespace) under another id, the same tests, an SFT
transcript whose user turn is the task, an SWE task of a training repository. ``megatron-tg
eval`` refuses such a recipe before building any model, naming the overlapping ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_tg.agent.task_types import Task
from megatron_tg.config.base import ConfigError
from megatron_tg.eval.disjoint import check_disjoint, normalise, text_hash

ROOT = Path(__file__).resolve().parents[2]


def task(tid, text, tests=("test_x.py::test_a",), hidden=None, repo=None):
    return Task(id=tid, instruction=text, fail_to_pass=list(tests),
                hidden_files=dict(hidden or {}), metadata={"repo": repo} if repo else {})


TRAIN = [task("sum", "Implement add(a, b) in solution.py.", hidden={"_t.py": "assert add(1, 2) == 3"}),
         task("swe-1", "Fix the redirect loop.", tests=["tests/test_r.py::test_loop"],
              repo="psf/requests")]


def test_normalisation_ignores_case_and_whitespace_only():
    assert normalise("  Implement\tADD(a,  b)\n") == "implement add(a, b)"
    assert text_hash("Implement add(a, b).") == text_hash("implement   ADD(a, b).")
    assert text_hash("Implement add(a, b).") != text_hash("Implement add(a, c).")


def test_disjoint_tasks_pass():
    held = [task("mul", "Implement mul(a, b) in solution.py.", tests=["test_m.py::test_m"]),
            task("swe-9", "Fix the pool leak.", tests=["tests/test_p.py::test_leak"],
                 repo="encode/httpx")]
    assert check_disjoint(held, train=TRAIN) == held


@pytest.mark.parametrize("held,match", [
    # the training instruction, re-cased and re-spaced, under a new id
    (task("sum-v2", "implement  ADD(a, b) in solution.py.", tests=["test_o.py::test_o"]),
     r"\['sum-v2'\].*sum-v2 ~ sum \(same text\)"),
    # different words, the same tests
    (task("plus", "Write a function returning a + b.", hidden={"_t.py": "assert add(1, 2) == 3"}),
     r"plus ~ sum \(same tests\)"),
    # an SWE task of a repository the policy trains on
    (task("swe-2", "Fix the cookie jar.", tests=["tests/test_c.py::test_jar"], repo="PSF/requests"),
     r"swe-2 ~ swe-1 \(same repository\)"),
    # the same id
    (task("sum", "Something else entirely.", tests=["t.py::t"]), r"task id\(s\).*\['sum'\]"),
])
def test_overlapping_held_out_task_is_refused_naming_the_ids(held, match):
    with pytest.raises(ConfigError, match=match):
        check_disjoint([task("ok", "Implement mul(a, b).", tests=["m.py::m"]), held], train=TRAIN)


def test_sft_transcript_of_a_held_out_task_is_refused(tmp_path):
    sft = tmp_path / "sft.jsonl"
    rows = [{"messages": [{"role": "user", "content": "Unrelated."},
                          {"role": "assistant", "content": "ok"}]},
            {"messages": [{"role": "system", "content": "You are a coding agent."},
                          {"role": "user", "content": "Implement MUL(a, b)\nin solution.py."},
                          {"role": "assistant", "content": "done"}]}]
    sft.write_text("".join(json.dumps(r) + "\n" for r in rows))
    held = [task("mul", "Implement mul(a, b) in solution.py.", tests=["test_m.py::test_m"])]
    with pytest.raises(ConfigError, match=rf"sft.data.*mul ~ {sft}:2 \(task text is an SFT user "
                                          r"turn\)"):
        check_disjoint(held, train=TRAIN, transcripts_path=str(sft))
    assert check_disjoint(held, train=TRAIN) == held  # without the transcripts: fine


def test_eval_command_refuses_an_overlapping_task_before_building_a_model(tmp_path, capsys):
    """The built-in training tasks (rollout.tasks unset) hold fizzbuzz; a held-out file with
    the same problem under another id is refused by ``megatron-tg eval`` with exit 2."""
    from megatron_tg.agent.tasks import builtin_tasks
    from megatron_tg.cli import main

    fizz = next(t for t in builtin_tasks() if t.id == "fizzbuzz")
    row = fizz.to_dict()
    row["id"] = "fizzbuzz-heldout"
    row["instruction"] = "  " + fizz.instruction.upper() + "\n"
    held = tmp_path / "heldout.jsonl"
    held.write_text(json.dumps(row) + "\n")
    # The recipe's model directory does not even exist here: the refusal comes first.
    rc = main(["eval", "--recipe", str(ROOT / "recipes" / "tiny_cpu.yaml"), f"evaluation.tasks={held}"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "held-out tasks are not disjoint" in err
    assert "fizzbuzz-heldout ~ fizzbuzz (same text)" in err and "(same tests)" in err
