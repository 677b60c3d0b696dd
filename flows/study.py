"""The `tandem-study` Prefect flow: N seeds x the arms through the pipeline, then the claims.

Composition only; every step is a function of tasks/study/runs.py. One task run per seed x arm trains (named
`train-seed-<S>-<arm>`, with a progress artifact that follows its saved checkpoints), one per seed evaluates and
one analyses once that seed's arms are trained, and `claims` aggregates every seed. `jobs` task runs go side by
side (threads, each driving a one-thread stage subprocess). Rerun after an interruption, finished work is
skipped and unfinished training resumes (see tasks/study/runs.py).
"""

from __future__ import annotations

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.task_runners import ThreadPoolTaskRunner

from flows import progress
from tasks.study import runs as study

HOUR = 3600
# The seed x arm tasks run in worker threads (jobs side by side), where Prefect cannot enforce a timeout, so
# they carry none; each drives a stage subprocess, which the stage's own guards stop.


@task(name="study-shared", cache_policy=NO_CACHE)
def shared_task(s: study.StudySettings) -> str:
    return str(study.shared_inputs(s))


@task(name="study-train", task_run_name="train-seed-{seed}-{arm}", cache_policy=NO_CACHE)
def train_task(s: study.StudySettings, seed: int, arm: str) -> dict:
    root = s.root(seed)
    total = study.load_params(s.params_file).train.steps
    with progress.artifact(None, f"seed {seed}, arm {arm}: training",
                           progress.checkpoint_share(root / "models" / "checkpoints" / arm, total), every=30.0):
        out = study.train(root, arm)
    get_run_logger().info("seed %s %s: trained (%s steps, reward %s -> %s)", seed, arm, out.get("steps"),
                          out.get("reward_first"), out.get("reward_last"))
    return out


@task(name="study-evaluate", task_run_name="evaluate-seed-{seed}", cache_policy=NO_CACHE)
def evaluate_task(s: study.StudySettings, seed: int) -> dict:
    return study.evaluate(s.root(seed))


@task(name="study-analyze", task_run_name="analyze-seed-{seed}", cache_policy=NO_CACHE)
def analyze_task(s: study.StudySettings, seed: int) -> dict:
    return study.analyze(s.root(seed))


@task(name="study-claims", cache_policy=NO_CACHE)
def claims_task(s: study.StudySettings) -> dict:
    doc = study.aggregate(s)
    get_run_logger().info("%s", study.claims_summary(doc))
    try:
        create_markdown_artifact(key="tandem-study-report", markdown=(s.out / "report.md").read_text(),
                                 description="The study's claims table and measures")
    except Exception as e:  # noqa: BLE001 - the UI is a view: never fail the study for it
        get_run_logger().warning("report artifact not created: %s", e)
    return doc


@flow(name="tandem-study", persist_result=False, log_prints=True, timeout_seconds=7 * 24 * HOUR)
def tandem_study(params_path: str = "params.study.yaml", seeds: int = 3, first_seed: int = 0,
                 out: str = "studies", jobs: int = 2, until: str = "claims") -> dict:
    """Train, evaluate and analyse every seed x arm of the study file, then write the claims (`until`: train |
    analyze | claims stops after that step)."""
    if until not in ("train", "analyze", "claims"):
        raise study.BadInputError(f"until: {until!r} must be one of train, analyze, claims")
    study.settings(params_path, seeds, first_seed, out, jobs)  # refuse bad settings before the subflow starts
    runner = ThreadPoolTaskRunner(max_workers=max(1, jobs))
    return study_steps.with_options(task_runner=runner)(params_path, seeds, first_seed, out, jobs, until)


@flow(name="tandem-study-steps", persist_result=False, log_prints=True, timeout_seconds=7 * 24 * HOUR)
def study_steps(params_path: str, seeds: int, first_seed: int, out: str, jobs: int, until: str) -> dict:
    s = study.settings(params_path, seeds, first_seed, out, jobs)
    shared_task(s)
    roots = {seed: study.prepare_root(s, seed) for seed in s.seeds}
    # seed-major order: the first seed's arms finish first, so its evaluation overlaps later seeds' training
    arms = s.arms
    trains = {(seed, arm): train_task.submit(s, seed, arm) for seed in s.seeds for arm in arms}
    if until == "train":
        return {f"seed-{k[0]}/{k[1]}": f.result() for k, f in trains.items()}
    evals = {seed: evaluate_task.submit(s, seed, wait_for=[trains[(seed, a)] for a in arms]) for seed in s.seeds}
    analyses = {seed: analyze_task.submit(s, seed, wait_for=[evals[seed]]) for seed in s.seeds}
    results = {f"seed-{seed}": f.result() for seed, f in analyses.items()}
    if until == "analyze":
        return results
    doc = claims_task(s)
    return {"claims": str(s.out / "claims.json"), "report": str(s.out / "report.md"), "roots": list(map(str, roots.values())),
            "verdicts": [r["verdict"] for r in doc["claims"]]}
