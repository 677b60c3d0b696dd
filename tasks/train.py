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
worker has exited cleanly. A failed worker fails the stage with one message: its expected error, as one process
would print it (a full disk too: the error records are reserved before the run, so writing one needs no new
space), or the rank and the signal that killed it; a rank's traceback goes to `scratch/logs/train-<arm>/`, not
the terminal. The spec, the workers' error records and torch elastic's logs live in the transaction's directory
under scratch/staging/, never in /tmp, so a killed run leaves nothing behind that the next run does not sweep.
The launcher dies with this process and the workers with the launcher (Linux parent-death signal), so a killed
stage leaves no orphan training behind and a rerun resumes from the last complete checkpoint. The launcher's
machinery (accelerate's command line, the parent-death signal, the failure records and their one message) is
`tasks/launch.py`.

With `TANDEM_RESUME_REMOTE` set, the main process pulls the run's checkpoints from that DVC remote before training
and pushes each new one there (`tasks/durable.py`): a worker that replaces a lost one resumes where it stopped.
"""

from __future__ import annotations

import csv
import os
import sys
from contextlib import nullcontext
from pathlib import Path

from tandem.config import Params, apply_tool_env
from tandem.timing import is_timing_key
from tasks import durable, headline, launch, tracking
from tasks.common import (Layout, atomic_path, junior_of, junior_record, load_params, read_jsonl, remove,
                          sidecar_of, stage_outputs, timing_path, write_json, write_metrics)


def default_io(params: Params) -> tuple[dict[str, Path], dict[str, Path]]:
    lay = Layout.of(params)
    inputs = {"train_data": lay.prepared / "train.jsonl", "val_data": lay.prepared / "val.jsonl",
              "base_model": lay.base_model, "junior_model": lay.junior_model}
    outputs: dict[str, Path] = {"checkpoints": lay.checkpoints, "runs": lay.runs / "wandb",
                                "scratch": lay.scratch / "train"}
    for arm in params.train.arms:  # dvc.yaml: one stage per arm (train@<arm>) declaring these four
        outputs[f"metrics_{arm}"] = lay.metrics / f"train_{arm}.json"
        outputs[f"headline_{arm}"] = lay.metrics / "headline" / f"train_{arm}.json"
        outputs[f"plot_{arm}"] = lay.plots / "train" / f"{arm}.csv"
    return inputs, outputs


def write_step_table(path: Path, rows: list[dict], timing_to: Path | None = None) -> None:
    """The per-step table (`dvc plots`) without its timing columns, which go to `<arm>.timing.csv` beside it
    (or `timing_to`): the table DVC hashes then depends on the run's inputs alone. Written into a stage
    transaction, the timing table is staged with the table (`tasks.common.sidecar_of`)."""
    from tandem.train import TABLE_COLUMNS

    timing = ["step"] + [c for c in TABLE_COLUMNS if is_timing_key(c)]
    side, staged = sidecar_of(path, timing_to)
    if not staged:  # in place: never the new table beside the old run's times, even for a moment
        remove(side)
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
# Checkpoint files the published copy leaves out: the trainer's snapshot of the process's global RNGs (Python,
# NumPy, torch) at the save. Only a resumed run reads it, and runs resume from scratch/train/, never from a
# published copy; its bytes depend on what else the process did (a `tandem run` runs every stage in one
# process), not on the run's inputs. The generators that shape training are seeded from the params.
PROCESS_STATE = ("rng_state",)


def materialise(work_dir: Path, out_dir: Path) -> list[str]:
    """`out_dir` (a new folder) := copies of the complete checkpoints of `work_dir`, every file checked against
    the checksums recorded when it was saved; returns the step folder names.

    Copies, not hard links: a published file that is later damaged or edited must not change the resume copy.
    A damaged checkpoint in `work_dir` raises `CheckpointError` naming the file (nothing is published).

    The state files in `CLOCKED_STATE` lose their timing values in the published copy, and the files of
    `PROCESS_STATE` are left out of it; its recorded checksums follow (scratch/, where a run resumes, keeps
    everything as saved).
    """
    from tandem.checkpoints import (complete_checkpoints, copy_verified, damaged_checkpoints, drop_clock,
                                    drop_files)
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
        drop_files(Path(out_dir) / ckpt.name, PROCESS_STATE)
        names.append(ckpt.name)
    return names


def publish_targets(outputs: dict, arm: str) -> dict[str, Path]:
    """The declared outputs of one arm, which change together: its checkpoints, summary, headline metric and
    per-step table."""
    return {"checkpoints": Path(outputs["checkpoints"]) / arm, "metrics": Path(outputs[f"metrics_{arm}"]),
            "headline": Path(outputs[f"headline_{arm}"]), "plot": Path(outputs[f"plot_{arm}"])}


def timing_targets(outputs: dict, arm: str) -> dict[str, Path]:
    """The untracked timing sidecars of one arm's summary and per-step table: optional outputs of the same
    transaction, so they change with the outputs they belong to."""
    targets = publish_targets(outputs, arm)
    return {f"{k}_timing": timing_path(targets[k]) for k in ("metrics", "plot")}


def _write_outputs(dest: dict, final: dict, work_dir: Path, summary: dict, rows: list[dict]) -> None:
    """The arm's outputs into `dest` (the transaction's staged paths), the timing sidecars too (staged as
    `<name>_timing` where the transaction declares them, else beside the `final` paths)."""
    materialise(work_dir, Path(dest["checkpoints"]))
    write_metrics(dest["metrics"], summary,  # step and phase times
                  timing_to=dest.get("metrics_timing") or timing_path(final["metrics"]))
    write_json(dest["headline"], headline.train(summary))
    write_step_table(Path(dest["plot"]), rows, timing_to=dest.get("plot_timing") or timing_path(final["plot"]))


def run_arm(params: Params, arm: str, inputs: dict, outputs: dict) -> dict:
    """Train one arm and write its summary and per-step table; returns the summary.

    With `train.num_processes` > 1 outside a launched worker this launches the workers and waits for them.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:  # refuse a folder remote on an ephemeral worker before any work (tasks/durable.py)
        durable.ResumeStore.from_env(params.out_root)
    if params.train.num_processes > 1 and world == 1:
        if Path(inputs["base_model"]).exists():  # a damaged base is named here, not by N workers at once
            from tandem.models import check_model_dir

            check_model_dir(inputs["base_model"])
        _check_plan(params, arm, inputs)  # a plan that cannot fit is refused before any process starts
        summary = launch.launch_arm(params, arm, inputs, outputs, publish_targets(outputs, arm),
                                    timing_targets(outputs, arm))
    else:
        summary = _run_in_this_process(params, arm, inputs, outputs)
    if launch.machines(params).rank > 0:  # another machine of a multi-machine run: machine 0 publishes
        return summary
    # the published checkpoints as the arm's W&B artifact (a no-op unless W&B is on; never raises)
    tracking.log_checkpoints(params, arm, publish_targets(outputs, arm)["checkpoints"],
                             work_dir=Path(outputs["scratch"]) / arm)
    return summary


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
    junior_dir = junior_of(params, inputs)
    senior, junior = load_model(base, senior_dtype, trust), load_model(junior_dir, junior_dtype, trust)
    # a junior of its own: the senior's base stays the drift reference (KL diagnostic, kl_reg)
    base_ref = None if junior_dir == base else load_model(base, junior_dtype, trust)
    tokenizer = load_tokenizer(base, trust)
    main = int(os.environ.get("RANK", "0")) == 0
    store = durable.ResumeStore.from_env(params.out_root) if main else None
    # hashes the weights: once, where the resume store or the W&B run needs it
    fingerprint = (run_fingerprint_of(params, arm, junior, base_ref)
                   if main and (store is not None or tracking.enabled(params)) else None)
    on_save = _durable_resume(params, arm, Path(outputs["scratch"]) / arm, store, fingerprint)
    # the W&B run of this arm (rank 0 logs; the trainer's W&B callback logs into it)
    tracked = (tracking.arm_run(params, arm, fingerprint, work_dir=Path(outputs["scratch"]) / arm)
               if tracking.enabled(params) and main else nullcontext())
    with tracked:
        res = train_arm(ArmRun(arm, senior, junior, tokenizer, train_rows, params.train, params.rollout,
                               Path(outputs["scratch"]) / arm, seed=params.seed, val_rows=val_rows,
                               weight_roots=weight_roots(params, junior_dir), base=base_ref, on_save=on_save))
    res.summary["junior"] = junior_record(params, junior_dir)
    if int(os.environ.get("RANK", "0")) == 0:  # one writer; every rank holds the same history
        work, rows = Path(outputs["scratch"]) / arm, step_rows(res.log_history)
        if publish_to is not None:  # a launched worker: the launching stage commits what it writes there
            _write_outputs(publish_to, publish_targets(outputs, arm), work, res.summary, rows)
        else:
            with stage_outputs(params, f"train-{arm}", publish_targets(outputs, arm),
                               timing_targets(outputs, arm)) as staged:
                _write_outputs(staged, publish_targets(outputs, arm), work, res.summary, rows)
    return res.summary


def weight_roots(params: Params, junior_dir: Path) -> tuple[Path, Path]:
    """The directories an arm's rollout service may load weights from: the run's output root and the junior's
    (the service starts from the junior's directory, the senior's engine from the base's where the two
    architectures differ: `senior_start_dir`; tasks/cluster.py starts it the same way on a Ray cluster)."""
    return Path(params.out_root), Path(junior_dir)


def _durable_resume(params: Params, arm: str, work: Path, store: durable.ResumeStore | None, fingerprint: str | None):
    """With a resume store (`TANDEM_RESUME_REMOTE` set, tasks/durable.py; the main process alone opens it): pull the
    checkpoints of the run `fingerprint` that the remote holds into `work` (training then resumes from the last
    one), and return the hook that pushes each new checkpoint there; None without a store."""
    if store is None:
        return None
    if params.train.resume == "auto":
        latest = store.pull(fingerprint, arm, work)
        if latest is not None:
            print(f"train: arm {arm}: checkpoints up to step {latest} pulled from DVC remote {store.name!r}",
                  file=sys.stderr)
    return lambda step_dir: store.push_step(fingerprint, arm, step_dir)


def run_fingerprint_of(params: Params, arm: str, junior, base=None) -> str:
    """The fingerprint the trainer gives this arm's run (its checkpoints carry it; resume needs it to match)."""
    from tandem.train import arm_spec, run_fingerprint
    from tandem.train.numerics import weights_hash

    key = weights_hash(junior) if base is None else f"{weights_hash(junior)}:{weights_hash(base)}"
    return run_fingerprint(arm_spec(arm, params.train, params.rollout), params.train, params.rollout, params.seed,
                           key)


KEEP = ("steps", "reward_first", "reward_last", "senior_fraction", "handoffs_per_completion", "kl_to_base_last",
        "zero_variance_groups", "val_accuracy_initial", "val_accuracy_last", "step_seconds", "phase_seconds",
        "junior_unchanged", "junior", "checkpoints")


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
    done = {arm: run_arm(params, arm, inputs, outputs) for arm in params.train.arms}
    if launch.machines(params).rank > 0:  # machine 0's stage publishes and collects the arms' numbers
        return done
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
        return launch.launcher_main(argv[1:])
    a = ap.parse_args(argv)
    apply_tool_env()
    if a.worker:
        return launch.worker_main(Path(a.worker), _run_in_this_process)
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


if __name__ == "__main__":
    sys.exit(main())
