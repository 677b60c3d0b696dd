"""DVC's views of the pipeline: `dvc plots show` draws every declared chart with its x and y and the arms
overlaid, `dvc metrics show` holds headline numbers only (at most 40 columns).

The declarations are checked against dvc.yaml and params.yaml; the integration tests run DVC itself on the
committed record (metrics/ is in git, `cache: false`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tasks import headline

REPO = Path(__file__).resolve().parents[1]
TEMPLATES = {"linear", "simple", "scatter", "smooth", "bar_horizontal", "bar_horizontal_sorted"}
MAX_COLUMNS = 40  # `dvc metrics show`: the Path column and one per metric key


def _dvc_yaml() -> dict:
    return yaml.safe_load((REPO / "dvc.yaml").read_text())


def _params() -> dict:
    return yaml.safe_load((REPO / "params.yaml").read_text())


def _declared(kind: str) -> list[str]:
    """Every path a stage declares under `kind` (outs, metrics, plots), foreach stages expanded over the arms."""
    out = []
    for st in _dvc_yaml()["stages"].values():
        items = _params()["train"]["arms"] if "foreach" in st else [None]
        for item in items:
            body = st["do"] if "foreach" in st else st
            for e in body.get(kind, []):
                path = e if isinstance(e, str) else next(iter(e))
                out.append(path.replace("${item}", str(item)))
    return out


def _sources(plot: dict) -> list[tuple[str, str]]:
    """(file, field) of every y of a top-level plot."""
    return [(f, field) for f, fields in plot["y"].items() for field in ([fields] if isinstance(fields, str) else fields)]


def test_every_plot_has_x_y_a_template_and_data_a_stage_writes():
    plots = _dvc_yaml()["plots"]
    outs = _declared("outs")
    assert plots and not _declared("plots"), "every view is a top-level plot (stage-level entries draw one per file)"
    for entry in plots:
        (pid, plot), = entry.items()
        assert plot.get("x") and plot.get("y") and plot.get("title"), pid
        assert plot.get("template") in TEMPLATES, pid
        for f, _ in _sources(plot):
            assert any(f == o or f.startswith(o.rstrip("/") + "/") for o in outs), f"{pid}: no stage writes {f}"


def test_per_arm_charts_overlay_exactly_the_params_arms():
    """DVC cannot template plot file names, so the arms are spelled out in dvc.yaml: they must be params.yaml's,
    all of them in each per-arm chart (one measure per chart), and the evaluation charts cover every mode."""
    arms, modes = set(_params()["train"]["arms"]), set(_params()["evaluate"]["modes"])
    seen_modes = set()
    for entry in _dvc_yaml()["plots"]:
        (pid, plot), = entry.items()
        stems = {Path(f).stem for f, _ in _sources(plot)}
        fields = {field for _, field in _sources(plot)}
        if stems & arms:  # one file per arm: the same measure of each
            assert stems == arms and len(fields) == 1, pid
            seen_modes |= {f.split("/")[0] for f in fields if "/pass@" in f}
        elif len(fields) > 1:  # one file, one column per arm
            assert {f.split("/")[0] for f in fields} == arms, pid
    assert seen_modes == modes


def test_metrics_are_the_headline_files_only():
    metrics = _declared("metrics")
    assert metrics and all(m.startswith("metrics/headline/") for m in metrics), metrics
    for out in ("metrics/eval.json", "metrics/analysis.json", "metrics/data.json", "metrics/base.json"):
        assert out in _declared("outs"), f"{out} is a plain output (read by the report, the gate and the study)"


def _leaves(doc, prefix=""):
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _leaves(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1], doc


def test_headline_numbers_are_numbers_and_few(tmp_path):
    """On the committed record: every leaf is a number (or null), and the columns fit; with the paper's four
    arms too (the same builders on a document with one more arm)."""
    from tests.report.fake_metrics import fake_analysis, fake_eval

    files = sorted((REPO / "metrics" / "headline").glob("*.json"))
    assert {f.name for f in files} >= {"data.json", "base.json", "eval.json", "analysis.json"}
    keys = set()
    for f in files:
        for k, v in _leaves(json.loads(f.read_text())):
            assert v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)), (f.name, k, v)
            keys.add(k)
    assert 1 + len(keys) <= MAX_COLUMNS, sorted(keys)
    ev, an = fake_eval(), fake_analysis()
    ev["arms"]["grpo_g16"] = ev["arms"]["grpo"]
    an["summary"]["grpo_g16"] = an["summary"]["grpo"]
    wide = {k for d in (headline.evaluation(ev), headline.analysis(an)) for k, _ in _leaves(d)}
    wide |= {k for k in keys if not k.startswith(("pass@", *[f"{a}." for a in _params()["train"]["arms"]]))}
    assert 1 + len(wide) <= MAX_COLUMNS, sorted(wide)


def _dvc(*args: str) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "DVC_NO_ANALYTICS": "1"})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    return res


@pytest.mark.integration
def test_dvc_plots_show_draws_every_plot_with_its_data():
    shown = json.loads(_dvc("plots", "show", "--json", "--split").stdout)["data"]
    for entry in _dvc_yaml()["plots"]:
        (pid, plot), = entry.items()
        (render,) = shown[pid]
        anchors = render["anchor_definitions"]
        rows = anchors["<DVC_METRIC_DATA>"]
        assert rows, f"{pid}: no data"
        assert anchors["<DVC_METRIC_X_LABEL>"] == plot["x_label"] and anchors["<DVC_METRIC_TITLE>"] == plot["title"]
        x = plot["x"]
        assert all(x in r for r in rows), f"{pid}: rows without {x}"
        files = {Path(f).name for f, _ in _sources(plot)}
        if len(files) > 1:  # one line per arm file
            assert {r["filename"] for r in rows} == files, pid


@pytest.mark.integration
def test_dvc_metrics_show_fits_in_40_columns():
    shown = json.loads(_dvc("metrics", "show", "--json").stdout)
    keys = set()
    for rev in shown.values():
        for path, body in rev["data"].items():
            assert path.startswith("metrics/headline/"), path
            keys |= {k for k, _ in _leaves(body["data"])}
    assert keys and 1 + len(keys) <= MAX_COLUMNS, sorted(keys)
