"""The `tandem` command line: run one stage, the whole pipeline, a multi-seed study, check a params file, plan
memory, run benchmarks.

This is the entry point above every layer (top level, next to `flows/`): it imports `tasks/` and `flows/` lazily
inside each command, so `tandem --help` and `tandem check-params` start fast.

Failures: a params error exits with code 2 before any work; an expected failure (`tandem.errors.UserError`: bad
data, a missing input, a damaged model file or checkpoint, a busy output root, a stopped run or a failed training
worker; or a missing file, or a full disk, named as such) prints one message without a traceback and exits with
code 1; anything else is a bug and keeps its traceback. `tandem --debug ...` or
`TANDEM_DEBUG=1` shows the traceback of expected failures too. `tandem run` and `tandem stage` hold the output
root's lock (tandem/workspace.py) while they work.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import typer

from cli.options import (PARAMS_OPT, WAIT_OPT, BenchRolloutOptions, ControlRunOptions, RunOptions, StudyOptions,
                         takes)
from tandem.config import ParamsError
from tandem.errors import as_user_error, is_expected

STAGES = ("prepare", "base", "junior", "train", "evaluate", "analyze", "report")

# pretty_exceptions_show_locals stays off: a traceback must never print local values (tokens, env copies)
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_show_locals=False,
                  help="Tandem RL as a reproducible pipeline: stages, the full flow, params checks, benchmarks.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print ratios measured in one process.")
app.add_typer(bench_app, name="bench")
study_app = typer.Typer(help="Studies: a multi-seed run, the registered pilot, a registered positive control "
                             "(gate, runs), and the claims of any committed study recomputed from its files.")
app.add_typer(study_app, name="study")


def debug_enabled() -> bool:
    return os.environ.get("TANDEM_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")


@app.callback()
def _main(debug: bool = typer.Option(False, "--debug", help="show tracebacks of expected failures too "
                                                            "(same as TANDEM_DEBUG=1)")) -> None:
    if debug:
        os.environ["TANDEM_DEBUG"] = "1"


def _expected(e: BaseException) -> bool:
    """An expected failure: a UserError, a missing file (an input an earlier stage did not make), a full disk."""
    return is_expected(e)


class _NoTracebackForExpected(logging.Filter):
    """Drop the traceback from log records of expected failures (Prefect logs every failed task run with one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None and _expected(record.exc_info[1]):
            record.exc_info, record.exc_text = None, None
        return True


def _guard_log_handlers() -> None:
    """Every log handler configured so far drops secrets (tandem/redact.py) and, unless debugging, the
    tracebacks of expected failures (Prefect configures its handlers when it is imported)."""
    from tandem.redact import RedactingFilter

    wanted = [RedactingFilter()] + ([] if debug_enabled() else [_NoTracebackForExpected()])
    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    for lg in loggers:
        for h in lg.handlers:
            for f in wanted:
                if not any(type(g) is type(f) for g in h.filters):
                    h.addFilter(f)


@contextmanager
def expected_failures(what: str, where: str | os.PathLike | None = None) -> Iterator[None]:
    """Turn an expected failure into one red message and exit code 1 (the traceback with --debug).

    A full disk is reported as such, naming the file (or `where`, the output root, when the error names none)."""
    try:
        yield
    except typer.Exit:
        raise
    except Exception as e:
        if not _expected(e) or debug_enabled():
            raise
        e = as_user_error(e, where)
        message = e.summary() if hasattr(e, "summary") else str(e)
        typer.secho(f"{what} failed: {message}", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=getattr(e, "exit_code", 1))


def _offline_defaults() -> None:
    """Tools that phone home stay quiet unless the user asked otherwise (`tandem.config.TOOL_ENV`; W&B's mode
    comes from `train.wandb_mode`, offline by default, unless WANDB_MODE is set)."""
    from tandem.config import apply_tool_env

    apply_tool_env()
    # the stages' own loggers reach the flow run's logs (and the UI), not only the terminal
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "tandem,tasks,flows")


def _load(params: str):
    from tasks.common import load_params

    try:
        return load_params(params)
    except ParamsError as e:
        typer.secho(str(e), fg=typer.colors.RED, err=True)
        raise typer.Exit(code=2)


def run_stage(name: str, params_obj, arm: str | None = None) -> dict:
    """Import `tasks.<name>` and run it on its declared inputs and outputs (one arm of `train` if given)."""
    mod = importlib.import_module(f"tasks.{name}")
    inputs, outputs = mod.default_io(params_obj)
    if arm is not None:
        return mod.run_arm(params_obj, arm, inputs, outputs)
    return mod.run(params_obj, inputs, outputs)


@app.command()
def stage(name: str = typer.Argument(..., help=f"stage to run, one of: {', '.join(STAGES)}"),
          params: str = PARAMS_OPT,
          arm: Optional[str] = typer.Option(None, help="train stage only: train this one arm (dvc.yaml's train@<arm>)"),
          wait: bool = WAIT_OPT) -> None:
    """Run one pipeline stage (this is the command dvc.yaml calls)."""
    _offline_defaults()
    if name not in STAGES:
        typer.secho(f"unknown stage {name!r}; choose one of: {', '.join(STAGES)}", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=2)
    p = _load(params)
    if arm is not None and (name != "train" or arm not in p.train.arms):
        typer.secho(f"--arm {arm!r}: only for the train stage, and one of train.arms {p.train.arms}",
                    fg=typer.colors.RED, err=True)
        raise typer.Exit(code=2)
    from tandem.workspace import workspace_lock

    t0 = time.perf_counter()
    _guard_log_handlers()
    with expected_failures(f"stage {name}", p.out_root):
        # one arm of train writes only that arm's files: it may run next to another arm (dvc, tandem study)
        with workspace_lock(p.out_root, wait=wait, command=f"tandem stage {name}" + (f" --arm {arm}" if arm else ""),
                            scope=f"train-{arm}" if arm else None):
            summary = run_stage(name, p, arm)
    typer.echo(f"stage {name} done in {time.perf_counter() - t0:.1f}s")
    if summary:
        typer.echo(json.dumps(summary, indent=2, default=str)[:4000])


def _stage_list(stages: str) -> list[str] | None:
    items = [x.strip() for x in stages.split(",") if x.strip()]
    return None if items in ([], ["all"]) else items


def _direct_stages(p, wanted: list[str] | None) -> list[tuple[str, str | None]]:
    """(stage module, arm) pairs for --direct, in pipeline order: every stage, or those --stages names."""
    pairs = [(name, None) for name in STAGES]
    if not wanted:
        return pairs
    keep: list[tuple[str, str | None]] = []
    groups = {"training": ("prepare", "base", "junior", "train"), "evaluation": ("evaluate", "analyze", "report")}
    for name in STAGES:
        for w in wanted:
            if w == "all" or name in groups.get(w, ()) or w == name:
                keep.append((name, None))
                break
            if name == "train" and w.startswith("train@") and w[len("train@"):] in p.train.arms:
                keep.append((name, w[len("train@"):]))
    known = set(STAGES) | set(groups) | {"all"} | {f"train@{a}" for a in p.train.arms}
    bad = [w for w in wanted if w not in known]
    if bad:
        raise typer.BadParameter(f"{', '.join(bad)}: choose from {', '.join(sorted(known))}", param_hint="--stages")
    return list(dict.fromkeys(keep))


@app.command(help="Run the pipeline (the `tandem-pipeline` Prefect flow) and print where the results are.\n\n"
                  "A params file other than params.yaml whose out_root is `.` runs in runs/<name>/ "
                  "(params.study.yaml -> runs/study/), so it never writes over the default run's outputs. After a "
                  "run of the project's own params.yaml, the outputs are compared with the committed record "
                  "(HEAD's dvc.lock), and a short summary says whether they match.")
@takes(RunOptions)
def run(o: RunOptions) -> None:
    _offline_defaults()
    p = _load(o.params)
    wanted = _stage_list(o.stages)
    todo = _direct_stages(p, wanted)  # also checks the names before any work
    if o.dvc not in ("auto", "on", "off", "adopt"):
        raise typer.BadParameter(f"{o.dvc!r}: choose auto, on, off or adopt", param_hint="--dvc")
    from flows.dvc_sync import find_project
    from tasks.common import run_root

    if o.dvc in ("auto", "off"):
        p, moved = run_root(o.params, p, find_project(Path.cwd().resolve()))
        if moved:
            typer.secho(moved, fg=typer.colors.YELLOW, err=True)
    t0 = time.perf_counter()
    report = None
    result: dict = {}
    direct = o.direct
    if not direct:
        try:
            from flows.pipeline import Sharing, tandem_pipeline
        except ImportError as e:  # the flow is optional for a stage-only install
            typer.secho(f"Prefect flow unavailable ({e}); running stages directly", fg=typer.colors.YELLOW)
            direct = True
    if direct:
        flow_only = [flag for flag, on in (("--promote", o.promote), ("--pull", o.pull), ("--push", o.push),
                                           ("--publish", o.publish), ("--force", o.force),
                                           ("--eval-runner", o.eval_runner != "threads"), ("--dvc", o.dvc != "auto"))
                     if on]
        if flow_only:
            raise typer.BadParameter(f"{', '.join(flow_only)} {'needs' if len(flow_only) == 1 else 'need'} the Prefect flow "
                                     "(drop --direct)",
                                     param_hint="--direct")
    from tandem.workspace import workspace_lock

    with expected_failures("pipeline", p.out_root), workspace_lock(p.out_root, wait=o.wait, command="tandem run"):
        if direct:
            for name, arm in todo:
                if importlib.util.find_spec(f"tasks.{name}") is None:
                    typer.secho(f"stage {name}: not available yet, stopping here", fg=typer.colors.YELLOW)
                    break
                typer.secho(f"== stage {name}" + (f" --arm {arm}" if arm else ""), bold=True)
                run_stage(name, p, arm)
        else:
            _guard_log_handlers()
            try:
                result = tandem_pipeline(params_path=o.params, dvc=o.dvc, force=o.force, promote=o.promote,
                                         sharing=Sharing(pull=o.pull, push=o.push, publish=o.publish,
                                                         remote=o.remote),
                                         live=o.live, eval_runner=o.eval_runner, stages=wanted)
            except RuntimeError as e:
                raise _prefect_server_failure(e) from e
            result = result if isinstance(result, dict) else {}
            report = result.get("report")
            res = result.get("resources")
            if res and res.get("run_peak_rss_mb") is not None:
                typer.echo(f"peak resident memory: {res['run_peak_rss_mb']:.0f} MB (per task: results/run.json)")
    root = Path(p.out_root)
    typer.secho(f"\npipeline finished in {time.perf_counter() - t0:.0f}s. Results:", bold=True)
    for label, rel in [("report", "reports/report.html"), ("metrics", "metrics/"), ("models", "models/"),
                       ("generations", "results/generations/")]:
        path = Path(report) if (label == "report" and report) else root / rel
        if path.exists():
            typer.echo(f"  {label:12s} {path.resolve()}")
    if result.get("dvc_synced") and not o.publish:
        _compare_with_record(root, result.get("ran"))


PREFECT_SERVER_TIMEOUT = "ephemeral Prefect API server"  # in the RuntimeError Prefect raises when it did not start


def _prefect_server_failure(e: RuntimeError) -> BaseException:
    """Prefect's temporary API server failing to start (with no PREFECT_API_URL, each `tandem run` starts one) as
    the user error it is; any other RuntimeError as it was."""
    if PREFECT_SERVER_TIMEOUT not in str(e):
        return e
    from tandem.errors import UserError

    wait = os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "?")
    return UserError(f"Prefect's temporary API server did not answer within {wait} s ({str(e).split('. ')[0]}; a "
                     f"busy machine is the usual cause). Rerun when it is less loaded, raise "
                     f"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, point PREFECT_API_URL at a running server "
                     f"(`prefect server start`), or run the stages without the flow (`tandem run --direct`)")


def _compare_with_record(root: Path, ran: list[str] | None = None) -> None:
    """Say whether this run reproduced the committed record (HEAD's dvc.lock), and what to do if not; `ran`
    (the stages the flow computed) tells a reproduction from a run that found every stage up to date."""
    from tasks.record import compare_with_record, record_summary

    try:
        cmp = compare_with_record(root, ran)
    except (OSError, ValueError) as e:  # a damaged dvc.lock or metrics file: the run itself succeeded
        typer.secho(f"\ncould not compare with the committed record: {e}", fg=typer.colors.YELLOW)
        return
    if cmp is None:
        return
    from tandem.machine import describe, summary

    typer.secho("\n" + record_summary(cmp, summary(describe())),
                fg=typer.colors.GREEN if cmp.reproduced else typer.colors.YELLOW)


def _echo_status(rows: list[dict]) -> None:
    """`--status` of any study: one line per run: its unit, arm, state and step."""
    for r in rows:
        step = f"{r['step']}/{r['steps']}" if r.get("steps") else ""
        typer.echo(f"{r['unit']:<22} {r['arm']:<13} {r['state']:<14} {step}")


STUDY_OUT = typer.Option("studies/junior-control", "--out", help="the study's folder (its registration.yaml)")


@study_app.callback(invoke_without_command=True)
def study(ctx: typer.Context,
          recompute: bool = typer.Option(False, "--recompute", help="rebuild <out>'s claims (or the pilot's "
                                         "result) from its committed files alone, and exit"),
          out: Optional[str] = typer.Option(None, "--out", help="with --recompute: the committed study's folder "
                                            "(default: studies)")) -> None:
    """Run a study or recompute a committed one: `tandem study --recompute --out <folder>`."""
    if ctx.invoked_subcommand is not None:
        if recompute or out:
            raise typer.BadParameter("--recompute and --out go alone, or after the subcommand", param_hint="--out")
        return
    if not recompute:
        typer.echo(ctx.get_help())
        raise typer.Exit(code=0)
    with expected_failures("study"):
        from tasks.study import recompute as rc

        kind, doc = rc.recompute(out or "studies")
    typer.echo(rc.summary(kind, doc))


@study_app.command("run")
@takes(StudyOptions)
def study_run(o: StudyOptions) -> None:
    """Run the pipeline for several seeds x the arms of a params file (or the registered study) and test the
    claims with 95% intervals (`<out>/claims.json`, `<out>/report.md`). Rerun after an interruption: it continues
    where it stopped."""
    _offline_defaults()
    out = o.out or ("studies" if o.registered else "studies/first-study")
    if o.until not in ("train", "analyze", "claims"):
        typer.secho(f"--until {o.until!r}: choose train, analyze or claims", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=2)
    if o.registered:
        with expected_failures("study"):
            from tasks.study import pilot as pl
            from tasks.study import runs as st

            reg = pl.load_registration()
            sc = reg.study
            study_file = reg.dir / "study.yaml"
            if not study_file.exists():
                raise st.BadInputError(f"study: {study_file} does not exist yet; `tandem study pilot` writes it "
                                       "when a registered variant has room")
            seeds_ = sorted(int(x) for x in sc["seeds"])
            if seeds_ != list(range(seeds_[0], seeds_[0] + len(seeds_))):
                raise st.BadInputError(f"study: registered seeds {seeds_} must be consecutive")
            s = st.settings(study_file, len(seeds_), seeds_[0], reg.dir, int(sc.get("jobs", o.jobs)))
            if o.show_status:
                _echo_status(st.status(s))
                return
            pc = sc["positive_control"]
            ctl = st.Control(int(pc["sft_steps"]), int(pc["sft_batch_size"]), float(pc["sft_lr"]))
            t0 = time.perf_counter()
            st.run_study(s, o.until, ctl, reg.dir / "results", log=typer.echo)
            doc = None
            if o.until == "claims":
                from tasks.study import recompute as rc

                _, doc = rc.recompute(reg.dir)
        typer.secho(f"\nstudy finished in {time.perf_counter() - t0:.0f}s", bold=True)
        if doc is not None:
            typer.echo(rc.summary("registered", doc))
        return
    _load(o.params)
    with expected_failures("study"):
        from tasks.study import runs as st

        s = st.settings(o.params, o.seeds, o.first_seed, out, o.jobs)
        if o.show_status:
            _echo_status(st.status(s))
            return
        t0 = time.perf_counter()
        if o.direct:
            st.shared_inputs(s)
            for seed in s.seeds:
                root = st.prepare_root(s, seed)
                for arm in s.arms:
                    typer.echo(f"study: seed {seed} {arm}: training (log: {root / 'logs' / f'train_{arm}.log'})")
                    st.train(root, arm)
                if o.until != "train":
                    st.evaluate(root)
                    st.analyze(root)
            doc = st.aggregate(s) if o.until == "claims" else None
        else:
            from flows.study import tandem_study

            _guard_log_handlers()
            tandem_study(params_path=o.params, seeds=o.seeds, first_seed=o.first_seed, out=out, jobs=o.jobs,
                         until=o.until)
            doc = st.read_json(s.out / "claims.json") if o.until == "claims" else None
    typer.secho(f"\nstudy finished in {time.perf_counter() - t0:.0f}s", bold=True)
    if doc is not None:
        typer.echo(st.claims_summary(doc))
        typer.echo(f"  claims   {s.out / 'claims.json'}\n  report   {s.out / 'report.md'}")


@study_app.command("pilot")
def study_pilot(registration: str = typer.Option("studies/registration.yaml", "--registration",
                                                help="the registered pilot, study and claims"),
                jobs: Optional[int] = typer.Option(None, "--jobs", help="runs side by side (default: the "
                                                                        "registration's)"),
                show_status: bool = typer.Option(False, "--status", help="print where each pilot run stands and "
                                                                         "exit")) -> None:
    """Run the registered pilot (GRPO against the base on a pilot-only seed) to its room verdict, the KL-Reg
    beta and the study's params file (`studies/pilot/result.md`). Rerun after an interruption: it continues."""
    _offline_defaults()
    with expected_failures("pilot"):
        from tasks.study import pilot as pl

        if show_status:
            _echo_status(pl.status(registration))
            return
        t0 = time.perf_counter()
        doc = pl.run(registration, jobs, log=typer.echo)
    typer.secho(f"\npilot finished in {time.perf_counter() - t0:.0f}s: {doc['verdict']}", bold=True)
    typer.echo(f"  result   {Path(registration).resolve().parent / 'pilot' / 'result.md'}")


GATE_DIALECT = typer.Option(None, "--dialect",
                            help="measure only this registered dialect (repeatable); writes no gate.json")


GATE_REBUILD = typer.Option(False, "--rebuild",
                            help="measure the gate again on S and J rebuilt on this machine (a registered rebuild "
                                 "amendment): writes rebuilds/<S>-<J>/gate.json")


GATE_JOBS = typer.Option(1, "--jobs", min=1, max=6, help="a dialect's six measurements side by side, one process and "
                                                           "one thread each (the same samples as one after the other)")


@study_app.command("gate")
def study_gate(out: str = STUDY_OUT, dialect: list[str] | None = GATE_DIALECT, rebuild: bool = GATE_REBUILD,
               jobs: int = GATE_JOBS) -> None:
    """A registered positive control's gate: build S and J for each registered dialect in order and measure the
    base-only criteria (G1-G5); writes gate.json and gate.md. Rerun: dialects already measured are kept (each
    dialect's result is kept in gate-dialects/<dialect>.json as soon as it is measured). --dialect NAME
    (repeatable) measures only those dialects, e.g. two in processes side by side, and writes no gate.json:
    a run without it then decides in the registered order. --rebuild measures the taken dialect again on S and J
    the stages rebuild on this machine, when a rebuild amendment is registered (amendments.yaml). --jobs N measures
    a dialect's six measurements N at a time, one process and one thread each: the same samples."""
    _offline_defaults()
    with expected_failures("study gate"):
        from tasks.study import control as ctl

        t0 = time.perf_counter()
        if rebuild:
            doc = ctl.gate_rebuild(Path(out), jobs)
            where = ctl.rebuild_dir(ctl.registration(Path(out)), doc["build"])
            typer.secho(f"rebuild gate finished in {time.perf_counter() - t0:.0f}s: "
                        f"{'passed' if doc['passed'] else 'failed'} ({ctl.rel(where / 'gate.md')})", bold=True)
            return
        if dialect:
            measured = ctl.measure_dialects(Path(out), dialect, jobs)
        else:
            doc = ctl.gate(Path(out), jobs)
    if dialect:
        reg = ctl.registration(Path(out))
        for r in measured:
            typer.echo(f"gate: dialect {r['dialect']!r} measured: {'passes' if r['passed'] else 'fails'} "
                       f"({ctl.rel(ctl.dialect_result_file(reg, r['dialect']))})")
        typer.secho(f"gate finished in {time.perf_counter() - t0:.0f}s: measured {', '.join(dialect)}; run "
                    "`tandem study gate` without --dialect to decide", bold=True)
        return
    typer.secho(f"gate finished in {time.perf_counter() - t0:.0f}s: "
                + (f"passed with dialect {doc['dialect']!r}" if doc["passed"] else "no dialect passed"), bold=True)
    typer.echo(f"  gate   {Path(out) / 'gate.md'}")


@study_app.command("control")
@takes(ControlRunOptions)
def study_control(o: ControlRunOptions) -> None:
    """A registered positive control's runs: train, evaluate and analyse every registered seed x arm that has no
    result yet (resumable), writing results/seed-<S>/<arm>.json as each finishes."""
    _offline_defaults()
    with expected_failures("study control"):
        from tasks.study import control as ctl

        if o.show_status:
            _echo_status(ctl.status(Path(o.out)))
            return
        pick = (lambda v: [x.strip() for x in v.split(",") if x.strip()] if v else None)
        t0 = time.perf_counter()
        seeds = pick(o.seeds)
        if seeds and not all(x.isdigit() for x in seeds):
            raise typer.BadParameter(f"{o.seeds!r}: comma-separated seeds, e.g. 0,1,2", param_hint="--seeds")
        done = ctl.run(Path(o.out), seeds=[int(x) for x in seeds] if seeds else None, arms=pick(o.arms),
                       jobs=o.jobs, commit=o.commit, log=typer.echo)
    typer.secho(f"control runs finished in {time.perf_counter() - t0:.0f}s: {len(done)} result(s) written", bold=True)


@app.command("check-params")
def check_params(file: str = typer.Argument("params.yaml", help="params file to validate"),
                 explain: bool = typer.Option(False, "--explain", help="print every setting with its value, rule "
                                                                      "and help instead of the sections")) -> None:
    """Validate a params file (every setting present, no unknown keys, types, value rules) and print it."""
    p = _load(file)
    typer.secho(f"{file}: OK (every setting stated)", fg=typer.colors.GREEN)
    if explain:
        from tandem.config import explain as explain_settings, show

        for key, value, rule, help_text in explain_settings(p):
            typer.echo(f"  {key} = {show(value)}" + (f"  [{rule}]" if rule else "") + f"\n      {help_text}")
        return
    for section in ("data", "model", "junior", "rollout", "train", "evaluate", "analyze", "report"):
        typer.echo(f"  {section}: {json.dumps(getattr(p, section).__dict__, default=str)}")


def _print_rollout_plan(r: dict) -> None:
    """`tandem plan`'s rollout section: the layout, the rows each engine holds, and the predicted tandem/solo."""
    typer.secho(f"\nrollout: layout {r['layout']} on {r['gpu']} ({r['gpu_memory_gib']:g} GiB): {r['gpus_note']}",
                bold=True)
    per_call = f" (per call {r['rows_per_call']})" if r["rows_per_call"] != r["rows_per_engine"] else ""
    typer.echo(f"  rows per engine {r['rows_per_engine']}{per_call}; KV per row at full "
               f"length {r['kv_gib_per_row']} GiB; {r['vllm_gpu_memory']} of a GPU per engine leaves "
               f"{r['room_gib']} GiB: {r['resident_rows']} rows resident, {r['admission_waves']} admission wave(s)")
    s, c = r["engine_steps_per_token"], r["computed_per_token"]
    typer.echo(f"  engine steps per generated token of a row (measured premises): senior {s['senior']}, junior "
               f"{s['junior']}, solo {s['solo']}; computed tokens per generated token: tandem {c['tandem']}, solo "
               f"{c['solo']}")
    if r["step_ms"]:
        s = r["step_ms"]
        typer.echo(f"  step (ms): weights {s['weights']}; tandem senior {s['tandem_gpu_senior']} + gap "
                   f"{s['tandem_gap_senior']}, junior {s['tandem_gpu_junior']} + gap {s['tandem_gap_junior']}; "
                   f"solo {s['solo']} (asynchronous scheduling, {r['solo_rows_per_gpu']} rows per GPU)")
    ratio = r["predicted_tandem_over_solo"]
    typer.echo(f"  predicted tandem/solo: {ratio if ratio is not None else 'n/a'} (tandem {r['tandem_s']} s, solo "
               f"{r['solo_s']} s per rollout call)")
    for n in r["notes"]:
        typer.echo(f"  - {n}")


def _print_layouts(c: dict) -> None:
    """`tandem plan`'s layout comparison: per layout the GPUs, rollout and training seconds per step, the trainer's
    idle seconds and tandem/solo; the recommended layout and why."""
    typer.secho(f"\nlayouts on a node of {c['node_gpus']} GPUs (per training step; training is a compute-bound "
                f"lower bound):", bold=True)
    f = lambda x, nd=1: "-" if x is None else f"{x:.{nd}f}"  # noqa: E731
    for name, r in c["layouts"].items():
        if "why" in r:
            typer.echo(f"  {name:9s} not priced: {r['why']}")
            continue
        mark = " (this params file)" if r.get("params_layout") else ""
        fits = "" if r["fits"] else "; DOES NOT FIT in memory"
        typer.echo(f"  {name:9s} {r['gpus']} GPUs ({r['trainer_gpus']} trainer, {r['rollout_gpus']} rollout, "
                   f"{r['vllm_gpu_memory']} per engine): rollout {f(r['rollout_s'])} s ({r['calls_per_step']} "
                   f"call(s) of {r['rows_per_call']} rows), training {f(r['training_s'])} s, trainer idle "
                   f"{f(r['trainer_idle_s'])} s, {f(r['step_s'])} s per step; tandem/solo "
                   f"{f(r['predicted_tandem_over_solo'], 2)}{mark}{fits}")
    rec = c["recommended"]
    typer.secho(f"  recommended: {rec or 'none'} ({c['why']})", bold=True)


@app.command("plan")
def plan(params: str = PARAMS_OPT,
         as_json: bool = typer.Option(False, "--json", help="print one JSON line (per_gpu_gib, gpus, fits, breakdown)"),
         device: str = typer.Option("cuda", help="plan for cuda (train.gpu_memory_gib per GPU) or cpu (this machine's RAM)"),
         model: Optional[str] = typer.Option(None, help="model dir whose config.json gives the shape (default: models/base under out_root)"),
         gpus: int = typer.Option(0, "--gpus", min=0, help="GPUs of the node (0 = not stated): a run that needs more is refused")) -> None:
    """The memory plan of a params file: per-GPU bytes for training (every arm) and evaluation, and whether it fits
    (exit code 1 when it does not); on cuda also the GPUs the run needs on one node (exit code 2 when --gpus is
    fewer)."""
    from tandem.plan import PlanError, plan_all

    if device not in ("cuda", "cpu"):
        typer.secho(f"--device {device!r}: choose cuda or cpu", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=2)
    p = _load(params)
    try:
        res = plan_all(p, model or Path(p.out_root) / "models" / "base", device, gpus)
    except PlanError as e:
        typer.secho(str(e), fg=typer.colors.RED, err=True)
        raise typer.Exit(code=2)
    if as_json:
        typer.echo(json.dumps(res))
        raise typer.Exit(code=0 if res["fits"] else 1)
    m = res["model"]
    typer.echo(f"model: {m['n_params']:,} parameters ({m['source']}); {res['gpus']} process(es), "
               f"budget {res['budget_gib']} GiB per {'GPU' if device == 'cuda' else 'process'}")
    if device == "cuda":
        node = f" (the node has {gpus})" if gpus else " (state the node's with --gpus)"
        typer.echo(f"GPUs: the run needs {res['gpus_needed']} on one node{node}")
    for name, pj in [*res["train"].items(), ("evaluate", res["evaluate"])]:
        title = f"train@{name}" if name != "evaluate" else "evaluate"
        typer.secho(f"\n{title}: {pj['per_gpu_gib']:.2f} GiB per device -> {'fits' if pj['fits'] else 'DOES NOT FIT'}",
                    bold=True, fg=typer.colors.GREEN if pj["fits"] else typer.colors.RED)
        for part in ("persistent_gib", "rollout_gib", "training_gib"):
            for k, v in pj[part].items():
                typer.echo(f"  {part[:-4]:11s} {k:24s} {v:10.3f} GiB")
        if pj.get("training_phase_gib"):
            typer.echo(f"  {'training':11s} {'(phase peak)':24s} {pj['training_phase_gib']:10.3f} GiB")
        for c in pj["checks"]:
            typer.secho(f"  ! {c}", fg=typer.colors.RED)
        for n in pj["notes"]:
            typer.echo(f"  - {n}")
    if res.get("rollout"):
        _print_rollout_plan(res["rollout"])
    if res.get("layouts"):
        _print_layouts(res["layouts"])
    typer.secho(f"\nworst: {res['worst_arm']} at {res['per_gpu_gib']:.2f} GiB per device; fits: {res['fits']}", bold=True)
    raise typer.Exit(code=0 if res["fits"] else 1)


@bench_app.command("rollout")
@takes(BenchRolloutOptions)
def bench_rollout(o: BenchRolloutOptions) -> None:
    """Rollout throughput: solo, tandem (word), lockstep reference and plain generate, with ratios; with
    --backend vllm: the service's throughput, its counters, the predicted GPU ratio, log-probs against
    transformers and the weight-sync check."""
    model_dir = o.model if o.model else ("models/base" if Path("models/base/config.json").exists() else None)
    if o.backend == "vllm":
        if o.write_premises and o.vocab != "qwen3":
            typer.secho("--write-premises: the cost model's premises are counts on real text at full length; run "
                        "with --vocab qwen3", fg=typer.colors.RED, err=True)
            raise typer.Exit(code=2)
        vb = load_benchmark("vllm_rollout")
        work = load_benchmark("rollout").BenchWorkload(n_prompts=o.prompts, n_samples=o.samples or (4 if o.vocab == "qwen3" else 8),
                             max_new_tokens=o.max_new_tokens, repeats=o.repeats)
        res = vb.bench_rollout_vllm(model_dir, o.url, work, vb.VLLMBenchOptions(
            vocab=o.vocab, gpu=o.gpu, gpu_rows=o.gpu_rows, compare_stream=o.compare_stream,
            compare_vocab=o.compare_vocab, compare_isolated=o.compare_isolated))
        _print_bench(res, o.as_json)
        if o.write_premises:
            from tandem.rollout.cost import Premises, write_premises

            where = write_premises(Premises.from_json(res["premises"]))
            typer.echo(f"premises written to {where}", err=True)
        if o.vocab == "model" and not (res["weights_synced"] and res["logprob_max_abs_diff"] <= 0.1):
            raise typer.Exit(code=1)
        return
    if o.backend != "hf":
        typer.secho(f"unknown backend {o.backend!r}; choose hf or vllm", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=2)
    res = load_benchmark("rollout").bench_rollout(model_dir=model_dir)
    _print_bench(res, o.as_json)


@bench_app.command("train")
def bench_train(as_json: bool = typer.Option(False, "--json", help="print one JSON line"),
                params: str = PARAMS_OPT) -> None:
    """Mean training step time of the tandem and grpo arms with the phase split, and their ratio."""
    res = load_benchmark("bench_train").bench_train(_load(params))
    _print_bench(res, as_json)


@bench_app.command("orchestration")
def bench_orchestration(as_json: bool = typer.Option(False, "--json", help="print one JSON line"),
                        repeats: int = typer.Option(1, help="pairs of runs to average")) -> None:
    """Orchestration overhead: the Prefect flow against calling the stages directly, on a tiny config."""
    import subprocess

    script = _benchmark_file("orchestration")
    cmd = [sys.executable, str(script), "--repeats", str(repeats)] + (["--json"] if as_json else [])
    raise typer.Exit(code=subprocess.call(cmd))


def _benchmark_file(name: str) -> Path:
    """`benchmarks/<name>.py` of this source checkout (benchmarks live beside the package, not in it)."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    if not script.exists():
        typer.secho(f"{script} not found (run from a source checkout)", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=2)
    return script


def load_benchmark(name: str):
    """The module `benchmarks.<name>` of this source checkout (the checkout's root put on the import path, so
    that benchmarks import each other as `benchmarks.<name>`)."""
    import importlib

    root = str(_benchmark_file(name).parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    return importlib.import_module(f"benchmarks.{name}")


def _print_bench(res: dict, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(res))
    else:
        for k, v in res.items():
            typer.echo(f"{k:28s} {v:.4g}" if isinstance(v, float) else f"{k:28s} {v}")


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
