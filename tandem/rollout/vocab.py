"""Per-vocabulary token tables for the authorship schedules, and the senior/junior vocabulary check.

The schedules never decode text during a rollout: they look token ids up in boolean tables computed once per
tokenizer from each token's own text.
- word start: the token's text begins with whitespace (byte-level BPE `Ġ` space / `Ċ` newline / `ĉ` tab,
  SentencePiece `▁`, a raw newline). The `word` schedule redraws the author after such a token.
- step end: the `step` schedule ends a turn when the turn's text contains a blank line (`\\n\\n`). A byte-level
  BPE may write it as one token (`ĊĊ`) or as two single-newline tokens (`Ċ`, `Ċ`, as the tiny tokenizer
  does); `starts_newline`/`ends_newline` let the schedule see the two-token case without decoding.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Sequence

import torch

SP_SPACE = "\u2581"  # SentencePiece's visible space `▁`
_SP_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # SentencePiece byte-fallback pieces such as <0x0A>


class VocabularyMismatchError(ValueError):
    """Senior and junior do not share one vocabulary: ids would mean different strings to each model."""


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level alphabet: printable stand-in character -> raw byte (`Ġ` -> 0x20, `Ċ` -> 0x0A)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _decoder_kind(tokenizer: Any) -> str | None:
    """'byte_level' / 'sentencepiece' from a fast tokenizer's decoder, or None when it does not say."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    dec = getattr(backend, "decoder", None)
    if dec is None:
        return None
    desc = repr(dec)
    if "ByteLevel" in desc:
        return "byte_level"
    if "Metaspace" in desc or "ByteFallback" in desc:
        return "sentencepiece"
    return None


def detect_style(pieces: Sequence[str | None]) -> str:
    """How token strings spell text: 'byte_level' (GPT-2 alphabet), 'sentencepiece' (`▁`) or 'plain'."""
    alphabet = _byte_decoder()
    real = [p for p in pieces if p]
    if any(SP_SPACE in p for p in real) and not any(("Ġ" in p or "Ċ" in p) for p in real):
        return "sentencepiece"
    if any(("Ġ" in p or "Ċ" in p) for p in real) and all(c in alphabet for p in real for c in p):
        return "byte_level"
    return "plain"


def piece_text(piece: str | None, style: str) -> str:
    """The text one token string stands for (undecodable byte fragments become U+FFFD)."""
    if not piece:
        return ""
    if style == "byte_level":
        dec = _byte_decoder()
        if all(c in dec for c in piece):
            return bytes(dec[c] for c in piece).decode("utf-8", errors="replace")
        return piece
    if style == "sentencepiece":
        m = _SP_BYTE.match(piece)
        if m:
            return bytes([int(m.group(1), 16)]).decode("utf-8", errors="replace")
        return piece.replace(SP_SPACE, " ")
    return piece


def token_texts(tokenizer: Any, vocab_size: int | None = None) -> list[str]:
    """Text of every id in [0, max(len(tokenizer), vocab_size)); special tokens and unused ids map to ''.

    Special tokens (EOS, role markers) count as no text: they neither start a word nor end a step.
    """
    n_tok = len(tokenizer)
    n = max(n_tok, vocab_size or 0)
    pieces: list[str | None] = list(tokenizer.convert_ids_to_tokens(list(range(n_tok))))
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    for i in special:
        if 0 <= i < n_tok:
            pieces[i] = None
    style = _decoder_kind(tokenizer) or detect_style(pieces)
    texts = [piece_text(p, style) for p in pieces]
    return texts + [""] * (n - n_tok)


@dataclass(frozen=True)
class TokenTables:
    """Boolean lookup tables over the vocabulary (axis V), on one device."""

    word_start_V: torch.Tensor      # text begins with whitespace
    step_end_V: torch.Tensor        # text contains a blank line `\n\n`
    starts_newline_V: torch.Tensor  # text begins with `\n` (second half of a two-token blank line)
    ends_newline_V: torch.Tensor    # text ends with `\n` (first half)
    empty_V: torch.Tensor           # no text (special tokens): leaves the newline state unchanged

    @property
    def vocab_size(self) -> int:
        return int(self.word_start_V.numel())

    def to(self, device: torch.device | str) -> "TokenTables":
        return TokenTables(*(t.to(device) for t in (self.word_start_V, self.step_end_V, self.starts_newline_V,
                                                    self.ends_newline_V, self.empty_V)))


def tables_from_texts(texts: Sequence[str]) -> TokenTables:
    """Build the lookup tables from per-id texts (pure; see `token_texts`)."""
    def col(pred) -> torch.Tensor:
        return torch.tensor([bool(pred(t)) for t in texts], dtype=torch.bool)

    return TokenTables(
        word_start_V=col(lambda t: t[:1].isspace()),
        step_end_V=col(lambda t: "\n\n" in t),
        starts_newline_V=col(lambda t: t.startswith("\n")),
        ends_newline_V=col(lambda t: t.endswith("\n")),
        empty_V=col(lambda t: t == ""),
    )


def build_tables(tokenizer: Any, vocab_size: int | None = None) -> TokenTables:
    """Tables for a tokenizer, padded to the model's vocabulary size (ids beyond the tokenizer are inert)."""
    return tables_from_texts(token_texts(tokenizer, vocab_size))


def word_start_ids(tokenizer: Any) -> list[int]:
    """Ids whose text begins with whitespace: the word schedule's redraw points."""
    return build_tables(tokenizer).word_start_V.nonzero().flatten().tolist()


def model_vocab_size(model: Any) -> int:
    """Rows of the model's output layer (falls back to the input embedding, then the config).

    A path (str) is read through its config, for engines that load models themselves (vLLM).
    """
    if isinstance(model, (str, os.PathLike)):
        from transformers import AutoConfig

        return int(AutoConfig.from_pretrained(str(model)).vocab_size)
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if out is not None and getattr(out, "weight", None) is not None:
        return int(out.weight.shape[0])
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is not None:
        return int(emb.weight.shape[0])
    return int(model.config.vocab_size)


def check_vocab_compatible(senior: Any, junior: Any | None, tokenizer: Any,
                           junior_tokenizer: Any | None = None) -> int:
    """Raise `VocabularyMismatchError` unless senior, junior and tokenizer(s) share one vocabulary.

    Checks: both models have the same number of output rows; the tokenizer fits in them; when the junior
    comes with its own tokenizer, every id maps to the same token string and the special tokens agree.
    Returns the shared model vocabulary size.
    """
    v_s = model_vocab_size(senior)
    if len(tokenizer) > v_s:
        raise VocabularyMismatchError(
            f"the tokenizer has {len(tokenizer)} tokens but the senior's output layer has only {v_s} rows: "
            f"the model was not built for this tokenizer")
    if junior is None:
        return v_s
    v_j = model_vocab_size(junior)
    if v_s != v_j:
        raise VocabularyMismatchError(
            f"senior and junior vocabularies differ in size (senior {v_s} output rows, junior {v_j}): "
            f"tandem rollouts pass token ids between the models, so both must use one tokenizer")
    if junior_tokenizer is not None and junior_tokenizer is not tokenizer:
        if len(junior_tokenizer) != len(tokenizer):
            raise VocabularyMismatchError(
                f"senior and junior tokenizers differ in size ({len(tokenizer)} vs {len(junior_tokenizer)} "
                f"tokens): tandem rollouts need one shared vocabulary")
        vs, vj = tokenizer.get_vocab(), junior_tokenizer.get_vocab()
        if vs != vj:
            diff = sorted(set(vs.items()) ^ set(vj.items()), key=lambda kv: kv[1])[:3]
            raise VocabularyMismatchError(
                f"senior and junior tokenizers map ids to different token strings (first differences: "
                f"{diff}): tandem rollouts need one shared vocabulary")
        if tokenizer.eos_token_id != junior_tokenizer.eos_token_id:
            raise VocabularyMismatchError(
                f"senior and junior tokenizers disagree on EOS ({tokenizer.eos_token_id} vs "
                f"{junior_tokenizer.eos_token_id})")
    return v_s
