"""The `tandem` command line: run one stage, the whole pipeline, check a params file, run benchmarks.

This is the entry point above every layer (top level, next to `flows/`): it imports `tasks/` and `flows/` lazily
inside each command, so `tandem --help` and `tandem check-params` start fast.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from tandem.config import ParamsError

STAGES = ("prepare", "base", "train", "evaluate", "analyze", "report")

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Tandem RL as a reproducible pipeline: stages, the full flow, params checks, benchmarks.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print ratios measured in one process.")
app.add_typer(bench_app, name="bench")

PARAMS_OPT = typer.Option("params.yaml", "--params", "-p", help="params file (YAML) to read")


def _offline_defaults() -> None:
    """Tools that phone home stay quiet unless the user asked otherwise (W&B's mode comes from
    `train.wandb_mode`, offline by default, unless WANDB_MODE is set)."""
    for key, value in {
        "DVC_NO_ANALYTICS": "1",
        "GX_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "TRL_EXPERIMENTAL_SILENCE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    }.items():
        os.environ.setdefault(key, value)


def _load(params: str, all_presets: bool = False):
    from tasks.common import load_params

    try:
        return load_params(params, all_presets=all_presets)
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
          arm: Optional[str] = typer.Option(None, help="train stage only: train this one arm (dvc.yaml's train@<arm>)")) -> None:
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
    t0 = time.perf_counter()
    try:
        summary = run_stage(name, p, arm)
    except Exception as e:  # a stage's own readable failure (validation, missing input) ends here with exit 1
        if type(e).__name__ == "DataValidationError":  # the stage already printed the row-by-row report
            typer.secho(f"stage {name} failed: data validation found problems (report above); "
                        "no outputs were written", fg=typer.colors.RED, err=True)
            raise typer.Exit(code=1)
        if isinstance(e, FileNotFoundError):
            typer.secho(f"stage {name} failed: {e}", fg=typer.colors.RED, err=True)
            raise typer.Exit(code=1)
        raise
    typer.echo(f"stage {name} done in {time.perf_counter() - t0:.1f}s")
    if summary:
        typer.echo(json.dumps(summary, indent=2, default=str)[:4000])


@app.command()
def run(params: str = PARAMS_OPT,
        direct: bool = typer.Option(False, help="call the stages in order without Prefect")) -> None:
    """Run the whole pipeline (the `tandem-pipeline` Prefect flow) and print where the results are."""
    _offline_defaults()
    p = _load(params)
    t0 = time.perf_counter()
    report = None
    if not direct:
        try:
            from flows.pipeline import tandem_pipeline
        except ImportError as e:  # the flow is optional for a stage-only install
            typer.secho(f"Prefect flow unavailable ({e}); running stages directly", fg=typer.colors.YELLOW)
            direct = True
    if direct:
        for name in STAGES:
            if importlib.util.find_spec(f"tasks.{name}") is None:
                typer.secho(f"stage {name}: not available yet, stopping here", fg=typer.colors.YELLOW)
                break
            typer.secho(f"== stage {name}", bold=True)
            run_stage(name, p)
    else:
        result = tandem_pipeline(params_path=params)
        report = result.get("report") if isinstance(result, dict) else None
        res = result.get("resources") if isinstance(result, dict) else None
        if res:
            typer.echo(f"peak resident memory: {res['run_peak_rss_mb']:.0f} MB (per task: metrics/run.json)")
    root = Path(p.out_root)
    typer.secho(f"\npipeline finished in {time.perf_counter() - t0:.0f}s. Results:", bold=True)
    for label, rel in [("report", "reports/report.html"), ("metrics", "metrics/"), ("models", "models/"),
                       ("generations", "results/generations/")]:
        path = Path(report) if (label == "report" and report) else root / rel
        if path.exists():
            typer.echo(f"  {label:12s} {path.resolve()}")


@app.command("check-params")
def check_params(file: str = typer.Argument("params.yaml", help="params file to validate")) -> None:
    """Validate a params file (unknown keys, types, value rules) and print the resolved settings."""
    p = _load(file, all_presets=True)
    typer.secho(f"{file}: OK (preset: {p.preset or 'none'})", fg=typer.colors.GREEN)
    for section in ("data", "model", "rollout", "train", "evaluate", "analyze", "report"):
        typer.echo(f"  {section}: {json.dumps(getattr(p, section).__dict__, default=str)}")


@bench_app.command("rollout")
def bench_rollout(as_json: bool = typer.Option(False, "--json", help="print one JSON line"),
                  model: Optional[str] = typer.Option(None, help="model dir (default: models/base if present)")) -> None:
    """Rollout throughput: solo, tandem (word), lockstep reference and plain generate, with ratios."""
    from tandem.rollout.bench import bench_rollout as _bench

    res = _bench(model_dir=model if model else ("models/base" if Path("models/base/config.json").exists() else None))
    _print_bench(res, as_json)


@bench_app.command("train")
def bench_train(as_json: bool = typer.Option(False, "--json", help="print one JSON line"),
                params: str = PARAMS_OPT) -> None:
    """Mean training step time of the tandem and grpo arms with the phase split, and their ratio."""
    from tandem.bench_train import bench_train as _bench

    res = _bench(_load(params))
    _print_bench(res, as_json)


@bench_app.command("orchestration")
def bench_orchestration(as_json: bool = typer.Option(False, "--json", help="print one JSON line"),
                        repeats: int = typer.Option(1, help="pairs of runs to average")) -> None:
    """Orchestration overhead: the Prefect flow against calling the stages directly, on a tiny config."""
    import subprocess

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "orchestration.py"
    if not script.exists():
        typer.secho(f"{script} not found (run from a source checkout)", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=2)
    cmd = [sys.executable, str(script), "--repeats", str(repeats)] + (["--json"] if as_json else [])
    raise typer.Exit(code=subprocess.call(cmd))


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
