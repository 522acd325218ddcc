"""Validation of each config group and across groups, and the documented-field convention."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import textwrap
import typing

import pytest

from megatron_tg.config import ConfigError, TGConfig, load_config

MODEL = "model.hf_config=some/model"


@pytest.mark.parametrize("override, field", [
    ("model.params_dtype=float16", "model.params_dtype"),
    ("model.transformer_impl=te", "model.transformer_impl"),
    ("parallel.backend=mpi", "parallel.backend"),
    ("rollout.engine=vllm", "rollout.engine"),
    ("rollout.sandbox=docker", "rollout.sandbox"),
    ("objective.mode=ppo", "objective.mode"),
    ("objective.kl_direction=sideways", "objective.kl_direction"),
    ("judge.feedback_role=assistant", "judge.feedback_role"),
])
def test_bad_choice_names_field_and_value(override, field):
    value = override.split("=", 1)[1]
    with pytest.raises(ConfigError) as err:
        load_config(None, [MODEL, override])
    assert field in str(err.value) and repr(value) in str(err.value)


@pytest.mark.parametrize("override, message", [
    ("parallel.tp=0", "parallel.tp: must be >= 1; got 0"),
    ("rollout.group_size=1", "rollout.group_size: must be >= 2; got 1"),
    ("rollout.top_p=1.5", "rollout.top_p: must be <= 1; got 1.5"),
    ("rollout.temperature=0", "rollout.temperature: must be > 0; got 0.0"),
    ("optimizer.lr=0", "optimizer.lr: must be > 0; got 0.0"),
    ("optimizer.adam_beta2=1", "optimizer.adam_beta2: must be < 1; got 1.0"),
    ("steps=0", "steps: must be >= 1; got 0"),
    ("run_name=a/b", "run_name: must be one path component"),
    ("rollout.buffer_size=2", "rollout.buffer_size: must hold one step's groups"),
    ("rollout.sandbox=none", "rollout.allow_unsandboxed=true"),
    ("judge.endpoint=http://judge:8000/v1", "judge.model: required when judge.endpoint is set"),
    ("judge.feedback_framing=no placeholder", "judge.feedback_framing: must contain {feedback}"),
    ("objective.kl_coef=-1", "objective.kl_coef must be >= 0"),
    ("parallel.etp=0", "parallel.etp: must be >= 1; got 0"),
    # megatron reduces expert grads over the dense DP group when ep = 1 (see ParallelDims)
    ("parallel.etp=2", "parallel: ep=1 requires etp == tp (got etp=2, tp=1)"),
    # YAML's .inf passes "> 0" and used to overflow later, inside the sandbox
    ("rollout.tool_timeout_s=.inf", "rollout.tool_timeout_s: must be a finite number; got inf"),
    ("rollout.request_timeout_s=.nan", "rollout.request_timeout_s: must be a finite number; got nan"),
    ("optimizer.lr=-.inf", "optimizer.lr: must be a finite number; got -inf"),
])
def test_out_of_range_values(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [MODEL, override])
    assert message in str(err.value)


def test_unsandboxed_needs_consent_and_then_validates():
    cfg = load_config(None, [MODEL, "rollout.sandbox=none", "rollout.allow_unsandboxed=true"])
    assert cfg.rollout.sandbox == "none"


def test_rollout_must_fit_the_sequence_and_the_micro_batch():
    with pytest.raises(ConfigError, match="rollout.max_context_tokens: a whole rollout must fit model.seq_length=4096; got 8192"):
        load_config(None, [MODEL, "rollout.max_context_tokens=8192"])
    with pytest.raises(ConfigError, match="optimizer.micro_batch_tokens: must hold one model.seq_length=4096"):
        load_config(None, [MODEL, "optimizer.micro_batch_tokens=1024"])


def test_moe_with_tp_needs_sequence_parallel_when_ep_says_moe():
    with pytest.raises(ConfigError, match=r"parallel\.sequence_parallel: .*MoE.*parallel\.tp=2"):
        load_config(None, [MODEL, "parallel.tp=2", "parallel.ep=2"])
    assert load_config(None, [MODEL, "parallel.tp=2", "parallel.ep=2", "parallel.sequence_parallel=true"])


def _hf_dir(tmp_path, **fields):
    d = tmp_path / "model"
    d.mkdir()
    base = {"model_type": "qwen3_moe", "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2}
    (d / "config.json").write_text(json.dumps({**base, **fields}))
    return d


def test_moe_read_from_the_hf_config_when_ep_is_1(tmp_path):
    moe = _hf_dir(tmp_path, num_experts=8)
    with pytest.raises(ConfigError, match="sequence_parallel"):
        load_config(None, [f"model.hf_config={moe}", "parallel.tp=2"])
    dense = tmp_path / "dense.json"
    dense.write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4}))
    assert load_config(None, [f"model.hf_config={dense}", "parallel.tp=2"]).parallel.tp == 2


def test_unreadable_hf_config_is_an_error(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="model.hf_config: cannot read"):
        load_config(None, [f"model.hf_config={bad}", "parallel.tp=2"])


def test_nodes_must_hold_the_layout():
    with pytest.raises(ConfigError, match=r"parallel\.nodes: 1 nodes x 8 GPUs do not fit"):
        load_config(None, [MODEL, "parallel.nodes=1", "parallel.ep=16"])


def test_layout_checks_the_model_shape(tmp_path):
    model = _hf_dir(tmp_path, num_experts=6)
    cfg = load_config(None, [f"model.hf_config={model}", "parallel.ep=4"])
    with pytest.raises(ConfigError, match="num_experts=6 not divisible by ep=4"):
        cfg.layout(4)
    with pytest.raises(ConfigError, match="world_size=6 is not divisible"):
        cfg.layout(6)
    ok = load_config(None, [f"model.hf_config={model}", "parallel.ep=2", "parallel.tp=2",
                            "parallel.etp=1", "parallel.sequence_parallel=true"])
    assert ok.layout(4).describe() == {"world_size": 4, "tp": 2, "cp": 1, "ep": 2, "pp": 1,
                                       "dp": 2, "etp": 1, "edp": 2}


def _config_classes(cls=TGConfig, seen=None):
    seen = seen if seen is not None else []
    if cls not in seen:
        seen.append(cls)
        for hint in typing.get_type_hints(cls).values():
            if dataclasses.is_dataclass(hint):
                _config_classes(hint, seen)
    return seen


@pytest.mark.parametrize("cls", _config_classes(), ids=lambda c: c.__name__)
def test_every_field_has_a_docstring_and_every_group_validates(cls):
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    undocumented = [
        stmt.target.id for stmt, nxt in zip(body, body[1:] + [None])
        if isinstance(stmt, ast.AnnAssign)
        and not (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                 and isinstance(nxt.value.value, str) and nxt.value.value.strip())
    ]
    assert not undocumented, f"{cls.__name__} fields without a docstring: {undocumented}"
    assert callable(getattr(cls, "validate", None)), f"{cls.__name__} has no validate()"


def test_feedback_roles_match_the_chat_framing():
    from megatron_tg.chat.feedback import FRAMINGS
    from megatron_tg.config.rollout import FEEDBACK_ROLES

    assert FEEDBACK_ROLES == FRAMINGS


def test_tool_call_readings_match_the_chat_package():
    from megatron_tg.chat.tool_reading import READINGS
    from megatron_tg.config.rollout import TOOL_CALL_READINGS

    assert TOOL_CALL_READINGS == READINGS
