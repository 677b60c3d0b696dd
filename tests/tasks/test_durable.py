"""Resume state on the run's DVC remote (tasks/durable.py): the refusal of a folder remote on an ephemeral
worker, a push and pull of checkpoints through DVC's remote filesystem, and the acceptance run against a local
S3 server (moto, 127.0.0.1): worker A is killed (SIGKILL) mid-training; worker B, in a fresh directory, pulls,
resumes at A's last pushed step and publishes the same checkpoint bytes as an uninterrupted run."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.common import read_metrics

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from tandem.errors import UserError  # noqa: E402
from tasks import durable  # noqa: E402

DVC = [sys.executable, "-m", "dvc"]


def _dvc_project(root: Path, url: str, endpoint: str | None = None) -> None:
    root.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}
    for cmd in (["init", "--no-scm", "-q"], ["remote", "add", "-d", "store", url],
                *([["remote", "modify", "store", "endpointurl", endpoint]] if endpoint else [])):
        subprocess.run(DVC + cmd, cwd=root, check=True, capture_output=True, env=env)


def test_folder_urls():
    assert durable.is_folder_url("../dvc-remote") and durable.is_folder_url("/srv/remote")
    assert durable.is_folder_url("file:///srv/remote")
    assert not durable.is_folder_url("s3://bucket/path") and not durable.is_folder_url("gs://b/p")


def test_an_ephemeral_worker_may_not_push_to_a_folder(monkeypatch):
    monkeypatch.delenv(durable.EPHEMERAL_ENV, raising=False)
    durable.check_push_target("record", "../dvc-remote", "dvc push")  # a machine whose disk persists: fine
    monkeypatch.setenv(durable.EPHEMERAL_ENV, "1")
    durable.check_push_target("store", "s3://bucket/p", "dvc push")  # a shared store: fine
    with pytest.raises(UserError) as e:
        durable.check_push_target("record", "../dvc-remote", "dvc push")
    assert "\n" not in str(e.value) and "is a folder (../dvc-remote)" in str(e.value)
    assert f"{durable.EPHEMERAL_ENV}=1" in str(e.value)


def test_the_stage_refuses_a_folder_remote_on_an_ephemeral_worker(tmp_path, monkeypatch):
    _dvc_project(tmp_path, str(tmp_path / "remote"))
    monkeypatch.setenv(durable.RESUME_REMOTE_ENV, "default")
    monkeypatch.setenv(durable.EPHEMERAL_ENV, "1")
    with pytest.raises(UserError, match="lost with the worker"):
        durable.ResumeStore.from_env(tmp_path)
    monkeypatch.delenv(durable.EPHEMERAL_ENV)
    assert durable.ResumeStore.from_env(tmp_path).name == "store"
    monkeypatch.setenv(durable.RESUME_REMOTE_ENV, "nope")
    with pytest.raises(UserError, match="'nope' is not configured"):
        durable.ResumeStore.from_env(tmp_path)
    monkeypatch.delenv(durable.RESUME_REMOTE_ENV)
    assert durable.ResumeStore.from_env(tmp_path) is None  # unset: the resume state stays on this disk


def _checkpoint(arm_dir: Path, step: int) -> Path:
    from tandem.checkpoints import write_state

    d = arm_dir / f"step-{step}"
    (d / "sub").mkdir(parents=True)
    (d / "model.safetensors").write_bytes(bytes([step]) * 100)
    (d / "config.json").write_text("{}")
    (d / "sub" / "rng_state_0.pth").write_bytes(b"rng%d" % step)
    write_state(d, {"fingerprint": "fp", "step": step, "complete": True})
    return d


def test_push_and_pull_through_a_folder_remote(tmp_path, monkeypatch):
    from tandem.checkpoints import complete_checkpoints, resume_checkpoint

    _dvc_project(tmp_path / "a", str(tmp_path / "remote"))
    _dvc_project(tmp_path / "b", str(tmp_path / "remote"))
    monkeypatch.setenv(durable.RESUME_REMOTE_ENV, "default")
    a, b = durable.ResumeStore.from_env(tmp_path / "a"), durable.ResumeStore.from_env(tmp_path / "b")
    assert b.pull("fp", "tandem", tmp_path / "b" / "arm") is None  # nothing pushed yet
    for step in (2, 4):
        a.push_step("fp", "tandem", _checkpoint(tmp_path / "a" / "arm", step))
    assert a.latest_step("fp", "tandem") == 4 and a.latest_step("other", "tandem") is None
    assert b.pull("fp", "tandem", tmp_path / "b" / "arm") == 4
    got = complete_checkpoints(tmp_path / "b" / "arm")
    assert [s for s, _ in got] == [2, 4]
    for _, p in got:
        for f in ("model.safetensors", "config.json", "sub/rng_state_0.pth", "tandem_state.json"):
            assert (p / f).read_bytes() == (tmp_path / "a" / "arm" / p.name / f).read_bytes()
    assert resume_checkpoint(tmp_path / "b" / "arm", "fp").name == "step-4"  # checksums hold after the trip
    assert b.pull("fp", "tandem", tmp_path / "b" / "arm") == 4  # a second pull fetches nothing new


# --------------------------------------------------------------------------------------------------
# The acceptance run: SIGKILL of worker A, worker B resumes from the S3 remote
# --------------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def s3(monkeypatch):
    """A moto S3 server on 127.0.0.1 with one bucket; credentials for it in the environment."""
    moto_server = pytest.importorskip("moto.server")
    pytest.importorskip("dvc_s3")
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    import boto3

    endpoint = f"http://127.0.0.1:{port}"
    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket="tandem-resume-test")
    yield endpoint, client
    server.stop()


# trl's pickled TrainingArguments name the run's own directory (output_dir), so they differ between any two
# directories; everything else of a published checkpoint must match byte for byte
PATH_BEARING = "training_args.bin"


def _digests(ck: Path) -> dict[str, str]:
    """Every file's SHA-256 but the path-bearing one's; `tandem_state.json` without that file's checksum entry."""
    out = {str(p.relative_to(ck)): hashlib.sha256(p.read_bytes()).hexdigest()
           for p in sorted(ck.rglob("*")) if p.is_file() and p.name not in (PATH_BEARING, "tandem_state.json")}
    state = json.loads((ck / "tandem_state.json").read_text())
    state["files"].pop(PATH_BEARING)
    out["tandem_state.json"] = json.dumps(state, sort_keys=True)
    return out


@pytest.mark.slow
@pytest.mark.integration
def test_worker_b_resumes_from_the_s3_remote_after_worker_a_is_killed(s3, tmp_path):
    if str(Path(__file__).parent) not in sys.path:
        sys.path.insert(0, str(Path(__file__).parent))
    import test_train_stage as T  # its stage runs: the project, the subprocess, the step counts

    from tandem.checkpoints import complete_checkpoints

    endpoint, client = s3
    boxing = T.build_boxing_base(tmp_path / "boxing")
    clean, a, b = tmp_path / "clean", tmp_path / "worker-a", tmp_path / "worker-b"
    p_clean = T._project(clean, boxing)
    _dvc_project(a, "s3://tandem-resume-test/remote", endpoint)
    _dvc_project(b, "s3://tandem-resume-test/remote", endpoint)
    p_a, p_b = T._project(a, boxing), T._project(b, boxing)
    os.environ[durable.RESUME_REMOTE_ENV] = "default"  # the workers' environment (monkeypatch undoes nothing here)
    try:
        victim = T._start(p_a)
        os.environ.pop(durable.RESUME_REMOTE_ENV)
        ref = T._start(p_clean)  # the uninterrupted run, without a remote
        deadline, latest = time.time() + 300, None
        while latest is None:
            assert victim.poll() is None, victim.communicate()[0][-4000:]
            assert time.time() < deadline, "worker A pushed no checkpoint"
            keys = [o["Key"] for o in client.list_objects_v2(Bucket="tandem-resume-test").get("Contents", [])]
            marks = [k for k in keys if k.endswith("/tandem/latest.json")]
            if marks:
                latest = json.loads(client.get_object(Bucket="tandem-resume-test", Key=marks[0])["Body"].read())["step"]
            time.sleep(0.05)
        victim.send_signal(signal.SIGKILL)
        victim.communicate(timeout=30)
        assert victim.returncode == -signal.SIGKILL
        a_steps = [s for s, _ in complete_checkpoints(a / "scratch" / "train" / "tandem")]
        assert a_steps[-1] == latest < T.STEPS  # killed mid-run, at its last saved (and pushed) step
        assert not (b / "scratch").exists()  # worker B starts on a fresh directory
        os.environ[durable.RESUME_REMOTE_ENV] = "default"
        out = T._finish(T._start(p_b))
    finally:
        os.environ.pop(durable.RESUME_REMOTE_ENV, None)
    T._finish(ref)
    assert f"checkpoints up to step {latest} pulled from DVC remote 'store'" in out
    summary = read_metrics(b / "metrics" / "train_tandem.json")
    assert summary["resumed_from"] == f"step-{latest}" and summary["steps"] == T.STEPS
    ck_clean, ck_b = clean / "models" / "checkpoints" / "tandem", b / "models" / "checkpoints" / "tandem"
    want = [f"step-{n}" for n in range(T.SAVE_EVERY, T.STEPS + 1, T.SAVE_EVERY)]
    assert [p.name for _, p in complete_checkpoints(ck_b)] == want
    for name in want:  # the published checkpoints, byte for byte (weights, optimizer, scheduler, trainer state)
        assert {"model.safetensors", "optimizer.pt", "trainer_state.json"} <= set(_digests(ck_b / name))
        assert _digests(ck_b / name) == _digests(ck_clean / name), name
    # B pushed its own checkpoints on: the remote's latest is the run's last step
    assert durable.ResumeStore(*_store_args(b)).latest_step(summary["fingerprint"], "tandem") == T.STEPS


def _store_args(root: Path) -> tuple:
    os.environ[durable.RESUME_REMOTE_ENV] = "default"
    try:
        s = durable.ResumeStore.from_env(root)
    finally:
        os.environ.pop(durable.RESUME_REMOTE_ENV)
    return s.name, s.url, s.fs, s.root
