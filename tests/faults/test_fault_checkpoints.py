"""No silent substitution: incomplete or damaged checkpoints are errors naming them, never replaced by another.

An incomplete last checkpoint (its config, marker or weights removed) makes `evaluate` refuse with the folder
named, instead of quietly calling the step before it "final". Published checkpoints are copies of the resume
copies in scratch/train/<arm>/ (no shared inodes), with every file's size and SHA-256 recorded when training
saved it and checked on resume (every file), on evaluation (the model's files) and on publication (each file
as it is copied). The slow test runs the train stage itself: a damaged published file is replaced by an intact
copy on the rerun, a damaged resume copy fails the rerun with the file named.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

from fault_fixtures import F, failure_line, flip, scratch_checkpoint, tandem  # noqa: E402
from params_files import complete_params  # noqa: E402

from tandem.checkpoints import list_checkpoints, read_state  # noqa: E402


def _refusal():
    """The error a refused checkpoint raises (imported late: older layouts had none, and these tests say so)."""
    from tandem.errors import CheckpointError

    return CheckpointError


def resume_checkpoint(arm_dir, fingerprint):
    from tandem.checkpoints import resume_checkpoint as resume

    return resume(arm_dir, fingerprint)


@pytest.fixture
def root(fault_tree, tmp_path) -> Path:
    shutil.copytree(fault_tree, tmp_path / "out")
    return tmp_path / "out"


def _plan(root: Path, which: str = "final"):
    import tasks.evaluate as ev

    return ev.plan(F.small_params(root, checkpoints=which))


# --------------------------------------------------------------------------------------------------
# An incomplete last checkpoint is an error naming it
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["final", "all"])
@pytest.mark.parametrize("removed", ["config.json", "tandem_state.json", "model.safetensors"])
def test_an_incomplete_last_checkpoint_is_an_error_naming_it(root, removed, which):
    last = root / "models" / "checkpoints" / "grpo" / "step-4"
    (last / removed).unlink()
    with pytest.raises(_refusal()) as exc:
        _plan(root, which)
    msg = str(exc.value)
    assert str(last) in msg and "missing" in msg and "tandem stage train --arm grpo" in msg
    assert "\n" not in msg


def test_the_intact_tree_plans_the_last_checkpoint_as_final(root):
    """The control for the test above: with every file in place, final means step 4 of each arm."""
    units = _plan(root)
    assert {(u["arm"], u["step"]) for u in units if u["step"]} == {(a, 4) for a in F.ARMS}


def test_the_stage_stops_with_one_message_and_writes_nothing(root):
    (root / "models" / "checkpoints" / "tandem" / "step-4" / "config.json").unlink()
    params = root / "params.yaml"
    p = F.small_params(root, checkpoints="final")
    params.write_text(yaml.safe_dump(complete_params({
        "out_root": str(root), "train": {"arms": list(F.ARMS)},
        "evaluate": {k: getattr(p.evaluate, k) for k in ("n_samples", "ks", "max_new_tokens", "batch_size",
                                                         "progress", "score_workers", "checkpoints")}})))
    line = failure_line(tandem("stage", "evaluate", "-p", str(params)), "stage evaluate")
    assert "tandem/step-4 (missing config.json)" in line
    assert not (root / "metrics" / "eval.json").exists() and not (root / "scratch" / "evaluate").exists()


# --------------------------------------------------------------------------------------------------
# Checksums: recorded at save time, verified on evaluation, resume and publication
# --------------------------------------------------------------------------------------------------

def test_checksums_are_recorded_for_every_file_when_a_checkpoint_is_saved(tmp_path):
    d = scratch_checkpoint(tmp_path / "tandem", 2)
    files = read_state(d)["files"]
    assert set(files) == {"config.json", "tokenizer.json", "model.safetensors", "optimizer.pt", "trainer_state.json"}
    assert files["model.safetensors"]["bytes"] == (d / "model.safetensors").stat().st_size
    assert len(files["optimizer.pt"]["sha256"]) == 64


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "symlink to /dev/zero", "extra weight file"])
def test_evaluation_refuses_a_published_checkpoint_that_differs_from_its_checksums(root, damage):
    f = root / "models" / "checkpoints" / "kl_reg" / "step-2" / "model.safetensors"
    if damage == "flipped byte":
        flip(f, at=f.stat().st_size // 2)
    elif damage == "truncated":
        f.write_bytes(f.read_bytes()[:-64])
    elif damage == "symlink to /dev/zero":
        f.unlink()
        f.symlink_to("/dev/zero")
    else:
        shutil.copy(f, f.with_name("model-extra.safetensors"))
    with pytest.raises(_refusal()) as exc:
        _plan(root, "all")
    msg = str(exc.value)
    assert "kl_reg/step-2/model" in msg and "recorded when it was saved" in msg and "\n" not in msg


def test_a_checkpoint_of_the_older_layout_without_checksums_is_used_with_a_warning(tmp_path, caplog):
    """Not silently either: each such checkpoint is named once, as unverified."""
    d = scratch_checkpoint(tmp_path / "tandem", 2)
    state = read_state(d)
    del state["files"]
    (d / "tandem_state.json").write_text(json.dumps(state))
    with caplog.at_level("WARNING", logger="tandem.checkpoints"):
        assert [c.step for c in list_checkpoints(tmp_path, "tandem", tmp_path / "base")] == [0, 2]
    assert f"{d}: tandem_state.json records no file checksums" in caplog.text


def test_a_resume_file_that_differs_stops_the_resume_not_the_evaluation(tmp_path):
    arm = tmp_path / "tandem"
    scratch_checkpoint(arm, 2)
    last = scratch_checkpoint(arm, 4)
    flip(last / "optimizer.pt")
    # evaluation reads the model's files only: they are intact
    assert [c.step for c in list_checkpoints(tmp_path, "tandem", tmp_path / "base")] == [0, 2, 4]
    with pytest.raises(_refusal()) as exc:  # resuming would load the damaged optimizer state
        resume_checkpoint(arm, "A")
    assert f"{last / 'optimizer.pt'}: other bytes" in str(exc.value) and "train.resume: never" in str(exc.value)


def test_resume_refuses_an_incomplete_checkpoint_of_its_run_instead_of_the_one_before(tmp_path):
    arm = tmp_path / "tandem"
    scratch_checkpoint(arm, 2)
    last = scratch_checkpoint(arm, 4)
    (last / "config.json").unlink()
    with pytest.raises(_refusal(), match=r"step-4 \(missing config.json\)"):
        resume_checkpoint(arm, "A")
    shutil.rmtree(last)  # the user's explicit choice: go back to step 2
    assert resume_checkpoint(arm, "A") == arm / "step-2"
    assert resume_checkpoint(arm, "B") is None  # another run's checkpoints are never resumed


def test_published_checkpoints_are_verified_copies_not_links(tmp_path):
    from tasks.train import materialise

    work, out = tmp_path / "scratch" / "tandem", tmp_path / "models" / "checkpoints" / "tandem"
    for step in (2, 4):
        scratch_checkpoint(work, step)
    assert materialise(work, out) == ["step-2", "step-4"]
    for step in (2, 4):
        for f in (work / f"step-{step}").iterdir():
            g = out / f"step-{step}" / f.name
            assert g.read_bytes() == f.read_bytes()
            assert not os.path.samefile(f, g) and f.stat().st_nlink == 1
    flip(out / "step-4" / "model.safetensors")  # damage to the published copy stays there
    resume_checkpoint(work, "A")
    assert read_state(out / "step-4") == read_state(work / "step-4")


def test_the_published_copy_leaves_the_process_rng_snapshot_out_and_still_verifies(tmp_path):
    """rng_state*.pth (the process's global RNGs at the save) stays in scratch/, where runs resume, and is left
    out of the published copy, whose recorded checksums follow: it verifies as a whole."""
    from tandem.checkpoints import verify_checkpoint
    from tasks.train import materialise

    work, out = tmp_path / "scratch" / "tandem", tmp_path / "models" / "checkpoints" / "tandem"
    d = scratch_checkpoint(work, 2)
    (d / "rng_state.pth").write_bytes(b"process rng " * 8)
    from tandem.checkpoints import write_state
    write_state(d, {"fingerprint": "A", "step": 2, "complete": True})  # records the new file too
    verify_checkpoint(d, "all")
    assert materialise(work, out) == ["step-2"]
    assert (d / "rng_state.pth").exists() and not (out / "step-2" / "rng_state.pth").exists()
    assert "rng_state.pth" not in read_state(out / "step-2")["files"]
    verify_checkpoint(out / "step-2", "all")
    assert (out / "step-2" / "optimizer.pt").read_bytes() == (d / "optimizer.pt").read_bytes()


def test_publication_refuses_a_damaged_resume_copy(tmp_path):
    from tasks.train import materialise

    work, out = tmp_path / "scratch" / "tandem", tmp_path / "out" / "tandem"
    scratch_checkpoint(work, 2)
    flip(work / "step-2" / "model.safetensors")
    with pytest.raises(_refusal()) as exc:
        materialise(work, out)
    assert f"{work / 'step-2' / 'model.safetensors'}: other bytes" in str(exc.value)


# --------------------------------------------------------------------------------------------------
# The train stage itself
# --------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_rerun_of_train_never_republishes_a_damaged_checkpoint(tmp_path):
    from train_fixtures import build_base, write_prepared

    root = tmp_path / "out"
    build_base(root / "models" / "base")
    write_prepared(root / "data" / "prepared", n_train=8, n_val=2)
    params = root / "params.yaml"
    params.write_text(yaml.safe_dump(complete_params({
        "out_root": str(root), "rollout": {"batch_size": 8},
        "train": {"arms": ["tandem"], "steps": 2, "save_every": 1, "prompts_per_step": 2, "group_size": 2,
                  "max_new_tokens": 6, "kl_rows": 2, "val_every": 0, "report_to": "none", "cpu_threads": 1}})))
    res = tandem("stage", "train", "-p", str(params))
    assert res.exit_code == 0, res.output
    published = root / "models" / "checkpoints" / "tandem"
    scratch = root / "scratch" / "train" / "tandem"
    assert sorted(p.name for p in published.iterdir()) == ["step-1", "step-2"]

    flip(published / "step-2" / "model.safetensors")  # damage the published copy only
    res = tandem("stage", "train", "-p", str(params))
    assert res.exit_code == 0, res.output  # the rerun publishes intact copies again
    assert (published / "step-2" / "model.safetensors").read_bytes() == \
        (scratch / "step-2" / "model.safetensors").read_bytes()
    before = {p: p.read_bytes() for p in published.rglob("*") if p.is_file()}

    flip(scratch / "step-1" / "model.safetensors")  # now the resume copy itself
    line = failure_line(tandem("stage", "train", "-p", str(params)), "stage train")
    assert f"{scratch / 'step-1' / 'model.safetensors'}: other bytes" in line
    assert {p: p.read_bytes() for p in published.rglob("*") if p.is_file()} == before  # nothing republished
