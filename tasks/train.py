"""Stage `train`: every arm of `train.arms` from `models/base/`, with checkpoints, resume and per-step metrics.

Each arm trains a fresh copy of the base next to a frozen junior copy (`tandem.train.train_arm`), saving
`scratch/train/<arm>/step-<N>/` every `train.save_every` steps and at the end. With `train.resume: auto`
a rerun after a crash continues from the last complete checkpoint of the same run there. The declared output
`models/checkpoints/<arm>/` is materialised from those checkpoints (hard links) once the run is complete: it is
a plain DVC output, so the stage is in DVC's run-cache (params that return to an earlier state restore it),
while scratch/ (no stage declares it) keeps the resume state across DVC deleting outputs before a rerun. Writes
`metrics/train_<arm>.json` (summary) and `metrics/plots/train/<arm>.csv` (one row per step, for `dvc plots`).
`run_arm` trains one arm (dvc.yaml has one stage per arm; the Prefect flow maps it over arms), `collect`
gathers the headline numbers of every arm.
W&B goes through trl's `report_to`: mode from `WANDB_MODE` if set, else `train.wandb_mode` (offline by
default), files under `runs/wandb/`. `python -m tasks.train [params.yaml] [--arm NAME]` runs it directly.

With `train.num_processes` N > 1, `run_arm` (the entry of `tandem stage train`, dvc.yaml and the Prefect flow)
starts `accelerate launch --num_processes N` on `python -m tasks.train --worker SPEC` and waits: every worker
trains its share, the main one writes the metrics; a failed worker fails the stage. The launcher dies with
this process and the workers with the launcher (Linux parent-death signal), so a killed stage leaves no
orphan training behind and a rerun resumes from the last complete checkpoint.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from tandem.config import Params, apply_tool_env, tool_env
from tasks.common import (Layout, atomic_path, is_timing_key, load_params, read_jsonl, split_timing, timing_path,
                          write_metrics)


def default_io(params: Params) -> tuple[dict[str, Path], dict[str, Path]]:
    L = Layout.of(params)
    inputs = {"train_data": L.prepared / "train.jsonl", "val_data": L.prepared / "val.jsonl",
              "base_model": L.base_model}
    outputs: dict[str, Path] = {"checkpoints": L.checkpoints, "runs": L.runs / "wandb",
                                "scratch": L.scratch / "train"}
    for arm in params.train.arms:  # dvc.yaml: one stage per arm (train@<arm>) declaring these three
        outputs[f"metrics_{arm}"] = L.metrics / f"train_{arm}.json"
        outputs[f"plot_{arm}"] = L.plots / "train" / f"{arm}.csv"
    return inputs, outputs


def _wandb_env(params: Params, runs_dir: Path) -> None:
    if params.train.report_to != "wandb":
        return
    os.environ.setdefault("WANDB_MODE", params.train.wandb_mode)
    os.environ.setdefault("WANDB_PROJECT", params.train.wandb_project)
    if "WANDB_DIR" not in os.environ:
        runs_dir.mkdir(parents=True, exist_ok=True)
        os.environ["WANDB_DIR"] = str(runs_dir.resolve())


def _finish_wandb(params: Params) -> None:
    # transformers' W&B callback never closes its run: without this, the next arm would log into it.
    if params.train.report_to == "wandb" and "wandb" in sys.modules:
        import wandb

        if wandb.run is not None:
            wandb.finish()


def write_step_table(path: Path, rows: list[dict]) -> None:
    """The per-step table (`dvc plots`) without its timing columns, which go to `<arm>.timing.csv` beside it:
    the table DVC hashes then depends on the run's inputs alone."""
    from tandem.train import TABLE_COLUMNS

    timing = ["step"] + [c for c in TABLE_COLUMNS if is_timing_key(c)]
    for dest, cols in ((path, [c for c in TABLE_COLUMNS if not is_timing_key(c)]), (timing_path(path), timing)):
        with atomic_path(dest) as tmp:
            with open(tmp, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
                w.writeheader()
                for r in rows:
                    w.writerow({k: ("" if r.get(k) is None else r[k]) for k in cols})


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or links not allowed
        shutil.copy2(src, dst)


# Checkpoint files that carry the run's clock (trl's per-step times, the save time): the output gets them
# without those values, so a rerun with the same inputs materialises bit-identical checkpoints.
CLOCKED_STATE = ("trainer_state.json", "tandem_state.json")


def _without_timings(path: Path) -> None:
    """Replace `path` (a hard link into scratch/, left as it is) by a copy without timing values."""
    doc = json.loads(path.read_text())
    kept, timing = split_timing(doc)
    if timing is None:
        return
    path.unlink()
    path.write_text(json.dumps(kept, indent=2, sort_keys=True) + "\n")


def materialise(work_dir: Path, out_dir: Path) -> list[str]:
    """`out_dir` := the complete checkpoints of `work_dir` (hard links, copies where linking fails), atomically.

    Nothing ever writes into a committed checkpoint, so sharing its files with the output is safe. The state
    files in `CLOCKED_STATE` are the exception: the output holds copies without their timings (scratch/, where
    a run resumes, keeps them).
    """
    from tandem.train import complete_checkpoints

    names = []
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        for _, ckpt in complete_checkpoints(work_dir):
            shutil.copytree(ckpt, tmp / ckpt.name, copy_function=_link_or_copy)
            for name in CLOCKED_STATE:
                if (tmp / ckpt.name / name).exists():
                    _without_timings(tmp / ckpt.name / name)
            names.append(ckpt.name)
    return names


def run_arm(params: Params, arm: str, inputs: dict, outputs: dict) -> dict:
    """Train one arm and write its summary and per-step table; returns the summary.

    With `train.num_processes` > 1 outside a launched worker this launches the workers and waits for them.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if params.train.num_processes > 1 and world == 1:
        _check_plan(params, arm, inputs)  # a plan that cannot fit is refused before any process starts
        return launch_arm(params, arm, inputs, outputs)
    if world != params.train.num_processes:
        raise RuntimeError(f"train: running in {world} processes but train.num_processes is "
                           f"{params.train.num_processes}: let the stage launch itself (tandem stage train)")
    return _run_arm_here(params, arm, inputs, outputs)


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
    """`accelerate launch` of the training workers: torchrun under accelerate's multi-process launcher.

    On a CPU-only machine the same launcher runs the workers on the gloo backend (accelerate's `--cpu` flag
    would pick its single-process launcher); `train.sharding: fsdp` adds FSDP (version 1, full sharding).
    """
    t = params.train
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes",
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


def launch_arm(params: Params, arm: str, inputs: dict, outputs: dict) -> dict:
    """Train one arm in `train.num_processes` processes through `accelerate launch`; returns the summary."""
    import torch

    from tasks.common import read_metrics

    if params.train.sharding != "none" and not torch.cuda.is_available():
        # accelerate 1.15 turns FSDP on only for accelerator devices (a CPU run would silently train with DDP),
        # and torch's FSDP1 refuses CPU modules ("FSDP needs a non-CPU accelerator device")
        raise ValueError(f"train.sharding: {params.train.sharding} needs GPUs; on this CPU-only machine use "
                         "train.sharding: none (every process holds the whole model)")
    metrics = Path(outputs[f"metrics_{arm}"])
    metrics.unlink(missing_ok=True)  # the summary read below must be this run's
    raw = params.to_dict()
    spec = {"params": raw, "arm": arm, "inputs": {k: str(v) for k, v in inputs.items()},
            "outputs": {k: str(v) for k, v in outputs.items()}}
    with tempfile.TemporaryDirectory(prefix="tandem-train-") as tmp:
        spec_path = Path(tmp) / "worker.json"
        spec_path.write_text(json.dumps(spec))
        repo = str(Path(__file__).resolve().parents[1])  # the workers import this very checkout
        env = {**tool_env(), "OMP_NUM_THREADS": str(max(params.train.cpu_threads, 1)),
               "PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p),
               "TANDEM_STAGE_PID": str(os.getpid())}
        proc = subprocess.Popen(launch_command(params, spec_path), env=env, preexec_fn=_die_with_parent)
        try:
            rc = proc.wait()
        except BaseException:  # Ctrl-C or a cancelled flow run: take the workers down too
            proc.terminate()
            proc.wait(timeout=60)
            raise
    if rc != 0:
        raise RuntimeError(f"train: the {params.train.num_processes}-process run of arm {arm!r} failed "
                           f"(accelerate launch exit status {rc}); the workers' output is above")
    if not metrics.exists():
        raise RuntimeError(f"train: the workers of arm {arm!r} exited cleanly but wrote no {metrics}")
    return read_metrics(metrics)


def _run_arm_here(params: Params, arm: str, inputs: dict, outputs: dict) -> dict:
    import torch

    from tandem.models import check_model_dir, load_model, load_tokenizer
    from tandem.plan import check_fits
    from tandem.precision import load_dtypes
    from tandem.train import step_rows, train_arm

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
    _wandb_env(params, Path(outputs["runs"]))
    try:
        res = train_arm(arm, senior, junior, tokenizer, train_rows, params.train, params.rollout,
                        Path(outputs["scratch"]) / arm, seed=params.seed, val_rows=val_rows,
                        weight_roots=(params.out_root,))
    finally:
        _finish_wandb(params)
    if int(os.environ.get("RANK", "0")) == 0:  # one writer; every rank holds the same history
        materialise(Path(outputs["scratch"]) / arm, Path(outputs["checkpoints"]) / arm)
        write_metrics(outputs[f"metrics_{arm}"], res.summary)  # step and phase times go beside it
        write_step_table(Path(outputs[f"plot_{arm}"]), step_rows(res.log_history))
    return res.summary


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


def _worker(spec_path: Path) -> int:
    """One process of `launch_arm`'s run: rebuild the params, train this rank's share of the arm."""
    from tandem.config import params_from_dict

    _die_with_parent()
    stage = int(os.environ.get("TANDEM_STAGE_PID", "0"))
    if stage and not _alive(stage):  # the stage died before this worker armed its signal: nothing to train for
        return 1
    spec = json.loads(spec_path.read_text())
    params = params_from_dict(spec["params"])
    run_arm(params, spec["arm"], spec["inputs"], spec["outputs"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
