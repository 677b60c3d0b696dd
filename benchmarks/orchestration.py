"""Orchestration overhead: the `tandem-pipeline` Prefect flow against calling the stages directly.

Each variant runs the whole pipeline from scratch on a tiny config (tests/flows/tiny_params.yaml by
default) in a fresh Python process with its own output folder, timed from outside (interpreter start,
imports and everything). The flow variant also reports, from inside the run, how its time splits:

- temporary API server start: Prefect starts a local server when no PREFECT_API_URL is set (`tandem run`
  on a laptop); a deployment or a long-lived server does not pay it;
- in-flow overhead: the flow's wall time minus the time spent inside the stage functions (task-run state
  changes, artifacts, logging, futures).

    python benchmarks/orchestration.py [--params FILE] [--repeats N] [--json]

Prints the seconds of each variant and the ratios (target: flow overhead under 5% of the direct run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from tandem.config import TOOL_ENV

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PARAMS = REPO / "tests" / "flows" / "tiny_params.yaml"

_DIRECT = """
import json, sys, time
t0 = time.perf_counter()
import importlib
from tasks.common import load_params
p = load_params(sys.argv[1])
stages = {}
for name in ("prepare", "base", "train", "evaluate", "analyze", "report"):
    mod = importlib.import_module(f"tasks.{name}")
    t = time.perf_counter()
    mod.run(p, *mod.default_io(p))
    stages[name] = time.perf_counter() - t
print("BENCH " + json.dumps({"inside": time.perf_counter() - t0, "stages": stages}))
"""

_FLOW = """
import json, sys, time
t0 = time.perf_counter()
from flows.pipeline import tandem_pipeline
t_import = time.perf_counter() - t0
state = tandem_pipeline(params_path=sys.argv[1], dvc="off", live=False, return_state=True)
res = state.result()
print("BENCH " + json.dumps({"inside": time.perf_counter() - t0, "import": t_import,
                             "flow_wall": res["wall_seconds"], "timings": res["timings"]}))
"""


def _run(code: str, params_file: Path, env: dict) -> dict:
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", code, str(params_file)], cwd=REPO, env=env, capture_output=True,
                         text=True)
    total = time.perf_counter() - t0
    if res.returncode != 0:
        raise RuntimeError(f"benchmark run failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    line = next(line for line in res.stdout.splitlines()[::-1] if line.startswith("BENCH "))
    return {"total": total, **json.loads(line[len("BENCH "):])}


def _params_in(tmp: Path, source: Path, name: str) -> Path:
    out = tmp / name
    out.mkdir()
    raw = yaml.safe_load(source.read_text())
    raw["out_root"] = str(out)
    f = out / "params.yaml"
    f.write_text(yaml.safe_dump(raw, sort_keys=False))
    return f


def measure(params: Path = DEFAULT_PARAMS, repeats: int = 1) -> dict:
    """Alternate direct and flow runs `repeats` times; medians and ratios."""
    env = {**os.environ, **TOOL_ENV, "HF_HUB_OFFLINE": "1", "WANDB_MODE": os.environ.get("WANDB_MODE", "disabled"),
           "PREFECT_LOGGING_LEVEL": "WARNING"}
    direct, flow = [], []
    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp:
        for i in range(repeats):
            direct.append(_run(_DIRECT, _params_in(Path(tmp), params, f"direct-{i}"), env))
            flow.append(_run(_FLOW, _params_in(Path(tmp), params, f"flow-{i}"), env))
    d = statistics.median(r["total"] for r in direct)
    f = statistics.median(r["total"] for r in flow)
    work = [sum(v for k, v in r["timings"].items()) for r in flow]
    in_flow = statistics.median(r["flow_wall"] - w for r, w in zip(flow, work))
    # server start + engine setup: the flow process's time not spent importing or inside the flow body
    startup = statistics.median(r["inside"] - r["import"] - r["flow_wall"] for r in flow)
    return {
        "repeats": repeats, "direct_seconds": round(d, 2), "flow_seconds": round(f, 2),
        "flow_vs_direct_ratio": round(f / d, 4), "overhead_fraction": round(f / d - 1, 4),
        "in_flow_overhead_seconds": round(in_flow, 2), "in_flow_overhead_fraction": round(in_flow / d, 4),
        "server_and_engine_start_seconds": round(startup, 2),
        "overhead_without_server_start_fraction": round((f - startup) / d - 1, 4),
        "direct_runs": [round(r["total"], 2) for r in direct], "flow_runs": [round(r["total"], 2) for r in flow],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=Path, default=DEFAULT_PARAMS, help="params file of the tiny pipeline")
    ap.add_argument("--repeats", type=int, default=1, help="direct/flow pairs to run (medians are reported)")
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    a = ap.parse_args(argv)
    res = measure(a.params, a.repeats)
    if a.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k:42s} {v}")
        print(f"\nflow / direct = {res['flow_vs_direct_ratio']:.3f} "
              f"({res['overhead_fraction']:+.1%}; in-flow overhead {res['in_flow_overhead_fraction']:+.1%}, "
              f"without the temporary server start {res['overhead_without_server_start_fraction']:+.1%}; "
              f"target < 5%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
