"""The checkpoint layout (tandem/checkpoints.py): one completeness rule for every reader."""

from __future__ import annotations

from pathlib import Path

from tandem.checkpoints import (commit_dir, complete_checkpoints, generations_file, is_complete,
                                latest_checkpoint, list_checkpoints, parse_step, read_state, step_name,
                                write_state)


def _ckpt(d: Path, state: dict | None = None, weights: bool = True, config: bool = True) -> Path:
    d.mkdir(parents=True)
    if config:
        (d / "config.json").write_text("{}")
    if weights:
        (d / "model.safetensors").write_bytes(b"w")
    if state is not None:
        write_state(d, state)
    return d


def test_names_round_trip():
    assert step_name(12) == "step-12" and parse_step("step-12") == 12
    assert [parse_step(n) for n in ("step-x", ".step-3.tmp", "checkpoint-3", "step-3a", "step-")] == [None] * 5


def test_one_rule_for_training_and_evaluation(tmp_path):
    arm = tmp_path / "ck" / "tandem"
    _ckpt(arm / "step-2", {"fingerprint": "A"})
    _ckpt(arm / "step-10", {"fingerprint": "B"})
    _ckpt(arm / "step-3")  # no marker: training never finished it
    _ckpt(arm / "step-4", {"fingerprint": "A"}, weights=False)
    _ckpt(arm / "step-5", {"fingerprint": "A"}, config=False)
    _ckpt(arm / "step-0", {"fingerprint": "A"})  # step 0 is the base, never a checkpoint
    _ckpt(arm / "checkpoint-6", {"fingerprint": "A"})  # staging name
    assert [s for s, _ in complete_checkpoints(arm)] == [2, 10]
    assert not is_complete(arm / "step-3") and is_complete(arm / "step-2")
    assert [c.step for c in list_checkpoints(tmp_path / "ck", "tandem", tmp_path / "base")] == [0, 2, 10]
    assert list_checkpoints(tmp_path / "ck", "grpo", tmp_path / "base")[0].path == tmp_path / "base"
    assert latest_checkpoint(arm).name == "step-10" and latest_checkpoint(arm, "A").name == "step-2"
    assert latest_checkpoint(arm, "C") is None and read_state(arm / "step-2") == {"fingerprint": "A"}


def test_commit_publishes_a_complete_checkpoint(tmp_path):
    arm = tmp_path / "tandem"
    staging = _ckpt(arm / "checkpoint-7", {"fingerprint": "A"})
    assert complete_checkpoints(arm) == []
    commit_dir(staging, arm / step_name(7))
    assert [s for s, _ in complete_checkpoints(arm)] == [7] and not staging.exists()


def test_generations_layout():
    assert generations_file("g", "kl_reg", 4, "solo", "gsm8k") == Path("g/kl_reg/step-4/solo/gsm8k.jsonl")


def test_final_and_best_picks_the_best_validated_saved_step(tmp_path):
    import json

    arm = tmp_path / "ck" / "grpo"
    for s in (50, 100, 150):
        _ckpt(arm / f"step-{s}", {"fingerprint": "A"})
    # validation at every 50 steps (and once at a step that was not saved); a tie between 50 and 100 -> later
    hist = [{"loss": 1.0, "tandem/step": s, "step": 2 * s, "val/accuracy": acc}
            for s, acc in ((25, 0.9), (50, 0.4), (100, 0.4), (150, 0.3))]
    (arm / "step-150" / "trainer_state.json").write_text(json.dumps({"log_history": hist}))
    steps = [c.step for c in list_checkpoints(tmp_path / "ck", "grpo", tmp_path / "base", "final_and_best")]
    assert steps == [0, 100, 150]
    hist[-1]["val/accuracy"] = 0.5  # the last is the best: one entry
    (arm / "step-150" / "trainer_state.json").write_text(json.dumps({"log_history": hist}))
    assert [c.step for c in list_checkpoints(tmp_path / "ck", "grpo", tmp_path / "base", "final_and_best")] == [0, 150]
    (arm / "step-150" / "trainer_state.json").unlink()  # no validation record: the final checkpoint only
    assert [c.step for c in list_checkpoints(tmp_path / "ck", "grpo", tmp_path / "base", "final_and_best")] == [0, 150]
