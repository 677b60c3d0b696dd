"""The worker's `RowArrays`: a session's growing history as an int32 array, equal to a full conversion at every
chunk, converting only what is new; a history that does not extend the known one is converted afresh (no vLLM
needed: the patch into vLLM's batch is exercised by the service tests on real engines)."""

from __future__ import annotations

import random

import numpy as np

from tandem.rollout.vllm.worker import RowArrays


def test_row_arrays_follow_a_growing_history():
    rng = random.Random(0)
    rows = RowArrays()
    hist = [rng.randrange(150000) for _ in range(7)]
    for _ in range(60):  # chunks: the history grows by a few tokens each time, as a session's does
        a = rows.array("s", list(hist))
        assert a.dtype == np.int32 and a.tolist() == hist
        buf, n = rows.rows["s"]
        assert n == len(hist) <= len(buf)
        hist += [rng.randrange(150000) for _ in range(rng.randrange(0, 9))]


def test_row_arrays_convert_only_the_new_tokens():
    rows = RowArrays()
    rows.array("s", [1, 2, 3])
    buf, _ = rows.rows["s"]
    buf[1] = 99  # a token of the known prefix: not read again from the list
    assert rows.array("s", [1, 2, 3, 4]).tolist() == [1, 99, 3, 4]


def test_row_arrays_start_over_when_the_prefix_changes():
    rows = RowArrays()
    rows.array("s", [5, 6, 7, 8])
    assert rows.array("s", [5, 6, 9, 10, 11]).tolist() == [5, 6, 9, 10, 11]  # its last known token differs
    assert rows.array("s", [1, 2]).tolist() == [1, 2]                        # shorter than the known history
    rows.drop(["s"])
    assert "s" not in rows.rows
    assert rows.array("t", []).tolist() == []
