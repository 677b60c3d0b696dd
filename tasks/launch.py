"""The multi-process training launcher: `accelerate launch` of the training workers, tied to the stage's life.

`launch_arm` (called by `tasks/train.py` when `train.num_processes` > 1) writes the run's spec into the stage's
transaction directory, starts `python -m tasks.train --launch ...` (`launcher_main`: accelerate's launcher
with the first failure recorded) on `python -m tasks.train --worker SPEC` (`worker_main`: one rank, which
trains through the function the stage passes in) and waits; `worker_failure` turns what the workers and
the launcher recorded into one message (`summarise_failure`). The launcher dies with the stage and the workers
with the launcher (Linux parent-death signal, `prctl PR_SET_PDEATHSIG`), and a worker whose stage is already
gone does not start, so a killed stage leaves no orphan training behind. A free local port is picked for the
workers' rendezvous.

Failures survive a full disk: the record files (one per rank and one for the launcher) are reserved, filled
with blanks, before any process starts, and a failure is written over the reservation in place
(`write_record`), which needs no new space. A rank's traceback goes to its log file
(`scratch/logs/train-<arm>/rank-<r>.log`), not the terminal (`--debug` prints it again); an expected failure of
any rank is the one line the same failure prints in one process. Torch elastic's log directory is set inside the
transaction's directory (`--log_dir`), so nothing is left in /tmp; it is removed with the transaction.

Past one machine (`train.num_machines` > 1) the stage runs on every machine: `machines` reads this machine's rank
and the main machine's address from the environment, `launch_command` passes them to `accelerate launch` (static
rendezvous: global rank 0 on machine 0), machine 0 stages and commits the outputs as above, and every other
machine's stage only launches its share of the workers and waits (`follow_arm`). `check_shared_storage` proves
at start that every machine sees the same `out_root`; a rank that loses a peer on another machine fails the stage
with one line that says to restart every machine.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from tandem.config import Params, params_from_dict, tool_env
from tandem.errors import LOW_SPACE_BYTES, DiskFullError, UserError, WorkerFailedError, free_bytes
from tasks.common import fsync_dir, remove, stage_outputs, timing_path

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


ELASTIC_LOGS = "elastic"  # torch elastic's log directory, inside the transaction's directory (never /tmp)


# Where one machine of a multi-machine run (`train.num_machines` > 1) learns its place: torch elastic's variables
# first (torchrun reads PET_<OPTION> as its options' defaults; Kubeflow's PyTorchJob sets them), then the plain
# ones that SLURM scripts and torchrun's docs use. Each is the environment of whatever started the stage.
MACHINE_RANK_ENV = ("PET_NODE_RANK", "NODE_RANK")
MAIN_ADDR_ENV = ("PET_MASTER_ADDR", "MASTER_ADDR")
MAIN_PORT_ENV = ("PET_MASTER_PORT", "MASTER_PORT")


@dataclass(frozen=True)
class Machines:
    """This machine's place in the run: `count` machines, this one's `rank` (0: the main machine, where global
    rank 0 runs and the outputs are published), the main machine's address and rendezvous port (0: a free local
    port, one machine)."""

    count: int
    rank: int
    main_ip: str
    main_port: int


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    return next((env[k].strip() for k in names if env.get(k, "").strip()), None)


def machines(params: Params, env: Mapping[str, str] | None = None) -> Machines:
    """This machine's place (`Machines`), from `train.num_machines` and, past one machine, the environment
    (`MACHINE_RANK_ENV`, `MAIN_ADDR_ENV`, `MAIN_PORT_ENV`); a missing or impossible value is one line."""
    env = os.environ if env is None else env
    n = params.train.num_machines
    if n == 1:
        return Machines(1, 0, "127.0.0.1", 0)
    got = {names: _first(env, names) for names in (MACHINE_RANK_ENV, MAIN_ADDR_ENV, MAIN_PORT_ENV)}
    missing = [" or ".join(names) for names, v in got.items() if v is None]
    if missing:
        raise UserError(f"train.num_machines is {n}, but this machine's environment lacks {', '.join(missing)}: "
                        "whatever starts the stage on each machine sets its rank (0 on the main machine) and the "
                        "main machine's address and port (torchrun / PyTorchJob's PET_* variables, or a job script)")
    rank, addr, port = got[MACHINE_RANK_ENV], got[MAIN_ADDR_ENV], got[MAIN_PORT_ENV]
    if not (rank.isdigit() and int(rank) < n) or not (port.isdigit() and 0 < int(port) < 65536):
        raise UserError(f"train.num_machines is {n}: machine rank {rank!r} must be 0-{n - 1} and port {port!r} "
                        "a TCP port (1-65535)")
    return Machines(n, int(rank), addr, int(port))


def launch_command(params: Params, spec_path: Path) -> list[str]:
    """`accelerate launch` of the training workers: torchrun under accelerate's multi-process launcher, run
    through `python -m tasks.train --launch` (`launcher_main`), which records the first failure for the stage's message.

    On a CPU-only machine the same launcher runs the workers on the gloo backend (accelerate's `--cpu` flag
    would pick its single-process launcher); `train.sharding: fsdp` adds FSDP (version 1, full sharding).
    Torch elastic's log directory is `ELASTIC_LOGS` beside the spec (the transaction's directory, removed with
    it): left to itself, torch makes a `/tmp/torchelastic_*` tree per launch and never removes it.
    `train.num_processes` counts every machine's processes; with `train.num_machines` > 1 this machine's rank
    and the main machine's address come from the environment (`machines`).
    """
    t, where = params.train, machines(params)
    # one machine: a free local port; several: accelerate's static rendezvous at the main machine's address,
    # which gives machine R the global ranks R x (num_processes / num_machines) on, so rank 0 is on machine 0
    at = (["--num_machines", "1", "--main_process_port", str(_free_port())] if where.count == 1 else
          ["--num_machines", str(where.count), "--machine_rank", str(where.rank), "--main_process_ip", where.main_ip,
           "--main_process_port", str(where.main_port)])
    cmd = [sys.executable, "-m", ENTRY, "--launch", "--num_processes", str(t.num_processes), *at,
           "--mixed_precision", "no", "--dynamo_backend", "no", "--log_dir", str(Path(spec_path).parent / ELASTIC_LOGS)]
    if t.sharding == "none":
        cmd += ["--multi_gpu"]  # accelerate's torchrun launcher (DDP); it picks gloo when there is no GPU
    else:
        cmd += ["--use_fsdp", "--fsdp_version", "1", "--fsdp_sharding_strategy", "FULL_SHARD",
                "--fsdp_auto_wrap_policy", "NO_WRAP", "--fsdp_use_orig_params", "true",
                "--fsdp_state_dict_type", "FULL_STATE_DICT", "--fsdp_sync_module_states", "false",
                "--fsdp_cpu_ram_efficient_loading", "false", "--fsdp_offload_params", "false"]
    return cmd + ["-m", ENTRY, "--worker", str(spec_path)]


ERROR_DIR_ENV = "TANDEM_TRAIN_ERRORS"  # where the launcher and each worker record how they failed
LOG_DIR_ENV = "TANDEM_TRAIN_LOGS"  # where each worker writes the traceback of its failure
LAUNCHER_RECORD = "launcher.json"
RECORD_BYTES = 4096  # reserved per record file (one block): a record is written over it in place


def rank_record(rank: int) -> str:
    return f"rank-{rank}.json"


def logs_dir(outputs: dict, arm: str) -> Path:
    """The ranks' log files of one arm's launched run: `scratch/logs/train-<arm>/` (kept after the run)."""
    return Path(outputs["scratch"]).parent / "logs" / f"train-{arm}"


def reserve_records(errors: Path, n: int) -> None:
    """Create the launcher's and each of `n` ranks' record files, `RECORD_BYTES` of blanks each, flushed to disk
    before any process starts: a failure later written over them in place needs no new space on a full disk."""
    for name in [LAUNCHER_RECORD, *(rank_record(r) for r in range(n))]:
        with open(errors / name, "wb") as f:
            f.write(b" " * RECORD_BYTES)
            f.flush()
            os.fsync(f.fileno())
    fsync_dir(errors)


def _fit(record: dict) -> bytes:
    """`record` as JSON within `RECORD_BYTES` (its message shortened as needed)."""
    rec = dict(record)
    data = json.dumps(rec).encode()
    while len(data) > RECORD_BYTES and rec.get("message"):
        rec["message"] = rec["message"][: len(rec["message"]) // 2] + "..."
        data = json.dumps(rec).encode()
    return data[:RECORD_BYTES]


def write_record(path: Path, record: dict) -> bool:
    """Write `record` over the reserved file `path` in place (no temporary file, no new blocks where the file
    was reserved); False when it could not be written (never raises: the caller is already failing)."""
    data = _fit(record)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            done = 0
            while done < len(data):
                done += os.pwrite(fd, data[done:], done)
            os.fsync(fd)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False


def read_record(path: Path) -> dict | None:
    """A record written by `write_record`, or None (still blank, missing, or unreadable)."""
    try:
        text = path.read_bytes().decode("utf-8", "replace").strip()
        rec = json.loads(text) if text else None
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def launch_arm(params: Params, arm: str, inputs: dict, outputs: dict, targets: dict[str, Path],
               optional: dict[str, Path] | None = None) -> dict:
    """Train one arm in `train.num_processes` processes through `accelerate launch`; returns the summary.

    The outputs (`targets`: name -> the path it replaces; `optional`: the timing sidecars, which may stay
    unwritten) are staged by this process's transaction and written there by the main worker; they replace
    the previous ones only once every worker has exited cleanly."""
    import torch

    from tasks.common import read_metrics

    if params.train.sharding != "none" and not torch.cuda.is_available():
        # accelerate 1.15 turns FSDP on only for accelerator devices (a CPU run would silently train with DDP),
        # and torch's FSDP1 refuses CPU modules ("FSDP needs a non-CPU accelerator device")
        raise ValueError(f"train.sharding: {params.train.sharding} needs GPUs; on this CPU-only machine use "
                         "train.sharding: none (every process holds the whole model)")
    where = machines(params)
    if where.rank > 0:
        return follow_arm(params, arm, inputs, outputs, where)
    txn = stage_outputs(params, f"train-{arm}", targets, optional)
    with txn as staged:
        _run_launcher(params, arm, txn.dir, {"inputs": inputs, "outputs": outputs, "publish_to": staged})
        if not staged["metrics"].exists():
            raise RuntimeError(f"train: the workers of arm {arm!r} exited cleanly but wrote no summary "
                               f"({staged['metrics']})")
        summary = read_metrics(staged["metrics"], timing_to=timing_path(outputs[f"metrics_{arm}"]))
    return summary


def follow_arm(params: Params, arm: str, inputs: dict, outputs: dict, where: Machines) -> dict:
    """Machine `where.rank` > 0 of a multi-machine run: launch this machine's share of the workers and wait.

    It publishes nothing and takes no lock: the main machine's stage holds the arm's lock and commits the outputs
    its rank 0 writes (on the shared `out_root`). Its spec, error records and torch elastic's logs live in
    `scratch/machines/train-<arm>-<rank>/`, removed when the workers have finished cleanly."""
    run_dir = Path(outputs["scratch"]).parent / "machines" / f"train-{arm}-{where.rank}"
    remove(run_dir)
    run_dir.mkdir(parents=True)
    _run_launcher(params, arm, run_dir, {"inputs": inputs, "outputs": outputs, "publish_to": None})
    remove(run_dir)
    return {"arm": arm, "machine_rank": where.rank, "num_machines": where.count,
            "published_by": "machine 0 (the main machine's stage)"}


def _run_launcher(params: Params, arm: str, run_dir: Path, io: dict) -> None:
    """Write the workers' spec into `run_dir` (`io`: inputs, outputs, publish_to: where rank 0 writes the arm's
    outputs, None on a machine that publishes nothing), start `accelerate launch` and wait; a failure raises the
    one error `worker_failure` makes of it."""
    spec = {"params": params.to_dict(), "arm": arm,
            **{k: (None if v is None else {n: str(p) for n, p in v.items()}) for k, v in io.items()}}
    spec_path = run_dir / "worker.json"
    spec_path.write_text(json.dumps(spec))
    errors = run_dir / "errors"
    errors.mkdir()
    reserve_records(errors, params.train.num_processes)
    outputs = io["outputs"]
    logs = logs_dir(outputs, arm)
    if io["publish_to"] is not None:  # the main machine (machine 0)
        remove(logs)  # the logs of an earlier launch of this arm (a rank that fails makes the folder again)
    repo = str(Path(__file__).resolve().parents[1])  # the workers import this very checkout
    env = {**tool_env(), "OMP_NUM_THREADS": str(max(params.train.cpu_threads, 1)),
           "PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p),
           "TANDEM_STAGE_PID": str(os.getpid()), ERROR_DIR_ENV: str(errors), LOG_DIR_ENV: str(logs)}
    proc = subprocess.Popen(launch_command(params, spec_path), env=env, preexec_fn=_die_with_parent)
    try:
        rc = proc.wait()
    except BaseException:  # Ctrl-C or a cancelled flow run: take the workers down too
        proc.terminate()
        proc.wait(timeout=60)
        raise
    if rc != 0:
        raise worker_failure(params, arm, rc, proc.pid, errors, Path(outputs["scratch"]) / arm, logs)


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def read_records(errors: Path) -> tuple[dict[int, dict], dict | None]:
    """(rank -> its failure record, the launcher's record) from the error directory; blank reservations and
    unreadable files count as no record."""
    records = {}
    for f in sorted(errors.glob("rank-*.json")):
        rec = read_record(f)
        try:
            records[int(rec["rank"])] = rec
        except (TypeError, KeyError, ValueError):
            continue
    return records, read_record(errors / LAUNCHER_RECORD)


def worker_failure(params: Params, arm: str, rc: int, launcher_pid: int, errors: Path, scratch: Path,
                   logs: Path | None = None) -> Exception:
    """The one error that says why a multi-process run failed, from the records in `errors`
    (`summarise_failure`)."""
    records, launcher = read_records(errors)
    lost = [r for r, rec in sorted(records.items()) if rec.get("kind") == "peer_lost"]
    if params.train.num_machines > 1 and lost and not any(r.get("kind") in ("expected", "bug") for r in records.values()):
        return WorkerFailedError(
            f"train: rank {lost[0]} of the {params.train.num_processes}-process run of arm {arm!r} on "
            f"{params.train.num_machines} machines lost a process of another machine (killed, or its machine or "
            f"network gone); this machine's processes stopped. Restart the stage on every machine: training "
            f"resumes from the last complete checkpoint in {scratch}")
    return summarise_failure(params.train.num_processes, arm, rc, launcher_pid, records, launcher, scratch, logs)


def summarise_failure(n: int, arm: str, rc: int, launcher_pid: int, records: dict[int, dict], launcher: dict | None,
                      scratch: Path, logs: Path | None = None) -> Exception:
    """The one error that says why an `n`-process run failed (launcher exit status `rc`): a rank's expected
    error (the very error that rank raised, so the line reads as in one process), a rank or the launcher killed
    by a signal, a bug in a rank (its traceback in its log file), or, with nothing recorded, a full disk where
    the run writes.

    Expected errors and kills are `UserError`s (one line, exit code 1); anything else stays a bug."""
    again = f"rerun the stage: training resumes from the last complete checkpoint in {scratch}"
    if launcher is None and rc < 0:
        return WorkerFailedError(f"train: the launcher (accelerate launch, pid {launcher_pid}) of the {n}-process run "
                                 f"of arm {arm!r} was killed by {_signal_name(rc)}; its workers stopped with it. "
                                 f"Find what killed it (out of memory? see `dmesg`), then {again}")
    for rank, rec in sorted(records.items()):
        if rec.get("kind") == "expected":
            if rec.get("type") == "DiskFullError" and rec.get("path"):
                return DiskFullError(rec["path"], rec.get("free"))
            return WorkerFailedError(str(rec.get("message") or f"train: rank {rank} of {n} failed ({rec.get('type')})"))
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
            log = f": {logs / f'rank-{rank}.log'}" if logs is not None else " is in the rank's log"
            return RuntimeError(f"train: rank {rank} of the {n}-process run of arm {arm!r} failed with "
                                f"{rec.get('type')}: {rec.get('message', '')} (its traceback{log})")
    if not any(r.get("kind") in ("expected", "bug") for r in records.values()):
        # no rank could say why (at most that a peer was lost): a disk with no space left is the likely reason
        free = free_bytes(scratch)
        if free is not None and free < LOW_SPACE_BYTES:
            return DiskFullError(scratch, free)
    where = f", their tracebacks in {logs}" if logs is not None else ""
    return RuntimeError(f"train: the {n}-process run of arm {arm!r} failed (accelerate launch exit status {rc}); "
                        f"the ranks' output is above{where}")


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
            write_record(Path(errors) / LAUNCHER_RECORD, {"root_rank": root, "failures": failures})
        if _debug():
            raise
        return 1
    return 0


def _failure_record(e: BaseException, where: str | os.PathLike | None = None) -> dict:
    """What a worker says about its failure: expected (a UserError, a full disk, a missing file; a full disk
    names its file, or `where`, and keeps the path and free space so the stage raises the same error), the loss
    of another rank (a collective that broke because a peer died), or a bug."""
    from tandem.errors import as_user_error, disk_full_error, is_expected

    full = disk_full_error(e, where)
    if full is not None:
        return {"kind": "expected", "type": "DiskFullError", "message": str(full), "path": full.path, "free": full.free}
    if is_expected(e):
        return {"kind": "expected", "type": type(e).__name__, "message": str(as_user_error(e))}
    text = str(e)
    lost = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused")
    if any(t in text for t in lost) or type(e).__name__ in ("DistBackendError", "DistNetworkError"):
        return {"kind": "peer_lost", "type": type(e).__name__, "message": text[:500]}
    return {"kind": "bug", "type": type(e).__name__, "message": text[:2000]}


def _log_traceback(rank: int, e: BaseException) -> None:
    """The traceback of this rank's failure into its log file (`LOG_DIR_ENV`); nothing when it cannot be
    written (a full disk: the record, written in place, still says what failed)."""
    import traceback

    logs = os.environ.get(LOG_DIR_ENV)
    if not logs:
        return
    try:
        Path(logs).mkdir(parents=True, exist_ok=True)
        with open(Path(logs) / f"rank-{rank}.log", "a", encoding="utf-8") as f:
            f.write("".join(traceback.format_exception(e)))
    except OSError:
        pass


def check_shared_storage(params: Params) -> None:
    """In every worker of a multi-machine run, before any work: global rank 0 writes a file with a random token
    under `out_root`, every rank reads it back, and all learn who saw it (an all-gather). When a machine does not
    see it, its `out_root` is not the main machine's (train.shared_storage declared, but not so): every rank
    raises the same one-line error, and nothing was trained or written."""
    import secrets

    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list, gather_object

    state = PartialState()  # the process group accelerate (and then the trainer) uses
    where = Path(params.out_root) / "scratch"
    token = [secrets.token_hex(16) if state.is_main_process else None]
    if state.is_main_process:
        where.mkdir(parents=True, exist_ok=True)
        (where / f".shared-{token[0]}").write_text(token[0])
    broadcast_object_list(token)
    probe = where / f".shared-{token[0]}"
    try:
        seen = probe.read_text() == token[0]
    except OSError:
        seen = False
    machine = int(os.environ.get("GROUP_RANK", "0"))  # torch elastic: this machine's (node's) rank
    views = gather_object([(machine, seen)])
    if state.is_main_process:
        probe.unlink(missing_ok=True)
    blind = sorted({m for m, ok in views if not ok})
    if blind:
        raise UserError(f"train.shared_storage is true, but machine {', '.join(map(str, blind))} of "
                        f"{params.train.num_machines} does not see out_root {params.out_root} as the main machine "
                        f"writes it (a probe file under its scratch/ was not there): mount one shared file system "
                        "at out_root on every machine")


def worker_main(spec_path: Path, train: Callable[[Params, str, dict, dict, dict | None], dict]) -> int:
    """One process of `launch_arm`'s run: rebuild the params, train this rank's share of the arm with
    `train(params, arm, inputs, outputs, publish_to)`.

    A failure is recorded for the stage's message (in place, in its reserved record file) and its traceback goes
    to the rank's log file; the terminal shows neither unless debugging."""
    _die_with_parent()
    stage = int(os.environ.get("TANDEM_STAGE_PID", "0"))
    if stage and not _alive(stage):  # the stage died before this worker armed its signal: nothing to train for
        return 1
    spec = json.loads(spec_path.read_text())
    params = params_from_dict(spec["params"])
    try:
        if params.train.num_machines > 1:
            check_shared_storage(params)
        train(params, spec["arm"], spec["inputs"], spec["outputs"], spec.get("publish_to"))
    except Exception as e:
        rank = int(os.environ.get("RANK", "0"))
        record = {"rank": rank, **_failure_record(e, spec["outputs"].get("scratch"))}
        _log_traceback(rank, e)
        errors = os.environ.get(ERROR_DIR_ENV)
        if errors:
            write_record(Path(errors) / rank_record(rank), record)
        if _debug():
            raise
        return 1
    return 0
