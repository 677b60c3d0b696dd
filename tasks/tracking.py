"""W&B around the stages (the library never imports wandb): one run per training arm, per evaluation, per report.

Every run is created explicitly with `wandb.init(id=..., name=..., group=..., job_type=..., tags=..., config=...,
resume="allow", reinit="finish_previous")`; nothing goes through `WANDB_*` environment variables, which wandb
reads once per process (a second arm in the same process would otherwise log into the first arm's run).
transformers' W&B callback (trl's `report_to: wandb`) finds the arm's run as `wandb.run` and logs into it.

- Every execution is a run of its own, with a new id (`new_run_id`): a rerun of the evaluation or the report, or
  a new training run, never shares an id with an earlier one (runs with one id merge on sync and drop repeated
  steps). The exception is a training run that resumes, the trainer's rule (`resumes`: `train.resume: auto` and
  a complete checkpoint with the run's fingerprint in the arm's scratch dir): it continues the W&B run it
  started, whose id a record beside that dir keeps (`scratch/train/<arm>.wandb.json`; checkpoints older than
  records continue `arm_run_id`, the fingerprint id earlier versions gave every run of an arm).
- The config of every run is the full params (`params.to_dict()`, secrets from the environment redacted) plus
  what identifies the run: the arm and its fingerprint, or the digest of what an evaluation or a report logs.
- The group: under `dvc exp run`, the experiment's name (DVC_EXP_NAME, which DVC sets for the stages of an
  experiment); else the pipeline run: the Prefect flow run's name (`pipeline_group`, handed to the stage
  processes through TANDEM_RUN_GROUP), else, for `dvc repro`, a fingerprint of the params, so the stage
  processes of one configuration share it.
- Artifacts by reference (`file://` entries: nothing is uploaded, the files stay where DVC tracks them): each
  arm's final published checkpoint (type `model`, logged into the arm's training run once the stage has
  published it: `log_checkpoints`) and the report (type `report`, in the report's run: `log_report`).
- wandb prints nothing (`silent`, no console capture): the run logs carry one line per run instead.

Everything is a no-op unless `train.report_to` is `wandb`; the mode comes from `WANDB_MODE` or
`train.wandb_mode`; files go to `runs/wandb/` (offline runs: `wandb sync runs/wandb/offline-run-*`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from tandem.config import Params
from tandem.errors import CheckpointError
from tandem.redact import redact
from tasks.common import Layout, read_json, read_jsonl, write_json

PREFIX = "tandem"
GROUP_ENV = "TANDEM_RUN_GROUP"  # the pipeline run's name, set by the flow for its stages (and their workers)
EXP_ENV = "DVC_EXP_NAME"  # the experiment's name, set by `dvc exp run` for the stage commands it runs
RECORD_SUFFIX = ".wandb.json"  # beside an arm's scratch dir: the W&B run id its training started with
log = logging.getLogger("tasks.tracking")


def enabled(params: Params) -> bool:
    return params.train.report_to == "wandb"


def mode(params: Params) -> str:
    return os.environ.get("WANDB_MODE") or params.train.wandb_mode


def _digest(obj: Any, n: int = 16) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:n]


def group(params: Params) -> str:
    """The W&B group of every run of this pipeline run or experiment (see the module docstring)."""
    return (os.environ.get(EXP_ENV) or os.environ.get(GROUP_ENV)
            or f"{PREFIX}-{_digest(params.to_dict(), 10)}")


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


def new_run_id(kind: str) -> str:
    """A run id no other execution has: `tandem-<kind>-<12 random hex digits>`."""
    return f"{PREFIX}-{kind}-{uuid.uuid4().hex[:12]}"


def run_config(params: Params, **identity: Any) -> dict:
    """Every run's config: the full params, secrets from the environment redacted, plus what identifies the run."""
    return {**redact(params.to_dict()), **identity}


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


def _file_uri(path: Path) -> str:
    # wandb reads the path after `file://` as it stands (Path.as_uri's percent-escapes would name another file)
    return f"file://{Path(path).resolve()}"


# --------------------------------------------------------------------------------------------------
# Training arms
# --------------------------------------------------------------------------------------------------

def arm_run_id(arm: str, fingerprint: str) -> str:
    """The id earlier versions gave every run of an arm (its training fingerprint): what a resumed training
    continues when its checkpoints predate the run-id record."""
    return f"{PREFIX}-{arm}-{fingerprint}"


def arm_dir(params: Params, arm: str) -> Path:
    """The arm's scratch dir, where the trainer writes and resumes (tasks/train.py: `outputs["scratch"]/<arm>`)."""
    return Layout.of(params).scratch / "train" / arm


def resumes(params: Params, work_dir: Path, fingerprint: str) -> bool:
    """Whether the trainer will continue run `fingerprint` in `work_dir`: its own rule, `train.resume: auto` and
    a complete checkpoint carrying that fingerprint there (`tandem.checkpoints.latest_checkpoint`)."""
    from tandem.checkpoints import latest_checkpoint

    if params.train.resume != "auto":
        return False
    try:
        return latest_checkpoint(work_dir, fingerprint) is not None
    except (CheckpointError, OSError):  # a damaged checkpoint: the trainer names it and stops, W&B need not
        return False


def _record(work_dir: Path) -> Path:
    # beside the scratch dir, not in it: under `train.resume: never` the trainer empties the dir itself
    return Path(work_dir).with_name(Path(work_dir).name + RECORD_SUFFIX)


def recorded_run_id(work_dir: Path, fingerprint: str) -> str | None:
    """The W&B run id the training run `fingerprint` in `work_dir` started with, or None."""
    try:
        rec = json.loads(_record(work_dir).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(rec, dict) and rec.get("fingerprint") == fingerprint and isinstance(rec.get("run_id"), str)
    return rec["run_id"] if ok else None


def training_run_id(params: Params, arm: str, fingerprint: str, work_dir: Path | None = None) -> str:
    """The W&B run id of an arm's training: when the trainer resumes that run (`resumes`), the id it started
    with; else a new id, recorded for the resumes to come."""
    work_dir = Path(work_dir) if work_dir is not None else arm_dir(params, arm)
    if resumes(params, work_dir, fingerprint):
        return recorded_run_id(work_dir, fingerprint) or arm_run_id(arm, fingerprint)
    run_id = new_run_id(arm)
    try:
        write_json(_record(work_dir), {"arm": arm, "fingerprint": fingerprint, "run_id": run_id})
    except OSError as e:  # the run goes on; a resume of it would start another W&B run
        log.warning("W&B: run id of arm %s not recorded in %s (%s)", arm, _record(work_dir), e)
    return run_id


@contextmanager
def arm_run(params: Params, arm: str, fingerprint: str, *, work_dir: Path | None = None) -> Iterator[Any]:
    """The W&B run of one training arm for the enclosed training (yields it; None when W&B is off).

    `work_dir` is the arm's scratch dir (default `arm_dir`): a training that resumes from a checkpoint there
    continues its W&B run (`training_run_id`). The trainer's W&B callback logs every step into the run
    (`train/global_step` is its step axis)."""
    if not enabled(params):
        yield None
        return
    run = init_run(params, run_id=training_run_id(params, arm, fingerprint, work_dir),
                   name=f"{group(params)}-train-{arm}", job_type="train", tags=_tags(params, f"arm:{arm}"),
                   config=run_config(params, arm=arm, fingerprint=fingerprint))
    try:
        yield run
    except BaseException:
        run.finish(exit_code=1)
        raise
    run.finish()


def log_checkpoints(params: Params, arm: str, checkpoints: Path | None = None, *,
                    work_dir: Path | None = None) -> str | None:
    """The arm's final published checkpoint (the last `step-<N>` of `checkpoints`, default
    `models/checkpoints/<arm>/`) as a W&B artifact of type `model`, by reference, logged into the arm's
    training run (continued by its id); returns the artifact's name. Call it once the stage has published the
    checkpoints; it never raises (W&B is optional: a failure is one warning)."""
    if not enabled(params) or mode(params) == "disabled" or int(os.environ.get("RANK", "0")) != 0:
        return None
    try:
        return _log_checkpoints(params, arm, Path(checkpoints) if checkpoints is not None
                                else Layout.of(params).checkpoints / arm,
                                Path(work_dir) if work_dir is not None else arm_dir(params, arm))
    except Exception as e:  # tracking is optional: the published checkpoints are the result
        log.warning("W&B: checkpoints of arm %s not logged (%s: %s)", arm, type(e).__name__, e)
        return None


def _log_checkpoints(params: Params, arm: str, checkpoints: Path, work_dir: Path) -> str | None:
    import wandb

    from tandem.checkpoints import FILES_KEY, STATE_FILE, complete_checkpoints, read_state

    found = complete_checkpoints(checkpoints)
    if not found:
        log.warning("W&B: no complete checkpoint in %s to log for arm %s", checkpoints, arm)
        return None
    step, final = found[-1]
    state = read_state(final)
    fingerprint = state.get("fingerprint")
    if not isinstance(fingerprint, str):
        raise ValueError(f"{final} records no run fingerprint, so its training run is unknown")
    files = sorted(state.get(FILES_KEY) or {}) or sorted(
        p.relative_to(final).as_posix() for p in final.rglob("*") if p.is_file() and p.name != STATE_FILE)
    name = f"{PREFIX}-checkpoint-{arm}"
    art = wandb.Artifact(name, type="model", metadata={
        "arm": arm, "step": step, "fingerprint": fingerprint, "path": _relative(params, final)})
    for rel in files:  # no checksum of the (large) weights: the state file records each file's SHA-256
        art.add_reference(_file_uri(final / rel), name=rel, checksum=False)
    art.add_reference(_file_uri(final / STATE_FILE), name=STATE_FILE)  # its digest: a new version per content
    run = init_run(params, run_id=recorded_run_id(work_dir, fingerprint) or arm_run_id(arm, fingerprint),
                   name=f"{group(params)}-train-{arm}", job_type="train", tags=_tags(params, f"arm:{arm}"),
                   config=run_config(params, arm=arm, fingerprint=fingerprint))
    try:
        run.log_artifact(art)
    finally:
        run.finish()
    log.info("W&B artifact %s: %s (step %d), in run %s", name, _relative(params, final), step, run.id)
    return name


def _relative(params: Params, path: Path) -> str:
    """`path` relative to the output root (where DVC tracks it), else as given."""
    try:
        return Path(path).resolve().relative_to(Path(params.out_root).resolve()).as_posix()
    except ValueError:
        return str(path)


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


def _evaluation_digest(params: Params) -> str:
    """What the evaluation logs, as a digest (its runs' config): runs of one content are found by it."""
    ev = read_json(Layout.of(params).metrics / "eval.json")
    what = {"settings": ev.get("settings"), "junior": (ev.get("junior") or {}).get("hash"),
            "checkpoints": {a: [c.get("hash") for c in d.get("checkpoints", [])] for a, d in ev.get("arms", {}).items()}}
    return _digest(what)


def log_evaluation(params: Params) -> str | None:
    """One new W&B run (job type `evaluate`): pass@k per checkpoint as its history, the final numbers in its
    summary, the results and sample completions as tables; returns its id. Never raises (W&B is optional: a
    failure is one warning, the stage's outputs are already written)."""
    if not enabled(params) or mode(params) == "disabled":
        return None
    try:
        return _log_evaluation(params)
    except Exception as e:
        log.warning("W&B: evaluation not logged (%s: %s)", type(e).__name__, e)
        return None


def _log_evaluation(params: Params) -> str:
    import wandb

    run = init_run(params, run_id=new_run_id("evaluate"), name=f"{group(params)}-evaluate", job_type="evaluate",
                   tags=_tags(params, "evaluation"),
                   config=run_config(params, content_digest=_evaluation_digest(params)))
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


def report_files(params: Params) -> list[Path]:
    """The report stage's documents that exist: reports/report.html and reports/report.md."""
    reports = Layout.of(params).reports
    return [p for p in (reports / "report.html", reports / "report.md") if p.is_file()]


def log_report(params: Params, figures: list[tuple[str, Path, str]], *,
               files: list[Path] | None = None) -> str | None:
    """The report's figures ((name, png path, caption) each) as one new W&B run of job type `report`, and the
    report's documents (`files`, default `report_files`) with its figures as the run's artifact of type
    `report`, by reference; its id."""
    if not enabled(params) or mode(params) == "disabled":
        return None
    docs = report_files(params) if files is None else [Path(p) for p in files if Path(p).is_file()]
    logged = list(dict.fromkeys([*docs, *(Path(p) for _, p, _ in figures)]))
    if not logged:
        return None
    import wandb

    content = _digest([hashlib.sha256(p.read_bytes()).hexdigest() for p in logged])
    run = init_run(params, run_id=new_run_id("report"), name=f"{group(params)}-report", job_type="report",
                   tags=_tags(params, "report"), config=run_config(params, content_digest=content))
    try:
        if figures:
            run.log({f"report/{name}": wandb.Image(str(path), caption=caption) for name, path, caption in figures})
        # entries are named from the report's folder (figures/<name>.png beside report.html)
        _log_report_artifact(params, run, logged, docs[0].parent if docs else Layout.of(params).reports)
        return run.id
    finally:
        run.finish()


def _log_report_artifact(params: Params, run: Any, files: list[Path], folder: Path) -> None:
    import wandb

    try:
        folder = Path(folder).resolve()
        art = wandb.Artifact(f"{PREFIX}-report", type="report",
                             metadata={"paths": [_relative(params, p) for p in files]})
        for p in files:  # small files: wandb's own checksums give a new version per content
            full = Path(p).resolve()
            art.add_reference(_file_uri(full), name=full.relative_to(folder).as_posix()
                              if full.is_relative_to(folder) else full.name)
        run.log_artifact(art)
    except Exception as e:  # the figures are logged already; the artifact is extra
        log.warning("W&B: report artifact not logged (%s: %s)", type(e).__name__, e)
