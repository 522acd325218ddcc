"""Fixtures for the judge tests: the tiny tokenizer (built once per process)."""

from __future__ import annotations

import pytest

from megatron_tg.chat.tokenizer import get_tiny_tokenizer


@pytest.fixture(scope="session")
def tok():
    return get_tiny_tokenizer()
