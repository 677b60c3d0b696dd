"""Stage `report` on small fake metrics: outputs, escaping, metadata, the promotion section, the claims section
first (with intervals in the tables when every generation file is there, a reason when not), and a real
headless-Chromium load of the HTML (every image decodes, no console error)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.config import params_from_dict
from tasks import promotion
from tasks import report as R
from tasks.common import read_json, write_metrics

from tests.report.chromium import ensure_chromium, load_page
from tests.report.fake_metrics import HOSTILE, write_fake_run, write_full_generations, write_per_problem_csv


def _params(root: Path, **report):
    return params_from_dict({"out_root": str(root), "train": {"report_to": "none"}, "report": report})


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    write_fake_run(root)
    # the stages write their timings to `*.timing.json` sidecars, not into the metrics DVC hashes
    for name in ("eval", "base"):
        write_metrics(root / "metrics" / f"{name}.json", read_json(root / "metrics" / f"{name}.json"))
    # what the prepare stage leaves: its validation summary and the GX Data Docs
    write_metrics(root / "metrics" / "data.json", {"validation": {"passed": True, "rows_checked": 4500,
                                                                  "expectations": 15, "failures": 0}, "seconds": 3.5})
    (root / "reports" / "data-docs").mkdir(parents=True)
    (root / "reports" / "data-docs" / "index.html").write_text("<html><body>prepared_data</body></html>")
    page = root / "reports" / "data-docs" / "validations" / "prepared_data" / "__none__" / "20260101T000000Z"
    page.mkdir(parents=True)
    (page / "abc.html").write_text("<html><body>prepared_data: 15 expectations</body></html>")
    params = _params(root)
    return params, R.run(params)


@pytest.fixture(scope="module")
def rendered_claims(tmp_path_factory):
    """A run with every generation file the measures read, and the analysis per-problem table: tandem
    clearly stronger than GRPO on every mode, KL-Reg the same as GRPO."""
    root = tmp_path_factory.mktemp("report-claims")
    ev = write_fake_run(root)
    write_full_generations(root, ev, {"base": 0.3, "tandem": 0.9, "grpo": 0.2, "kl_reg": 0.2})
    write_per_problem_csv(root, ev, {"tandem": 0.05, "grpo": 0.5, "kl_reg": 0.5})
    params = _params(root)
    return params, R.run(params)


def _headings(md: str) -> list[str]:
    return [line[3:] for line in md.splitlines() if line.startswith("## ")]


def test_claims_come_first_with_intervals_in_tables_and_figures(rendered_claims):
    params, out = rendered_claims
    md, html = Path(out["markdown"]).read_text(), Path(out["html"]).read_text()
    assert _headings(md)[:2] == ["Claims", "Summary"]
    assert html.index("<h2>Claims</h2>") < html.index("<h2>Summary</h2>")
    assert out["claims"] == 8 and out["figures"] == 6  # the claims' error-bar figure joins the five
    assert "WARNING: one training seed" in md
    # tandem 0.9 vs GRPO 0.2 on 4 problems x 8 samples per benchmark: step-schedule claim holds
    claims_rows = [line for line in md.splitlines() if line.startswith("| 2\\. handoff robustness")]
    assert claims_rows and "| holds |" in claims_rows[0], claims_rows
    for header in ("pass@1 95% CI", "junior CE 95% CI", "overlap 95% CI", "KL mean 95% CI"):
        assert header in md, header
    assert "intervals: final checkpoints and the base only" in md
    # every row of the solo pass@k table (base and the three final checkpoints) has an interval cell
    solo = md.split("Solo pass@k (macro)")[1].split("\n\n")[1].splitlines()
    assert len(solo) == 6 and all("| \\[" in line for line in solo[2:]), solo


def test_report_without_measures_says_why_there_are_no_claims(rendered):
    _, out = rendered  # the plain fake run saves one generation file per arm: the measures cannot be made
    md = Path(out["markdown"]).read_text()
    assert _headings(md)[:2] == ["Claims", "Summary"]
    assert "No claims table: the per-problem measures could not be computed" in md and "missing generations" in md
    assert out["claims"] == 0 and "95% CI" not in md


def test_outputs_and_figures(rendered):
    params, out = rendered
    tmp_path = Path(params.out_root)
    html = Path(out["html"]).read_text()
    md = Path(out["markdown"]).read_text()
    assert out["figures"] == 5
    assert html.count('<img src="data:image/png;base64,') == 5
    # the Markdown links exactly the figure files written next to it
    figs = sorted(p.name for p in (tmp_path / "reports" / "figures").glob("*.png"))
    assert len(figs) == 5 and all(f"](figures/{f})" in md for f in figs)
    for section in ("Solo accuracy (figure 2)", "Tandem accuracy", "Drift from the base (figure 4)",
                    "KL-Reg comparison (figure 7)", "Legibility (table 1)", "Ablation (table 2)", "Training",
                    "Promotion", "Example generations", "Data validation", "Run metadata"):
        assert section in html and section in md, section
    # the validation, with a link to its Data Docs next to the report (a path in the artifact, not a link)
    assert "Validation passed: 4500 rows checked against 15 expectations, 0 failures." in md
    assert '<a href="data-docs/index.html">' in html and "](<data-docs/index.html>)" in md
    assert '<a href="data-docs/validations/prepared_data/__none__/20260101T000000Z/abc.html">' in html
    art = R.artifact_markdown(params, out)
    assert "`reports/data-docs/index.html` (a DVC output)" in art and "](<" not in art


def test_model_text_is_escaped_in_both_formats(rendered):
    _, out = rendered
    html = Path(out["html"]).read_text()
    md = Path(out["markdown"]).read_text()
    assert "<script" not in html
    assert "&lt;script&gt;console.error(&quot;xss&quot;)&lt;/script&gt;" in html
    assert HOSTILE in md  # verbatim, inside a fence it cannot close
    assert "````text\n" + HOSTILE + "\n````" in md


def test_metadata_rows(rendered):
    _, out = rendered
    html = Path(out["html"]).read_text()
    for key in ("git commit", "dvc.lock sha256", "packages", "hardware", "wall times", "seeds", "params (resolved)"):
        assert key in html, key
    assert "torch " in html and "base 12.5 s" in html and "train tandem ~30.0 s (20 steps x 1.50 s)" in html


def test_wall_times_come_from_the_timing_sidecars(rendered):
    """The metrics hold no timings (the fixture's stages wrote them beside, as the real ones do); the report's
    wall times read them back: 3 arms x 3 checkpoints x 3 modes x 2 benchmarks x 1.5 s of evaluation."""
    params, out = rendered
    root = Path(params.out_root)
    assert "seconds" not in (root / "metrics" / "eval.json").read_text()
    assert (root / "metrics" / "eval.timing.json").exists()
    md = Path(out["markdown"]).read_text()
    assert "prepare 3.5 s" in md and "base 12.5 s" in md
    assert "evaluate 81.0 s (sum over listed entries, cached ones included)" in md and "evaluate 0.0 s" not in md


def test_rerun_is_byte_identical_apart_from_the_timestamp(rendered):
    params, out = rendered
    first = Path(out["markdown"]).read_text()
    R.run(params)
    strip = lambda s: "\n".join(l for l in s.splitlines() if "| generated |" not in l)  # noqa: E731
    assert strip(Path(out["markdown"]).read_text()) == strip(first)


def test_promotion_section_compares_with_the_registry(tmp_path):
    from tests.promotion_fixtures import commit_pinned_lock

    commit_pinned_lock(tmp_path)  # a promotion tags a commit whose dvc.lock pins the checkpoint
    write_fake_run(tmp_path)
    params = _params(tmp_path, regression_tolerance=0.0)
    first = R.run(params)
    assert first["promote"] and "first promotion" in first["promotion_reason"]
    ev = json.loads((tmp_path / "metrics" / "eval.json").read_text())
    promotion.record(params, promotion.decision_for(params, ev))
    # a worse retrained run: every score drops
    write_fake_run(tmp_path, offset=-0.1)
    ev2 = json.loads((tmp_path / "metrics" / "eval.json").read_text())
    for c in ev2["arms"]["tandem"]["checkpoints"]:
        c["hash"] = "retrained-" + c["hash"]
    (tmp_path / "metrics" / "eval.json").write_text(json.dumps(ev2))
    second = R.run(params)
    assert not second["promote"] and "regressed" in second["promotion_reason"], second["promotion_reason"]
    md = Path(second["markdown"]).read_text()
    assert "does not pass" in md and "last promoted" in md


def test_missing_inputs_say_which_stage_to_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="evaluate stage"):
        R.run(_params(tmp_path))


def test_artifact_markdown_holds_the_report_without_local_links(rendered):
    params, out = rendered
    text = R.artifact_markdown(params, out)
    assert "Promotion gate" in text and Path(out["html"]).resolve().as_uri() not in text
    md = Path(out["markdown"]).read_text()
    tables = [line for line in md.splitlines() if line.startswith("|")]
    assert tables and all(line in text for line in tables)  # every table row of the report, verbatim
    assert "](" not in "".join(line for line in text.splitlines() if line.startswith("!"))  # no image links


@pytest.mark.integration
@pytest.mark.slow
def test_report_opens_cleanly_in_headless_chromium(rendered):
    chromium, why = ensure_chromium()
    if chromium is None:
        pytest.skip(f"browser test skipped: {why}")
    _, out = rendered
    page = load_page(chromium, Path(out["html"]))
    assert page.title == "Tandem RL: results"
    assert len(page.images) == 5
    assert all(i["complete"] and i["naturalWidth"] > 0 and i["naturalHeight"] > 0 for i in page.images), page.images
    assert page.errors == []
    assert page.scripts == 0 and '<script>console.error("xss")</script>' in page.text  # shown, not run


@pytest.mark.integration
@pytest.mark.slow
def test_browser_check_detects_broken_images_and_console_errors(tmp_path):
    # guard: the same harness fails a page with a missing image, an undecodable one and a console error
    chromium, why = ensure_chromium()
    if chromium is None:
        pytest.skip(f"browser test skipped: {why}")
    bad = tmp_path / "bad.html"
    bad.write_text('<!DOCTYPE html><html><body><img src="missing.png"><img src="data:image/png;base64,AAAA">'
                   '<script>console.error("boom")</script></body></html>')
    page = load_page(chromium, bad)
    assert [i["naturalWidth"] for i in page.images] == [0, 0]
    assert any("boom" in e for e in page.errors) and any("ERR_FILE_NOT_FOUND" in e for e in page.errors)


class _FakeWandb:
    """Stands in for the wandb module: records init kwargs, logged keys, and finish."""

    def __init__(self):
        self.inits, self.logged, self.finished = [], {}, 0
        outer = self

        class Run:
            id = "report-run"

            def log(self, data):
                outer.logged.update(data)

            def finish(self):
                outer.finished += 1

        self._run = Run

    def init(self, **kw):
        self.inits.append(kw)
        return self._run()

    @staticmethod
    def Settings(**kw):  # noqa: N802 (wandb's name)
        return kw

    def Image(self, path, caption=""):  # noqa: N802 (wandb's name)
        assert Path(path).exists()
        return ("image", path, caption)


def test_figures_go_to_wandb_when_tracking_is_on(rendered, monkeypatch):
    import sys

    params, out = rendered
    from tandem.report.document import Figure

    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    fig_dir = Path(out["html"]).parent / "figures"
    figs = [Figure(p.stem, "caption", p.read_bytes()) for p in sorted(fig_dir.glob("*.png"))]
    on = params_from_dict({"out_root": params.out_root, "train": {"report_to": "wandb"}})
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert R.log_figures_to_wandb(on, figs, fig_dir) is True
    assert set(fake.logged) == {f"report/{f.name}" for f in figs} and fake.finished == 1
    assert fake.inits[0]["mode"] == "offline" and fake.inits[0]["job_type"] == "report"
    assert fake.inits[0]["id"].startswith("tandem-report-") and fake.inits[0]["group"]
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert R.log_figures_to_wandb(on, figs, fig_dir) is False and len(fake.inits) == 1
    assert R.log_figures_to_wandb(params, figs, fig_dir) is False  # report_to: none


def test_examples_are_the_problems_where_the_models_disagree(tmp_path):
    from tandem.checkpoints import generations_file

    ev = {"settings": {"benchmarks": {"b": {}}},
          "arms": {"tandem": {"checkpoints": [{"step": 0}, {"step": 8}]}, "grpo": {"checkpoints": [{"step": 0}, {"step": 8}]}}}
    scores = {("tandem", 0): {"p1": [1, 1], "p2": [0, 0], "p3": [1, 0]},  # the base, under the first arm
              ("tandem", 8): {"p1": [1, 1], "p2": [1, 1], "p3": [1, 0]},
              ("grpo", 8): {"p1": [1, 1], "p2": [0, 1], "p3": [1, 0]}}
    for (arm, step), by_id in scores.items():
        f = generations_file(tmp_path, arm, step, "solo", "b")
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("".join(json.dumps({"id": pid, "sample": i, "score": float(v), "text": f"{arm}-{step}-{pid}-{i}",
                                         "answer": "7", "finish_reason": "eos"}) + "\n"
                             for pid, vs in by_id.items() for i, v in enumerate(vs)))
    blocks = R.examples(ev, tmp_path, max_examples=1)
    # p2 splits the models most (base 0/2, tandem 2/2, GRPO 1/2): one block per model, a correct sample from
    # the best model and a wrong one from the others
    assert [b.text for b in blocks] == ["tandem-0-p2-0", "tandem-8-p2-0", "grpo-8-p2-0"]
    assert blocks[0].label.startswith("base, b, problem p2: 0/2 samples correct")
    assert blocks[1].label.startswith("TRL (tandem) step-8, b, problem p2: 2/2") and "GRPO step-8" in blocks[2].label
    assert len(R.examples(ev, tmp_path, max_examples=3)) == 9 and R.examples(ev, tmp_path, 0) == []
