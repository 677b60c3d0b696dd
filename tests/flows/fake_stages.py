"""Fake stage modules with the real contracts (`default_io`, `run`, and the unit/arm entry points the flow
calls), writing tiny files where a matching fake `dvc.yaml` expects them. They record every call, so the
flow's wiring (order, mapping, DVC commits, artifacts) is tested without any model."""

from __future__ import annotations

import json
import threading
import types
from pathlib import Path

import yaml

from tasks.common import Layout

DVC_YAML = """\
stages:
  prepare:
    cmd: echo prepare
    deps: [src.txt]
    params: [seed]
    outs: [data/prepared]
    metrics:
      - metrics/data.json
  base:
    cmd: echo base
    deps: [data/prepared]
    params: [model.hidden_size]
    outs: [models/base]
  train:
    foreach: ${train.arms}
    do:
      cmd: echo train
      deps: [models/base, data/prepared]
      params: [train.steps]
      outs:
        - models/checkpoints/${item}
  evaluate:
    cmd: echo evaluate
    deps: [models/checkpoints]
    params: [evaluate]
    outs: [results/generations]
    metrics:
      - metrics/eval.json
  analyze:
    cmd: echo analyze
    deps: [results/generations]
    metrics:
      - metrics/analysis.json
  report:
    cmd: echo report
    deps: [metrics/eval.json, metrics/analysis.json]
    outs:
      - reports
"""

def _params_yaml() -> str:
    """A complete params file (the flow loads it strictly): the tiny test pipeline's, with the fake's values."""
    raw = yaml.safe_load((Path(__file__).with_name("tiny_params.yaml")).read_text())
    raw["model"]["hidden_size"] = 16
    raw["train"].update(arms=["tandem", "grpo"], steps=2, report_to="none")
    raw["evaluate"].update(modes=["solo", "step"], ks=[1], n_samples=2)
    return yaml.safe_dump(raw, sort_keys=False)


PARAMS_YAML = _params_yaml()


# The fakes in use, looked up by name: `stage` pickles by reference, so tasks shipped to a Dask worker in this
# process (eval_runner='dask') find the same fakes and the same Recorder.
ACTIVE: dict = {}


def stage(name: str):
    return ACTIVE[name]


class Recorder:
    def __init__(self, fail: set[str] | None = None, hold: int | None = None):
        self.calls: list[str] = []
        self.fail = set(fail or ())
        self.lock = threading.Lock()
        # the `hold`-th unit to run (0-based) waits a quarter done until `release` is set (a test reads the API
        # meanwhile); `held_unit` names it
        self.hold, self.held, self.release = hold, threading.Event(), threading.Event()
        self.held_unit: str | None = None
        self.unit_bars: list[bool] = []  # `evaluate.progress` as each unit saw it (its own tqdm bars on or off)

    def midway(self, name: str) -> None:
        units = [c for c in self.calls if c.startswith("unit-")]
        if self.hold is not None and units.index(name) == self.hold:
            self.held_unit = name
            self.held.set()
            assert self.release.wait(120), "the test never released the held unit"

    def hit(self, name: str) -> None:
        with self.lock:
            self.calls.append(name)
        if name in self.fail:
            raise RuntimeError(f"fake failure in {name}")


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def modules(rec: Recorder) -> dict[str, types.SimpleNamespace]:
    """name -> a module-like namespace for `flows.pipeline._stage`."""

    def io(params):
        return {}, {}

    def train_io(params):
        return {}, {"checkpoints": Layout.of(params).checkpoints}

    def prepare_run(params, inputs, outputs):
        rec.hit("prepare")
        lay = Layout.of(params)
        _write(lay.prepared / "train.jsonl", '{"id": 1}\n')
        _write(lay.metrics / "data.json", json.dumps({"n": 1}))
        return {"n": 1}

    def base_run(params, inputs, outputs):
        rec.hit("base")
        _write(Layout.of(params).base_model / "w.txt", "base")
        return {"ok": True}

    def run_arm(params, arm, inputs, outputs):
        rec.hit(f"train-{arm}")
        _write(Layout.of(params).checkpoints / arm / "step-2" / "w.txt", arm)
        return {"arm": arm}

    def plan(params, inputs=None):
        return [{"arm": a, "step": s, "path": "x", "mode": m}
                for a in params.train.arms for s in (0, 2) for m in params.evaluate.modes
                if not (s == 0 and a != params.train.arms[0])]

    def load_benchmarks(params, inputs=None):
        return {"b1": [{"id": 1}, {"id": 2}], "b2": [{"id": 3}, {"id": 4}]}

    def run_unit(params, unit, inputs=None, outputs=None, progress=None):
        """Both benchmarks, as the real run_unit reports them: generations done out of the unit's total
        (2 problems x n_samples each), from 0, batch by batch."""
        name = f"unit-{unit['arm']}-{unit['step']}-{unit['mode']}"
        rec.hit(name)
        rec.unit_bars.append(params.evaluate.progress)
        per = 2 * params.evaluate.n_samples
        if progress is not None:
            progress(0, 2 * per)
            progress(per // 2, 2 * per)
            rec.midway(name)  # a test can hold the unit here, a quarter done
            progress(per, 2 * per)  # b1 done
            progress(2 * per, 2 * per)  # b2 done
        return {"b1": {"n_problems": 2, "pass@1": 0.5, "senior_share": 1.0, "mean_tokens": 3.0},
                "b2": {"n_problems": 2, "pass@1": 0.25, "senior_share": 1.0, "mean_tokens": 4.0}}

    def collect(params, inputs=None, outputs=None):
        rec.hit("evaluate-collect")
        lay = Layout.of(params)
        _write(lay.generations / "g.jsonl", "{}\n")
        _write(lay.metrics / "eval.json", json.dumps({"settings": {}, "arms": {}}))
        return {"tandem/solo/pass@1": 0.5}

    def analyze_run(params, inputs, outputs):
        rec.hit("analyze")
        _write(Layout.of(params).metrics / "analysis.json", json.dumps({"arms": {}}))
        return {}

    def report_run(params, inputs, outputs):
        rec.hit("report")
        lay = Layout.of(params)
        _write(lay.reports / "report.html", "<html></html>")
        _write(lay.reports / "report.md", "# r\n")
        return {"html": str(lay.reports / "report.html"), "markdown": str(lay.reports / "report.md"),
                "promote": False, "promotion_reason": "fake"}

    def existing_summary(params):
        lay = Layout.of(params)
        return {"html": str(lay.reports / "report.html"), "markdown": str(lay.reports / "report.md"),
                "promote": False, "promotion_reason": "fake"}

    def artifact_markdown(params, summary):
        return "# report\n\n" + Path(summary["markdown"]).read_text()

    ns = types.SimpleNamespace
    return {
        "prepare": ns(default_io=io, run=prepare_run),
        "base": ns(default_io=io, run=base_run),
        "train": ns(default_io=train_io, run_arm=run_arm, run=None),
        "evaluate": ns(default_io=io, plan=plan, run_unit=run_unit, collect=collect, run=None,
                       load_benchmarks=load_benchmarks),
        "analyze": ns(default_io=io, run=analyze_run),
        "report": ns(default_io=io, run=report_run, artifact_markdown=artifact_markdown,
                     existing_summary=existing_summary),
    }
