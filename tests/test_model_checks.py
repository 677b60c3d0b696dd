"""A well-formed but wrong model is refused where it is loaded, and a run that never trained or a checkpoint that is
gone is never passed off as a result.

- The manifest of a published model (`tandem_manifest.json`, `tandem.models.write_manifest`): NaN weights, an
  int8-cast tensor, a missing or an extra tensor, a file of another size or other bytes are refused by
  `check_model_dir` and `load_model` in one line naming the file; verified once per process while the files stay.
- Non-finite weights are refused on every load, with or without a manifest (`tandem.models.check_finite`), and
  before a stage publishes a model (`tasks.base.publish_manifest`).
- Training whose every optimizer update was skipped as non-finite raises (`tandem.train.summary.
  all_updates_skipped`; slow: the real trainer with a NaN loss at every step).
- Evaluate refuses a checkpoint the arm's training summary lists but that is missing on disk.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tandem.errors import CheckpointError, ModelFileError, NonFiniteLossError, UserError
from tandem.models import (MANIFEST_FILE, check_model_dir, check_weights_finite, load_model, save_model,
                           verify_manifest, write_manifest)
from train_fixtures import build_base

TENSOR = "model.layers.0.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> Path:
    """A tiny base as the base stage publishes it: the model folder with its manifest."""
    base = build_base(tmp_path_factory.mktemp("published") / "base", hidden=32)
    write_manifest(base)
    return base


def _variant(src: Path, dest: Path, edit=None, manifest: bool = True) -> Path:
    """A copy of `src` whose weight file is rewritten after `edit(state_dict)` (a well-formed safetensors file)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dest)
    if edit is not None:
        sd = load_file(dest / "model.safetensors")
        edit(sd)
        save_file(sd, str(dest / "model.safetensors"), metadata={"format": "pt"})
    if not manifest:
        (dest / MANIFEST_FILE).unlink()
    return dest


def _refused(d: Path) -> str:
    """The one-line message both `check_model_dir` and `load_model` refuse `d` with."""
    with pytest.raises(ModelFileError) as a:
        check_model_dir(d)
    with pytest.raises(ModelFileError) as b:
        load_model(d)
    assert isinstance(a.value, UserError) and "\n" not in str(a.value) and "\n" not in str(b.value)
    return str(b.value)


def test_manifest_records_every_file_and_tensor(published):
    doc = json.loads((published / MANIFEST_FILE).read_text())
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(doc["files"])
    assert MANIFEST_FILE not in doc["files"]
    assert doc["files"]["model.safetensors"]["bytes"] == (published / "model.safetensors").stat().st_size
    assert doc["tensors"]["model.safetensors"][TENSOR] == {"dtype": "F32", "shape": [64, 32]}
    assert verify_manifest(published) is True
    check_model_dir(published)
    assert torch.isfinite(load_model(published).model.layers[0].mlp.up_proj.weight).all()


def test_nan_weights_are_refused_on_load_naming_the_file(published, tmp_path):
    d = _variant(published, tmp_path / "nan", lambda sd: sd[TENSOR].fill_(float("nan")))
    msg = _refused(d)
    assert f"{d / 'model.safetensors'}: tensor {TENSOR!r} holds NaN or infinite values" in msg
    assert "SHA-256 differs" in msg


def test_nan_weights_are_refused_without_a_manifest(published, tmp_path):
    """An older output or a `model.source: path` folder has no manifest: it still loads, but never with NaN."""
    d = _variant(published, tmp_path / "nan", lambda sd: sd[TENSOR][0, 0].fill_(float("inf")), manifest=False)
    check_model_dir(d)  # well formed, and nothing recorded to compare with
    with pytest.raises(ModelFileError) as exc:
        load_model(d)
    assert str(exc.value).startswith(f"{d / 'model.safetensors'}: tensor {TENSOR!r} holds 1 NaN or infinite value ")
    with pytest.raises(ModelFileError, match=f"{d / 'model.safetensors'}: tensor {TENSOR!r} holds NaN"):
        check_weights_finite(d)
    ok = _variant(published, tmp_path / "ok", manifest=False)
    assert verify_manifest(ok) is False and load_model(ok) is not None  # no manifest: loads as before


def test_an_int8_cast_tensor_is_refused(published, tmp_path):
    d = _variant(published, tmp_path / "int8", lambda sd: sd.__setitem__(TENSOR, sd[TENSOR].to(torch.int8)))
    assert f"{d / 'model.safetensors'}: tensor {TENSOR!r} is I8, F32 when published" in _refused(d)


def test_a_missing_or_an_extra_tensor_is_refused(published, tmp_path):
    gone = _variant(published, tmp_path / "gone", lambda sd: sd.pop(TENSOR))
    assert f"{gone / 'model.safetensors'}: tensor {TENSOR!r} is missing (published as F32 [64, 32])" in _refused(gone)
    extra = _variant(published, tmp_path / "extra", lambda sd: sd.__setitem__("model.extra", torch.zeros(2)))
    assert f"{extra / 'model.safetensors'}: tensor 'model.extra' was not in the published model" in _refused(extra)
    reshaped = _variant(published, tmp_path / "shape",
                        lambda sd: sd.__setitem__(TENSOR, sd[TENSOR].reshape(32, 64).contiguous()))
    assert f"tensor {TENSOR!r} has shape [32, 64], [64, 32] when published" in _refused(reshaped)


def test_a_file_of_another_size_or_other_bytes_is_refused(published, tmp_path):
    d = _variant(published, tmp_path / "size")
    with open(d / "config.json", "a") as f:
        f.write(" ")
    n = (published / "config.json").stat().st_size
    assert f"{d / 'config.json'}: {n + 1} bytes, {n} when published" in _refused(d)

    d = _variant(published, tmp_path / "bytes")  # same size, one byte changed
    raw = bytearray((d / "tokenizer.json").read_bytes())
    i = raw.index(b"<|im_end|>")
    raw[i + 2] = ord("X")
    (d / "tokenizer.json").write_bytes(bytes(raw))
    assert f"{d / 'tokenizer.json'}: other bytes than when published (SHA-256 differs)" in _refused(d)

    d = _variant(published, tmp_path / "gone")
    (d / "generation_config.json").unlink()
    assert f"{d / 'generation_config.json'}: missing" in _refused(d)

    d = _variant(published, tmp_path / "damaged")
    (d / MANIFEST_FILE).write_text(json.dumps({"files": {}}))
    assert f"{d / MANIFEST_FILE}: holds no valid record" in _refused(d)


def test_verified_once_per_process_while_the_files_stay(published, tmp_path, monkeypatch):
    import tandem.checkpoints as C

    d = _variant(published, tmp_path / "cached")
    hashed = []
    real = C._sha256
    monkeypatch.setattr(C, "_sha256", lambda p: hashed.append(Path(p).name) or real(p))
    verify_manifest(d)
    first = len(hashed)
    assert first == len(json.loads((d / MANIFEST_FILE).read_text())["files"])
    verify_manifest(d)
    check_model_dir(d)
    assert len(hashed) == first  # remembered: a big model is hashed once per process
    st = (d / "config.json").stat()
    os.utime(d / "config.json", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    verify_manifest(d)  # a file's time changed: checked again
    assert len(hashed) == 2 * first


def test_saving_over_a_published_folder_drops_its_manifest(published, tmp_path):
    from tandem.models import load_tokenizer

    d = _variant(published, tmp_path / "resaved")
    save_model(load_model(d), load_tokenizer(d), d)
    assert not (d / MANIFEST_FILE).exists() and load_model(d) is not None


def test_a_stage_refuses_to_publish_non_finite_weights(published, tmp_path):
    from tasks.base import _copy_local, publish_manifest

    d = _variant(published, tmp_path / "nan", lambda sd: sd[TENSOR].fill_(float("nan")), manifest=False)
    with pytest.raises(ModelFileError, match="holds NaN or infinite values"):
        publish_manifest(d)
    assert not (d / MANIFEST_FILE).exists()
    # a local model folder with a manifest of its own: the copy gets the stage's manifest, not the source's
    copy = tmp_path / "copy"
    _copy_local(published, copy, trust_remote_code=False)
    assert not (copy / MANIFEST_FILE).exists()
    doc = publish_manifest(copy)
    assert "tandem_source.json" in doc["files"] and verify_manifest(copy)


# --------------------------------------------------------------------------------------------------
# Training whose every update was skipped
# --------------------------------------------------------------------------------------------------

def test_all_updates_skipped_decides_on_the_whole_log_history():
    from tandem.train.summary import SKIPPED_KEY, all_updates_skipped

    def step(n, skipped):
        entry = {"loss": float("nan"), "step": 2 * n, "tandem/step": n}
        return entry if skipped is None else {**entry, SKIPPED_KEY: skipped}

    end = {"train_loss": float("nan"), "step": 4}  # trl's end-of-training entry carries no per-step loss
    assert all_updates_skipped([step(1, 2), step(2, 2), end], updates_per_step=2)
    assert not all_updates_skipped([step(1, 2), step(2, 1), end], updates_per_step=2)  # one update did happen
    assert not all_updates_skipped([step(1, 0), step(2, 0)], updates_per_step=2)
    assert not all_updates_skipped([step(1, None), step(2, None)], updates_per_step=1)  # an older log: trained
    assert not all_updates_skipped([end], updates_per_step=1)  # no step at all


@pytest.mark.slow
def test_training_whose_every_step_is_skipped_raises_before_publishing(published, tmp_path, monkeypatch):
    import tandem.train.trainer as T
    from tandem.config import RolloutConfig, TrainConfig
    from tandem.models import load_tokenizer
    from tandem.train import ArmRun, train_arm
    from tandem.train.summary import SKIPPED_KEY
    from train_fixtures import write_prepared
    from tasks.common import read_jsonl

    write_prepared(tmp_path / "prepared", n_train=8, n_val=2)
    rows = read_jsonl(tmp_path / "prepared" / "train.jsonl")
    real_build = T.build_trainer

    def build(*a, **k):  # every loss NaN: the guard skips every optimizer update
        trainer = real_build(*a, **k)
        real_loss = trainer.compute_loss
        trainer.compute_loss = lambda *x, **y: real_loss(*x, **y) * float("nan")
        return trainer

    monkeypatch.setattr(T, "build_trainer", build)
    train = TrainConfig(arms=["grpo"], steps=2, prompts_per_step=2, group_size=2, max_new_tokens=6, save_every=1,
                        report_to="none", warmup_steps=0, kl_rows=0, val_every=0, nonfinite_loss="skip")

    def run():
        return train_arm(ArmRun("grpo", load_model(published), load_model(published), load_tokenizer(published), rows,
                                train, RolloutConfig(), tmp_path / "grpo", 0, progress=False,
                                score_fn=lambda texts, golds, **kw: [float(i % 2) for i in range(len(texts))]))

    with pytest.raises(NonFiniteLossError, match=r"arm grpo: every optimizer update of the run \(2 steps"):
        run()
    state = json.loads((tmp_path / "grpo" / "step-2" / "trainer_state.json").read_text())
    assert [h[SKIPPED_KEY] for h in state["log_history"] if "loss" in h] == [1, 1]
    with pytest.raises(NonFiniteLossError):  # a rerun resumes the finished run and refuses it again
        run()


# --------------------------------------------------------------------------------------------------
# Evaluate: a checkpoint the training summary lists is gone
# --------------------------------------------------------------------------------------------------

def test_evaluate_refuses_a_listed_checkpoint_missing_on_disk(tmp_path):
    import tasks.evaluate as ev
    from tandem.config import params_from_dict
    from tests.tasks import eval_fixtures as F

    F.fake_model_dir(tmp_path / "models" / "base", b"base", marker=False)
    ck = tmp_path / "models" / "checkpoints" / "grpo"
    for step in (2, 4):
        F.fake_model_dir(ck / f"step-{step}", f"w{step}".encode())
    summary = tmp_path / "metrics" / "train_grpo.json"
    summary.parent.mkdir()
    summary.write_text(json.dumps({"arm": "grpo", "checkpoints": ["step-2", "step-4"]}))
    params = params_from_dict({"out_root": str(tmp_path), "train": {"arms": ["grpo"]},
                               "evaluate": {"checkpoints": "final"}})
    inputs, _ = ev.default_io(params)
    assert ev.training_summary(params, "grpo") == summary
    assert [c.step for c in ev._all_checkpoints(params, inputs)["grpo"]] == [0, 4]
    shutil.rmtree(ck / "step-4")
    with pytest.raises(CheckpointError) as exc:  # never step-2 as "final" in its place
        ev._all_checkpoints(params, inputs)
    msg = str(exc.value)
    assert msg.startswith(f"{ck / 'step-4'}: missing, but the arm's training summary {summary} lists it")
    assert "(the final one, step-4)" in msg and "tandem stage train --arm grpo" in msg and "\n" not in msg
    with pytest.raises(CheckpointError, match="step-4"):
        ev.plan(params)
    summary.unlink()  # checkpoints that no training summary describes: listed as they are
    assert [c.step for c in ev._all_checkpoints(params, inputs)["grpo"]] == [0, 2]
