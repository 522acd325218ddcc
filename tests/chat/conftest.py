"""Shared fixtures: the tiny Qwen3-Coder-framed tokenizer and a multi-turn agent conversation."""

from __future__ import annotations

import pytest

from megatron_tg.chat.tokenizer import get_tiny_tokenizer

from .convos import conversation


@pytest.fixture(scope="session")
def tok():
    return get_tiny_tokenizer()


@pytest.fixture
def convo():
    return conversation()
