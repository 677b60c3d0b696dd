"""The analysis's statistics cache (tandem.eval_cache.StatsCache, stats_key): an entry reads back exactly what was
stored, an entry without its summary is not there, and the key changes with everything that can change a value."""

from __future__ import annotations

import json

import numpy as np

from tandem.eval_cache import StatsCache, stats_key


def _cache(tmp_path) -> StatsCache:
    def write_arrays(path, arrays):
        with open(path, "wb") as f:
            np.savez(f, **arrays)
    return StatsCache(tmp_path, write_arrays, lambda path, obj: path.write_text(json.dumps(obj)))


def test_an_entry_reads_back_exactly_what_was_stored(tmp_path):
    rng = np.random.default_rng(0)

    def completion(n):
        return {"junior_nll": rng.random(n, dtype=np.float32), "kl": rng.random(n, dtype=np.float32),
                "targets": rng.integers(0, 50, n)}
    stats = {"arith": [completion(3), completion(1), completion(5)], "gsm8k": [completion(2)], "none": []}
    ids = {"arith": [7, 7, "p-2"], "gsm8k": ["a"], "none": []}
    common = {"arith": {"7": {"kl_mean": 0.1 + 0.2, "overlap": 1 / 3}}, "gsm8k": {}}
    cache = _cache(tmp_path)
    assert cache.load("k") is None
    cache.store("k", stats, ids, common)
    got_stats, got_ids, got_common = cache.load("k")
    assert got_ids == ids and got_common == common and list(got_stats) == list(stats)
    for b in stats:
        assert len(got_stats[b]) == len(stats[b])
        for want, got in zip(stats[b], got_stats[b]):
            assert list(got) == list(want)  # the arrays' order too
            for name in want:
                assert got[name].dtype == want[name].dtype and np.array_equal(got[name], want[name])
    cache.paths("k")[0].unlink()  # the summary marks an entry complete: arrays alone are not an entry
    assert cache.load("k") is None


def test_the_key_changes_with_every_input_of_the_statistics():
    base = dict(senior_hash="s", base_hash="b", junior_hash=None, texts=[["arith", [[1, [2], [3]]]]],
                refs={"arith": [["1"], [[2]], [[4]]]}, numerics={"batch_size": 8, "dtype": "float32"})
    key = stats_key(**base)
    assert stats_key(**base) == key
    for field, other in (("senior_hash", "s2"), ("base_hash", "b2"), ("junior_hash", "j"),
                         ("texts", [["arith", [[1, [2], [3, 3]]]]]), ("refs", {}),
                         ("numerics", {"batch_size": 4, "dtype": "float32"})):
        assert stats_key(**{**base, field: other}) != key, field
