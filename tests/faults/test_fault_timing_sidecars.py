"""Timing sidecars (`metrics/<name>.timing.json`) change with their summary, in the stage's transaction.

They used to be written in place while the summary was still staged: a run that failed or was killed after
the sidecar was replaced but before its transaction published the summary left the previous run's summary read
with this run's timings (`tasks.common.read_metrics` merges them). Now a sidecar is an optional output of the
same transaction (`tandem.transactions.StageOutputs`): the old pair stays, or the new pair replaces it (a kill
after the commit point is finished by the next run); a run without timings removes the old sidecar with the
commit. Outside a transaction the old sidecar goes before the summary is replaced, the new one after it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

from fault_fixtures import REPO, kill_after_moves  # noqa: E402
from params_files import complete_params  # noqa: E402

from tandem.config import params_from_dict  # noqa: E402

OLD, NEW = {"run": "old", "seconds": 1.0}, {"run": "new", "seconds": 2.0}


def _old_pair(root: Path) -> tuple[Path, Path]:
    from tasks.common import timing_path, write_metrics

    summary = root / "metrics" / "eval.json"
    summary.parent.mkdir(parents=True, exist_ok=True)
    write_metrics(summary, OLD)
    assert json.loads(timing_path(summary).read_text()) == {"seconds": 1.0}
    return summary, timing_path(summary)


def test_a_failure_after_the_sidecar_write_keeps_the_old_summary_with_the_old_timings(tmp_path):
    from tasks.common import read_metrics, stage_outputs, timing_path, write_json, write_metrics

    params = params_from_dict({"out_root": str(tmp_path)})
    summary, side = _old_pair(tmp_path)
    headline = tmp_path / "metrics" / "headline" / "eval.json"
    with pytest.raises(RuntimeError, match="between the sidecar and the publish"):
        with stage_outputs(params, "evaluate", {"metrics": summary, "headline": headline}) as staged:
            write_metrics(staged["metrics"], NEW, timing_to=timing_path(summary))  # as tasks/evaluate.py calls it
            write_json(staged["headline"], {})
            raise RuntimeError("failed between the sidecar and the publish")
    assert read_metrics(summary) == OLD and json.loads(side.read_text()) == {"seconds": 1.0}
    with pytest.raises(RuntimeError, match="stop"):
        with stage_outputs(params, "evaluate", {"metrics": summary, "headline": headline}) as staged:
            write_json(staged["metrics"], {"run": "new"})  # a staged summary without a sidecar of its own
            assert read_metrics(staged["metrics"], timing_to=side) == {"run": "new"}  # not the old timings
            raise RuntimeError("stop")
    with stage_outputs(params, "evaluate", {"metrics": summary, "headline": headline}) as staged:
        write_metrics(staged["metrics"], NEW, timing_to=timing_path(summary))
        assert read_metrics(staged["metrics"], timing_to=timing_path(summary)) == NEW  # the staged pair
        assert read_metrics(summary) == OLD  # until the commit
        write_json(staged["headline"], {})
    assert read_metrics(summary) == NEW
    with stage_outputs(params, "evaluate", {"metrics": summary, "headline": headline}) as staged:
        write_metrics(staged["metrics"], {"run": "untimed"}, timing_to=timing_path(summary))
        write_json(staged["headline"], {})
        assert side.exists()  # the old sidecar goes with the commit, not before
    assert read_metrics(summary) == {"run": "untimed"} and not side.exists()
    assert not list((tmp_path / "scratch" / "staging").iterdir())


def test_outside_a_transaction_a_failed_summary_write_never_keeps_new_timings(tmp_path, monkeypatch):
    """base.py writes its summary in place: a failure between the two files leaves no sidecar, not a new one."""
    import tasks.common as common

    summary, side = _old_pair(tmp_path)
    real = common.write_json

    def fail_on_summary(path, obj):
        if Path(path) == summary:
            raise OSError(5, "Input/output error", str(path))
        return real(path, obj)

    monkeypatch.setattr(common, "write_json", fail_on_summary)
    with pytest.raises(OSError):
        common.write_metrics(summary, NEW)
    monkeypatch.undo()
    assert common.read_metrics(summary) == {"run": "old"} and not side.exists()
    common.write_metrics(summary, NEW)
    assert common.read_metrics(summary) == NEW


def test_a_sidecar_declared_while_the_block_runs_is_in_the_plan_for_recovery(tmp_path):
    """An optional output declared while the block runs is in the transaction's plan (so `recover` finds it)."""
    from tandem.transactions import PLAN, StageOutputs

    summary, side = _old_pair(tmp_path)
    with StageOutputs(tmp_path, "evaluate", {"metrics": summary}) as staged:
        txn = StageOutputs.of_staged(staged["metrics"])
        assert txn is not None and StageOutputs.of_staged(summary) is None
        late = txn.add_optional("timing", side)
        assert txn.add_optional("again", side) == late and txn.staged_for(side) == late
        plan = json.loads((txn.dir / PLAN).read_text())
        assert plan["optional"] == {"timing": str(side)}
        staged["metrics"].write_text('{"run": "new"}\n')
        late.write_text('{"seconds": 2.0}\n')
    assert StageOutputs.of_staged(staged["metrics"]) is None
    assert json.loads(side.read_text()) == {"seconds": 2.0} and json.loads(summary.read_text()) == {"run": "new"}


def _child(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


def _prepare_params(root: Path, seed: int) -> dict:
    return complete_params({"seed": seed, "out_root": str(root), "data": {"n_train": 40, "n_val": 4, "n_eval": 3}})


def test_prepare_killed_right_after_its_sidecar_was_replaced_leaves_one_runs_pair(tmp_path):
    """Seed 0's run, then seed 1's killed right after the rename that replaced `metrics/data.timing.json`."""
    from tasks import prepare
    from tasks.common import timing_path
    from tandem.workspace import workspace_lock

    root = tmp_path / "out"
    p0 = params_from_dict(_prepare_params(root, 0))
    prepare.run(p0, *prepare.default_io(p0))
    summary = root / "metrics" / "data.json"
    side = timing_path(summary)
    old = (summary.read_bytes(), side.read_bytes())
    code = kill_after_moves([side], 1) + f"""
from tandem.config import params_from_dict
from tasks import prepare
p = params_from_dict({_prepare_params(root, 1)!r})
prepare.run(p, *prepare.default_io(p))
"""
    res = _child(code)
    assert res.returncode == -signal.SIGKILL, res.stderr[-3000:]
    with workspace_lock(root):  # the next run finishes a commit that was under way
        pass
    new = (summary.read_bytes(), side.read_bytes())
    assert new[0] != old[0] and new[1] != old[1], "the old summary with the new run's timings (or the reverse)"
    assert json.loads(new[0])["seed"] == 1
    assert not list((root / "scratch" / "staging").iterdir())


def test_the_two_process_stage_publishes_the_workers_sidecars_with_the_summary(tmp_path, monkeypatch):
    """The launched workers write the sidecars into the stage's transaction (`publish_to`), not in place."""
    import tasks.launch as launcher
    import tasks.train as stage
    from tasks.common import read_metrics, timing_path

    params = params_from_dict({"out_root": str(tmp_path), "train": {"arms": ["tandem"], "num_processes": 2,
                                                                    "report_to": "none"}})
    inputs, outputs = stage.default_io(params)
    metrics = Path(outputs["metrics_tandem"])
    metrics.parent.mkdir(parents=True)
    metrics.write_text('{"run": "earlier"}\n')
    timing_path(metrics).write_text('{"seconds": 1.0}\n')
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    body = ("import json, pathlib, sys\nspec = json.loads(pathlib.Path(sys.argv[1]).read_text())\n"
            "out = {k: pathlib.Path(v) for k, v in spec['publish_to'].items()}\n"
            "assert set(out) >= {'metrics_timing', 'plot_timing'}, sorted(out)\n"
            "out['metrics_timing'].write_text(json.dumps({'seconds': 2.0}))\n"
            "if len(sys.argv) > 2: sys.exit(3)  # fails after its sidecar, before the publish\n"
            "out['checkpoints'].mkdir()\n"
            "out['metrics'].write_text(json.dumps({'run': 'new'}))\n"
            "out['headline'].write_text(json.dumps({'steps': 1}))\n"
            "out['plot'].write_text('step\\n')\n")
    monkeypatch.setattr(launcher, "launch_command", lambda p, spec: [sys.executable, "-c", body, str(spec), "fail"])
    with pytest.raises(RuntimeError, match="exit status 3"):
        stage.run_arm(params, "tandem", inputs, outputs)
    assert read_metrics(metrics) == {"run": "earlier", "seconds": 1.0}
    monkeypatch.setattr(launcher, "launch_command", lambda p, spec: [sys.executable, "-c", body, str(spec)])
    assert stage.run_arm(params, "tandem", inputs, outputs) == {"run": "new", "seconds": 2.0}
    assert read_metrics(metrics) == {"run": "new", "seconds": 2.0}
    assert not timing_path(Path(outputs["plot_tandem"])).exists()  # not written by this run: not kept either
    assert not list((tmp_path / "scratch" / "staging").iterdir())
