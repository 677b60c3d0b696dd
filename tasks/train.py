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
"""

from __future__ import annotations

import csv
import os
import shutil
import sys
from pathlib import Path

from tandem.config import Params
from tasks.common import Layout, atomic_path, load_params, read_jsonl, write_json


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
    from tandem.train import TABLE_COLUMNS

    with atomic_path(path) as tmp:
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(TABLE_COLUMNS))
            w.writeheader()
            for r in rows:
                w.writerow({k: ("" if v is None else v) for k, v in r.items()})


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or links not allowed
        shutil.copy2(src, dst)


def materialise(work_dir: Path, out_dir: Path) -> list[str]:
    """`out_dir` := the complete checkpoints of `work_dir` (hard links, copies where linking fails), atomically.

    Nothing ever writes into a committed checkpoint, so sharing its files with the output is safe.
    """
    from tandem.train import complete_checkpoints

    names = []
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        for _, ckpt in complete_checkpoints(work_dir):
            shutil.copytree(ckpt, tmp / ckpt.name, copy_function=_link_or_copy)
            names.append(ckpt.name)
    return names


def run_arm(params: Params, arm: str, inputs: dict, outputs: dict) -> dict:
    """Train one arm and write its summary and per-step table; returns the summary."""
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
                        Path(outputs["scratch"]) / arm, seed=params.seed, val_rows=val_rows)
    finally:
        _finish_wandb(params)
    materialise(Path(outputs["scratch"]) / arm, Path(outputs["checkpoints"]) / arm)
    write_json(outputs[f"metrics_{arm}"], res.summary)
    write_step_table(Path(outputs[f"plot_{arm}"]), step_rows(res.log_history))
    return res.summary


KEEP = ("steps", "reward_first", "reward_last", "senior_fraction", "handoffs_per_completion", "kl_to_base_last",
        "zero_variance_groups", "val_accuracy_initial", "val_accuracy_last", "step_seconds", "phase_seconds",
        "junior_unchanged", "checkpoints")


def collect(params: Params, inputs: dict | None = None, outputs: dict | None = None) -> dict:
    """The headline numbers of every arm, from the per-arm summaries (nothing is written: each arm's own
    `metrics/train_<arm>.json` is its DVC stage's metric)."""
    from tasks.common import read_json

    do = {**default_io(params)[1], **(outputs or {})}
    out = {}
    for arm in params.train.arms:
        path = Path(do[f"metrics_{arm}"])
        if not path.exists():
            raise FileNotFoundError(f"train: {path} is missing (arm {arm!r} has not been trained)")
        summary = read_json(path)
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
    a = ap.parse_args(argv)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
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
