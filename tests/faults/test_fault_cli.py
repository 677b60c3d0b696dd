"""The command line on expected failures: one clear message, no traceback, exit code 1 (params errors: 2).

Each case runs `python -m cli` in a fresh interpreter, as a user would. `--debug` and `TANDEM_DEBUG=1` bring
the traceback back; a real bug keeps its traceback without them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from params_files import complete_params

REPO = Path(__file__).resolve().parents[2]
GOOD_EVAL = [{"id": f"e{i}", "problem": f"Benchmark question {i}: what is {i} times two?", "answer": str(2 * i)}
             for i in range(3)]


def _tandem(*args: str, env: dict[str, str | None] | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "TANDEM_DEBUG": "", **(env or {})}
    full_env = {k: v for k, v in full_env.items() if v is not None}  # None: unset
    return subprocess.run([sys.executable, "-m", "cli", *args], cwd=cwd, env=full_env, capture_output=True,
                          text=True, timeout=300)


def _project(tmp: Path, train_bytes: bytes, **data) -> Path:
    (tmp / "train.jsonl").write_bytes(train_bytes)
    (tmp / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GOOD_EVAL))
    params = complete_params({"seed": 0, "out_root": str(tmp / "out"),
                              "data": {"source": "jsonl", "train_file": str(tmp / "train.jsonl"),
                                       "eval_files": {"toy": str(tmp / "eval.jsonl")}, "n_val": 1, "n_eval": 0,
                                       **data}})
    path = tmp / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


def _no_traceback(res: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in res.stderr + res.stdout, res.stderr[-3000:]


@pytest.fixture(scope="module")
def not_jsonl(tmp_path_factory) -> Path:
    return _project(tmp_path_factory.mktemp("notjsonl"), b"id,problem,answer\na,What is one plus one?,2\n")


def test_a_file_that_is_not_json_lines_is_one_message_and_exit_1(not_jsonl):
    res = _tandem("stage", "prepare", "-p", str(not_jsonl))
    assert res.returncode == 1, res.stderr[-3000:]
    _no_traceback(res)
    assert "train.jsonl:1" in res.stderr and "[rule: json_lines]" in res.stderr
    assert len(res.stderr.strip().splitlines()) <= 6
    assert not (not_jsonl.parent / "out" / "data").exists()


@pytest.mark.parametrize("how", ["flag", "env"])
def test_debug_shows_the_traceback(not_jsonl, how):
    args = ("--debug", "stage", "prepare", "-p", str(not_jsonl)) if how == "flag" else \
        ("stage", "prepare", "-p", str(not_jsonl))
    res = _tandem(*args, env={"TANDEM_DEBUG": "1"} if how == "env" else None)
    assert res.returncode == 1
    assert "Traceback" in res.stderr and "DataFileError" in res.stderr


def test_failed_validation_prints_the_report_and_one_line(tmp_path):
    rows = [{"id": f"r{i}", "problem": f"What is {i} plus seven, twice?", "answer": "7"} for i in range(4)]
    rows.append({"id": "bad", "problem": "An answer that is empty.", "answer": ""})
    params = _project(tmp_path, "".join(json.dumps(r) + "\n" for r in rows).encode())
    res = _tandem("stage", "prepare", "-p", str(params))
    assert res.returncode == 1
    _no_traceback(res)
    assert "data validation FAILED" in res.stderr and "answer_not_empty" in res.stderr and "bad" in res.stderr
    assert "nothing was written" in res.stderr


def test_a_missing_input_is_one_message_and_exit_1(tmp_path):
    """evaluate before prepare/base: the missing model or data is named, no traceback."""
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(complete_params({"out_root": str(tmp_path / "out")})))
    res = _tandem("stage", "evaluate", "-p", str(tmp_path / "params.yaml"))
    assert res.returncode == 1, res.stderr[-3000:]
    _no_traceback(res)
    assert "stage evaluate failed" in res.stderr and ("prepare" in res.stderr or "base" in res.stderr)


def test_params_errors_keep_exit_code_2(tmp_path):
    (tmp_path / "params.yaml").write_text("data:\n  n_val: -1\n")
    res = _tandem("stage", "prepare", "-p", str(tmp_path / "params.yaml"))
    assert res.returncode == 2 and "data.n_val" in res.stderr
    _no_traceback(res)


def test_a_busy_output_root_is_refused_with_the_holder_named(not_jsonl):
    from tandem.workspace import workspace_lock

    with workspace_lock(not_jsonl.parent / "out", command="test holder"):
        res = _tandem("stage", "prepare", "-p", str(not_jsonl))
    assert res.returncode == 1
    _no_traceback(res)
    assert "in use by pid" in res.stderr and str(os.getpid()) in res.stderr and "test holder" in res.stderr


def test_a_real_bug_keeps_its_traceback(tmp_path):
    """An unexpected exception inside a stage is not dressed up as a user error."""
    code = ("import sys, cli.main as m\n"
            "def boom(*a, **k): raise ZeroDivisionError('a bug')\n"
            "m.run_stage = boom\n"
            f"sys.argv = ['tandem', 'stage', 'prepare', '-p', {str(tmp_path / 'params.yaml')!r}]\n"
            "m.app()\n")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(complete_params({"out_root": str(tmp_path / "out")})))
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(REPO), "TANDEM_DEBUG": ""})
    assert res.returncode != 0 and res.returncode != 2
    assert "ZeroDivisionError" in res.stderr


@pytest.mark.slow
@pytest.mark.integration
def test_tandem_run_through_the_prefect_flow_ends_in_one_message(not_jsonl, tmp_path):
    """The flow path: Prefect logs the failed task, but no traceback reaches the terminal; exit code 1."""
    res = _tandem("run", "-p", str(not_jsonl), env={"PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": None})
    assert res.returncode == 1, (res.stdout + res.stderr)[-3000:]
    _no_traceback(res)
    assert "pipeline failed: data input refused" in res.stderr and "[rule: json_lines]" in res.stderr


def test_a_prefect_server_that_does_not_start_is_one_message(not_jsonl, tmp_path):
    """Prefect's temporary API server timing out (a busy machine) ends `tandem run` in one line saying what to do,
    exit code 1; another RuntimeError from the flow keeps its traceback."""
    def run(error: str) -> subprocess.CompletedProcess:
        code = ("import sys, flows.pipeline as fp, cli.main as m\n"
                f"def boom(**k): raise RuntimeError({error!r})\n"
                "fp.tandem_pipeline = boom\n"
                f"sys.argv = ['tandem', 'run', '-p', {str(not_jsonl)!r}]\n"
                "m.app()\n")
        return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(REPO), "TANDEM_DEBUG": "",
                                   "PREFECT_HOME": str(tmp_path / "prefect")})

    res = run("Timed out while attempting to connect to ephemeral Prefect API server. Ephemeral server process "
              "exited with code 1.")
    assert res.returncode == 1, (res.stdout + res.stderr)[-3000:]
    _no_traceback(res)
    line = [ln for ln in res.stderr.splitlines() if "pipeline failed" in ln]
    assert len(line) == 1 and "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS" in line[0] and "--direct" in line[0]
    other = run("something else broke")
    assert other.returncode != 0 and "Traceback" in other.stderr and "something else broke" in other.stderr
