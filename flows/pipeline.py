"""The `tandem-pipeline` Prefect flow: prepare -> base -> train (per arm) -> evaluate (mapped) -> analyze -> report.

Orchestration only: every task calls a `tasks/<stage>` function on the paths `default_io` declares (the same
calls `dvc repro` makes through `tandem stage <name>`), then `dvc commit`s the stage (flows/dvc_sync.py) so
that after a flow run `dvc status` is clean and `dvc.lock` describes what the flow produced. A stage that
`dvc.lock` already records as current is skipped, as `dvc repro` would skip it: a scheduled rerun with
nothing changed trains nothing. Evaluation is mapped over `tasks.evaluate.plan` units, one task run per
(arm, checkpoint, mode), each publishing a table artifact of pass@k per benchmark; the report task
publishes a markdown artifact linking the HTML report.

Retries only where a failure can be transient: the base stage when it downloads from the hub, and the DVC
push to remote storage. Training never retries (a retry would silently redo minutes to hours of work; it
resumes from its last complete checkpoint when rerun on purpose).

`tandem-evaluation` reruns evaluate -> analyze -> report on whatever checkpoints exist (new checkpoints
from elsewhere), without training. Both flows are deployed by infra/prefect.yaml.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task, unmapped
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.task_runners import ThreadPoolTaskRunner

from flows import progress
from flows.dvc_sync import DvcSync
from tandem.config import Params
from tasks.common import load_params

# The pipeline's stages in order; dvc.yaml must list the same (tests/flows/test_pipeline.py checks).
STAGES = ("prepare", "base", "train", "evaluate", "analyze", "report")


def eval_workers() -> int:
    """Evaluation units run at once (TANDEM_EVAL_WORKERS). Default 1: on a small CPU, parallel units only
    fight over the same cores; on a large GPU box, raise it to overlap units."""
    raw = os.environ.get("TANDEM_EVAL_WORKERS", "1")
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"TANDEM_EVAL_WORKERS must be an integer >= 1, got {raw!r}")
    return int(raw)


def _stage(name: str):
    return importlib.import_module(f"tasks.{name}")


def _artifact_key(*parts: Any) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9]+", "-", "-".join(str(p) for p in parts).lower()).strip("-")


def is_current(name: str, sync: DvcSync, force: bool) -> bool:
    """Whether dvc.lock already records stage `name` as up to date (then it is skipped, as by dvc repro)."""
    if force or not sync.enabled or not sync.up_to_date(name):
        return False
    get_run_logger().info("%s: up to date in dvc.lock, skipped", name)
    return True


def run_stage(name: str, params: Params, sync: DvcSync, force: bool) -> dict:
    """One whole stage: `tasks.<name>.run` on its declared paths, then `dvc commit <name>`."""
    view = progress.current()
    if is_current(name, sync, force):
        view.set_state(name, name, "skipped")
        return {"skipped": True}
    mod = _stage(name)
    inputs, outputs = mod.default_io(params)
    with view.track(name, name):
        summary = mod.run(params, inputs, outputs)
        sync.commit(name)
    return summary or {}


# --------------------------------------------------------------------------------------------------
# Tasks (thin wrappers; the work is in tasks/)
# --------------------------------------------------------------------------------------------------

@task(name="prepare", task_run_name="prepare", cache_policy=NO_CACHE)
def prepare_task(params: Params, sync: DvcSync, force: bool) -> dict:
    return run_stage("prepare", params, sync, force)


@task(name="base", task_run_name="base", cache_policy=NO_CACHE, retry_delay_seconds=[10, 60])
def base_task(params: Params, sync: DvcSync, force: bool) -> dict:
    return run_stage("base", params, sync, force)


@task(name="train", task_run_name="train-{arm}", cache_policy=NO_CACHE, retries=0)
def train_arm_task(params: Params, arm: str) -> dict:
    mod = _stage("train")
    inputs, outputs = mod.default_io(params)
    with progress.current().track("train", f"train-{arm}"):
        return mod.run_arm(params, arm, inputs, outputs) or {}


@task(name="train-commit", task_run_name="train-commit", cache_policy=NO_CACHE)
def train_commit_task(params: Params, sync: DvcSync) -> dict:
    """After every arm: the stage's own aggregation when it has one (`collect`), then `dvc commit train`."""
    mod = _stage("train")
    inputs, outputs = mod.default_io(params)
    with progress.current().track("train", "train-commit"):
        summary = mod.collect(params, inputs, outputs) if hasattr(mod, "collect") else {}
        sync.commit("train")
    return summary or {}


@task(name="evaluate-plan", task_run_name="evaluate-plan", cache_policy=NO_CACHE)
def evaluate_plan_task(params: Params) -> list[dict]:
    mod = _stage("evaluate")
    inputs, _ = mod.default_io(params)
    return mod.plan(params, inputs)


def unit_label(unit: dict) -> str:
    return f"evaluate-{unit['arm']}-step-{unit['step']}-{unit['mode']}"


@task(name="evaluate", task_run_name="evaluate-{unit[arm]}-step-{unit[step]}-{unit[mode]}", cache_policy=NO_CACHE)
def evaluate_unit_task(params: Params, unit: dict) -> dict:
    """One (arm, checkpoint, mode) unit on every benchmark; publishes its pass@k table as an artifact."""
    mod = _stage("evaluate")
    inputs, outputs = mod.default_io(params)
    with progress.current().track("evaluate", unit_label(unit)):
        summaries = mod.run_unit(params, unit, inputs, outputs)
    ks = params.evaluate.ks
    rows = [{"benchmark": b, "problems": s.get("n_problems"), **{f"pass@{k}": s.get(f"pass@{k}") for k in ks},
             "senior_share": s.get("senior_share"), "mean_tokens": s.get("mean_tokens")}
            for b, s in sorted(summaries.items())]
    create_table_artifact(
        key=_artifact_key("eval", unit["arm"], "step", unit["step"], unit["mode"]), table=rows,
        description=f"pass@k per benchmark: {unit['arm']} step {unit['step']}, {unit['mode']} mode "
                    f"({params.evaluate.n_samples} samples per problem)")
    return summaries


@task(name="evaluate-collect", task_run_name="evaluate-collect", cache_policy=NO_CACHE)
def evaluate_collect_task(params: Params, sync: DvcSync) -> dict:
    mod = _stage("evaluate")
    inputs, outputs = mod.default_io(params)
    with progress.current().track("evaluate", "evaluate-collect"):
        summary = mod.collect(params, inputs, outputs)
        sync.commit("evaluate")
    return summary or {}


@task(name="analyze", task_run_name="analyze", cache_policy=NO_CACHE)
def analyze_task(params: Params, sync: DvcSync, force: bool) -> dict:
    return run_stage("analyze", params, sync, force)


@task(name="report", task_run_name="report", cache_policy=NO_CACHE)
def report_task(params: Params, sync: DvcSync, force: bool) -> dict:
    mod = _stage("report")
    summary = run_stage("report", params, sync, force)
    if summary.get("skipped"):  # the report on disk is current: publish it again for this run
        summary = {**mod.existing_summary(params), "skipped": True}
    create_markdown_artifact(key="tandem-report", markdown=mod.artifact_markdown(params, summary),
                             description="Tandem RL results report")
    return summary


@task(name="promote", task_run_name="promote", cache_policy=NO_CACHE)
def promote_task(params: Params, sync: DvcSync, tag: bool) -> dict:
    """Promote this run's best checkpoint when the regression gate passes (scheduled retraining)."""
    from prefect.runtime import flow_run

    from tasks import promotion
    from tasks.common import Layout, read_json

    decision = promotion.decision_for(params, read_json(Layout.of(params).metrics / "eval.json"))
    logger = get_run_logger()
    if not decision.promote:
        logger.info("promotion: keeping the promoted checkpoint: %s", decision.reason)
        return decision.to_dict()
    rec = promotion.record(params, decision, run_id=str(flow_run.id or ""),
                           tag_repo=(sync.root if tag and sync.enabled else None),
                           provenance={"dvc_sync": sync.reason})
    logger.info("promotion: promoted %s/step-%s (%s)%s", decision.candidate.arm, decision.candidate.step,
                decision.reason, f", tagged {rec['git_tag']}" if rec.get("git_tag") else "")
    return {**decision.to_dict(), "record": rec}


@task(name="dvc-push", task_run_name="dvc-push", cache_policy=NO_CACHE, retries=3, retry_delay_seconds=[10, 60, 300])
def push_task(sync: DvcSync, remote: str | None) -> None:
    sync.push(remote)


# --------------------------------------------------------------------------------------------------
# Flows
# --------------------------------------------------------------------------------------------------

def _live_view(live: bool | None) -> bool:
    if live is not None:
        return live
    from prefect.runtime import deployment

    return sys.stderr.isatty() and deployment.id is None and os.environ.get("CI") is None


def _train(params: Params, sync: DvcSync, view: progress.ProgressView, force: bool) -> dict:
    arms = list(params.train.arms)
    if is_current("train", sync, force):
        for a in arms:
            view.set_state("train", f"train-{a}", "skipped")
        view.set_state("train", "train-commit", "skipped")
        return {"skipped": True}
    # Arms run one after another: each needs the whole machine (cores or GPU), and trl's accelerate state
    # is process-wide.
    out = {a: train_arm_task(params, a) for a in arms}
    out["commit"] = train_commit_task(params, sync)
    return out


def _evaluate_analyze_report(params: Params, sync: DvcSync, view: progress.ProgressView, force: bool) -> dict:
    out: dict[str, Any] = {}
    current = is_current("evaluate", sync, force)
    units = [] if current else evaluate_plan_task(params)
    for name in [unit_label(u) for u in units] + ["evaluate-collect"]:
        view.expect("evaluate", name)
    for name in ("analyze", "report"):
        view.expect(name, name)
    if current:
        view.set_state("evaluate", "evaluate-collect", "skipped")
        out["evaluate"] = {"skipped": True}
    else:
        evaluate_unit_task.map(unmapped(params), units).result()  # raises if any unit failed
        out["evaluate"] = evaluate_collect_task(params, sync)
    out["analyze"] = analyze_task(params, sync, force)
    out["report"] = report_task(params, sync, force)
    return out


def _setup(params_path: str, dvc: str, push: bool) -> tuple[Params, DvcSync]:
    params = load_params(params_path)
    sync = DvcSync.detect(params_path, params.out_root, dvc)
    if push and not sync.enabled:
        raise RuntimeError(f"push=True needs DVC sync, which is off: {sync.reason}")
    get_run_logger().info("DVC sync: %s", sync.reason)
    return params, sync


def _run_resources(params: Params, view: progress.ProgressView) -> dict:
    """Per-task wall time and peak memory of this run, written to metrics/run.json (the run's metadata)."""
    from tasks.common import Layout, peak_rss, torch_threads, write_json

    peaks = view.peak_memory()
    whole = peak_rss()
    doc = {"timing": view.timings(), "resources": {"peak_rss_mb_by_task": peaks, **whole,
                                                    "run_peak_rss_mb": max([*peaks.values(),
                                                                            whole["process_max_rss_mb"] or 0,
                                                                            whole["children_max_rss_mb"] or 0])},
           "torch_threads": torch_threads(), "cpu_count": os.cpu_count()}
    write_json(Layout.of(params).metrics / "run.json", doc)
    return doc["resources"]


def _finish(params: Params, sync: DvcSync, view: progress.ProgressView, summaries: dict, t0: float,
            promote: bool, tag: bool, push: bool, remote: str | None) -> dict:
    if promote:
        summaries["promotion"] = promote_task(params, sync, tag)
    if push:
        push_task(sync, remote)
    report = summaries.get("report", {}) or {}
    html = str(Path(report["html"]).resolve()) if report.get("html") else None
    md = str(Path(report["markdown"]).resolve()) if report.get("markdown") else None
    result = {"report": html, "markdown": md, "stages": summaries,
              "timings": view.timings(), "wall_seconds": round(time.perf_counter() - t0, 3), "dvc": sync.reason,
              "resources": _run_resources(params, view)}
    get_run_logger().info("report: %s", result["report"])
    if view.live_requested:
        print(f"\nReport: {result['report']}", file=sys.stderr)
    return result


@flow(name="tandem-pipeline", task_runner=ThreadPoolTaskRunner(max_workers=eval_workers()), persist_result=False,
      log_prints=False)
def tandem_pipeline(params_path: str = "params.yaml", dvc: str = "auto", force: bool = False, promote: bool = False,
                    tag: bool = False, push: bool = False, remote: str | None = None,
                    live: bool | None = None) -> dict:
    """Run every stage on `params_path` and return {'report': html path, 'stages': summaries, ...}.

    dvc: 'auto' commits each stage to dvc.lock when this run is the DVC project's run (and skips stages
    dvc.lock records as current), 'on' insists on that, 'off' never touches DVC. force: run every stage.
    promote/tag: scheduled retraining (promote the best checkpoint if no regression; also git-tag it).
    push: `dvc push` the results (to `remote`, default the project's default remote), with retries.
    live: terminal progress view (default: on when attached to a terminal and not under a deployment).
    """
    t0 = time.perf_counter()
    params, sync = _setup(params_path, dvc, push)
    view = progress.ProgressView(f"tandem-pipeline ({params_path})", live=_live_view(live))
    summaries: dict[str, Any] = {}
    with progress.activate(view):
        for stage, name in [("prepare", "prepare"), ("base", "base")] + \
                [("train", f"train-{a}") for a in params.train.arms] + [("train", "train-commit")]:
            view.expect(stage, name)
        summaries["prepare"] = prepare_task(params, sync, force)
        base = base_task.with_options(retries=2 if params.model.source == "hub" else 0)
        summaries["base"] = base(params, sync, force)
        summaries["train"] = _train(params, sync, view, force)
        summaries.update(_evaluate_analyze_report(params, sync, view, force))
    return _finish(params, sync, view, summaries, t0, promote, tag, push, remote)


@flow(name="tandem-evaluation", task_runner=ThreadPoolTaskRunner(max_workers=eval_workers()), persist_result=False,
      log_prints=False)
def tandem_evaluation(params_path: str = "params.yaml", dvc: str = "auto", force: bool = False,
                      promote: bool = False, tag: bool = False, push: bool = False, remote: str | None = None,
                      live: bool | None = None) -> dict:
    """Evaluate whatever checkpoints exist (new ones included), then analyze and report; no training."""
    t0 = time.perf_counter()
    params, sync = _setup(params_path, dvc, push)
    view = progress.ProgressView(f"tandem-evaluation ({params_path})", live=_live_view(live))
    with progress.activate(view):
        summaries = _evaluate_analyze_report(params, sync, view, force)
    return _finish(params, sync, view, summaries, t0, promote, tag, push, remote)


if __name__ == "__main__":  # pragma: no cover
    print(tandem_pipeline(params_path=sys.argv[1] if len(sys.argv) > 1 else "params.yaml")["report"])
