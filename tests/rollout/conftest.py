"""Fixtures for the rollout tests: a tiny byte-level BPE and pairs of random tiny Qwen3 models that disagree."""

from __future__ import annotations

import pytest

from tandem.rollout import toy


@pytest.fixture(scope="session")
def tok():
    """Byte-level BPE with newlines isolated: a blank line is two `Ċ` tokens (the project's tiny tokenizer)."""
    return toy.byte_bpe_tokenizer()


@pytest.fixture(scope="session")
def tok_merged():
    """Byte-level BPE where `\\n\\n` merges into one `ĊĊ` token (the Qwen-style case)."""
    return toy.byte_bpe_tokenizer(isolate_newlines=False)


@pytest.fixture(scope="session")
def pair64(tok):
    """float64 senior/junior with different random weights."""
    return toy.tiny_pair(tok)


@pytest.fixture(scope="session")
def prompts(tok):
    return toy.prompts(tok, 6)


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: the tiny models gain nothing from two, and on a shared 2-core machine two threads
    per op can be ten times slower (measured)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
