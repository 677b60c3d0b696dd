"""Running one pipeline stage for a study: in this process (`run_stage`) or in a child interpreter (`stage`).

Every study driver (tasks/study/runs.py, control.py, pilot.py) runs the stages' own functions (`tasks.<stage>.run`,
`tasks.train.run_arm`, on the paths their `default_io` declares: the calls the pipeline flow and `tandem stage`
make), each in a child interpreter of its own with the params file's torch threads, so runs go side by side; each
appends its output to a log, whose tail a failure names. `python -m tasks.study.stages NAME PARAMS_FILE [ARM]` is
the child's entry point. `write_params` writes a run's derived params file (tandem/study/params.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import yaml

from tandem.errors import BadInputError, UserError
from tasks.common import atomic_path, load_params

CODE_ROOT = Path(__file__).resolve().parents[2]


def _stage_module(name: str):
    """The stage module the study runs (imported one at a time: each costs its own import time)."""
    if name == "prepare":
        from tasks import prepare as mod
    elif name == "base":
        from tasks import base as mod
    elif name == "junior":
        from tasks import junior as mod
    elif name == "train":
        from tasks import train as mod
    elif name == "evaluate":
        from tasks import evaluate as mod
    elif name == "analyze":
        from tasks import analyze as mod
    else:
        raise BadInputError(f"study: no stage {name!r} (prepare, base, junior, train, evaluate, analyze)")
    return mod


def run_stage(params_file: str | Path, name: str, arm: str | None = None) -> int:
    """Stage `name` (one arm of train if given) on `params_file` in this process, as `tandem stage` runs it: the
    quiet-tool defaults, the output root's lock (one arm of train holds only its own scope, so arms go side
    by side), then the stage's own function on its declared paths. Returns 0, or 1 after a failure (an
    expected one as its one-line message, anything else with its traceback)."""
    from tandem.config import apply_tool_env
    from tandem.errors import as_user_error, is_expected
    from tandem.workspace import workspace_lock

    apply_tool_env()
    t0 = time.perf_counter()
    try:
        params = load_params(params_file)
        mod = _stage_module(name)
        inputs, outputs = mod.default_io(params)
        with workspace_lock(params.out_root, command=f"tandem study: stage {name}" + (f" --arm {arm}" if arm else ""),
                            scope=f"train-{arm}" if arm else None):
            if arm is None:
                mod.run(params, inputs, outputs)
            else:
                mod.run_arm(params, arm, inputs, outputs)
    except Exception as e:  # noqa: BLE001 - the parent reads the log's tail into its error
        if is_expected(e):
            print(f"stage {name} failed: {as_user_error(e)}", file=sys.stderr)
        else:
            traceback.print_exc()
        return 1
    print(f"stage {name} done in {time.perf_counter() - t0:.1f}s")
    return 0


def stage(params_file: Path, name: str, log: Path, arm: str | None = None) -> None:
    """`run_stage` in a child interpreter (`python -m tasks.study.stages NAME PARAMS_FILE [ARM]`), output appended to `log`:
    each stage sets its own torch threads, holds its own models and frees them when it ends, so stages of
    different seeds and arms run side by side."""
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "tasks.study.stages", name, str(params_file)] + ([arm] if arm else [])
    env = dict(os.environ, WANDB_MODE=os.environ.get("WANDB_MODE", "disabled"))
    env["PYTHONPATH"] = os.pathsep.join([str(CODE_ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    with open(log, "a", encoding="utf-8") as f:
        f.write(f"\n== stage {name}{' --arm ' + arm if arm else ''} --params {params_file} "
                f"({time.strftime('%Y-%m-%d %H:%M:%S')})\n")
        f.flush()
        rc = subprocess.call(cmd, cwd=CODE_ROOT, stdout=f, stderr=subprocess.STDOUT, env=env)
    if rc != 0:
        tail = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-5:]
        raise UserError(f"study: stage {name}{' --arm ' + arm if arm else ''} for {params_file.parent} failed "
                        f"(exit {rc}); see {log}:\n  " + "\n  ".join(tail))


def rel(p: Path, root: Path | None = None) -> str:
    """`p` relative to the project root (`root`, default CODE_ROOT) when it lies inside it (what a committed file
    names), else as is."""
    try:
        return str(Path(p).resolve().relative_to(root or CODE_ROOT))
    except ValueError:
        return str(p)


def write_params(path: Path, raw: dict) -> Path:
    """`raw` (tandem.study.params.derive's result) as the params file `path` (written only when it changed: the
    file is the record of the run), then loaded strictly: a complete, valid file before anything runs."""
    text = yaml.safe_dump(raw, sort_keys=False)
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            Path(tmp).write_text(text)
    load_params(path)
    return path


def main(argv: list[str] | None = None) -> int:
    """`python -m tasks.study.stages NAME PARAMS_FILE [ARM]`: one stage of one study root (what `stage` runs)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (2, 3):
        print("usage: python -m tasks.study.stages NAME PARAMS_FILE [ARM]", file=sys.stderr)
        return 2
    return run_stage(argv[1], argv[0], argv[2] if len(argv) == 3 else None)


if __name__ == "__main__":
    sys.exit(main())
