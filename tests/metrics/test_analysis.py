"""tandem/metrics/analysis.py on hand-made statistics, against naive loops."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.metrics.analysis import (analyze_checkpoints, checkpoint_entry, kl_histogram_edges,
                                     per_completion_mean, pooled, reference_types, top_tokens_final)


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
                              {"base": base, "h": ST}, ["b1", "b2"], 5, reference_arm="tandem", top_drift_tokens=1,
                              min_type_count=1, kl_bins=4, qs=[0.5], to_tokens=lambda ids: ["x"] * len(ids))
    assert doc["reference"]["step"] == 3 and [t["id"] for t in doc["reference"]["tokens"]] == [1]
    assert doc["summary"]["tandem"]["kl_mean"] == pytest.approx(0.2)
    assert doc["arms"]["tandem"]["checkpoints"][0]["drift"]["kl"]["mean"] == 0.0
