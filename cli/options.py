"""Command options declared once, as the fields of a frozen dataclass, for commands with many options.

    @dataclass(frozen=True)
    class RunOptions:
        params: str = option(PARAMS_OPT)                                   # a shared typer.Option
        force: bool = option(False, "--force", "-f", help="...")          # typer.Option(False, "--force", ...)

    @app.command()
    @takes(RunOptions)
    def run(o: RunOptions) -> None: ...                                    # o.params, o.force

`takes` hands typer a function whose signature is the dataclass's fields in order (name, type, and the
`typer.Option` as the default), so option names, help and defaults are what the fields declare and
`tandem run --help` lists them as before; the command's body receives one frozen `RunOptions`, which Python
callers and tests can also build directly (`RunOptions(force=True)`: the fields' defaults are the options'
defaults).
"""

from __future__ import annotations

import functools
import inspect
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable, Optional

import typer
from typer.models import ParameterInfo

PARAMS_OPT = typer.Option("params.yaml", "--params", "-p", help="params file (YAML) to read")
WAIT_OPT = typer.Option(False, "--wait", help="if another run holds this output root, wait for it instead of stopping")


def option(default: Any, *names: str, **settings: Any) -> Any:
    """A dataclass field that is also a command option: `typer.Option(default, *names, **settings)`, or an
    existing `typer.Option` (then its default is the field's)."""
    info = default if isinstance(default, ParameterInfo) else typer.Option(default, *names, **settings)
    return field(default=info.default, metadata={"typer": info})


def takes(options_cls: type) -> Callable[[Callable[[Any], Any]], Callable[..., Any]]:
    """Decorator: the command `fn(options)` as a typer callback taking one keyword per field of
    `options_cls` (see the module docstring)."""
    hints = typing.get_type_hints(options_cls)  # the field types as objects, resolved in their own module
    params = []
    for f in fields(options_cls):
        if "typer" not in f.metadata or f.default is MISSING:
            raise TypeError(f"{options_cls.__name__}.{f.name} is not declared with option()")
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.metadata["typer"],
                                        annotation=hints[f.name]))

    def decorate(fn: Callable[[Any], Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def command(**values: Any) -> Any:
            return fn(options_cls(**values))

        command.__signature__ = inspect.Signature(params, return_annotation=None)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params} | {"return": None}
        return command

    return decorate


@dataclass(frozen=True)
class RunOptions:
    """`tandem run`."""

    params: str = option(PARAMS_OPT)
    stages: str = option("all", "--stages", "-s", metavar="SELECTION",
                         help="what to run: all | training (prepare, base, train@<arm>) | evaluation "
                              "(evaluate, analyze, report) | a comma list of stages or groups, e.g. "
                              "base,train@tandem or evaluate,report (the outputs of stages left out "
                              "must exist)")
    force: bool = option(False, "--force", "-f",
                         help="run the selected stages even when dvc.lock says they are up to date")
    promote: bool = option(False, "--promote",
                           help="promote the best checkpoint if it does not regress (git tags on a commit "
                                "whose dvc.lock pins it: with --publish, or after committing dvc.lock)")
    pull: bool = option(False, "--pull", help="`dvc pull` first: the outputs dvc.lock names, from the "
                                              "DVC remote (the record's artifacts)")
    push: bool = option(False, "--push", help="`dvc push` the outputs to the DVC remote afterwards")
    remote: Optional[str] = option(None, "--remote", help="DVC remote for --push (default: the "
                                                          "project's, .dvc/config)")
    publish: bool = option(False, "--publish", help="commit dvc.lock, params.yaml and metrics/ and push "
                                                    "them and the promotion tags to git `origin`")
    eval_runner: str = option("threads", "--eval-runner", metavar="RUNNER",
                              help="where evaluation units run: threads | dask (a local Dask cluster) | "
                                   "a Dask scheduler address (tcp://host:8786)")
    dvc: str = option("auto", "--dvc", metavar="MODE",
                      help="auto: commit each stage to dvc.lock and skip current ones when this is the "
                           "project's run (params.yaml, out_root .) | on: insist | off: never touch DVC | "
                           "adopt: copy --params over params.yaml first (a worker's own clone)")
    live: Optional[bool] = option(None, "--live/--no-live",
                                  help="terminal progress view (default: on in a terminal)")
    direct: bool = option(False, help="call the stages in order without Prefect (no DVC commits, "
                                      "skips, promotion or push)")
    wait: bool = option(WAIT_OPT)


@dataclass(frozen=True)
class StudyOptions:
    """`tandem study run`."""

    seeds: int = option(3, "--seeds", help="number of training seeds (first-seed, first-seed + 1, ...)")
    params: str = option("params.study.yaml", "--params", "-p", help="complete params file of the study")
    first_seed: int = option(0, "--first-seed", help="the first seed")
    out: Optional[str] = option(None, "--out", help="directory for the per-seed roots, claims.json and the "
                                "report (default: studies/first-study for a --params study, studies for "
                                "--registered)")
    jobs: int = option(2, "--jobs", help="runs side by side (each a one-thread stage process)")
    until: str = option("claims", "--until", help="stop after: train | analyze | claims")
    show_status: bool = option(False, "--status", help="print where each seed x arm stands and exit")
    direct: bool = option(False, help="run the steps in this process without Prefect")
    registered: bool = option(False, "--registered", help="the registered study (studies/registration"
                              ".yaml: its study file, seeds, arms, positive control); per seed x arm "
                              "results go to studies/results/ as they finish")


@dataclass(frozen=True)
class ControlRunOptions:
    """`tandem study control`."""

    out: str = option("studies/junior-control", "--out", help="the control's folder (its registration.yaml)")
    seeds: Optional[str] = option(None, "--seeds", help="comma-separated seeds (default: the registration's, "
                                  "in order)")
    arms: Optional[str] = option(None, "--arms", help="comma-separated control arms (default: every arm)")
    jobs: int = option(2, "--jobs", help="seed x arm runs side by side (each a one-thread stage process)")
    commit: bool = option(False, "--commit", help="git-commit each finished run's result file as it lands")
    show_status: bool = option(False, "--status", help="print where each seed x arm stands and exit")


@dataclass(frozen=True)
class BenchRolloutOptions:
    """`tandem bench rollout`."""

    as_json: bool = option(False, "--json", help="print one JSON line")
    model: Optional[str] = option(None, help="model dir (default: models/base if present)")
    backend: str = option("hf", help="hf (this process) or vllm (the rollout service in "
                                     "vLLM's own environment)")
    url: Optional[str] = option(None, help="vllm: attach to a running service instead of "
                                           "starting one ($TANDEM_VLLM_TOKEN: its secret)")
    vocab: str = option("model", help="vllm: model (the model's tokenizer) or qwen3 (Qwen3's "
                                      "real vocabulary, replayed real text at full length)")
    max_new_tokens: Optional[int] = option(None, help="vllm: tokens per row (default 128; "
                                                      "qwen3: 3000)")
    prompts: int = option(8, help="vllm: distinct prompts")
    samples: Optional[int] = option(None, help="vllm: rows per prompt (default 8; qwen3: 4)")
    repeats: int = option(2, help="vllm: timed runs of each (best kept)")
    gpu: str = option("h200", help="vllm: the GPU the prediction prices (h200 | h100)")
    gpu_rows: int = option(128, help="vllm: rows the prediction scales the counts to")
    compare_stream: bool = option(True, help="vllm: also time the tandem rollout through "
                                             "AsyncLLM.generate's sessions (stream_*) and with one "
                                             "engine-core message per chunk (single_*)")
    compare_vocab: bool = option(True, help="vllm, qwen3: also run the same rollout relabelled into a "
                                            "334-token vocabulary on the same body (small_vocab_*)")
    compare_isolated: bool = option(True, help="vllm, qwen3: also step the engine core's scheduler alone "
                                               "at a short and the long history, both vocabularies "
                                               "(isolated_*)")
    write_premises: bool = option(False, "--write-premises", help="vllm: write this run's premises (counts per "
                                                                 "generated token, CPU per unit) to the cost "
                                                                 "model's file, tandem/rollout/premises.json")
