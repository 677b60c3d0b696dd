"""W&B around the stages (the library never imports wandb): one run per training arm, per evaluation, per report.

Every run is created explicitly with `wandb.init(id=..., name=..., group=..., job_type=..., tags=...,
resume="allow", reinit="finish_previous")`; nothing goes through `WANDB_*` environment variables, which wandb
reads once per process (a second arm in the same process would otherwise log into the first arm's run).
transformers' W&B callback (trl's `report_to: wandb`) finds the arm's run as `wandb.run` and logs into it.

- Ids are stable: an arm's id is its training run's fingerprint (settings, seed, base weights), an
  evaluation's and a report's come from the content they log, so a rerun after a crash continues the same run.
- The group is the pipeline run: the Prefect flow run's name (`pipeline_group`, handed to the stage processes
  through TANDEM_RUN_GROUP), else, for `dvc repro`, a fingerprint of the params, so the stage processes of
  one configuration share it.
- wandb prints nothing (`silent`, no console capture): the run logs carry one line per run instead.

Everything is a no-op unless `train.report_to` is `wandb`; the mode comes from `WANDB_MODE` or
`train.wandb_mode`; files go to `runs/wandb/` (offline runs: `wandb sync runs/wandb/offline-run-*`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from tandem.config import Params
from tasks.common import Layout, read_json, read_jsonl

PREFIX = "tandem"
GROUP_ENV = "TANDEM_RUN_GROUP"  # the pipeline run's name, set by the flow for its stages (and their workers)
log = logging.getLogger("tasks.tracking")


def enabled(params: Params) -> bool:
    return params.train.report_to == "wandb"


def mode(params: Params) -> str:
    return os.environ.get("WANDB_MODE") or params.train.wandb_mode


def _digest(obj: Any, n: int = 16) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:n]


def group(params: Params) -> str:
    """The W&B group of every run of this pipeline run (see the module docstring)."""
    return os.environ.get(GROUP_ENV) or f"{PREFIX}-{_digest(params.to_dict(), 10)}"


@contextmanager
def pipeline_group(name: str) -> Iterator[None]:
    """Within the block, every run (of this process and of the stage processes it starts) joins group `name`."""
    old = os.environ.get(GROUP_ENV)
    os.environ[GROUP_ENV] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(GROUP_ENV, None)
        else:
            os.environ[GROUP_ENV] = old


def _tags(params: Params, *extra: str) -> list[str]:
    return [t for t in [PREFIX, params.model.source, params.rollout.backend, *extra] if t]


def init_run(params: Params, *, run_id: str, name: str, job_type: str, tags: list[str],
             config: dict | None = None):
    """An explicit W&B run (resumed when `run_id` exists), made the process's current run (`wandb.run`)."""
    import wandb

    runs = Layout.of(params).runs
    runs.mkdir(parents=True, exist_ok=True)
    run = wandb.init(project=params.train.wandb_project, id=run_id, name=name, group=group(params),
                     job_type=job_type, tags=tags, config=config, dir=str(runs.resolve()), mode=mode(params),
                     resume="allow", reinit="finish_previous",
                     # wandb's banners and end-of-run summaries stay out of the stage logs; no console capture
                     # (the flow routes the streams itself) and no system-metrics sampler thread
                     settings=wandb.Settings(silent=True, console="off", x_disable_stats=True))
    where = f" in {runs / 'wandb'}" if mode(params) == "offline" else ""
    log.info("W&B %s run %s (%s, group %s)%s", job_type, run_id, mode(params), group(params), where)
    return run


# --------------------------------------------------------------------------------------------------
# Training arms
# --------------------------------------------------------------------------------------------------

def arm_run_id(arm: str, fingerprint: str) -> str:
    """An arm's W&B run id: its training run's fingerprint (settings, seed, base weights), the one its checkpoints
    carry, so a resumed training continues the same W&B run and any change starts a new one."""
    return f"{PREFIX}-{arm}-{fingerprint}"


@contextmanager
def arm_run(params: Params, arm: str, fingerprint: str) -> Iterator[Any]:
    """The W&B run of one training arm for the enclosed training (yields it; None when W&B is off).

    The trainer's W&B callback logs every step into it (`train/global_step` is its step axis)."""
    if not enabled(params):
        yield None
        return
    run = init_run(params, run_id=arm_run_id(arm, fingerprint), name=f"{group(params)}-train-{arm}",
                   job_type="train", tags=_tags(params, f"arm:{arm}"),
                   config={"arm": arm, "seed": params.seed, "fingerprint": fingerprint,
                           "rollout": params.to_dict()["rollout"]})
    try:
        yield run
    except BaseException:
        run.finish(exit_code=1)
        raise
    run.finish()


# --------------------------------------------------------------------------------------------------
# Evaluation and report
# --------------------------------------------------------------------------------------------------

def evaluation_rows(params: Params) -> tuple[list[str], list[list]]:
    """metrics/eval.json as one row per (arm, step, mode, benchmark) with pass@k columns."""
    ev = read_json(Layout.of(params).metrics / "eval.json")
    ks = list(params.evaluate.ks)
    cols = ["arm", "step", "mode", "benchmark", *[f"pass@{k}" for k in ks]]
    rows = []
    for arm, a in sorted(ev.get("arms", {}).items()):
        for c in a.get("checkpoints", []):
            for mode_, by_bench in sorted((c.get("modes") or {}).items()):
                for bench, s in sorted((by_bench.get("benchmarks") or by_bench).items()):
                    if isinstance(s, dict) and any(f"pass@{k}" in s for k in ks):
                        rows.append([arm, c.get("step"), mode_, bench, *[s.get(f"pass@{k}") for k in ks]])
    return cols, rows


def checkpoint_history(params: Params) -> list[tuple[int, dict[str, float]]]:
    """(step, {"<arm>/<mode>/pass@<k>": macro value}) per evaluated checkpoint step, in step order: the
    evaluation run's history, so W&B draws each arm's pass@k against the training step."""
    ev = read_json(Layout.of(params).metrics / "eval.json")
    by_step: dict[int, dict[str, float]] = {}
    for arm, a in ev.get("arms", {}).items():
        for c in a.get("checkpoints", []):
            row = by_step.setdefault(int(c.get("step", 0)), {})
            for mode_, block in (c.get("modes") or {}).items():
                for key, value in (block.get("macro") or {}).items():
                    if key.startswith("pass@") and isinstance(value, (int, float)):
                        row[f"{arm}/{mode_}/{key}"] = value
    return sorted(by_step.items())


def sample_rows(params: Params, per_file: int = 2, limit: int = 60) -> tuple[list[str], list[list]]:
    """A few saved completions per generations file (results/generations/<arm>/step-<N>/<mode>/<bench>.jsonl)."""
    cols = ["arm", "step", "mode", "benchmark", "id", "completion", "answer", "score"]
    root = Layout.of(params).generations
    rows: list[list] = []
    for f in sorted(root.rglob("*.jsonl")):
        parts = f.relative_to(root).parts  # arm, step-N, mode, bench.jsonl
        arm, step, mode_ = (list(parts[:-1]) + ["", "", ""])[:3]
        for r in read_jsonl(f)[:per_file]:
            rows.append([arm, step, mode_, f.stem, str(r.get("id", "")), str(r.get("text", ""))[:4000],
                         str(r.get("answer", "")), r.get("score")])
            if len(rows) >= limit:
                return cols, rows
    return cols, rows


def _evaluation_id(params: Params) -> str:
    ev = read_json(Layout.of(params).metrics / "eval.json")
    what = {"settings": ev.get("settings"), "junior": (ev.get("junior") or {}).get("hash"),
            "checkpoints": {a: [c.get("hash") for c in d.get("checkpoints", [])] for a, d in ev.get("arms", {}).items()}}
    return f"{PREFIX}-evaluate-{_digest(what)}"


def log_evaluation(params: Params) -> str | None:
    """One W&B run (job type `evaluate`): pass@k per checkpoint as its history, the final numbers in its
    summary, the results and sample completions as tables; returns its id."""
    if not enabled(params) or mode(params) == "disabled":
        return None
    import wandb

    run = init_run(params, run_id=_evaluation_id(params), name=f"{group(params)}-evaluate", job_type="evaluate",
                   tags=_tags(params, "evaluation"), config={"evaluate": params.to_dict()["evaluate"],
                                                            "seed": params.seed})
    try:
        for step, values in checkpoint_history(params):
            run.log({**values, "checkpoint_step": step}, step=step)
        summary = read_json(Layout.of(params).metrics / "eval.json").get("summary") or {}
        run.summary.update({f"final/{arm}/{k}": v for arm, s in summary.items() for k, v in s.items()})
        cols, rows = evaluation_rows(params)
        scols, srows = sample_rows(params)
        run.log({"evaluation/pass_at_k": wandb.Table(columns=cols, data=rows),
                 "evaluation/samples": wandb.Table(columns=scols, data=srows)})
        return run.id
    finally:
        run.finish()


def log_report(params: Params, figures: list[tuple[str, Path, str]]) -> str | None:
    """The report's figures ((name, png path, caption) each) as one W&B run of job type `report`; its id."""
    if not enabled(params) or mode(params) == "disabled" or not figures:
        return None
    import wandb

    run_id = f"{PREFIX}-report-{_digest([hashlib.sha256(Path(p).read_bytes()).hexdigest() for _, p, _ in figures])}"
    run = init_run(params, run_id=run_id, name=f"{group(params)}-report", job_type="report",
                   tags=_tags(params, "report"), config={"seed": params.seed})
    try:
        run.log({f"report/{name}": wandb.Image(str(path), caption=caption) for name, path, caption in figures})
        return run.id
    finally:
        run.finish()
