"""Fixtures for the rollout tests: tiny Qwen3-MoE checkpoints and engine subprocesses.

The models are random but with a large init (initializer_range=0.2) so next-token
distributions are peaked (top-1 ~0.13 of 300) and greedy choices are separated by
far more than float noise; that makes "greedy equals HF greedy" a meaningful check.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

VOCAB = 300
EOS_ID = 1


def build_tiny_model(path: Path, seed: int, with_tokenizer: bool = False) -> Path:
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        moe_intermediate_size=32,
        intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=1024,
        initializer_range=0.2,
        bos_token_id=0,
        eos_token_id=EOS_ID,
        pad_token_id=0,
    )
    model = transformers.Qwen3MoeForCausalLM(cfg)
    model.save_pretrained(path)
    if with_tokenizer:
        build_tokenizer(path)
    return path


def build_tokenizer(path: Path) -> None:
    """A word-level tokenizer over the same 300 ids: "w3 w17" <-> [3, 17]."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": EOS_ID, "<unk>": 2}
    vocab.update({f"w{i}": i for i in range(3, VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    fast.save_pretrained(path)


@pytest.fixture(scope="session")
def model_a(tmp_path_factory) -> Path:
    """Checkpoint A with a tokenizer (text and stop strings work)."""
    return build_tiny_model(tmp_path_factory.mktemp("model_a"), seed=0, with_tokenizer=True)


@pytest.fixture(scope="session")
def model_b(tmp_path_factory) -> Path:
    """Checkpoint B: same architecture, different weights."""
    return build_tiny_model(tmp_path_factory.mktemp("model_b"), seed=1)


@pytest.fixture(scope="session")
def model_plain(tmp_path_factory) -> Path:
    """Checkpoint without a tokenizer (the engine behaves like --skip-tokenizer-init)."""
    return build_tiny_model(tmp_path_factory.mktemp("model_plain"), seed=0)


from megatron_tg.rollout.engine.launch import Engine, start_engines  # noqa: E402,F401


@pytest.fixture(scope="session")
def engine_launcher(tmp_path_factory):
    """start(model_dirs) -> engines; every engine is stopped at the end of the session
    at the latest (modules stop theirs earlier to give the CPUs back)."""
    started: list[Engine] = []
    log_dir = tmp_path_factory.mktemp("engine_logs")

    def start(model_dirs: list[Path]) -> list[Engine]:
        engines = start_engines(model_dirs, log_dir)
        started.extend(engines)
        return engines

    yield start
    for e in started:
        e.stop()


def http(url: str, path: str, body=None, method: str | None = None, timeout: float = 60.0):
    """Tiny synchronous JSON HTTP helper: returns (status, parsed JSON or text)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{url}{path}", data=data, method=method or ("POST" if body is not None else "GET"),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read().decode()
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw


@pytest.fixture(scope="session")
def http_call():
    return http
