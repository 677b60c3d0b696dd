"""benchmarks/pass_rate.py: a saved model's sweep measures come from its own level's entry, or the run's end."""

from __future__ import annotations

import json
from pathlib import Path


def test_sweep_measures_read_the_saved_level_or_the_runs_end(tmp_path, monkeypatch):
    from cli.main import load_benchmark

    bench = load_benchmark("pass_rate")
    monkeypatch.setattr(bench, "REPO", tmp_path)
    run = tmp_path / "sweep" / "avx2-s1"
    (run / "metrics").mkdir(parents=True)
    levels = [{"level": 0.6, "probe": 0.62, "dir": "sweep/avx2-s1/levels/0.60", "greedy_macro": 0.7,
               "sampled_macro": 0.4},
              {"level": 0.65, "probe": 0.66, "dir": "sweep/avx2-s1/levels/0.65", "greedy_macro": 0.75,
               "sampled_macro": 0.5}]
    probes = [{"step": 100, "phase": "target", "accuracy": 0.4}, {"step": 125, "phase": "level", "accuracy": 0.71}]
    (run / "levels.json").write_text(json.dumps({"levels": levels, "probes": probes}))
    (run / "metrics" / "base.json").write_text(json.dumps({"accuracy": {"greedy": {"macro": 0.8},
                                                                        "sampled": {"macro": 0.55}}}))
    assert bench.run_root(Path("sweep/avx2-s1/levels/0.65")) == Path("sweep/avx2-s1")
    assert bench.sweep_measures(Path("sweep/avx2-s1/levels/0.65")) == {"greedy probe": 0.66, "greedy macro": 0.75,
                                                                       "sampled macro": 0.5}
    assert bench.sweep_measures(Path("sweep/avx2-s1/models/base")) == {"greedy probe": 0.71, "greedy macro": 0.8,
                                                                       "sampled macro": 0.55}
    assert bench.sweep_measures(Path("other/run/models/base")) == {}


def test_the_report_fits_solo_pass_at_1_on_the_pass_rate():
    from cli.main import load_benchmark

    bench = load_benchmark("pass_rate")
    rows = {str(i): {"solo": 0.2 + 0.8 * x, "reference pass rate": x, "greedy probe": 0.8}
            for i, x in enumerate([0.3, 0.4, 0.5, 0.6])}
    text = bench.report(rows)
    assert "reference pass rate: r = 1.000 over 4" in text
    assert "solo pass@1 = 0.200 + 0.800 x reference pass rate; residual sd 0.000" in text
    assert "greedy probe: no correlation (constant over the 4 models)" in text
