"""The tandem Prefect flows, composed from dvc.yaml: `tandem-pipeline`, `tandem-training`, `tandem-evaluation`.

One pipeline definition: the stages, their order and the per-arm fan-out come from dvc.yaml
(`flows.dvc_sync.pipeline_stages`), and every DVC stage (prepare, base, train@<arm>, evaluate, analyze,
report) is one task run calling `tasks/<stage>` on the paths its `default_io` declares, the same call
`tandem stage <name>` makes for `dvc repro`. After each stage the flow `dvc commit`s it; a stage DVC
reports up to date is a task run in the "Skipped" state. The evaluate stage fans out over
`tasks.evaluate.plan` units (one task run per arm x checkpoint x mode) in a subflow whose task runner is
chosen by the `eval_runner` parameter: threads on this machine, or a Dask cluster (`dask` = a local one,
`tcp://host:8786` = an existing scheduler). With `cluster.runner: ray` (tasks/cluster.py) every train arm and
every evaluation unit is a task on a Ray cluster through prefect-ray, holding the GPUs `cluster.train_gpus` /
`cluster.eval_gpus` reserve (`remote_options`); in the vLLM backend's dedicated layout an arm's two rollout
engines are one-GPU actors beside it, its rollout service started in the senior's (`cluster.reservation`).

The UI shows the work: the flow graph is dvc.yaml's (each stage's task run waits for the stages it reads from,
and nothing else links tasks), stage output goes to the run's logs (a stage's stdout and stderr through
`progress.stage_output`, other tasks' prints through `log_prints`, the `tandem`/`tasks` loggers through
PREFECT_LOGGING_EXTRA_LOGGERS, results as one formatted line each, and an evaluation unit's benchmarks one
line each as they finish), each training arm and evaluation unit has a progress artifact that moves while it
runs, each unit a rounded pass@k table next to it: keyless, so they live in their task runs. Keyed artifacts,
one entry each in the global catalog with a version per run, are kept for what is compared across runs: the
report (`tandem-report`), the promotion decision (`tandem-promotion`) and the evaluation's summary table
(`evaluation-summary`, which grows as units finish). Every flow run carries tags to find it by: its params
file, a fingerprint of its params, the git commit of its code and, under `dvc exp run`, the experiment's name
(`run_tags`); its task runs and its evaluation subflow carry them too. Tasks in the flow's main thread and
flows have timeouts (a thread-pool task's could not be enforced).

In a terminal the live view (`flows.progress`) is the display: DVC's progress bars and lock messages are off
around the flow's DVC calls (`flows.dvc_sync.quiet_dvc`), and the evaluation units run without their own tqdm
bars (`unit_params`): the flow reports a unit's progress itself.

State lives in DVC and git, never on a worker's disk: with `push` the flow uploads the committed outputs to
the DVC remote, with `publish` it commits dvc.lock to git and pushes it with the promotion tags (the
registry, tasks/promotion.py), so the next worker's clone + `dvc pull` starts where this one ended.

Retries only where a failure can be transient: the base stage when it downloads from the hub, and the DVC
push. Training never retries (it resumes from its last complete checkpoint when rerun on purpose).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml
from pydantic import BaseModel, Field
from prefect import flow, get_run_logger, tags, task, unmapped
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed, State
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.utilities.annotations import opaque, quote

from flows import progress
from flows.dvc_sync import DvcSync, StageSpec, find_project, pipeline_stages
from tasks import cluster, tracking
from tandem.config import Params
from tandem.workspace import workspace_lock
from tasks.common import load_params, run_root
from tasks.durable import check_remote_push

CODE_ROOT = Path(__file__).resolve().parents[1]
# The stage groups of dvc.yaml in file order (tasks/<group>.py each); the flow reads dvc.yaml itself.
STAGES = tuple(yaml.safe_load((CODE_ROOT / "dvc.yaml").read_text())["stages"])

HOUR = 3600
# Wall-clock limits: generous for the paper's model on GPUs, so only a hung task trips them. Only tasks that run in
# the flow's main thread carry one (Prefect cannot enforce a timeout in a worker thread, and says so at WARNING
# level): the evaluation units run on the task runner's threads, so their limit is the evaluation subflow's
# (`evaluate-unit` per unit).
TIMEOUTS = {"prepare": 2 * HOUR, "base": 12 * HOUR, "junior": 12 * HOUR, "train": 72 * HOUR, "evaluate-unit": 12 * HOUR,
            "evaluate": 2 * HOUR, "analyze": 12 * HOUR, "report": 2 * HOUR, "promote": 600, "sync": 4 * HOUR}
FLOW_TIMEOUT = 7 * 24 * HOUR


def eval_workers(params: Params) -> int:
    """Evaluation units run at once: `evaluate.workers` ($TANDEM_EVAL_WORKERS overrides it for a deployment).
    1 in the default run: on a small CPU, parallel units only fight over the same cores; on a large GPU box,
    raise it to overlap units."""
    return params.evaluate.workers


def _stage(name: str):
    return importlib.import_module(f"tasks.{name}")


# The keyed artifacts: what is compared across runs, one catalog entry each (Prefect keys allow lowercase letters,
# digits and dashes). Everything else a run shows is keyless, in the task run that made it.
REPORT_KEY = "tandem-report"
PROMOTION_KEY = "tandem-promotion"
SUMMARY_KEY = "evaluation-summary"


def _group() -> str:
    """The pipeline run's name: the W&B group of every run it opens."""
    from prefect.runtime import flow_run

    return str(flow_run.name or "local")


def skipped(name: str) -> Completed:
    return Completed(message=f"{name}: up to date in dvc.lock", name="Skipped", data={"skipped": True})


def is_current(name: str, sync: DvcSync, force: bool) -> bool:
    """Whether DVC reports stage `name` up to date (then it is skipped, as by `dvc repro`)."""
    if force or not sync.enabled or not sync.up_to_date(name):
        return False
    get_run_logger().info("%s: up to date in dvc.lock, skipped", name)
    return True


# --------------------------------------------------------------------------------------------------
# Tasks (thin wrappers; the work is in tasks/)
# --------------------------------------------------------------------------------------------------

# log_prints off for whole stages: their stdout and stderr reach the run's logs through
# `progress.stage_output`, which leaves `print` unpatched (see there why that matters)
@task(name="stage", task_run_name="{spec.name}", cache_policy=NO_CACHE, retries=0, log_prints=False)
def stage_task(params: Params, spec: StageSpec, sync: DvcSync, force: bool):
    """One DVC stage: `tasks.<group>.run` (or `run_arm(item)` for a foreach stage), then `dvc commit`."""
    view = progress.current()
    if is_current(spec.name, sync, force):
        view.set_state(spec.group, spec.name, "skipped")
        return skipped(spec.name)
    mod = _stage(spec.group)
    inputs, outputs = mod.default_io(params)
    with view.track(spec.group, spec.name), progress.stage_output(get_run_logger()):
        if spec.item is None:
            summary = mod.run(params, inputs, outputs)
        else:
            summary = _run_item(params, spec, mod, inputs, outputs)
        sync.commit(spec.name)
    get_run_logger().info("%s: done", spec.name)
    return summary or {}


def _run_item(params: Params, spec: StageSpec, mod, inputs: dict, outputs: dict) -> dict:
    """A foreach instance (one training arm), with a keyless progress artifact fed by its saved checkpoints (its
    W&B run is opened by the stage, `tasks.tracking.arm_run`, in the pipeline run's group)."""
    arm = spec.item
    total = getattr(getattr(params, spec.group, None), "steps", None)
    share = (progress.checkpoint_share(Path(outputs["checkpoints"]) / str(arm), total)
             if "checkpoints" in outputs and total else None)
    with progress.artifact(None, f"{spec.name}: training steps saved as checkpoints", share):
        return mod.run_arm(params, arm, inputs, outputs) or {}


@task(name="evaluate-plan", task_run_name="evaluate-plan", cache_policy=NO_CACHE, timeout_seconds=TIMEOUTS["evaluate"])
def evaluate_plan_task(params: Params) -> list[dict]:
    mod = _stage("evaluate")
    inputs, _ = mod.default_io(params)
    return mod.plan(params, inputs)


def unit_label(unit: dict) -> str:
    return f"evaluate-{unit['arm']}-step-{unit['step']}-{unit['mode']}"


def unit_params(params: Params) -> Params:
    """The params the evaluation units run on: without evaluation's own tqdm bars (`evaluate.progress`, for
    `tandem stage evaluate` and `dvc repro`). The flow shows a unit's progress itself: its row in the live view,
    its progress artifact and a log line per benchmark. The bars would scroll above the live view (a few lines
    per benchmark), and in a log file or a worker's output, which holds both, a bar's line and the benchmark's
    log line would land on one line. Not a result setting (`tandem.run_keys`): results and their cache are the
    same either way."""
    if not params.evaluate.progress:
        return params
    return dataclasses.replace(params, evaluate=dataclasses.replace(params.evaluate, progress=False))


def benchmark_sizes(mod, params: Params, inputs: dict) -> dict[str, int]:
    """Each benchmark's generations in a unit (rows x samples), in the order `run_unit` computes them; {} when the
    stage module cannot tell (the unit then logs no line per benchmark, only its result line)."""
    load = getattr(mod, "load_benchmarks", None)
    if load is None:
        return {}
    try:
        return {b: len(rows) * params.evaluate.n_samples for b, rows in load(params, inputs).items()}
    except Exception as e:  # noqa: BLE001 - the unit itself reports a benchmark it cannot read
        get_run_logger().debug("benchmark sizes unknown: %s", e)
        return {}


def benchmark_line(label: str, passed: progress.Passed) -> str:
    """'evaluate-tandem-step-8-solo: arith-long done (1 of 3), 16 generations in 2.1 s', with ', 1 cached' after
    the count when some benchmarks came from the result cache, and 'benchmark 1 of 2 done (1 cached)' when the
    cached ones leave it open which benchmark this was."""
    count, cached = f"{passed.index} of {passed.count}", f"{passed.done_before} cached" if passed.done_before else ""
    if passed.name:
        what = f"{passed.name} done ({count}{', ' + cached if cached else ''})"
    else:
        what = f"benchmark {count} done" + (f" ({cached})" if cached else "")
    return f"{label}: {what}, {passed.size} generations in {passed.seconds:.1f} s"


def _rounded(value: Any, decimals: int) -> Any:
    return round(value, decimals) if isinstance(value, float) else value


def unit_rows(params: Params, unit: dict | None, summaries: dict) -> list[dict]:
    """One row per benchmark of a unit (arm, step and mode first when `unit` is given), pass@k rounded to what
    the number of problems can resolve (`tandem.report.render.proportion_decimals`)."""
    from tandem.report.render import proportion_decimals

    rows = []
    for b, s in sorted(summaries.items()):
        d = proportion_decimals(s.get("n_problems") or 1)
        head = {"arm": unit["arm"], "step": unit["step"], "mode": unit["mode"]} if unit else {}
        rows.append({**head, "benchmark": b, "problems": s.get("n_problems"),
                     **{f"pass@{k}": _rounded(s.get(f"pass@{k}"), d) for k in params.evaluate.ks},
                     "senior share": _rounded(s.get("senior_share"), 2), "mean tokens": _rounded(s.get("mean_tokens"), 1)})
    return rows


def result_line(label: str, rows: list[dict], k: int) -> str:
    """'evaluate-tandem-step-8-solo: pass@1 arith-long 0.20, arith-short 0.97 (8 problems each)'."""
    from tandem.report.render import proportion_decimals

    def value(r: dict) -> str:
        v = r.get(f"pass@{k}")
        return "-" if not isinstance(v, (int, float)) else f"{v:.{proportion_decimals(r.get('problems') or 1)}f}"

    problems = sorted({r["problems"] for r in rows})
    each = f"{problems[0]} problems each" if len(problems) == 1 else "problems: " + ", ".join(map(str, problems))
    return f"{label}: pass@{k} " + ", ".join(f"{r['benchmark']} {value(r)}" for r in rows) + f" ({each})"


@task(name="evaluate-unit", task_run_name="evaluate-{unit[arm]}-step-{unit[step]}-{unit[mode]}",
      cache_policy=NO_CACHE)
def evaluate_unit_task(params: Params, unit: dict, refresh: bool = False) -> dict:
    """One (arm, checkpoint, mode) unit on every benchmark: a progress artifact that follows its generations
    while it runs and a log line per benchmark as it finishes, then its pass@k table (rounded) as a table
    artifact and one result line in the logs. Both artifacts are keyless: they belong to this task run.
    `refresh` (a forced run) recomputes what the evaluation's result cache already holds."""
    mod = _stage("evaluate")
    inputs, outputs = mod.default_io(params)
    label, view, logger = unit_label(unit), progress.current(), get_run_logger()
    done = progress.Counter(view, label)
    # run_unit's progress(done, total) feeds the artifact and the view, and marks each finished benchmark
    milestones = progress.Milestones(benchmark_sizes(mod, params, inputs),
                                     lambda passed: logger.info("%s", benchmark_line(label, passed)))

    def heard(n: int, total: int) -> None:
        done.update(n, total)
        milestones.update(n, total)

    # the flag only when set: a forced run must recompute, any other run calls run_unit as it always has
    force = {"refresh": True} if refresh else {}
    with view.track("evaluate", label), \
            progress.artifact(None, f"{label}: generations done, every benchmark of the unit", done.percent):
        summaries = mod.run_unit(params, unit, inputs, outputs, progress=heard, **force)
    rows = unit_rows(params, None, summaries)
    create_table_artifact(
        table=rows,
        description=f"{label}: pass@k per benchmark, {unit['arm']} step {unit['step']}, {unit['mode']} mode "
                    f"({params.evaluate.n_samples} samples per problem)")
    logger.info("%s", result_line(label, rows, params.evaluate.ks[0]))
    return summaries


@task(name="stage", task_run_name="evaluate", cache_policy=NO_CACHE, timeout_seconds=TIMEOUTS["evaluate"])
def evaluate_collect_task(params: Params, sync: DvcSync) -> dict:
    """The evaluate stage's own task run: assemble metrics/eval.json from the units (and log them to W&B, job type
    `evaluate`, in the pipeline run's group), then `dvc commit evaluate`."""
    mod = _stage("evaluate")
    inputs, outputs = mod.default_io(params)
    with progress.current().track("evaluate", "evaluate"):
        summary = mod.collect(params, inputs, outputs)
        sync.commit("evaluate")
    get_run_logger().info("evaluate: done")
    return summary or {}


def publish_summary(params: Params, done: dict[int, tuple[dict, dict]], n_units: int) -> None:
    """The running evaluation summary: every finished unit's rows (arm x checkpoint x mode x benchmark), as a new
    version of one table artifact, so the UI shows the evaluation filling in. Keyed: its last version per run is
    the evaluation's table, compared across runs."""
    rows = [r for _, (unit, summaries) in sorted(done.items()) for r in unit_rows(params, unit, summaries)]
    rows.sort(key=lambda r: (str(r["arm"]), int(r["step"]), str(r["mode"]), str(r["benchmark"])))
    create_table_artifact(key=SUMMARY_KEY, table=rows,
                          description=f"Evaluation so far: {len(done)} of {n_units} units done "
                                      f"({params.evaluate.n_samples} samples per problem; pass@k rounded to what "
                                      "the number of problems resolves)")


@flow(name="tandem-evaluate-units", persist_result=False, log_prints=True, timeout_seconds=FLOW_TIMEOUT)
def evaluate_units(params: Params, units: list[dict], refresh: bool = False) -> list[dict]:
    """The evaluation fan-out on the task runner the parent chose (threads or a Dask cluster); the running
    summary artifact is updated here, in the flow, as each unit finishes. `refresh`: recompute every unit,
    cached results included (a forced run)."""
    from prefect.futures import as_completed

    with cluster.reservation(params, "evaluate"):  # each unit's GPUs on a Ray cluster (cluster.runner ray)
        futures = list(evaluate_unit_task.map(unmapped(params), units, unmapped(refresh)))
    index = {f.task_run_id: i for i, f in enumerate(futures)}
    done: dict[int, tuple[dict, dict]] = {}
    for fut in as_completed(futures):
        try:
            result = fut.result()
        except Exception:  # noqa: BLE001 - a failed unit is raised below, once the others have finished
            continue
        i = index[fut.task_run_id]
        done[i] = (units[i], result)
        try:
            publish_summary(params, done, len(units))
        except Exception as e:  # noqa: BLE001 - the UI is a view: never fail the evaluation for it
            get_run_logger().warning("evaluation summary artifact not updated: %s", e)
    return [f.result() for f in futures]  # raises if any unit failed


def task_runner(spec: str, workers: int = 1):
    """`threads` (`workers` at once), `dask` (a local Dask cluster, one worker with that many threads)
    or a Dask scheduler address (`tcp://host:8786`: an existing cluster, e.g. dask-kubernetes)."""
    if spec == "threads":
        return ThreadPoolTaskRunner(max_workers=workers)
    if spec == "dask" or spec.startswith(("tcp://", "tls://")):
        try:
            from prefect_dask import DaskTaskRunner
        except ImportError:
            raise ValueError(f"eval_runner {spec!r} needs prefect-dask: pip install -e '.[dask]'") from None

        if spec == "dask":
            return DaskTaskRunner(cluster_kwargs={"n_workers": 1, "processes": False,
                                                  "threads_per_worker": workers, "dashboard_address": None})
        return DaskTaskRunner(address=spec)
    raise ValueError(f"eval_runner must be 'threads', 'dask' or a Dask scheduler address (tcp://...), got {spec!r}")


@task(name="promote", task_run_name="promote", cache_policy=NO_CACHE, timeout_seconds=TIMEOUTS["promote"])
def promote_task(params: Params, sync: DvcSync) -> dict:
    """Promote this run's best checkpoint when the regression gate passes: GTO tags in git (tasks/promotion.py)."""
    from prefect.runtime import flow_run

    from tasks import promotion
    from tasks.common import Layout, read_json

    decision = promotion.decision_for(params, read_json(Layout.of(params).metrics / "eval.json"))
    logger = get_run_logger()
    if not decision.promote:
        logger.info("promotion: keeping the promoted checkpoint: %s", decision.reason)
        _promotion_artifact(decision.to_dict())
        return decision.to_dict()
    if promotion.git_root(params) is None:
        logger.warning("promotion: gate passes (%s) but %s is no git work tree with a commit: nothing recorded",
                       decision.reason, params.out_root)
        _promotion_artifact({**decision.to_dict(), "recorded": False})
        return {**decision.to_dict(), "recorded": False}
    rec = promotion.record(params, decision, run_id=str(flow_run.id or ""), provenance={"dvc_sync": sync.reason})
    logger.info("promotion: promoted %s/step-%s (%s) as %s", decision.candidate.arm, decision.candidate.step,
                decision.reason, rec["git_tag"])
    result = {**decision.to_dict(), "record": rec}
    _promotion_artifact(result)
    return result


def promotion_markdown(result: dict) -> str:
    """The promotion decision as markdown: the verdict, its reason, and the candidate beside the promoted one."""
    cand, prev = result.get("candidate") or {}, result.get("previous") or {}
    rec = result.get("record") or {}
    if rec.get("git_tag"):
        head = f"promoted {cand.get('arm')}/step-{cand.get('step')} as `{rec['git_tag']}`"
    elif result.get("promote"):
        head = "the gate passes, but nothing was recorded (no git work tree with a commit)"
    else:
        head = "kept the promoted checkpoint"
    lines = [f"# Promotion: {head}", "", str(result.get("reason", "")), ""]
    k = cand.get("k") or prev.get("k")
    if cand or prev:
        lines += [f"| | arm | step | solo pass@{k} | tandem pass@{k} |", "|---|---|---|---|---|"]
        lines += [f"| {name} | {c.get('arm')} | {c.get('step')} | {c.get('solo')} | {c.get('tandem')} |"
                  for name, c in (("candidate", cand), ("promoted", prev)) if c]
    return "\n".join(lines) + "\n"


def _promotion_artifact(result: dict) -> None:
    """The promotion decision as the keyed `tandem-promotion` artifact: one catalog entry, a version per run that
    asks for promotion, so the UI lists the decisions over time."""
    try:
        create_markdown_artifact(key=PROMOTION_KEY, markdown=promotion_markdown(result),
                                 description="Promotion decision of this run (tasks/promotion.py)")
    except Exception as e:  # noqa: BLE001 - the UI is a view: the tags are the record
        get_run_logger().warning("promotion artifact not created: %s", e)


@task(name="report-artifact", task_run_name="report-artifact", cache_policy=NO_CACHE, timeout_seconds=600)
def report_artifact_task(params: Params, summary: dict) -> None:
    """The report as a markdown artifact: readable in the UI without the worker's disk."""
    mod = _stage("report")
    if not summary or summary.get("skipped"):  # the report on disk is current: publish it for this run too
        summary = {**mod.existing_summary(params), "skipped": True}
    create_markdown_artifact(key=REPORT_KEY, markdown=mod.artifact_markdown(params, summary),
                             description="Tandem RL results report")


@task(name="dvc-pull", task_run_name="dvc-pull", cache_policy=NO_CACHE, retries=3, retry_delay_seconds=[10, 60, 300],
      timeout_seconds=TIMEOUTS["sync"])
def pull_task(sync: DvcSync) -> None:
    get_run_logger().info("dvc pull: %s", sync.pull().strip()[-2000:] or "nothing to fetch")


@task(name="dvc-push", task_run_name="dvc-push", cache_policy=NO_CACHE, retries=3, retry_delay_seconds=[10, 60, 300],
      timeout_seconds=TIMEOUTS["sync"])
def push_task(sync: DvcSync, remote: str | None, stage: str | None = None) -> None:
    sync.push(remote, stage=stage)


def _push_stage(sync: DvcSync, share: "Sharing | None", spec: StageSpec, state: State) -> None:
    """With `sharing.push`, a stage's outputs go to the DVC remote as soon as it is committed (task run
    `dvc-push:<stage>`), so a lost worker loses at most the stage it was running; skipped stages push nothing."""
    if share is None or not share.push or _skipped(state.result()):
        return
    push_task.with_options(task_run_name=f"dvc-push:{spec.name}")(sync, share.remote, spec.name,
                                                                   wait_for=_after([state]))


@task(name="git-commit", task_run_name="git-commit", cache_policy=NO_CACHE, timeout_seconds=600)
def git_commit_task(sync: DvcSync, message: str) -> str | None:
    commit = sync.git_commit(message)
    get_run_logger().info("git: %s", f"committed {commit}" if commit else "dvc.lock and metrics unchanged")
    return commit


@task(name="git-push", task_run_name="git-push", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=[10, 60],
      timeout_seconds=TIMEOUTS["sync"])
def git_push_task(sync: DvcSync) -> str:
    branch = sync.git_push()
    get_run_logger().info("git: pushed %s and the promotion tags to origin", branch)
    return branch


# --------------------------------------------------------------------------------------------------
# Composition
# --------------------------------------------------------------------------------------------------

def _live_view(live: bool | None) -> bool:
    if live is not None:
        return live
    from prefect.runtime import deployment

    return sys.stderr.isatty() and deployment.id is None and os.environ.get("CI") is None


def params_fingerprint(params: Params) -> str:
    """10 hex digits of the sha256 of the params (every key, resolved): equal params, equal fingerprint. The same
    digits as the W&B group of a `dvc repro` run of these params (`tasks.tracking.group`: `tandem-<digits>`)."""
    return hashlib.sha256(json.dumps(params.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:10]


def _git_head(root: Path) -> str | None:
    """The commit of the code at `root` (12 digits), else TANDEM_GIT_COMMIT (an image records its build commit)."""
    try:
        res = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, timeout=20)
        if res.returncode == 0 and res.stdout.strip():
            return res.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return os.environ.get("TANDEM_GIT_COMMIT", "")[:12] or None


def run_tags(params_path: str, params: Params, root: Path) -> list[str]:
    """A flow run's tags, to find and filter runs by in the UI: `params:<file>` (relative to the project),
    `params-sha:<params_fingerprint>`, `git:<commit>` when the code is a git checkout (or TANDEM_GIT_COMMIT names
    it), and `exp:<name>` under `dvc exp run` (DVC_EXP_NAME, as for the W&B group)."""
    path = Path(params_path)
    try:
        shown = str(path.resolve().relative_to(Path(root).resolve())) if path.is_absolute() else str(path)
    except ValueError:
        shown = str(path)
    out = [f"params:{shown}", f"params-sha:{params_fingerprint(params)}"]
    commit = _git_head(Path(root))
    if commit:
        out.append(f"git:{commit}")
    if os.environ.get(tracking.EXP_ENV):
        out.append(f"exp:{os.environ[tracking.EXP_ENV]}")
    return out


def _tag_flow_run(new: list[str]) -> None:
    """Add `new` to the running flow run's tags (a deployment's own tags stay). The flow run exists before its
    params are read, so its tags are set here, through the API; task runs and subflows started inside
    `prefect.tags(...)` get them when they are created."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    if not flow_run.id:
        return
    try:
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(flow_run.id)
            client.update_flow_run(run.id, tags=list(dict.fromkeys([*(run.tags or []), *new])))
    except Exception as e:  # noqa: BLE001 - tags help find a run: never fail the run for them
        get_run_logger().warning("flow run tags not set: %s", e)


SECRET_BLOCKS = {"wandb-api-key": "WANDB_API_KEY", "hf-token": "HF_TOKEN"}


def _secrets_from_blocks() -> list[str]:
    """Secrets by reference: a Prefect Secret block named like a key of SECRET_BLOCKS fills its environment
    variable for this run when the worker's environment (or a Kubernetes secret) has not set it already."""
    from prefect.blocks.system import Secret

    found = []
    for block, var in SECRET_BLOCKS.items():
        if os.environ.get(var):
            continue
        try:
            os.environ[var] = Secret.load(block).get()
            found.append(var)
        except (ValueError, RuntimeError):  # no such block: the variable stays unset
            continue
    return found


def _setup(params_path: str, dvc: str, push: bool, publish: bool,
           remote: str | None = None) -> tuple[Params, DvcSync, list[StageSpec]]:
    params = load_params(params_path)
    if dvc in ("auto", "off"):  # another params file never writes over the default run's outputs
        params, moved = run_root(params_path, params, find_project(Path.cwd().resolve()))
        if moved:
            get_run_logger().info("%s", moved)
    sync = DvcSync.detect(params_path, params.out_root, dvc)
    if (push or publish) and not sync.enabled:
        raise RuntimeError(f"push/publish need DVC sync, which is off: {sync.reason}")
    if push:  # a folder remote on an ephemeral worker is refused before any work (tasks/durable.py)
        check_remote_push(_project_root(sync), remote)
    get_run_logger().info("DVC sync: %s", sync.reason)
    if (found := _secrets_from_blocks()):
        get_run_logger().info("secrets from Prefect blocks: %s", ", ".join(found))
    specs = pipeline_stages(_project_root(sync) / "dvc.yaml", params.to_dict())
    return params, sync, specs


def _project_root(sync: DvcSync) -> Path:
    """The DVC project the run belongs to (its dvc.yaml is the run's stage graph), else the code's root."""
    return Path(sync.root or find_project(Path.cwd().resolve()) or CODE_ROOT)


def _closure(specs: list[StageSpec], groups: set[str], downstream: bool) -> list[StageSpec]:
    """The stages of `groups` with every stage after them (downstream) or every stage they need (upstream)."""
    keep = {s.name for s in specs if s.group in groups}
    for _ in specs:  # a fixed point within len(specs) rounds
        for s in specs:
            if downstream and set(s.after) & keep:
                keep.add(s.name)
            elif not downstream and s.name in keep:
                keep |= set(s.after)
    return [s for s in specs if s.name in keep]


def _after(states: list[State]) -> list:
    """`wait_for` on these task runs and nothing inside them: Prefect would otherwise walk into each state's result
    and link on any object it finds there that another task also returned (an interned string such as an arm's
    name is one object everywhere)."""
    return [opaque(st) for st in states]


# Stage selections by name (`tandem run --stages training`): the same sets as the training and evaluation flows.
SELECTIONS = {"all": "every stage", "training": "prepare, base and every train@<arm> (tandem-training)",
              "evaluation": "evaluate and every stage after it (tandem-evaluation)"}


def select_stages(specs: list[StageSpec], wanted: list[str] | None) -> list[StageSpec]:
    """The stages `wanted` names, in dvc.yaml's order: a selection of SELECTIONS, a stage (`train@tandem`) or a
    stage group (`train`: every arm). Stages outside the selection do not run; their outputs must exist."""
    if not wanted:
        return specs
    names = {s.name for s in specs} | {s.group for s in specs}
    keep: set[str] = set()
    for w in wanted:
        if w == "all":
            keep |= {s.name for s in specs}
        elif w == "training":
            keep |= {s.name for s in _closure(specs, {"train"}, downstream=False)}
        elif w == "evaluation":
            keep |= {s.name for s in _closure(specs, {"evaluate"}, downstream=True)}
        elif w in names:
            keep |= {s.name for s in specs if w in (s.name, s.group)}
        else:
            raise ValueError(f"stages: {w!r} is neither a stage of dvc.yaml ({', '.join(s.name for s in specs)}), "
                             f"a stage group, nor one of {', '.join(SELECTIONS)}")
    return [s for s in specs if s.name in keep]


def _run_stages(params: Params, sync: DvcSync, specs: list[StageSpec], force: bool, eval_runner: str,
                share: "Sharing | None" = None, on_cluster=None) -> dict:
    """Every stage in dvc.yaml's order, drawn in Prefect's graph with dvc.yaml's edges: a stage's task run waits
    for the task runs of the stages whose outputs it reads (`wait_for`), and its inputs are `quote`d, so Prefect
    links it on nothing else (it links tasks through any object one returned and another receives). With a
    cluster runner (`on_cluster`, tasks/cluster.py), each train arm is submitted there with its GPUs, unless DVC
    reports it up to date: it is skipped in the flow's process, reserving nothing. With `share.push` each stage's
    outputs are pushed once it is committed (`_push_stage`)."""
    view = progress.current()
    for s in specs:
        view.expect(s.group, s.name)
    out: dict[str, Any] = {}
    states: dict[str, State] = {}
    for s in specs:
        upstream = [states[a] for a in s.after if a in states]
        if s.group == "evaluate":
            out[s.name], states[s.name] = _evaluate(params, sync, force, eval_runner, upstream)
            _push_stage(sync, share, s, states[s.name])
            continue
        run = stage_task.with_options(timeout_seconds=TIMEOUTS.get(s.group, 12 * HOUR),
                                      retries=2 if (s.group == "base" and params.model.source == "hub") else 0,
                                      retry_delay_seconds=[10, 60])
        if on_cluster is not None and s.group == "train" and not _current(s.name, sync, force):
            out[s.name], states[s.name] = _on_cluster(on_cluster, params, run, dict(spec=s, sync=sync, force=force),
                                                      upstream)
        else:
            states[s.name] = run(quote(params), quote(s), quote(sync), quote(force), wait_for=_after(upstream),
                                 return_state=True)
            out[s.name] = states[s.name].result()  # a failed stage raises here and fails the flow
        _push_stage(sync, share, s, states[s.name])
        if s.group == "report":
            report_artifact_task(quote(params), quote(out[s.name]), wait_for=_after([states[s.name]]))
    return out


def _current(name: str, sync: DvcSync, force: bool) -> bool:
    """`is_current` without its log line (the stage's own task run logs the skip)."""
    return not force and sync.enabled and sync.up_to_date(name)


def _on_cluster(runner, params: Params, run, args: dict, upstream: list[State]) -> tuple[Any, State]:
    """A stage's task run submitted to the cluster's task runner with the stage's GPUs (`cluster.reservation`,
    which gives a train arm its rollout engines' slots and service when they are Ray actors, and releases them
    once the task has ended), waited for here: the flow's view times it as if it ran in the flow."""
    from prefect.utilities.engine import collect_task_run_inputs_sync

    spec, after = args["spec"], _after(upstream)
    with cluster.reservation(params, spec.group) as task_params:
        # the values as they are: the task engine names the run from `spec` before it would unwrap a `quote`;
        # the upstream task runs named here (a worker finds none in the states it is sent): dvc.yaml's edges
        future = runner.submit(run, {"params": task_params, **args}, wait_for=after,
                               dependencies={"wait_for": collect_task_run_inputs_sync(after)})
        with progress.current().track(spec.group, spec.name):
            future.wait()
    return future.result(), future.state  # a failed stage raises here and fails the flow


def _evaluate(params: Params, sync: DvcSync, force: bool, eval_runner: str,
              upstream: list[State]) -> tuple[dict, State]:
    """The evaluate stage: plan, the units' subflow, collect (its `evaluate` task run is what later stages wait
    for); a single Skipped `evaluate` task run when DVC reports it up to date. A forced run (`force`) bypasses
    the evaluation's result cache too: otherwise `--force` would rerun the stage on the cached generations and
    evaluate nothing."""
    if is_current("evaluate", sync, force):
        progress.current().set_state("evaluate", "evaluate", "skipped")
        state = stage_task.with_options(timeout_seconds=60)(
            quote(params), quote(StageSpec("evaluate", "evaluate")), quote(sync), quote(False),
            wait_for=_after(upstream), return_state=True)
        return state.result(), state
    plan = evaluate_plan_task(quote(params), wait_for=_after(upstream), return_state=True)
    units = plan.result()
    for u in units:
        progress.current().expect("evaluate", unit_label(u))
    fan_out = evaluate_units.with_options(task_runner=cluster.eval_runner(params, eval_runner)
                                          or task_runner(eval_runner, eval_workers(params)),
                                          timeout_seconds=TIMEOUTS["evaluate-unit"] * max(1, len(units)))
    quiet = unit_params(params)
    # a subflow's parameters are validated, so `opaque` (resolved, not walked) rather than `quote`
    units_state = fan_out(opaque(quiet), opaque(units), refresh=force, wait_for=_after([plan]), return_state=True)
    units_state.result()  # a failed unit fails the flow here, before collect
    state = evaluate_collect_task(quote(params), quote(sync), wait_for=_after([plan, units_state]),
                                  return_state=True)
    return state.result(), state


def _run_resources(params: Params, view: progress.ProgressView, summaries: dict) -> dict:
    """Per-task wall time and peak memory, with the machine, merged into results/run.json (the run's metadata;
    tasks/record.py): a stage DVC skipped keeps the numbers of the run that last ran it.

    Not under metrics/: the report stage depends on metrics/, and a file written there after the report would
    leave the report stale after every run."""
    from tasks.common import Layout, peak_rss, torch_threads
    from tasks.record import run_gpus, write_run_metadata

    ran = [name for name in view.timings() if not _skipped(summaries.get(name))]
    doc = write_run_metadata(Layout.of(params).root, view.timings(), view.peak_memory(), peak_rss(), ran,
                             {"torch_threads": torch_threads(), "cpu_count": os.cpu_count()}, run_gpus(params, ran))
    return doc.get("resources", {})


def _skipped(summary: Any) -> bool:
    return isinstance(summary, dict) and bool(summary.get("skipped"))


class Sharing(BaseModel):
    """What a flow run takes from and gives back to the shared stores: one group of fields in the Prefect UI
    (a deployment states it as `sharing: {push: true, publish: true}`)."""

    pull: bool = Field(False, description="`dvc pull` first: what dvc.lock names and the remote holds")
    push: bool = Field(False, description="`dvc push` the outputs to `remote`")
    publish: bool = Field(False, description="commit dvc.lock and metrics, push them and the promotion tags "
                                             "to git `origin`")
    remote: str | None = Field(None, description="the DVC remote to push to (default: the project's)")


@dataclass(frozen=True)
class _Request:
    """One flow run's parameters, as the three flows pass them on to `_pipeline`."""

    what: str
    params_path: str
    dvc: str
    force: bool
    promote: bool
    sharing: Sharing
    live: bool | None
    eval_runner: str
    select: Callable[[list[StageSpec]], list[StageSpec]]


def _finish(req: _Request, params: Params, sync: DvcSync, view: progress.ProgressView, summaries: dict,
            t0: float) -> dict:
    """Outputs to the DVC remote, dvc.lock and metrics to a git commit, the promotion as tags on that commit
    (whose dvc.lock pins the checkpoint), then branch and tags to origin."""
    from prefect.runtime import flow_run

    share = req.sharing
    # the stages that did work (not Skipped as up to date): what a comparison with the record can vouch for
    ran = [k for k, v in summaries.items() if not _skipped(v)]
    if share.push:
        push_task(sync, share.remote)
    if share.publish:
        summaries["git_commit"] = git_commit_task(sync, f"{req.what}: dvc.lock and metrics of flow run "
                                                        f"{flow_run.name or ''} (ran: {', '.join(ran) or 'nothing'})")
    if req.promote and "evaluate" in summaries:
        summaries["promotion"] = promote_task(params, sync)
    if share.publish:
        git_push_task(sync)
    report = summaries.get("report", {}) or {}
    report = report if isinstance(report, dict) else {}
    if report.get("skipped"):  # up to date: the report on disk is this run's
        report = _stage("report").existing_summary(params)
    html = str(Path(report["html"]).resolve()) if report.get("html") and Path(report["html"]).exists() else None
    md = str(Path(report["markdown"]).resolve()) if report.get("markdown") else None
    result = {"report": html, "markdown": md, "stages": summaries, "ran": ran,
              "timings": view.timings(), "wall_seconds": round(time.perf_counter() - t0, 3), "dvc": sync.reason,
              "dvc_synced": sync.enabled, "out_root": params.out_root,
              "resources": _run_resources(params, view, summaries)}
    if html:
        get_run_logger().info("report: %s", html)
        if view.live_requested:
            print(f"\nReport: {html}", file=sys.stderr)
    return result


def _pipeline(req: _Request) -> dict:
    t0 = time.perf_counter()
    params, sync, specs = _setup(req.params_path, req.dvc, req.sharing.push, req.sharing.publish, req.sharing.remote)
    labels = run_tags(req.params_path, params, _project_root(sync))
    _tag_flow_run(labels)
    get_run_logger().info("tags: %s", ", ".join(labels))
    # one run per output root (re-entrant: `tandem run` already holds it when it started this flow); every task
    # run and the evaluation subflow carry the run's tags
    with workspace_lock(params.out_root, command=f"{req.what} flow"), tags(*labels):
        if req.sharing.pull:
            pull_task(sync)
        specs = req.select(specs)
        get_run_logger().info("stages (from dvc.yaml): %s", ", ".join(s.name for s in specs))
        view = progress.ProgressView(f"{req.what} ({req.params_path})", live=_live_view(req.live))
        progress.quiet_tools()
        # every W&B run of this pipeline run (the arms, the evaluation, the report) joins one group: its name
        # cluster.runner ray: one Ray connection for the run (tasks/cluster.py), else None
        with progress.activate(view), tracking.pipeline_group(_group()), \
                (cluster.runner(params) or contextlib.nullcontext()) as on_cluster:
            summaries = _run_stages(params, sync, specs, req.force, req.eval_runner, req.sharing, on_cluster)
        return _finish(req, params, sync, view, summaries, t0)


_COMMON_DOC = """
    dvc: 'auto' commits each stage to dvc.lock when this run is the DVC project's run (and skips stages DVC
    reports up to date), 'on' insists on that, 'adopt' (a worker's own clone) first copies `params_path` onto
    params.yaml, 'off' never touches DVC. force: run every stage, and every evaluation unit past the result
    cache. promote: promote the best checkpoint if it does not regress (git tags). sharing: `pull` (`dvc pull`
    first: what dvc.lock names and the remote holds), `push` (`dvc push` the outputs to `remote`, default the
    project's), `publish` (commit dvc.lock and push it and the promotion tags to git `origin`). eval_runner:
    'threads', 'dask' or a Dask scheduler address.
    live: terminal progress view (default: on when attached to a terminal and not under a deployment).
    stages (tandem-pipeline): run only these: `training`, `evaluation`, stage names (`train@tandem`) or groups
    (`train`); the outputs of the stages left out must exist. A params file other than the project's
    params.yaml whose out_root is the project root runs in runs/<name>/ (tasks.common.run_root).
"""


@flow(name="tandem-pipeline", persist_result=False, log_prints=True, timeout_seconds=FLOW_TIMEOUT)
def tandem_pipeline(params_path: str = "params.yaml", dvc: str = "auto", force: bool = False, promote: bool = False,
                    sharing: Sharing = Sharing(), live: bool | None = None, eval_runner: str = "threads",
                    stages: list[str] | None = None) -> dict:
    """Every stage of dvc.yaml, or those `stages` names; returns {'report': html path, 'stages': summaries, ...}."""
    return _pipeline(_Request("tandem-pipeline", params_path, dvc, force, promote, sharing, live, eval_runner,
                              lambda specs: select_stages(specs, stages)))


@flow(name="tandem-training", persist_result=False, log_prints=True, timeout_seconds=FLOW_TIMEOUT)
def tandem_training(params_path: str = "params.yaml", dvc: str = "auto", force: bool = False,
                    sharing: Sharing = Sharing(), live: bool | None = None) -> dict:
    """The train stages and what they need (prepare, base): checkpoints for a later evaluation run."""
    return _pipeline(_Request("tandem-training", params_path, dvc, force, False, sharing, live, "threads",
                              lambda specs: _closure(specs, {"train"}, downstream=False)))


@flow(name="tandem-evaluation", persist_result=False, log_prints=True, timeout_seconds=FLOW_TIMEOUT)
def tandem_evaluation(params_path: str = "params.yaml", dvc: str = "auto", force: bool = False,
                      promote: bool = False, sharing: Sharing = Sharing(), live: bool | None = None,
                      eval_runner: str = "threads") -> dict:
    """Evaluate whatever checkpoints exist, then every stage after evaluate (analyze, report); no training."""
    return _pipeline(_Request("tandem-evaluation", params_path, dvc, force, promote, sharing, live, eval_runner,
                              lambda specs: _closure(specs, {"evaluate"}, downstream=True)))


for _f in (tandem_pipeline, tandem_training, tandem_evaluation):
    _f.fn.__doc__ = (_f.fn.__doc__ or "") + "\n" + _COMMON_DOC
    _f.__doc__ = _f.fn.__doc__


if __name__ == "__main__":  # pragma: no cover
    print(tandem_pipeline(params_path=sys.argv[1] if len(sys.argv) > 1 else "params.yaml")["report"])
