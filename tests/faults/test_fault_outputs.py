"""One transaction per stage's outputs: they change together or not at all, with no moment where one is missing.

A child process runs a stage and is SIGKILLed right after the first rename that publishes one of its outputs
(the hook sits on the os calls, so it fits any version of the writers). Afterwards every output set on disk
is one run's: `data/prepared/` never mixes training data of one seed with benchmarks of another, and the
next run that takes the output root's lock finishes the commit. Temporary files of killed writes are swept by
the next run and never stay inside a DVC-tracked output; the 2-process training run keeps the previous summary
until the new one is complete and leaves nothing in /tmp when it is killed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

from fault_fixtures import REPO, kill_after_moves, scratch_checkpoint, tandem, two_process_params  # noqa: E402
from train_fixtures import alive, descendants  # noqa: E402
from params_files import complete_params  # noqa: E402

from tandem.config import params_from_dict  # noqa: E402


def _child(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _hidden(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob(".*")) if d.is_dir() else []


# --------------------------------------------------------------------------------------------------
# prepare: data/prepared and metrics/data.json
# --------------------------------------------------------------------------------------------------

def _prepare_params(root: Path, seed: int) -> dict:
    return complete_params({"seed": seed, "out_root": str(root), "data": {"n_train": 40, "n_val": 4, "n_eval": 3}})


def _prepare(root: Path, seed: int) -> None:
    from tasks import prepare

    p = params_from_dict(_prepare_params(root, seed))
    prepare.run(p, *prepare.default_io(p))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> dict[int, dict[str, bytes]]:
    """The prepared files of seed 0 and of seed 1 (references), keyed by path under data/prepared."""
    out = {}
    for seed in (0, 1):
        root = tmp_path_factory.mktemp(f"seed{seed}")
        _prepare(root, seed)
        out[seed] = _tree(root / "data" / "prepared")
    assert out[0] != out[1]
    return out


def _seed_of(root: Path, refs: dict[int, dict[str, bytes]]) -> int | None:
    """The seed whose prepared files are exactly those under root (None: a mixture, or anything else)."""
    got = _tree(root / "data" / "prepared")
    return next((s for s, files in refs.items() if files == got), None)


@pytest.mark.parametrize("after", [1, 2])
def test_prepare_killed_while_publishing_leaves_one_runs_outputs(prepared, tmp_path, after):
    """Seed 0's outputs, then seed 1's run killed right after its first (or second) publishing rename."""
    root = tmp_path / "out"
    _prepare(root, 0)
    final = [root / "data" / "prepared" / n for n in ("train.jsonl", "val.jsonl", "eval")]
    final += [root / "data" / "prepared", root / "metrics" / "data.json"]
    code = kill_after_moves(final, after) + f"""
from tandem.config import params_from_dict
from tasks import prepare
p = params_from_dict({_prepare_params(root, 1)!r})
prepare.run(p, *prepare.default_io(p))
"""
    res = _child(code)
    assert res.returncode == -signal.SIGKILL, res.stderr[-3000:]
    assert _seed_of(root, prepared) in (0, 1)  # never training data of one seed beside benchmarks of the other
    assert _hidden(root / "data" / "prepared") == []

    from tandem.workspace import workspace_lock

    with workspace_lock(root):  # the next run finishes the commit before it reads anything
        pass
    assert _seed_of(root, prepared) == 1
    assert json.loads((root / "metrics" / "data.json").read_text())["seed"] == 1
    assert not list((root / "scratch" / "staging").iterdir())


def test_a_killed_write_leaves_nothing_inside_the_output_after_the_next_run(prepared, tmp_path):
    root = tmp_path / "out"
    _prepare(root, 0)
    code = kill_after_moves([], 1) + f"""
import builtins
real_open = builtins.open
def open_then_die(file, mode="r", *a, **k):
    f = real_open(file, mode, *a, **k)
    if "w" in mode and str(file).endswith("val.jsonl"):
        os.kill(os.getpid(), signal.SIGKILL)  # in the middle of writing the second output
    return f
builtins.open = open_then_die
from tandem.config import params_from_dict
from tasks import prepare
p = params_from_dict({_prepare_params(root, 1)!r})
prepare.run(p, *prepare.default_io(p))
"""
    res = _child(code)
    assert res.returncode == -signal.SIGKILL, res.stderr[-3000:]
    assert _seed_of(root, prepared) == 0  # killed before its commit: the old outputs, untouched
    _prepare(root, 1)
    assert _seed_of(root, prepared) == 1
    assert _hidden(root / "data" / "prepared") == [] and _hidden(root / "metrics") == []
    assert not list((root / "scratch" / "staging").iterdir())


# --------------------------------------------------------------------------------------------------
# Directory swaps have no missing moment
# --------------------------------------------------------------------------------------------------

def _always_there(monkeypatch, target: Path) -> list[str]:
    """Check, around every rename, replace, exchange or tree removal, that `target` exists."""
    import tandem.transactions as T

    calls = []

    def watch(name, fn):
        def wrapped(*a, **k):
            assert target.exists(), f"{target} missing before {name}{a}"
            out = fn(*a, **k)
            assert target.exists(), f"{target} missing after {name}{a}"
            calls.append(name)
            return out
        return wrapped

    for mod, name in ((os, "replace"), (os, "rename"), (shutil, "rmtree"), (T, "exchange")):
        monkeypatch.setattr(mod, name, watch(name, getattr(mod, name)))
    return calls


def test_a_directory_output_is_never_missing_while_it_is_replaced(tmp_path, monkeypatch):
    from tasks.common import atomic_path

    target = tmp_path / "eval"
    with atomic_path(target) as tmp:
        tmp.mkdir()
        (tmp / "old.jsonl").write_text("old\n")
    calls = _always_there(monkeypatch, target)
    with atomic_path(target) as tmp:
        tmp.mkdir()
        (tmp / "new.jsonl").write_text("new\n")
    monkeypatch.undo()
    assert calls and [p.name for p in target.iterdir()] == ["new.jsonl"]
    assert _hidden(tmp_path) == []


def test_a_stage_transaction_swaps_a_folder_and_a_file_in_together(tmp_path, monkeypatch):
    from tasks.common import stage_outputs

    params = params_from_dict({"out_root": str(tmp_path)})
    folder, file = tmp_path / "data" / "prepared", tmp_path / "metrics" / "data.json"
    folder.mkdir(parents=True)
    (folder / "train.jsonl").write_text("old\n")
    file.parent.mkdir()
    file.write_text('{"old": true}\n')
    calls = _always_there(monkeypatch, folder)
    with stage_outputs(params, "prepare", {"prepared": folder, "metrics": file}) as staged:
        staged["prepared"].mkdir()
        (staged["prepared"] / "train.jsonl").write_text("new\n")
        staged["metrics"].write_text('{"new": true}\n')
    monkeypatch.undo()
    assert calls and (folder / "train.jsonl").read_text() == "new\n" and file.read_text() == '{"new": true}\n'
    with pytest.raises(RuntimeError, match="failed midway"):  # an exception: nothing changes
        with stage_outputs(params, "prepare", {"prepared": folder, "metrics": file}) as staged:
            staged["prepared"].mkdir()
            staged["metrics"].write_text('{"newer": true}\n')
            raise RuntimeError("failed midway")
    assert (folder / "train.jsonl").read_text() == "new\n" and file.read_text() == '{"new": true}\n'
    assert not list((tmp_path / "scratch" / "staging").iterdir())


# --------------------------------------------------------------------------------------------------
# train: models/checkpoints/<arm>, its summary and table
# --------------------------------------------------------------------------------------------------

FAKE_TRAINING = """
import tandem.train as TT
from tandem.train.trainer import ArmResult

def train_arm(run):  # the checkpoints are already in scratch: only publication runs
    return ArmResult(run.arm, {{"arm": run.arm, "steps": 2, "run": {run!r}}}, [], ["step-2"])

TT.train_arm = train_arm
"""


def _train_root(tmp_path: Path) -> tuple[Path, dict]:
    from train_fixtures import build_base, write_prepared

    root = tmp_path / "out"
    build_base(root / "models" / "base", hidden=32)
    write_prepared(root / "data" / "prepared", n_train=4, n_val=2)
    raw = complete_params({"out_root": str(root), "train": {"arms": ["tandem"], "report_to": "none"}})
    return root, raw


def test_train_killed_inside_the_publishing_swap_leaves_no_staging_in_the_output(tmp_path):
    root, raw = _train_root(tmp_path)
    scratch_checkpoint(root / "scratch" / "train" / "tandem", 2, weights=b"run two")
    published = root / "models" / "checkpoints" / "tandem"
    scratch_checkpoint(published, 1, weights=b"an earlier run")
    metrics = root / "metrics" / "train_tandem.json"
    metrics.parent.mkdir(parents=True)
    metrics.write_text('{"run": "earlier"}\n')
    code = kill_after_moves([published, metrics], 1) + FAKE_TRAINING.format(run="new") + f"""
from tandem.config import params_from_dict
from tasks import train
p = params_from_dict({raw!r})
inputs, outputs = train.default_io(p)
train.run_arm(p, "tandem", inputs, outputs)
"""
    res = _child(code)
    assert res.returncode == -signal.SIGKILL, res.stderr[-3000:]
    ck = root / "models" / "checkpoints"
    assert _hidden(ck) == [] and published.is_dir()  # never missing, no staging copy inside the output

    from tandem.workspace import workspace_lock

    with workspace_lock(root, scope="train-tandem"):  # the next run of this arm finishes the commit
        pass
    assert sorted(p.name for p in published.iterdir()) == ["step-2"]
    assert json.loads(metrics.read_text())["run"] == "new"
    assert not list((root / "scratch" / "staging").iterdir())


def _fake_launcher(body: str) -> str:
    return ("import json, pathlib, sys\n"
            "spec = json.loads(pathlib.Path(sys.argv[1]).read_text())\n" + body)


def test_the_two_process_stage_keeps_the_old_summary_until_the_new_one_is_complete(tmp_path, monkeypatch):
    import tasks.launch as launcher
    import tasks.train as stage

    params = params_from_dict({"out_root": str(tmp_path), "train": {"arms": ["tandem"], "num_processes": 2,
                                                                    "report_to": "none"}})
    inputs, outputs = stage.default_io(params)
    metrics = Path(outputs["metrics_tandem"])
    metrics.parent.mkdir(parents=True)
    metrics.write_text('{"run": "earlier"}\n')
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    seen = {}

    def launch(p, spec):
        seen["old summary during the run"] = metrics.read_text()
        return [sys.executable, "-c", _fake_launcher("sys.exit(3)"), str(spec)]

    monkeypatch.setattr(launcher, "launch_command", launch)
    with pytest.raises(RuntimeError, match="exit status 3"):
        stage.run_arm(params, "tandem", inputs, outputs)
    assert seen["old summary during the run"] == '{"run": "earlier"}\n'
    assert metrics.read_text() == '{"run": "earlier"}\n'  # a failed run leaves it as it was

    done = _fake_launcher("out = {k: pathlib.Path(v) for k, v in spec['publish_to'].items()}\n"
                          "out['checkpoints'].mkdir()\n"
                          "out['metrics'].write_text(json.dumps({'run': 'new'}))\n"
                          "out['headline'].write_text(json.dumps({'steps': 1}))\n"
                          "out['plot'].write_text('step\\n')\n")
    monkeypatch.setattr(launcher, "launch_command", lambda p, spec: [sys.executable, "-c", done, str(spec)])
    assert stage.run_arm(params, "tandem", inputs, outputs) == {"run": "new"}
    assert json.loads(metrics.read_text()) == {"run": "new"} and Path(outputs["plot_tandem"]).exists()
    assert not list((tmp_path / "scratch" / "staging").iterdir())


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="workers follow the launcher through prctl")
def test_a_killed_two_process_stage_leaves_nothing_behind(tmp_path):
    """SIGKILL of the stage mid-run: no process survives, nothing is left in /tmp, the previous summary stays;
    the rerun sweeps the staging directory and completes."""
    from train_fixtures import build_base, write_prepared

    root = tmp_path / "out"
    build_base(root / "models" / "base", hidden=32)
    write_prepared(root / "data" / "prepared", n_train=16, n_val=4)
    params = two_process_params(root)
    metrics = root / "metrics" / "train_tandem.json"
    metrics.parent.mkdir(parents=True)
    metrics.write_text('{"run": "earlier"}\n')
    tmp_before = set(Path("/tmp").glob("tandem-train-*"))
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    stage = subprocess.Popen([sys.executable, "-m", "cli", "stage", "train", "-p", str(params)], cwd=REPO, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline, tree = time.time() + 400, []
    while not (root / "scratch" / "train" / "tandem" / "step-2").exists():
        assert stage.poll() is None and time.time() < deadline, "the run ended or stalled before its first checkpoint"
        tree = descendants(stage.pid) or tree
        time.sleep(0.05)
    tree = descendants(stage.pid) or tree
    stage.kill()
    stage.wait(timeout=30)
    end = time.time() + 30
    while any(alive(p) for p in tree) and time.time() < end:
        time.sleep(0.1)
    assert len(tree) >= 3 and not [p for p in tree if alive(p)], "workers outlived the killed stage"
    assert set(Path("/tmp").glob("tandem-train-*")) == tmp_before
    assert metrics.read_text() == '{"run": "earlier"}\n'
    assert not (root / "models" / "checkpoints" / "tandem").exists()
    assert list((root / "scratch" / "staging").iterdir())  # the killed run's staging, for the rerun to sweep

    res = tandem("stage", "train", "-p", str(params))
    assert res.exit_code == 0, res.output[-3000:]
    assert json.loads(metrics.read_text())["steps"] == 4
    assert not list((root / "scratch" / "staging").iterdir())
    assert sorted(p.name for p in (root / "models" / "checkpoints" / "tandem").iterdir()) == ["step-2", "step-4"]
