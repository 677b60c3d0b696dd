"""A multi-process training run fails like one process: one line, no tracebacks, nothing left in /tmp.

A 2-process run on a full disk printed ~300 lines and a dozen tracebacks: each rank's record of its failure was
written (through a temporary file) to the disk that was full, so it was lost, and both the ranks and the
launcher printed the tracebacks of their failed writes; the stage then reported a bug. And every launch left
an empty `/tmp/torchelastic_*` tree (torch elastic's log directory). Now the record files are reserved before
any process starts and written over in place (no new space needed), a rank's traceback goes to its log file,
the stage raises the error the rank raised (a full disk: the same `DiskFullError` line as in one process), and
torch elastic's log directory lies inside the transaction's directory, removed with it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

from fault_fixtures import REPO  # noqa: E402
from params_files import complete_params  # noqa: E402

LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux (prctl, /proc, tmpfs)")


# --------------------------------------------------------------------------------------------------
# The one line from the records
# --------------------------------------------------------------------------------------------------

def _summary(records=None, launcher=None, rc=1, scratch=Path("/nonexistent/scratch/train/tandem"), logs=None):
    from tasks.launch import summarise_failure

    return summarise_failure(2, "tandem", rc, 4242, records or {}, launcher, scratch, logs)


def test_a_ranks_full_disk_is_the_same_error_as_in_one_process():
    from tandem.errors import DiskFullError

    one_process = DiskFullError("/out/scratch/train/tandem/checkpoint-1", 0)
    rec = {"rank": 1, "kind": "expected", "type": "DiskFullError", "message": str(one_process),
           "path": one_process.path, "free": 0}
    peer = {"rank": 0, "kind": "peer_lost", "type": "DistBackendError", "message": "Connection closed by peer"}
    err = _summary({0: peer, 1: rec}, {"root_rank": 1, "failures": {"1": {"exitcode": 1, "pid": 7}}})
    assert isinstance(err, DiskFullError) and str(err) == str(one_process) and "\n" not in str(err)


def test_a_ranks_expected_error_is_its_own_message_and_the_lowest_rank_wins():
    from tandem.errors import UserError

    recs = {r: {"rank": r, "kind": "expected", "type": "NonFiniteLossError", "message": f"loss is NaN (rank {r})"}
            for r in (1, 0)}
    err = _summary(recs)
    assert isinstance(err, UserError) and str(err) == "loss is NaN (rank 0)"


def test_a_killed_rank_a_bug_and_nothing_recorded_are_one_line_each(tmp_path, monkeypatch):
    import tasks.launch as launch
    from tandem.errors import DiskFullError, UserError

    killed = {"root_rank": 1, "failures": {"1": {"exitcode": -signal.SIGKILL, "pid": 99},
                                           "0": {"exitcode": -signal.SIGTERM, "pid": 98}}}
    err = _summary(launcher=killed)
    assert isinstance(err, UserError) and "rank 1 (pid 99)" in str(err) and "SIGKILL" in str(err)
    bug = {1: {"rank": 1, "kind": "bug", "type": "KeyError", "message": "'x'"}}
    err = _summary(bug, {"root_rank": 1, "failures": {"1": {"exitcode": 1, "pid": 99}}}, logs=tmp_path / "logs")
    assert type(err) is RuntimeError and f"its traceback: {tmp_path / 'logs' / 'rank-1.log'}" in str(err)
    err = _summary(scratch=tmp_path)  # nothing recorded, but the disk has room: no claim of a full disk
    assert type(err) is RuntimeError and "exit status 1" in str(err)
    monkeypatch.setattr(launch, "free_bytes", lambda p: 1024)  # no space left where the run writes
    peer = {0: {"rank": 0, "kind": "peer_lost", "type": "DistBackendError", "message": "Connection closed by peer"}}
    for recs in ({}, peer):  # nothing recorded, or only that a peer was lost
        err = _summary(recs, scratch=tmp_path)
        assert isinstance(err, DiskFullError) and str(tmp_path) in str(err) and "\n" not in str(err)
    assert "\n" not in str(_summary(launcher=killed))


def test_records_are_reserved_and_written_in_place(tmp_path):
    from tasks.launch import RECORD_BYTES, read_records, reserve_records, write_record

    reserve_records(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["launcher.json", "rank-0.json", "rank-1.json"]
    assert read_records(tmp_path) == ({}, None)  # blank reservations are no records
    ino = (tmp_path / "rank-1.json").stat().st_ino
    assert write_record(tmp_path / "rank-1.json", {"rank": 1, "kind": "bug", "message": "x" * (3 * RECORD_BYTES)})
    assert (tmp_path / "rank-1.json").stat().st_ino == ino and (tmp_path / "rank-1.json").stat().st_size == RECORD_BYTES
    records, launcher = read_records(tmp_path)
    assert list(records) == [1] and records[1]["message"].endswith("...") and launcher is None
    assert not write_record(tmp_path / "missing-dir" / "rank-0.json", {"rank": 0})  # never raises


def _can_mount_tmpfs() -> bool:
    if not shutil.which("unshare"):
        return False
    res = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                         capture_output=True, timeout=30)
    return res.returncode == 0


TMPFS = pytest.mark.skipif(not sys.platform.startswith("linux") or not _can_mount_tmpfs(),
                           reason="needs a private tmpfs (unshare -rm)")

_FULL_RECORD = """
import json, subprocess, sys
from pathlib import Path
from tasks.launch import read_records, reserve_records, write_record
d = Path(sys.argv[1])
reserve_records(d, 2)
fill = subprocess.run(["dd", "if=/dev/zero", f"of={d}/ballast", "bs=4k"], capture_output=True)
try:
    Path(d / "other.json").write_text("{}")
    full = False
except OSError:
    full = True
ok = write_record(d / "rank-1.json", {"rank": 1, "kind": "expected", "type": "DiskFullError", "message": "m"})
print(json.dumps({"full": full, "written": ok, "records": {str(k): v for k, v in read_records(d)[0].items()}}))
"""


@TMPFS
def test_a_record_is_written_on_a_disk_with_no_space_left(tmp_path):
    d = tmp_path / "fs"
    d.mkdir()
    script = f"mount -t tmpfs -o size=1m tmpfs {d} && exec {sys.executable} -c '{_FULL_RECORD}' {d}"
    res = subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["full"] and out["written"] and out["records"]["1"]["type"] == "DiskFullError", res.stderr[-2000:]


_WORKER = """
import os, sys
from pathlib import Path
from tasks import launch
from tandem.errors import DiskFullError

def train(params, arm, inputs, outputs, publish_to):
    if sys.argv[2] == "full":
        raise DiskFullError(Path(outputs["scratch"]) / arm / "checkpoint-1", 0)
    return {}["no such key"]

sys.exit(launch.worker_main(Path(sys.argv[1]), train))
"""


@LINUX
@pytest.mark.parametrize("how", ["full", "bug"])
def test_a_failing_rank_prints_nothing_and_records_its_failure(tmp_path, how):
    from tandem.config import params_from_dict
    from tasks.launch import read_records, reserve_records

    errors, logs = tmp_path / "errors", tmp_path / "logs"
    errors.mkdir()
    reserve_records(errors, 2)
    spec = tmp_path / "worker.json"
    spec.write_text(json.dumps({"params": params_from_dict({"out_root": str(tmp_path)}).to_dict(), "arm": "tandem",
                                "inputs": {}, "outputs": {"scratch": str(tmp_path / "scratch" / "train")}}))
    env = {**os.environ, "PYTHONPATH": str(REPO), "RANK": "1", "TANDEM_DEBUG": "",
           "TANDEM_TRAIN_ERRORS": str(errors), "TANDEM_TRAIN_LOGS": str(logs)}
    res = subprocess.run([sys.executable, "-c", _WORKER, str(spec), how], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 1 and res.stderr == "" and res.stdout == "", res.stderr[-3000:]
    rec = read_records(errors)[0][1]
    assert rec["kind"] == ("expected" if how == "full" else "bug")
    if how == "full":
        assert rec["type"] == "DiskFullError" and rec["path"].endswith("scratch/train/tandem/checkpoint-1")
    log = (logs / "rank-1.log").read_text()
    assert "Traceback (most recent call last)" in log and ("DiskFullError" in log or "KeyError" in log)


def test_torch_elastic_logs_go_inside_the_transaction_directory(tmp_path):
    from tandem.config import params_from_dict
    from tasks.launch import ELASTIC_LOGS, launch_command

    cmd = launch_command(params_from_dict({"train": {"num_processes": 2}}), tmp_path / "worker.json")
    assert cmd[cmd.index("--log_dir") + 1] == str(tmp_path / ELASTIC_LOGS)
    assert cmd.index("--log_dir") < cmd.index("--worker")  # accelerate's option, not the worker's


# --------------------------------------------------------------------------------------------------
# Real 2-process runs
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    """A tiny base, prepared data and the params of a 1-step, 2-process run of the tandem arm."""
    from train_fixtures import build_base, write_prepared

    root = tmp_path_factory.mktemp("two-process") / "src"
    build_base(root / "models" / "base", hidden=32)
    write_prepared(root / "data" / "prepared", n_train=8, n_val=2)
    (root / "params.yaml").write_text(yaml.safe_dump(complete_params({
        "out_root": str(root), "rollout": {"batch_size": 8},
        "train": {"arms": ["tandem"], "steps": 1, "save_every": 1, "prompts_per_step": 2, "group_size": 2,
                  "max_new_tokens": 4, "kl_rows": 2, "val_every": 0, "report_to": "none", "cpu_threads": 1,
                  "num_processes": 2}})))
    return root


def _env(tmp: Path) -> dict:
    """The stage's environment with a private TMPDIR: whatever a launch leaves in the temp directory is there."""
    tmp.mkdir(exist_ok=True)
    return {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled",
            "TANDEM_DEBUG": "", "TMPDIR": str(tmp)}


@pytest.mark.slow
@LINUX
def test_a_two_process_run_leaves_no_torchelastic_tree_in_tmp(src, tmp_path):
    root = tmp_path / "out"
    shutil.copytree(src, root)
    params = root / "params.yaml"
    params.write_text(params.read_text().replace(str(src), str(root)))
    res = subprocess.run([sys.executable, "-m", "cli", "stage", "train", "-p", str(params)], cwd=REPO,
                         env=_env(tmp_path / "tmp"), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads((root / "metrics" / "train_tandem.json").read_text())["world_size"] == 2
    assert not list((tmp_path / "tmp").glob("torchelastic_*")), "torch elastic's log directory left in TMPDIR"
    assert not list((root / "scratch" / "staging").iterdir()) and not (root / "scratch" / "logs").exists()


@pytest.mark.slow
@TMPFS
def test_disk_full_in_a_two_process_run_is_the_one_line_of_one_process(src, tmp_path):
    """The first checkpoint does not fit: every rank fails, the stage prints the line one process prints."""
    script = tmp_path / "run.sh"
    script.write_text(f"""set -e
D={tmp_path}/fs
mkdir -p $D
mount -t tmpfs -o size=8m tmpfs $D
cp -a {src}/models {src}/data $D/
sed 's#{src}#'$D'#' {src}/params.yaml > $D/params.yaml
free=$(df -k --output=avail $D | tail -1)
dd if=/dev/zero of=$D/ballast bs=1k count=$((free - 30)) 2>/dev/null
cd {REPO}
exec {sys.executable} -m cli stage train -p $D/params.yaml
""")
    res = subprocess.run(["unshare", "-rm", "bash", str(script)], env=_env(tmp_path / "tmp"), capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 1, (res.stdout + res.stderr)[-3000:]
    assert "Traceback" not in res.stdout + res.stderr and "[rank" not in res.stderr, res.stderr[-3000:]
    lines = [ln for ln in res.stderr.splitlines() if "failed" in ln or "Error" in ln or "error" in ln]
    assert len(lines) == 1 and lines[0].startswith("stage train failed: No space left on device while writing "), \
        res.stderr[-3000:]
    assert "/fs/scratch/train/tandem/checkpoint-1" in lines[0], lines[0]
    assert not list((tmp_path / "tmp").glob("torchelastic_*"))
