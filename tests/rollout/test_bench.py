"""The rollout benchmark runs end to end on the fallback model and reports consistent fields."""

from __future__ import annotations

import pytest

from cli.main import load_benchmark

_bench = load_benchmark("rollout")
BenchWorkload, bench_rollout = _bench.BenchWorkload, _bench.bench_rollout


@pytest.mark.slow
def test_bench_rollout_small(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no models/base here: the fallback model is used
    r = bench_rollout(None, BenchWorkload(n_prompts=2, n_samples=2, max_new_tokens=12, repeats=1))
    assert r["model"].startswith("fallback")
    for k in ("solo_tok_s", "tandem_tok_s", "lockstep_tok_s", "lockstep_hf_tok_s", "generate_tok_s",
              "solo_tok_s_b1", "tandem_tok_s_b1", "lockstep_tok_s_b1"):
        assert r[k] > 0, k
    assert r["tandem_over_solo"] == pytest.approx(r["tandem_tok_s"] / r["solo_tok_s"])
    assert r["tandem_over_lockstep"] == pytest.approx(r["tandem_tok_s"] / r["lockstep_tok_s"])
    assert r["solo_over_generate"] == pytest.approx(r["solo_tok_s"] / r["generate_tok_s"])
    # same weights as senior and junior: tandem = solo = lockstep, token for token
    assert r["tandem_equals_solo"] and r["tandem_equals_lockstep"]
    assert 0.0 <= r["senior_fraction"] <= 1.0 and r["rows"] == 4 and r["threads"] == 1
    with pytest.raises(FileNotFoundError):
        bench_rollout(str(tmp_path / "missing"))
