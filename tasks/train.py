"""Stage `train`: every arm of `train.arms` from `models/base/`, with checkpoints, resume and per-step metrics.

Each arm trains a fresh copy of the base next to a frozen junior copy (`tandem.train.train_arm`), saving
`scratch/train/<arm>/step-<N>/` every `train.save_every` steps and at the end. With `train.resume: auto`
a rerun after a crash continues from the last complete checkpoint of the same run there, verified against the
checksums recorded when it was saved. The declared output `models/checkpoints/<arm>/` is published from those
checkpoints once the run is complete, as copies checked against the same checksums while they are copied (a
damaged resume copy fails the stage; damage to a published copy cannot reach the resume state, and a rerun
publishes intact copies again): it is a plain DVC output, so the stage is in DVC's run-cache (params that
return to an earlier state restore it), while scratch/ (no stage declares it) keeps the resume state across DVC
deleting outputs before a rerun. Writes `metrics/train_<arm>.json` (summary) and `metrics/plots/train/<arm>.csv`
(one row per step, for `dvc plots`), and `metrics/headline/train_<arm>.json` (its DVC metric: a few
headline numbers, tasks/headline.py). The four outputs of an arm change together, in one transaction
(`tasks.common.stage_outputs`): until a run is complete the previous run's stay as they were.
`run_arm` trains one arm (dvc.yaml has one stage per arm; the Prefect flow maps it over arms), `collect`
gathers the headline numbers of every arm.
W&B: one run per arm (`tasks.tracking.arm_run`), into which trl's `report_to` callback logs every step; mode
from `WANDB_MODE` if set, else `train.wandb_mode` (offline by default), files under `runs/wandb/`.
`python -m tasks.train [params.yaml] [--arm NAME]` runs it directly.

With `train.num_processes` N > 1, `run_arm` (the entry of `tandem stage train`, dvc.yaml and the Prefect flow)
starts `accelerate launch --num_processes N` (through `python -m tasks.train --launch`, which records which
rank failed first and how) on `python -m tasks.train --worker SPEC` and waits: every worker trains its share,
the main one writes the outputs into the transaction's staging directory, and the stage commits them once every
worker has exited cleanly. A failed worker fails the stage with one message naming the rank and the cause (its
expected error, or the signal that killed it). The spec and the workers' error records live in the
transaction's directory under scratch/staging/, never in /tmp, so a killed run leaves nothing behind that the
next run does not sweep. The launcher dies with this process and the workers with the launcher (Linux
parent-death signal), so a killed stage leaves no orphan training behind and a rerun resumes from the last
complete checkpoint.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import socket
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

from tandem.config import Params, apply_tool_env, tool_env
from tandem.errors import WorkerFailedError
from tandem.timing import is_timing_key
from tasks import headline, tracking
from tasks.common import (Layout, atomic_path, load_params, read_jsonl, stage_outputs, timing_path, write_json,
                          write_metrics)


def default_io(params: Params) -> tuple[dict[str, Path], dict[str, Path]]:
    L = Layout.of(params)
    inputs = {"train_data": L.prepared / "train.jsonl", "val_data": L.prepared / "val.jsonl",
              "base_model": L.base_model}
    outputs: dict[str, Path] = {"checkpoints": L.checkpoints, "runs": L.runs / "wandb",
                                "scratch": L.scratch / "train"}
    for arm in params.train.arms:  # dvc.yaml: one stage per arm (train@<arm>) declaring these four
        outputs[f"metrics_{arm}"] = L.metrics / f"train_{arm}.json"
        outputs[f"headline_{arm}"] = L.metrics / "headline" / f"train_{arm}.json"
        outputs[f"plot_{arm}"] = L.plots / "train" / f"{arm}.csv"
    return inputs, outputs


def write_step_table(path: Path, rows: list[dict], timing_to: Path | None = None) -> None:
    """The per-step table (`dvc plots`) without its timing columns, which go to `<arm>.timing.csv` beside it
    (or `timing_to`): the table DVC hashes then depends on the run's inputs alone."""
    from tandem.train import TABLE_COLUMNS

    timing = ["step"] + [c for c in TABLE_COLUMNS if is_timing_key(c)]
    side = Path(timing_to) if timing_to is not None else timing_path(path)
    for dest, cols in ((path, [c for c in TABLE_COLUMNS if not is_timing_key(c)]), (side, timing)):
        with atomic_path(dest) as tmp:
            with open(tmp, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
                w.writeheader()
                for r in rows:
                    w.writerow({k: ("" if r.get(k) is None else r[k]) for k in cols})


# Checkpoint files that carry the run's clock (trl's per-step times, the save time): the published copy gets
# them without those values, so a rerun with the same inputs publishes bit-identical checkpoints.
CLOCKED_STATE = ("trainer_state.json", "tandem_state.json")


def materialise(work_dir: Path, out_dir: Path) -> list[str]:
    """`out_dir` (a new folder) := copies of the complete checkpoints of `work_dir`, every file checked against
    the checksums recorded when it was saved; returns the step folder names.

    Copies, not hard links: a published file that is later damaged or edited must not change the resume copy.
    A damaged checkpoint in `work_dir` raises `CheckpointError` naming the file (nothing is published).

    The state files in `CLOCKED_STATE` lose their timing values in the published copy, whose recorded
    checksums follow (scratch/, where a run resumes, keeps them as saved).
    """
    from tandem.checkpoints import complete_checkpoints, copy_verified, damaged_checkpoints, drop_clock
    from tandem.errors import CheckpointError

    damaged = damaged_checkpoints(work_dir)
    if damaged:
        raise CheckpointError("train: " + "; ".join(f"{p} ({why})" for p, why in damaged) + ": not a complete "
                              "checkpoint, so the arm cannot be published. Remove it, and the step-<N> folders "
                              "after it to train those steps again, then rerun the stage")
    names = []
    Path(out_dir).mkdir(parents=True)
    for _, ckpt in complete_checkpoints(work_dir):
        copy_verified(ckpt, Path(out_dir) / ckpt.name)
        drop_clock(Path(out_dir) / ckpt.name, CLOCKED_STATE)
        names.append(ckpt.name)
    return names


def publish_targets(outputs: dict, arm: str) -> dict[str, Path]:
    """The declared outputs of one arm, which change together: its checkpoints, summary, headline metric and
    per-step table."""
    return {"checkpoints": Path(outputs["checkpoints"]) / arm, "metrics": Path(outputs[f"metrics_{arm}"]),
            "headline": Path(outputs[f"headline_{arm}"]), "plot": Path(outputs[f"plot_{arm}"])}


def _write_outputs(dest: dict, final: dict, work_dir: Path, summary: dict, rows: list[dict]) -> None:
    """The arm's outputs into `dest` (the transaction's staged paths); the untracked timing sidecars go straight
    beside the `final` paths."""
    materialise(work_dir, Path(dest["checkpoints"]))
    write_metrics(dest["metrics"], summary, timing_to=timing_path(final["metrics"]))  # step and phase times
    write_json(dest["headline"], headline.train(summary))
    write_step_table(Path(dest["plot"]), rows, timing_to=timing_path(final["plot"]))


def run_arm(params: Params, arm: str, inputs: dict, outputs: dict) -> dict:
    """Train one arm and write its summary and per-step table; returns the summary.

    With `train.num_processes` > 1 outside a launched worker this launches the workers and waits for them.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if params.train.num_processes > 1 and world == 1:
        if Path(inputs["base_model"]).exists():  # a damaged base is named here, not by N workers at once
            from tandem.models import check_model_dir

            check_model_dir(inputs["base_model"])
        _check_plan(params, arm, inputs)  # a plan that cannot fit is refused before any process starts
        return launch_arm(params, arm, inputs, outputs)
    return _run_in_this_process(params, arm, inputs, outputs)


def _run_in_this_process(params: Params, arm: str, inputs: dict, outputs: dict, publish_to: dict | None = None) -> dict:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != params.train.num_processes:
        raise RuntimeError(f"train: running in {world} processes but train.num_processes is "
                           f"{params.train.num_processes}: let the stage launch itself (tandem stage train)")
    return _run_arm_here(params, arm, inputs, outputs, publish_to)


def _check_plan(params: Params, arm: str, inputs: dict) -> None:
    import torch

    from tandem.plan import check_fits

    device = "cuda" if torch.cuda.is_available() else "cpu"
    check_fits(params, "train", Path(inputs["base_model"]), device, arms=[arm])


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
    through `python -m tasks.train --launch`, which records the first failure for the stage's message.

    On a CPU-only machine the same launcher runs the workers on the gloo backend (accelerate's `--cpu` flag
    would pick its single-process launcher); `train.sharding: fsdp` adds FSDP (version 1, full sharding).
    """
    t = params.train
    cmd = [sys.executable, "-m", "tasks.train", "--launch", "--num_processes",
           str(t.num_processes), "--num_machines", "1", "--main_process_port", str(_free_port()),
           "--mixed_precision", "no", "--dynamo_backend", "no"]
    if t.sharding == "none":
        cmd += ["--multi_gpu"]  # accelerate's torchrun launcher (DDP); it picks gloo when there is no GPU
    else:
        cmd += ["--use_fsdp", "--fsdp_version", "1", "--fsdp_sharding_strategy", "FULL_SHARD",
                "--fsdp_auto_wrap_policy", "NO_WRAP", "--fsdp_use_orig_params", "true",
                "--fsdp_state_dict_type", "FULL_STATE_DICT", "--fsdp_sync_module_states", "false",
                "--fsdp_cpu_ram_efficient_loading", "false", "--fsdp_offload_params", "false"]
    return cmd + ["-m", "tasks.train", "--worker", str(spec_path)]


ERROR_DIR_ENV = "TANDEM_TRAIN_ERRORS"  # where the launcher and each worker record how they failed
LAUNCHER_RECORD = "launcher.json"


def launch_arm(params: Params, arm: str, inputs: dict, outputs: dict) -> dict:
    """Train one arm in `train.num_processes` processes through `accelerate launch`; returns the summary.

    The outputs are staged by this process's transaction and written there by the main worker; they replace
    the previous ones only once every worker has exited cleanly."""
    import torch

    from tasks.common import read_metrics

    if params.train.sharding != "none" and not torch.cuda.is_available():
        # accelerate 1.15 turns FSDP on only for accelerator devices (a CPU run would silently train with DDP),
        # and torch's FSDP1 refuses CPU modules ("FSDP needs a non-CPU accelerator device")
        raise ValueError(f"train.sharding: {params.train.sharding} needs GPUs; on this CPU-only machine use "
                         "train.sharding: none (every process holds the whole model)")
    txn = stage_outputs(params, f"train-{arm}", publish_targets(outputs, arm))
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


def _run_arm_here(params: Params, arm: str, inputs: dict, outputs: dict, publish_to: dict | None = None) -> dict:
    import torch

    from tandem.models import check_model_dir, load_model, load_tokenizer
    from tandem.plan import check_fits
    from tandem.precision import load_dtypes
    from tandem.train import ArmRun, step_rows, train_arm

    base = Path(inputs["base_model"])
    check_model_dir(base)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    check_fits(params, "train", base, device, arms=[arm])  # refuse a plan over the device's memory, before any work
    for key in ("train_data", "val_data"):
        if not Path(inputs[key]).exists():
            raise FileNotFoundError(f"train: {inputs[key]} does not exist (run the prepare stage first)")
    train_rows, val_rows = read_jsonl(inputs["train_data"]), read_jsonl(inputs["val_data"])
    trust = params.model.trust_remote_code
    # train.precision: the senior holds the optimizer's master weights (float32), the frozen junior model.dtype
    senior_dtype, junior_dtype = load_dtypes(params.train, params.model.dtype, device)
    senior, junior = load_model(base, senior_dtype, trust), load_model(base, junior_dtype, trust)
    tokenizer = load_tokenizer(base, trust)
    # the W&B run of this arm (rank 0 logs; the trainer's W&B callback logs into it)
    tracked = (tracking.arm_run(params, arm, run_fingerprint_of(params, arm, junior))
               if tracking.enabled(params) and int(os.environ.get("RANK", "0")) == 0 else nullcontext())
    with tracked:
        res = train_arm(ArmRun(arm, senior, junior, tokenizer, train_rows, params.train, params.rollout,
                               Path(outputs["scratch"]) / arm, seed=params.seed, val_rows=val_rows,
                               weight_roots=(params.out_root,)))
    if int(os.environ.get("RANK", "0")) == 0:  # one writer; every rank holds the same history
        work, rows = Path(outputs["scratch"]) / arm, step_rows(res.log_history)
        if publish_to is not None:  # a launched worker: the launching stage commits what it writes there
            _write_outputs(publish_to, publish_targets(outputs, arm), work, res.summary, rows)
        else:
            with stage_outputs(params, f"train-{arm}", publish_targets(outputs, arm)) as staged:
                _write_outputs(staged, publish_targets(outputs, arm), work, res.summary, rows)
    return res.summary


def run_fingerprint_of(params: Params, arm: str, junior) -> str:
    """The fingerprint the trainer gives this arm's run (its checkpoints carry it; resume needs it to match)."""
    from tandem.train import arm_spec, run_fingerprint
    from tandem.train.numerics import weights_hash

    return run_fingerprint(arm_spec(arm, params.train, params.rollout), params.train, params.rollout, params.seed,
                           weights_hash(junior))


KEEP = ("steps", "reward_first", "reward_last", "senior_fraction", "handoffs_per_completion", "kl_to_base_last",
        "zero_variance_groups", "val_accuracy_initial", "val_accuracy_last", "step_seconds", "phase_seconds",
        "junior_unchanged", "checkpoints")


def collect(params: Params, inputs: dict | None = None, outputs: dict | None = None) -> dict:
    """The headline numbers of every arm, from the per-arm summaries (nothing is written: each arm's own
    `metrics/train_<arm>.json` is its DVC stage's metric)."""
    from tasks.common import read_metrics

    do = {**default_io(params)[1], **(outputs or {})}
    out = {}
    for arm in params.train.arms:
        path = Path(do[f"metrics_{arm}"])
        if not path.exists():
            raise FileNotFoundError(f"train: {path} is missing (arm {arm!r} has not been trained)")
        summary = read_metrics(path)  # with the run's step and phase times
        out[arm] = {k: summary.get(k) for k in KEEP}
    return out


def run(params: Params, inputs: dict | None = None, outputs: dict | None = None) -> dict:
    di, do = default_io(params)
    inputs, outputs = {**di, **(inputs or {})}, {**do, **(outputs or {})}
    for arm in params.train.arms:
        run_arm(params, arm, inputs, outputs)
    return collect(params, inputs, outputs)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("params", nargs="?", default="params.yaml")
    ap.add_argument("--arm", action="append", help="train only this arm (repeatable); default train.arms")
    ap.add_argument("--worker", metavar="SPEC", help="internal: one process of a launched multi-process run")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--launch"]:  # internal: accelerate's launcher with the first failure recorded
        return _launcher(argv[1:])
    a = ap.parse_args(argv)
    apply_tool_env()
    if a.worker:
        return _worker(Path(a.worker))
    params = load_params(a.params)
    if a.arm:
        bad = [arm for arm in a.arm if arm not in params.train.arms]
        if bad:
            raise SystemExit(f"--arm {bad}: not in train.arms {params.train.arms}")
        inputs, outputs = default_io(params)
        print(json.dumps({arm: run_arm(params, arm, inputs, outputs) for arm in a.arm}, indent=2, default=str))
    else:
        print(json.dumps(run(params), indent=2, default=str))
    return 0


def _debug() -> bool:
    return os.environ.get("TANDEM_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")


def _launcher(argv: list[str]) -> int:
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


def _worker(spec_path: Path) -> int:
    """One process of `launch_arm`'s run: rebuild the params, train this rank's share of the arm.

    A failure is recorded for the stage's message; an expected one (or the loss of another rank) prints
    nothing here unless debugging, a bug keeps its traceback."""
    from tandem.config import params_from_dict

    _die_with_parent()
    stage = int(os.environ.get("TANDEM_STAGE_PID", "0"))
    if stage and not _alive(stage):  # the stage died before this worker armed its signal: nothing to train for
        return 1
    spec = json.loads(spec_path.read_text())
    params = params_from_dict(spec["params"])
    try:
        _run_in_this_process(params, spec["arm"], spec["inputs"], spec["outputs"], spec.get("publish_to"))
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


if __name__ == "__main__":
    sys.exit(main())
