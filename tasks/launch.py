"""The multi-process training launcher: `accelerate launch` of the training workers, tied to the stage's life.

`launch_arm` (called by `tasks/train.py` when `train.num_processes` > 1) writes the run's spec into the stage's
transaction directory, starts `python -m tasks.train --launch ...` (`launcher_main`: accelerate's launcher
with the first failure recorded) on `python -m tasks.train --worker SPEC` (`worker_main`: one rank, which
trains through the function the stage passes in) and waits; `worker_failure` turns what the workers and
the launcher recorded into one message. The launcher dies with the stage and the workers with the launcher
(Linux parent-death signal, `prctl PR_SET_PDEATHSIG`), and a worker whose stage is already gone does not
start, so a killed stage leaves no orphan training behind. A free local port is picked for the workers'
rendezvous.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable

from tandem.config import Params, params_from_dict, tool_env
from tandem.errors import WorkerFailedError
from tasks.common import atomic_path, stage_outputs, timing_path

# the module whose `main` handles `--launch` and `--worker` (the workers import the stage, not this module)
ENTRY = "tasks.train"


def _die_with_parent() -> None:
    """In a child process: receive SIGKILL when the parent dies (Linux prctl PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(params: Params, spec_path: Path) -> list[str]:
    """`accelerate launch` of the training workers: torchrun under accelerate's multi-process launcher, run
    through `python -m tasks.train --launch` (`launcher_main`), which records the first failure for the stage's message.

    On a CPU-only machine the same launcher runs the workers on the gloo backend (accelerate's `--cpu` flag
    would pick its single-process launcher); `train.sharding: fsdp` adds FSDP (version 1, full sharding).
    """
    t = params.train
    cmd = [sys.executable, "-m", ENTRY, "--launch", "--num_processes",
           str(t.num_processes), "--num_machines", "1", "--main_process_port", str(_free_port()),
           "--mixed_precision", "no", "--dynamo_backend", "no"]
    if t.sharding == "none":
        cmd += ["--multi_gpu"]  # accelerate's torchrun launcher (DDP); it picks gloo when there is no GPU
    else:
        cmd += ["--use_fsdp", "--fsdp_version", "1", "--fsdp_sharding_strategy", "FULL_SHARD",
                "--fsdp_auto_wrap_policy", "NO_WRAP", "--fsdp_use_orig_params", "true",
                "--fsdp_state_dict_type", "FULL_STATE_DICT", "--fsdp_sync_module_states", "false",
                "--fsdp_cpu_ram_efficient_loading", "false", "--fsdp_offload_params", "false"]
    return cmd + ["-m", ENTRY, "--worker", str(spec_path)]


ERROR_DIR_ENV = "TANDEM_TRAIN_ERRORS"  # where the launcher and each worker record how they failed
LAUNCHER_RECORD = "launcher.json"


def launch_arm(params: Params, arm: str, inputs: dict, outputs: dict, targets: dict[str, Path]) -> dict:
    """Train one arm in `train.num_processes` processes through `accelerate launch`; returns the summary.

    The outputs (`targets`: name -> the path it replaces) are staged by this process's transaction and
    written there by the main worker; they replace the previous ones only once every worker has exited
    cleanly."""
    import torch

    from tasks.common import read_metrics

    if params.train.sharding != "none" and not torch.cuda.is_available():
        # accelerate 1.15 turns FSDP on only for accelerator devices (a CPU run would silently train with DDP),
        # and torch's FSDP1 refuses CPU modules ("FSDP needs a non-CPU accelerator device")
        raise ValueError(f"train.sharding: {params.train.sharding} needs GPUs; on this CPU-only machine use "
                         "train.sharding: none (every process holds the whole model)")
    txn = stage_outputs(params, f"train-{arm}", targets)
    with txn as staged:
        spec = {"params": params.to_dict(), "arm": arm, "inputs": {k: str(v) for k, v in inputs.items()},
                "outputs": {k: str(v) for k, v in outputs.items()},
                "publish_to": {k: str(v) for k, v in staged.items()}}
        spec_path = txn.dir / "worker.json"
        spec_path.write_text(json.dumps(spec))
        errors = txn.dir / "errors"
        errors.mkdir()
        repo = str(Path(__file__).resolve().parents[1])  # the workers import this very checkout
        env = {**tool_env(), "OMP_NUM_THREADS": str(max(params.train.cpu_threads, 1)),
               "PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p),
               "TANDEM_STAGE_PID": str(os.getpid()), ERROR_DIR_ENV: str(errors)}
        proc = subprocess.Popen(launch_command(params, spec_path), env=env, preexec_fn=_die_with_parent)
        try:
            rc = proc.wait()
        except BaseException:  # Ctrl-C or a cancelled flow run: take the workers down too
            proc.terminate()
            proc.wait(timeout=60)
            raise
        if rc != 0:
            raise worker_failure(params, arm, rc, proc.pid, errors, Path(outputs["scratch"]) / arm)
        if not staged["metrics"].exists():
            raise RuntimeError(f"train: the workers of arm {arm!r} exited cleanly but wrote no summary "
                               f"({staged['metrics']})")
        summary = read_metrics(staged["metrics"], timing_to=timing_path(outputs[f"metrics_{arm}"]))
    return summary


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def worker_failure(params: Params, arm: str, rc: int, launcher_pid: int, errors: Path, scratch: Path) -> Exception:
    """The one error that says why a multi-process run failed: a worker's expected error (its own message), a
    rank or the launcher killed by a signal, or a bug in a worker (whose traceback is above).

    Expected errors and kills are `WorkerFailedError`s (one line, exit code 1); anything else stays a bug."""
    n = params.train.num_processes
    again = f"rerun the stage: training resumes from the last complete checkpoint in {scratch}"
    records = {}
    for f in sorted(errors.glob("rank-*.json")):
        try:
            rec = json.loads(f.read_text())
            records[int(rec["rank"])] = rec
        except (OSError, ValueError, KeyError):
            continue
    try:
        launcher = json.loads((errors / LAUNCHER_RECORD).read_text())
    except (OSError, ValueError):
        launcher = None
    if launcher is None and rc < 0:
        return WorkerFailedError(f"train: the launcher (accelerate launch, pid {launcher_pid}) of the {n}-process run "
                                 f"of arm {arm!r} was killed by {_signal_name(rc)}; its workers stopped with it. "
                                 f"Find what killed it (out of memory? see `dmesg`), then {again}")
    for rank, rec in sorted(records.items()):
        if rec.get("kind") == "expected":
            return WorkerFailedError(f"train: rank {rank} of {n}: {rec.get('message', '')}")
    failures = {int(r): f for r, f in (launcher or {}).get("failures", {}).items()}
    killed = sorted((r, f) for r, f in failures.items() if f.get("exitcode", 0) < 0)
    for rank, f in sorted(killed, key=lambda rf: rf[1]["exitcode"] == -signal.SIGTERM):
        if f["exitcode"] == -signal.SIGTERM and any(r.get("kind") == "bug" for r in records.values()):
            break  # stopped by the launcher after another rank's bug: report the bug
        cause = " (out of memory, the kernel's OOM killer, or an external kill -9)" \
            if f["exitcode"] == -signal.SIGKILL else ""
        return WorkerFailedError(f"train: rank {rank} (pid {f.get('pid')}) of the {n}-process run of arm {arm!r} was "
                                 f"killed by {_signal_name(f['exitcode'])}{cause}; the other ranks were stopped. "
                                 f"Once the cause is gone, {again}")
    for rank, rec in sorted(records.items()):
        if rec.get("kind") == "bug":
            return RuntimeError(f"train: rank {rank} of the {n}-process run of arm {arm!r} failed with "
                                f"{rec.get('type')}: {rec.get('message', '')} (its traceback is above)")
    return RuntimeError(f"train: the {n}-process run of arm {arm!r} failed (accelerate launch exit status {rc}); "
                        f"the workers' output is above")


def _debug() -> bool:
    return os.environ.get("TANDEM_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")


def launcher_main(argv: list[str]) -> int:
    """`accelerate launch ARGV` that, when a worker fails, writes the failures (rank, exit code, signal, pid) to
    the error directory and exits with 1 instead of printing torch's failure report as a traceback."""
    import logging

    level = os.environ.get("LOGLEVEL")
    if not _debug():  # torch's elastic agent logs every stopped worker; the stage's one message says it all
        os.environ["LOGLEVEL"] = "CRITICAL"
    try:
        import torch.distributed.run  # noqa: F401  (its loggers take LOGLEVEL when created)
        from accelerate.commands.launch import launch_command, launch_command_parser
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    finally:
        os.environ.pop("LOGLEVEL", None) if level is None else os.environ.update(LOGLEVEL=level)
    if not _debug():
        for name in list(logging.Logger.manager.loggerDict):
            if name.startswith("torch.distributed.elastic"):
                logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        launch_command(launch_command_parser().parse_args(argv))
    except ChildFailedError as e:
        errors = os.environ.get(ERROR_DIR_ENV)
        if errors:
            root, _ = e.get_first_failure()
            failures = {str(r): {"exitcode": f.exitcode, "pid": f.pid, "local_rank": f.local_rank}
                        for r, f in e.failures.items()}
            (Path(errors) / LAUNCHER_RECORD).write_text(json.dumps({"root_rank": root, "failures": failures}))
        if _debug():
            raise
        return 1
    return 0


def _failure_record(e: BaseException) -> dict:
    """What a worker says about its failure: expected (a UserError, a full disk, a missing file), the loss of
    another rank (a collective that broke because a peer died), or a bug."""
    from tandem.errors import as_user_error, is_expected

    if is_expected(e):
        return {"kind": "expected", "type": type(e).__name__, "message": str(as_user_error(e))}
    text = str(e)
    lost = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused")
    if any(t in text for t in lost) or type(e).__name__ in ("DistBackendError", "DistNetworkError"):
        return {"kind": "peer_lost", "type": type(e).__name__, "message": text[:500]}
    return {"kind": "bug", "type": type(e).__name__, "message": text[:2000]}


def worker_main(spec_path: Path, train: Callable[[Params, str, dict, dict, dict | None], dict]) -> int:
    """One process of `launch_arm`'s run: rebuild the params, train this rank's share of the arm with
    `train(params, arm, inputs, outputs, publish_to)`.

    A failure is recorded for the stage's message; an expected one (or the loss of another rank) prints
    nothing here unless debugging, a bug keeps its traceback."""
    _die_with_parent()
    stage = int(os.environ.get("TANDEM_STAGE_PID", "0"))
    if stage and not _alive(stage):  # the stage died before this worker armed its signal: nothing to train for
        return 1
    spec = json.loads(spec_path.read_text())
    params = params_from_dict(spec["params"])
    try:
        train(params, spec["arm"], spec["inputs"], spec["outputs"], spec.get("publish_to"))
    except Exception as e:
        record = {"rank": int(os.environ.get("RANK", "0")), **_failure_record(e)}
        errors = os.environ.get(ERROR_DIR_ENV)
        if errors:
            with atomic_path(Path(errors) / f"rank-{record['rank']}.json") as tmp:
                tmp.write_text(json.dumps(record))
        if record["kind"] == "bug" or _debug():
            raise
        return 1
    return 0
