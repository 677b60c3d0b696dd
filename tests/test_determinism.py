"""Same inputs, same machine, same outputs: the prepare, base and train stages rerun bit for bit.

The prepare stage runs twice, in two output roots: every file it writes (data/prepared, metrics/data.json and
its headline, and the Great Expectations Data Docs in reports/data-docs, whose ids, run name and run time GX
would otherwise draw at random or from the clock: tasks/validation.py) must hash the same. A shortened base
stage (tokenizer, pretraining with a learning curve and the target schedule's probes, evaluation) and a
two-step training run of one arm run twice in the same output root; every file they write that DVC tracks
(models/base, metrics/base.json, models/checkpoints/<arm>, metrics/train_<arm>.json, the per-step table) must
hash the same. What measures the run rather than its result (wall times, throughput, peak memory, save times)
goes to `*.timing.*` sidecars, which neither git nor DVC tracks.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from params_files import complete_params  # noqa: E402


def _hashes(root: Path) -> dict[str, str]:
    return {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(root.rglob("*"))
            if f.is_file() and "scratch" not in f.relative_to(root).parts and f.name != ".tandem.lock"}


def _outputs_of(root: Path):
    from tandem.config import params_from_dict
    from tasks import base, train
    from tests.tasks.test_base import _prepare

    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    _prepare(root)
    params = params_from_dict(complete_params({
        "seed": 0, "out_root": str(root),
        "model": {"pretrain_steps": 40, "curve_points": 2, "curve_problems": 2, "pretrain_target": 1.0,
                  "pretrain_target_every": 10, "pretrain_target_problems": 2, "pretrain_cooldown": 10,
                  "eval_max_new_tokens": 12, "cpu_threads": 1},
        "train": {"arms": ["tandem"], "steps": 2, "save_every": 1, "report_to": "none", "cpu_threads": 1,
                  "max_new_tokens": 12}}))
    base.run(params)
    train.run_arm(params, "tandem", *train.default_io(params))
    return _hashes(root)


def test_timing_split_round_trips():
    from tandem.timing import merge_timing, split_timing

    doc = {"accuracy": {"macro": 0.5}, "seconds": 3.2, "pretrain": {"curve": [{"step": 1, "seconds": 0.4},
                                                                             {"step": 2}]},
           "phase_seconds": {"rollout": 1.0}, "generation": {"tokens": 10, "tokens_per_second": 5.0}}
    kept, timing = split_timing(doc)
    assert kept == {"accuracy": {"macro": 0.5}, "pretrain": {"curve": [{"step": 1}, {"step": 2}]},
                    "generation": {"tokens": 10}}
    assert timing == {"seconds": 3.2, "pretrain": {"curve": [{"seconds": 0.4}, {}]}, "phase_seconds": {"rollout": 1.0},
                      "generation": {"tokens_per_second": 5.0}}
    assert merge_timing(kept, timing) == doc
    assert split_timing({"n_steps": 3, "score_timeout": 5.0}) == ({"n_steps": 3, "score_timeout": 5.0}, None)
    # what a training run found on disk is not its result: a fresh clone resumes nothing and removes nothing
    summary = {"steps": 8, "resumed_from": "step-8", "removed_stale": ["step-4"], "checkpoints": ["step-4", "step-8"]}
    assert split_timing(summary) == ({"steps": 8, "checkpoints": ["step-4", "step-8"]},
                                     {"resumed_from": "step-8", "removed_stale": ["step-4"]})


def _prepared(root: Path) -> dict[str, str]:
    from tandem.config import params_from_dict
    from tasks import prepare

    params = params_from_dict(complete_params({"seed": 0, "out_root": str(root),
                                               "data": {"n_train": 60, "n_val": 10, "n_eval": 10}}))
    prepare.run(params, *prepare.default_io(params))
    return _hashes(root)


@pytest.mark.slow
def test_prepare_reruns_bit_for_bit_data_docs_included(tmp_path):
    first, second = _prepared(tmp_path / "a"), _prepared(tmp_path / "b")
    tracked = sorted(k for k in first if ".timing." not in k)
    docs = [k for k in tracked if k.startswith("reports/data-docs/")]
    assert {"reports/data-docs/index.html", "reports/data-docs/validation_result.json",
            "reports/data-docs/expectations/prepared_data.html"} <= set(docs)
    assert any(k.startswith("reports/data-docs/validations/") for k in docs)  # the validation's own page
    assert {"data/prepared/train.jsonl", "metrics/data.json", "metrics/headline/data.json"} <= set(tracked)
    assert set(first) == set(second)
    differ = [k for k in tracked if first[k] != second[k]]
    assert not differ, f"a second prepare run on the same data wrote other bytes: {differ}"


@pytest.mark.slow
def test_base_and_train_rerun_bit_for_bit(tmp_path):
    from tasks.common import read_json, read_metrics

    root = tmp_path / "run"
    first = _outputs_of(root)
    side = {k for k in first if ".timing." in k}
    assert {"metrics/base.timing.json", "metrics/train_tandem.timing.json",
            "metrics/plots/train/tandem.timing.csv"} <= side
    # the timings were measured and moved beside the metrics, not dropped
    assert read_metrics(root / "metrics" / "base.json")["pretrain"]["seconds"] > 0
    assert "seconds" not in read_json(root / "metrics" / "base.json")["pretrain"]
    assert read_json(root / "metrics" / "base.json")["pretrain"]["target"]["probes"]  # the probes ran
    assert "time_step" in (root / "metrics" / "plots" / "train" / "tandem.timing.csv").read_text()
    assert "saved_at" not in (root / "models" / "checkpoints" / "tandem" / "step-2" / "tandem_state.json").read_text()

    second = _outputs_of(root)
    tracked = sorted(k for k in first if k not in side)
    assert any(k.startswith("models/checkpoints/tandem/step-2/") for k in tracked)
    assert {"models/base/model.safetensors", "metrics/base.json", "metrics/train_tandem.json",
            "metrics/plots/train/tandem.csv"} <= set(tracked)
    assert set(first) == set(second)
    differ = [k for k in tracked if first[k] != second[k]]
    assert not differ, f"a rerun with the same inputs wrote other bytes: {differ}"
