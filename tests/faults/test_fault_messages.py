"""One line per expected failure: each names the file or the cause and what to do, exit code 1, no traceback.

Damaged base model files (weights truncated, empty, a symlink to a device or to nothing, a directory, a
header bomb, a header that is not JSON, unreadable), a corrupt `config.json` or `tokenizer.json`, a base
without `config.json`, for the evaluate and the train stage; a full disk in prepare, evaluate and train (a
real tmpfs where the machine allows one, else a write that raises ENOSPC); a killed rank or launcher of a
2-process training run. The command line runs in this process (typer's runner) or, where the failure needs a
real process tree or file system, in a child process. `--debug` brings the traceback back.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

from fault_fixtures import REPO, F, failure_line, tandem, two_process_params  # noqa: E402
from train_fixtures import descendants  # noqa: E402
from params_files import complete_params  # noqa: E402

EVAL_KEYS = ("n_samples", "ks", "max_new_tokens", "batch_size", "progress", "score_workers", "checkpoints")


@pytest.fixture
def eval_src(fault_tree) -> Path:
    return fault_tree


@pytest.fixture(scope="module")
def base_src(tmp_path_factory) -> Path:
    from train_fixtures import build_base

    return build_base(tmp_path_factory.mktemp("msg") / "base", hidden=32)


def _eval_project(src: Path, root: Path) -> Path:
    shutil.copytree(src, root)
    p = F.small_params(root, n_samples=1, ks=[1], max_new_tokens=4, checkpoints="final")
    params = root / "params.yaml"
    params.write_text(yaml.safe_dump(complete_params({
        "out_root": str(root), "train": {"arms": list(F.ARMS)},
        "evaluate": {k: getattr(p.evaluate, k) for k in EVAL_KEYS}})))
    return params


def _train_project(base: Path, root: Path, **train) -> Path:
    from train_fixtures import write_prepared

    shutil.copytree(base, root / "models" / "base")
    write_prepared(root / "data" / "prepared", n_train=8, n_val=2)
    params = root / "params.yaml"
    params.write_text(yaml.safe_dump(complete_params({
        "out_root": str(root), "rollout": {"batch_size": 8},
        "train": {"arms": ["tandem"], "steps": 1, "save_every": 1, "prompts_per_step": 2, "group_size": 2,
                  "max_new_tokens": 4, "kl_rows": 2, "val_every": 0, "report_to": "none", "cpu_threads": 1,
                  **train}})))
    return params


@pytest.fixture(params=["evaluate", "train"])
def project(request, eval_src, base_src, tmp_path) -> tuple[str, Path, Path]:
    """(stage, params file, base model dir) of a project that the stage would run."""
    root = tmp_path / "out"
    params = _eval_project(eval_src, root) if request.param == "evaluate" else _train_project(base_src, root)
    return request.param, params, root / "models" / "base"


# --------------------------------------------------------------------------------------------------
# Damaged model files
# --------------------------------------------------------------------------------------------------

def _damage_weights(f: Path, how: str) -> None:
    if how == "truncated":
        f.write_bytes(f.read_bytes()[:-100])
    elif how == "zero bytes":
        f.write_bytes(b"")
    elif how == "symlink to /dev/zero":
        f.unlink()
        f.symlink_to("/dev/zero")
    elif how == "dangling symlink":
        f.unlink()
        f.symlink_to(f.parent / "elsewhere.safetensors")
    elif how == "a directory":
        f.unlink()
        f.mkdir()
    elif how == "header bomb":
        f.write_bytes(struct.pack("<Q", 2 ** 62) + b"{}" + b"\0" * 64)
    elif how == "header not JSON":
        f.write_bytes(struct.pack("<Q", 12) + b"not a header" + b"\0" * 64)
    elif how == "unreadable":
        f.chmod(0)
    else:
        raise ValueError(how)


WEIGHT_DAMAGE = ["truncated", "zero bytes", "symlink to /dev/zero", "dangling symlink", "a directory",
                 "header bomb", "header not JSON", "unreadable"]


@pytest.mark.parametrize("how", WEIGHT_DAMAGE)
def test_damaged_base_weights_are_one_line_naming_the_file(project, how):
    stage, params, base = project
    if how == "unreadable" and os.geteuid() == 0:
        pytest.skip("root reads a file without read permission")
    weights = base / "model.safetensors"
    _damage_weights(weights, how)
    line = failure_line(tandem("stage", stage, "-p", str(params)), f"stage {stage}")
    assert f"{weights}:" in line and ("rerun the stage" in line or "Restore the file" in line), line


def test_unreadable_weights_as_any_user_are_one_line(eval_src, tmp_path, monkeypatch):
    """Reading fails with EACCES (what a file without read permission does for any user but root)."""
    import builtins

    params = _eval_project(eval_src, tmp_path / "out")
    weights = tmp_path / "out" / "models" / "base" / "model.safetensors"
    real_open = builtins.open

    def refuse(file, *a, **k):
        if Path(str(file)) == weights:
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real_open(file, *a, **k)

    monkeypatch.setattr(builtins, "open", refuse)
    line = failure_line(tandem("stage", "evaluate", "-p", str(params)), "stage evaluate")
    assert f"{weights}: cannot be read (permission denied)" in line


def test_debug_brings_the_traceback_back(eval_src, tmp_path, monkeypatch):
    from tandem.errors import ModelFileError

    monkeypatch.setenv("TANDEM_DEBUG", "")  # --debug sets it for the process; restored afterwards
    params = _eval_project(eval_src, tmp_path / "out")
    _damage_weights(tmp_path / "out" / "models" / "base" / "model.safetensors", "truncated")
    res = tandem("--debug", "stage", "evaluate", "-p", str(params))
    assert isinstance(res.exception, ModelFileError)  # raised, so the traceback shows


@pytest.mark.parametrize("name,content", [
    ("config.json", b'{"model_type": "qwen3", "hidden_size": 3'),  # cut short
    ("config.json", b"\x00\xff garbage"),
    ("config.json", b"[]"),
    ("config.json", b""),
    ("tokenizer.json", b'{"version": "1.0", "model": {"type": "BPE", "vocab": {'),
    ("tokenizer.json", b"\xff\xfe not json"),
])
def test_a_corrupt_base_config_or_tokenizer_is_one_line_naming_it(project, name, content):
    stage, params, base = project
    (base / name).write_bytes(content)
    line = failure_line(tandem("stage", stage, "-p", str(params)), f"stage {stage}")
    assert f"{base / name}:" in line


def test_a_tokenizer_json_the_tokenizers_library_refuses_is_one_line(base_src, tmp_path):
    """Valid JSON, but not a tokenizer: the library's own error, named with the directory."""
    params = _train_project(base_src, tmp_path / "out")
    base = tmp_path / "out" / "models" / "base"
    (base / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "NoSuchModel"}}')
    line = failure_line(tandem("stage", "train", "-p", str(params)), "stage train")
    assert f"{base}: the tokenizer cannot be loaded" in line


def test_a_base_without_config_json_is_one_line(project):
    stage, params, base = project
    (base / "config.json").unlink()
    line = failure_line(tandem("stage", stage, "-p", str(params)), f"stage {stage}")
    assert f"{base} is not a usable Hugging Face model directory: missing config.json" in line


# --------------------------------------------------------------------------------------------------
# A full disk
# --------------------------------------------------------------------------------------------------

def _can_mount_tmpfs() -> bool:
    if not shutil.which("unshare"):
        return False
    res = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                         capture_output=True, timeout=30)
    return res.returncode == 0


TMPFS = pytest.mark.skipif(not sys.platform.startswith("linux") or not _can_mount_tmpfs(),
                           reason="needs a private tmpfs (unshare -rm)")


def _on_full_tmpfs(tmp: Path, stage: str, setup: str, keep_free_kb: int, size_mb: int = 8) -> subprocess.CompletedProcess:
    """`tandem stage STAGE` in a private mount namespace, out_root on a tmpfs left with `keep_free_kb` free."""
    script = tmp / "run.sh"
    script.write_text(f"""set -e
D={tmp}/fs
mkdir -p $D
mount -t tmpfs -o size={size_mb}m tmpfs $D
{setup}
free=$(df -k --output=avail $D | tail -1)
dd if=/dev/zero of=$D/ballast bs=1k count=$((free - {keep_free_kb})) 2>/dev/null
cd {REPO}
exec {sys.executable} -m cli stage {stage} -p $D/params.yaml
""")
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "TANDEM_DEBUG": ""}
    return subprocess.run(["unshare", "-rm", "bash", str(script)], env=env, capture_output=True, text=True,
                          timeout=600)


def _one_disk_full_line(res: subprocess.CompletedProcess, stage: str) -> str:
    assert res.returncode == 1, (res.stdout + res.stderr)[-3000:]
    assert "Traceback" not in res.stderr + res.stdout, res.stderr[-3000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith(f"stage {stage} failed:")]
    assert len(lines) == 1 and "No space left on device while writing " in lines[0], res.stderr[-3000:]
    return lines[0]


@TMPFS
def test_disk_full_in_prepare_is_one_line_naming_the_path(tmp_path):
    raw = complete_params({"out_root": str(tmp_path / "fs"), "data": {"n_train": 200, "n_val": 4, "n_eval": 3}})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))  # ~70 KB of training rows
    res = _on_full_tmpfs(tmp_path, "prepare", f"cp {tmp_path}/params.yaml $D/params.yaml", keep_free_kb=16, size_mb=1)
    line = _one_disk_full_line(res, "prepare")
    assert str(tmp_path / "fs") in line


@pytest.mark.slow
@TMPFS
def test_disk_full_in_train_is_one_line_naming_the_path(base_src, tmp_path):
    """The first checkpoint does not fit: torch's writer fails with "basic_ios::clear: iostream error" or
    safetensors with "os error 28", and the message says what it is and where."""
    params = _train_project(base_src, tmp_path / "src")
    setup = (f"cp -a {tmp_path}/src/models {tmp_path}/src/data $D/\n"
             f"sed 's#{tmp_path}/src#'$D'#' {params} > $D/params.yaml")
    for free_kb in (100, 400):  # the weights do not fit / the weights fit but the optimizer state does not
        res = _on_full_tmpfs(tmp_path, "train", setup, keep_free_kb=free_kb)
        line = _one_disk_full_line(res, "train")
        assert "/fs/scratch/train/tandem/checkpoint-1" in line, line


def test_disk_full_in_evaluate_is_one_line_naming_the_path(eval_src, tmp_path, monkeypatch):
    """A write into the evaluation cache raises ENOSPC (no file name attached, as a write() error has none)."""
    import tasks.common as common

    params = _eval_project(eval_src, tmp_path / "out")
    real_open = open

    def full(file, mode="r", *a, **k):
        f = real_open(file, mode, *a, **k)
        if "w" in mode and "scratch/evaluate" in str(file):
            f.close()
            raise OSError(errno.ENOSPC, "No space left on device")
        return f

    monkeypatch.setattr(common, "open", full, raising=False)
    line = failure_line(tandem("stage", "evaluate", "-p", str(params)), "stage evaluate")
    assert "No space left on device while writing " + str(tmp_path / "out" / "scratch" / "evaluate") in line


# --------------------------------------------------------------------------------------------------
# A killed worker of a 2-process run
# --------------------------------------------------------------------------------------------------

def _rank_of(pid: int) -> str | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    if b"--launch" in cmd:
        return "launcher"
    if b"--worker" in cmd:
        return next((e[5:].decode() for e in env if e.startswith(b"RANK=")), None)
    return None


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("victim", ["1", "launcher"])
def test_a_killed_rank_or_launcher_is_one_line(base_src, tmp_path, victim):
    from train_fixtures import write_prepared

    root = tmp_path / "out"
    shutil.copytree(base_src, root / "models" / "base")
    write_prepared(root / "data" / "prepared", n_train=16, n_val=4)
    params = two_process_params(root)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "TANDEM_DEBUG": ""}
    stage = subprocess.Popen([sys.executable, "-m", "cli", "stage", "train", "-p", str(params)], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 400
    while not (root / "scratch" / "train" / "tandem" / "step-2").exists():
        assert stage.poll() is None and time.time() < deadline, "the run ended or stalled before its first checkpoint"
        time.sleep(0.05)
    target = next(p for p in descendants(stage.pid) if _rank_of(p) == victim)
    os.kill(target, signal.SIGKILL)
    out, err = stage.communicate(timeout=120)
    assert stage.returncode == 1, err[-3000:]
    assert "Traceback" not in out + err, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("stage train failed:")]
    assert len(lines) == 1, err[-3000:]
    (line,) = lines
    who = "rank 1" if victim == "1" else "the launcher (accelerate launch"
    assert f"{who}" in line and f"pid {target}" in line and "killed by SIGKILL" in line, line
    assert "rerun the stage: training resumes from the last complete checkpoint" in line
