"""tandem/metrics/analysis.py on hand-made statistics, against naive loops."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.config import AnalyzeConfig
from tandem.metrics.analysis import (analyze_checkpoints, checkpoint_entry, kl_histogram_edges,
                                     per_completion_mean, per_problem_counts, per_problem_means, pooled,
                                     reference_types, top_tokens_final)


def _comp(targets, kl, logratio, nll=None, overlap=None):
    n = len(targets)
    f = lambda x, d: np.asarray(x if x is not None else [d] * n, dtype=np.float32)  # noqa: E731
    return {"targets": np.asarray(targets, dtype=np.int64), "kl": f(kl, 0), "logratio": f(logratio, 0),
            "junior_nll": f(nll, 1.0), "overlap": f(overlap, 1.0)}


ST = {"b1": [_comp([1, 2, 1], [0.1, 0.2, 0.3], [1.0, -1.0, 3.0], nll=[1, 2, 3]), _comp([], [], [])],
      "b2": [_comp([2, 3], [0.4, 0.0], [0.5, 0.0], nll=[4, 4])]}


def test_pooled_and_per_completion_means_match_naive():
    assert pooled(ST, "kl").tolist() == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.0])
    assert per_completion_mean(ST["b1"], "junior_nll") == pytest.approx(2.0)  # the empty completion is skipped
    assert per_completion_mean([_comp([], [], [])], "kl") is None


def test_per_problem_means_match_a_naive_loop_and_average_back_to_the_per_completion_mean():
    rng = np.random.default_rng(0)
    ids = ["p2", "p1", "p2", "p3", "p1", "p3", "p2", "p1"]
    lengths = [3, 0, 1, 4, 2, 0, 5, 2]  # p1 and p3 each have one empty completion
    stats = [_comp(list(range(n)), rng.random(n), rng.normal(size=n), nll=rng.random(n) * 3) for n in lengths]
    stats.append(_comp([], [], []))
    ids.append("p4")  # only an empty completion: undefined, not 0
    for name in ("junior_nll", "kl", "overlap"):
        got = per_problem_means(stats, ids, name)
        assert list(got) == ["p2", "p1", "p3", "p4"]  # first-seen order
        for pid in got:
            vals = []
            for s, i in zip(stats, ids):
                if i == pid and len(s[name]) > 0:
                    vals.append(sum(float(x) for x in s[name]) / len(s[name]))
            if vals:
                assert got[pid] == pytest.approx(sum(vals) / len(vals), rel=1e-6)
            else:
                assert got[pid] is None
        n = per_problem_counts(stats, ids, name)
        assert n == {"p2": 3, "p1": 2, "p3": 1, "p4": 0}
        weighted = sum(n[i] * v for i, v in got.items() if v is not None) / sum(n.values())
        assert weighted == pytest.approx(per_completion_mean(stats, name), rel=1e-6)
    with pytest.raises(ValueError, match="2 completions but 1 problem ids"):
        per_problem_means(stats[:2], ids[:1], "kl")


def test_reference_types_rank_by_mean_logratio():
    ids, rows = reference_types(ST, vocab=5, k=2, min_count=1, to_tokens=lambda ids: [f"t{i}" for i in ids])
    # naive: type 1 -> (1 + 3) / 2 = 2, type 2 -> (-1 + 0.5) / 2, type 3 -> 0
    assert ids == [1, 3] and rows[0] == {"rank": 1, "id": 1, "token": "t1", "count": 2, "logratio": 2.0}
    assert top_tokens_final(ST, [1, 4], 5) == [{"id": 1, "count": 2, "logratio": 2.0},
                                               {"id": 4, "count": 0, "logratio": None}]


def test_checkpoint_entry_and_document():
    edges = kl_histogram_edges([ST], bins=4)
    assert edges[0] == 0 and edges[-1] == pytest.approx(np.quantile([0.1, 0.2, 0.3, 0.4, 0.0], 0.99))
    import torch

    e = checkpoint_entry({"step": 3, "hash": "h"}, ST, ["b1", "b2"], edges, [0.5], torch.tensor([1]), 5)
    assert e["n_completions"] == 3 and e["n_tokens"] == 5
    assert e["drift"]["kl"]["mean"] == pytest.approx(0.2) and e["drift"]["kl"]["benchmarks"]["b2"] == pytest.approx(0.2)
    assert e["drift"]["top_tokens"]["mean_logratio"] == pytest.approx(2.0)
    assert e["legibility"]["junior_ce"]["benchmarks"] == {"b1": pytest.approx(2.0), "b2": pytest.approx(4.0)}
    base = {"b1": [_comp([1], [0.0], [0.0])], "b2": [_comp([2], [0.0], [0.0])]}
    doc = analyze_checkpoints({"tandem": [{"step": 0, "hash": "base"}, {"step": 3, "hash": "h"}]},
                              {"base": base, "h": ST}, ["b1", "b2"], 5,
                              AnalyzeConfig(reference_arm="tandem", top_drift_tokens=1, min_type_count=1, kl_bins=4,
                                            quantiles=[0.5]), lambda ids: ["x"] * len(ids))
    assert doc["reference"]["step"] == 3 and [t["id"] for t in doc["reference"]["tokens"]] == [1]
    assert doc["summary"]["tandem"]["kl_mean"] == pytest.approx(0.2)
    assert doc["arms"]["tandem"]["checkpoints"][0]["drift"]["kl"]["mean"] == 0.0
