"""Token tables (word start, step end) on byte-level BPE and SentencePiece vocabularies; the vocabulary check."""

from __future__ import annotations

import pytest

from tandem.rollout import toy
from tandem.rollout.engine import TandemEngine
from tandem.rollout.vocab import (VocabularyMismatchError, _byte_decoder, build_tables, check_vocab_compatible,
                                  detect_style, piece_text, tables_from_texts, token_texts, word_start_ids)

SMALL = toy.TinyShape(hidden=32, layers=1, intermediate=64)


def test_byte_decoder_is_gpt2_alphabet_inverse():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    assert _byte_decoder() == {c: b for b, c in bytes_to_unicode().items()}


def test_word_start_table_byte_level_matches_decoded_text(tok):
    tables = build_tables(tok)
    special = set(tok.all_special_ids)
    assert tables.vocab_size == len(tok)
    n_starts = 0
    for i in range(len(tok)):
        piece = tok.convert_ids_to_tokens(i)
        # independent reference: the tokenizer's own decoder on the single id
        want = i not in special and tok.decode([i])[:1].isspace()
        assert bool(tables.word_start_V[i]) == want, (i, piece)
        if piece.startswith(("Ġ", "Ċ")) and i not in special:
            assert tables.word_start_V[i], piece
        n_starts += want
    assert 0 < n_starts < len(tok)
    assert not tables.word_start_V[tok.eos_token_id]
    assert tok.convert_tokens_to_ids("Ġ") in word_start_ids(tok)


def test_word_start_table_sentencepiece_style():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, "▁the": 2, "the": 3, "▁": 4, "<0x0A>": 5, "<0x41>": 6, "cat": 7, "▁cat": 8,
             "s": 9, "\u2581\u2581": 10}
    t = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    sp = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="</s>", unk_token="<unk>")
    tables = build_tables(sp)
    starts = {sp.convert_ids_to_tokens(i) for i in tables.word_start_V.nonzero().flatten().tolist()}
    assert starts == {"▁the", "▁", "<0x0A>", "▁cat", "\u2581\u2581"}
    texts = token_texts(sp)
    assert texts[5] == "\n" and texts[6] == "A" and texts[2] == " the" and texts[1] == ""
    assert detect_style(["▁a", "b"]) == "sentencepiece" and detect_style(["Ġa", "b"]) == "byte_level"


def test_piece_text_and_step_tables():
    assert piece_text("ĠĊĊ", "byte_level") == " \n\n"
    assert piece_text("Ċ", "byte_level") == "\n"
    tb = tables_from_texts(["a", "\n", "\n\n", " b", "x\n", "\ny", "", "a\n\nb"])
    assert tb.step_end_V.tolist() == [False, False, True, False, False, False, False, True]
    assert tb.starts_newline_V.tolist() == [False, True, True, False, False, True, False, False]
    assert tb.ends_newline_V.tolist() == [False, True, True, False, True, False, False, False]
    assert tb.word_start_V.tolist() == [False, True, True, True, False, True, False, False]
    assert tb.empty_V.tolist() == [False] * 6 + [True, False]


def test_step_end_table_on_merged_blank_line_token(tok, tok_merged):
    nn = tok_merged.convert_tokens_to_ids("ĊĊ")
    assert nn != tok_merged.unk_token_id and nn is not None
    assert bool(build_tables(tok_merged).step_end_V[nn])
    # the isolated-newline tokenizer has no blank-line token: a step end is two single-newline tokens
    t = build_tables(tok)
    assert not bool(t.step_end_V.any())
    nl = tok.convert_tokens_to_ids("Ċ")
    assert bool(t.ends_newline_V[nl]) and bool(t.starts_newline_V[nl])


def test_tables_padded_to_model_vocab(tok):
    tables = build_tables(tok, vocab_size=len(tok) + 7)
    assert tables.vocab_size == len(tok) + 7
    assert not tables.word_start_V[len(tok):].any() and tables.empty_V[len(tok):].all()


def test_vocab_mismatch_is_a_clear_error(tok):
    s = toy.tiny_qwen3(len(tok), 1, SMALL)
    j = toy.tiny_qwen3(len(tok) + 5, 2, SMALL)
    with pytest.raises(VocabularyMismatchError, match="differ in size"):
        check_vocab_compatible(s, j, tok)
    with pytest.raises(VocabularyMismatchError, match="differ in size"):
        TandemEngine(s, j, tok)
    small = toy.tiny_qwen3(len(tok) - 3, 1, SMALL)
    with pytest.raises(VocabularyMismatchError, match="only"):
        TandemEngine(small, None, tok)


def test_tokenizer_mismatch_same_size_is_an_error(tok):
    other = toy.byte_bpe_tokenizer(texts=["zebra quartz " * 20, "jumps over lazy dogs\n\n" * 10],
                                   vocab_size=len(tok))
    s = toy.tiny_qwen3(max(len(tok), len(other)), 1, SMALL)
    j = toy.tiny_qwen3(max(len(tok), len(other)), 2, SMALL)
    with pytest.raises(VocabularyMismatchError):
        check_vocab_compatible(s, j, tok, other)
    with pytest.raises(VocabularyMismatchError):
        TandemEngine(s, j, (tok, other))
    assert check_vocab_compatible(s, j, tok, tok) == s.lm_head.weight.shape[0]
