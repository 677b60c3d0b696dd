"""W&B around the stages (the library never imports wandb): run grouping, resume, evaluation tables.

Training logs to W&B through trl's `report_to`, whose `wandb.init` reads the `WANDB_*` environment, so
`arm_run` only sets that environment for the arm's duration: the group (one per pipeline run), the job type,
tags, and a run id derived from the arm's run fingerprint with `resume=allow`, so a rerun after a crash
continues the same W&B run instead of opening a new one. `log_evaluation` opens a run of job type
`evaluate` in the same group and logs the pass@k results and sample completions as tables. Everything is a
no-op unless `train.report_to` is `wandb`; the mode comes from `WANDB_MODE` or `train.wandb_mode`.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

from tandem.config import Params
from tasks.common import Layout, read_json, read_jsonl

PREFIX = "tandem"


def enabled(params: Params) -> bool:
    return params.train.report_to == "wandb"


def arm_run_id(params: Params, arm: str) -> str:
    """A stable W&B run id for `arm`: the same settings and base model give the same id (and resume)."""
    from tandem.evaluation import content_hash
    from tandem.train import arm_spec, run_fingerprint

    base = content_hash(Layout.of(params).base_model)
    fp = run_fingerprint(arm_spec(arm, params.train, params.rollout), params.train, params.rollout, params.seed, base)
    return f"{PREFIX}-{arm}-{fp}"


def _tags(params: Params, *extra: str) -> list[str]:
    return [t for t in [PREFIX, params.model.source, params.rollout.backend, *extra] if t]


@contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def arm_run(params: Params, arm: str, group: str) -> Iterator[str | None]:
    """The W&B environment of one training arm (yields its run id, None when W&B is off)."""
    if not enabled(params):
        yield None
        return
    run_id = arm_run_id(params, arm)
    with _env({"WANDB_RUN_GROUP": group, "WANDB_JOB_TYPE": "train", "WANDB_TAGS": ",".join(_tags(params, arm)),
               "WANDB_RUN_ID": run_id, "WANDB_RESUME": "allow", "WANDB_NAME": f"{group}-train-{arm}"}):
        yield run_id


def evaluation_rows(params: Params) -> tuple[list[str], list[list]]:
    """metrics/eval.json as one row per (arm, step, mode, benchmark) with pass@k columns."""
    ev = read_json(Layout.of(params).metrics / "eval.json")
    ks = list(params.evaluate.ks)
    cols = ["arm", "step", "mode", "benchmark", *[f"pass@{k}" for k in ks]]
    rows = []
    for arm, a in sorted(ev.get("arms", {}).items()):
        for c in a.get("checkpoints", []):
            for mode, by_bench in sorted((c.get("modes") or {}).items()):
                for bench, s in sorted((by_bench.get("benchmarks") or by_bench).items()):
                    if isinstance(s, dict) and any(f"pass@{k}" in s for k in ks):
                        rows.append([arm, c.get("step"), mode, bench, *[s.get(f"pass@{k}") for k in ks]])
    return cols, rows


def sample_rows(params: Params, per_file: int = 2, limit: int = 60) -> tuple[list[str], list[list]]:
    """A few saved completions per generations file (results/generations/<arm>/step-<N>/<mode>/<bench>.jsonl)."""
    cols = ["arm", "step", "mode", "benchmark", "id", "completion", "answer", "score"]
    root = Layout.of(params).generations
    rows: list[list] = []
    for f in sorted(root.rglob("*.jsonl")):
        parts = f.relative_to(root).parts  # arm, step-N, mode, bench.jsonl
        arm, step, mode = (list(parts[:-1]) + ["", "", ""])[:3]
        for r in read_jsonl(f)[:per_file]:
            rows.append([arm, step, mode, f.stem, str(r.get("id", "")), str(r.get("text", ""))[:4000],
                         str(r.get("answer", "")), r.get("score")])
            if len(rows) >= limit:
                return cols, rows
    return cols, rows


def log_evaluation(params: Params, group: str) -> str | None:
    """One W&B run (job type `evaluate`) with the results and sample completions as tables; its id."""
    if not enabled(params):
        return None
    import wandb

    runs = Layout.of(params).runs / "wandb"
    runs.mkdir(parents=True, exist_ok=True)
    run = wandb.init(project=params.train.wandb_project, group=group, job_type="evaluate",
                     tags=_tags(params, "evaluation"), name=f"{group}-evaluate", dir=str(runs),
                     mode=os.environ.get("WANDB_MODE", params.train.wandb_mode), reinit="finish_previous")
    try:
        cols, rows = evaluation_rows(params)
        run.log({"evaluation/pass_at_k": wandb.Table(columns=cols, data=rows)})
        scols, srows = sample_rows(params)
        run.log({"evaluation/samples": wandb.Table(columns=scols, data=srows)})
        return run.id
    finally:
        run.finish()

