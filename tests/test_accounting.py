"""GPU accounting (tandem/accounting.py) on tiny inputs against naive versions, its collection into
results/run.json (tasks/record.py) and its line in the report's metadata (tasks/report.py)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tandem import accounting as A


def test_gpu_type_names_one_model_a_mix_or_none():
    assert A.gpu_type([]) == A.NO_GPU == "none (a CPU run)"
    assert A.gpu_type(["NVIDIA H100"] * 8) == "NVIDIA H100"
    assert A.gpu_type(["B", "A", "B"]) == "A x1, B x2"


def test_inventory_counts_every_machine():
    assert A.gpu_inventory([]) == {"count": 0, "type": A.NO_GPU, "per_machine": 0, "machines": 1}
    assert A.gpu_inventory(["H"] * 4, machines=2)["count"] == 8
    with pytest.raises(ValueError, match="at least one machine"):
        A.gpu_inventory(["H"], machines=0)


@pytest.mark.parametrize("wall,gpus,tokens", [(10.0, 0, 500), (10.0, 2, 500), (0.0, 4, 10), (3.5, 8, None)])
def test_task_accounting_against_the_naive_sums(wall, gpus, tokens):
    naive_held = sum(wall for _ in range(gpus))
    acc = A.task_accounting(wall, gpus, tokens)
    assert acc["gpus"] == gpus and acc["gpu_seconds"] == pytest.approx(naive_held) and acc["tokens"] == tokens
    if gpus == 0 or tokens is None or naive_held == 0:
        assert acc["tokens_per_gpu_second"] is None  # a CPU run: no rate, never a division by zero
    else:
        assert acc["tokens_per_gpu_second"] == pytest.approx(tokens / naive_held, abs=1e-3)


def test_negative_time_or_gpus_is_refused():
    with pytest.raises(ValueError, match="negative"):
        A.gpu_seconds(-1.0, 1)
    with pytest.raises(ValueError, match="negative"):
        A.gpu_seconds(1.0, -1)


def test_token_counts_against_naive_loops():
    lengths, rows = [10.5, 20.0, 7.25], 16
    naive = 0.0
    for x in lengths:
        for _ in range(rows):
            naive += x
    assert A.rollout_tokens(lengths, rows) == round(naive) == 604
    batches = [(64, 126.3125), (64, 46.25)]
    assert A.generation_tokens(batches) == round(sum(n * m for n, m in batches)) == 11044


def test_the_line_says_a_cpu_run_held_no_gpu():
    assert A.accounting_line(A.gpu_inventory([]), {"base": A.task_accounting(5.0, 0, 10)}).startswith("0 GPUs, none")
    line = A.accounting_line(A.gpu_inventory(["H100"] * 2), {"train tandem": A.task_accounting(10.0, 2, 400)})
    assert line == "2 GPUs (H100): train tandem 20.0 GPU-s (20.0 tokens/GPU-s)"


def _outputs(root: Path) -> None:
    """A base summary, one arm's summary and step table (resumed after step 1), one evaluation unit."""
    m = root / "metrics"
    (m / "plots" / "train").mkdir(parents=True)
    (m / "base.json").write_text(json.dumps({"generation": {"tokens": 1000}}))
    # as the train stage writes them: the summary, and what the run found on disk in its untracked sidecar
    (m / "train_tandem.json").write_text(json.dumps({"prompts_per_step": 2, "group_size": 4}))
    (m / "train_tandem.timing.json").write_text(json.dumps({"resumed_from": "step-1", "removed_stale": []}))
    with open(m / "plots" / "train" / "tandem.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "reward_mean", "joint_length"])
        w.writerows([[1, 0.1, 100.0], [2, 0.2, 10.0], [3, 0.3, 20.0]])
    bench = {"a": {"n_generations": 4, "mean_tokens": 5.0}, "b": {"n_generations": 2, "mean_tokens": 3.0}}
    (m / "eval.json").write_text(json.dumps({"arms": {"tandem": {"checkpoints": [
        {"step": 8, "modes": {"solo": {"benchmarks": bench}}}]}}}))


def test_run_json_accounts_a_cpu_run_as_zero_gpus(tmp_path):
    from tasks.record import write_run_metadata

    _outputs(tmp_path)
    timing = {"prepare": 1.0, "base": 4.0, "train@tandem": 10.0, "evaluate-tandem-step-8-solo": 2.0}
    doc = write_run_metadata(tmp_path, timing, {}, {}, list(timing), gpus={"names": []})
    assert doc["gpu"] == {"count": 0, "type": "none (a CPU run)", "per_machine": 0, "machines": 1}
    acc = doc["accounting"]
    assert set(acc) == set(timing)
    assert all(a["gpus"] == 0 and a["gpu_seconds"] == 0.0 and a["tokens_per_gpu_second"] is None for a in acc.values())
    # tokens: the arm's steps past the one it resumed from (2 x 4 rows x (10 + 20)), the unit's generations
    assert acc["train@tandem"]["tokens"] == 240 and acc["evaluate-tandem-step-8-solo"]["tokens"] == 26
    assert acc["base"]["tokens"] == 1000 and acc["prepare"]["tokens"] is None
    on_disk = json.loads((tmp_path / "results" / "run.json").read_text())
    assert on_disk["gpu"]["count"] == 0 and on_disk["accounting"]["prepare"]["gpu_seconds"] == 0.0


def test_run_json_accounts_gpus_on_every_machine_and_keeps_skipped_tasks(tmp_path):
    from tasks.record import write_run_metadata

    _outputs(tmp_path)
    gpus = {"names": ["NVIDIA H100"] * 2, "machines": {"train@tandem": 2}}
    first = write_run_metadata(tmp_path, {"base": 4.0, "train@tandem": 10.0}, {}, {}, ["base", "train@tandem"],
                               gpus=gpus)
    assert first["gpu"]["type"] == "NVIDIA H100" and first["gpu"]["count"] == 2
    assert first["accounting"]["base"] == {"gpus": 2, "gpu_seconds": 8.0, "tokens": 1000,
                                           "tokens_per_gpu_second": 125.0}
    assert first["accounting"]["train@tandem"] == {"gpus": 4, "gpu_seconds": 40.0, "tokens": 240,
                                                   "tokens_per_gpu_second": 6.0}
    # a later run of one task: the skipped task keeps the accounting of the run that last ran it
    second = write_run_metadata(tmp_path, {"train@tandem": 5.0}, {}, {}, ["train@tandem"], gpus=gpus)
    assert second["accounting"]["base"] == first["accounting"]["base"]
    assert second["accounting"]["train@tandem"]["gpu_seconds"] == 20.0


def test_tasks_on_a_ray_cluster_are_accounted_with_the_gpus_they_reserved(tmp_path):
    import yaml

    from tandem.config import params_from_dict
    from tasks import cluster
    from tasks.record import write_run_metadata
    from tests.flows import fake_stages

    raw = yaml.safe_load(fake_stages.PARAMS_YAML)
    local = params_from_dict(raw, strict=True)
    tasks = ["base", "train@tandem", "evaluate-tandem-step-0-solo"]
    assert cluster.reserved_gpus(local, tasks) == {}  # local: the flow machine's GPUs count
    on_ray = params_from_dict({**raw, "cluster": {**raw["cluster"], "runner": "ray", "train_gpus": 2,
                                                   "eval_gpus": 1}}, strict=True)
    reserved = cluster.reserved_gpus(on_ray, tasks)
    assert reserved == {"train@tandem": 2, "evaluate-tandem-step-0-solo": 1}
    _outputs(tmp_path)
    doc = write_run_metadata(tmp_path, {"base": 4.0, "train@tandem": 10.0}, {}, {}, ["base", "train@tandem"],
                             gpus={"names": [], "reserved": reserved})  # the flow itself on a CPU head node
    assert doc["accounting"]["base"]["gpus"] == 0
    assert doc["accounting"]["train@tandem"] == {"gpus": 2, "gpu_seconds": 20.0, "tokens": 240,
                                                 "tokens_per_gpu_second": 12.0, "on": "ray"}


def test_the_report_states_the_gpus(tmp_path, monkeypatch):
    from tandem.config import params_from_dict
    import tasks.accounting as record
    import tasks.report as R

    _outputs(tmp_path)
    params = params_from_dict({"out_root": str(tmp_path)})
    docs = {"base": {"seconds": {"total": 4.0}}, "evaluate": json.loads((tmp_path / "metrics" / "eval.json").read_text())}
    docs["evaluate"]["arms"]["tandem"]["checkpoints"][0]["modes"]["solo"]["benchmarks"]["a"]["seconds"] = 2.0
    arms = {"tandem": {"wall_seconds_this_run": 10.0}}
    monkeypatch.setattr(record, "held_gpus", lambda: [])
    assert R._gpu_accounting(params, docs, arms).startswith("0 GPUs, none (a CPU run): 0 GPU-seconds")
    monkeypatch.setattr(record, "held_gpus", lambda: ["NVIDIA H100"])
    assert R._gpu_accounting(params, docs, arms) == (
        "1 GPUs (NVIDIA H100): base 4.0 GPU-s (250.0 tokens/GPU-s), train tandem 10.0 GPU-s (24.0 tokens/GPU-s), "
        "evaluate 2.0 GPU-s (13.0 tokens/GPU-s)")
