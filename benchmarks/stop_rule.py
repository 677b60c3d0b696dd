"""The vLLM engine core's stop rule in isolation: `TandemScheduler._update_request_with_output` per sampled token on
real vLLM `Request`s and real `TandemScheduler`s (built, with their token tables, as
`benchmarks/sched_step.py` builds them), Qwen3's vocabulary size against a small one, interleaved in one
process.

What it measures: the scheduler's per-token work for a tandem chunk (vLLM's own `append_output_token_ids` with
the prefix-cache block hasher and `check_stop`, then the word schedule's byte-table lookup and, at a word start,
the counter-based redraw), for `--rows` requests of one token per call, with word-start tables of the given
sizes (random, Qwen3's share of word starts: 53,021 / 151,936). `p_senior` 1 keeps every chunk open (no
switches), so the figure is per token; `chunk_rule_us` is the cost of resuming a chunk's rule (once per chunk).
Prints one JSON line with the microseconds per call for each vocabulary and their ratio.

Run in vLLM's environment: `.venv-vllm/bin/python benchmarks/stop_rule.py [--tokens N] [--rows R]`.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=3000, help="tokens per request")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--vocab", type=int, nargs=2, default=[151936, 334], metavar=("LARGE", "SMALL"))
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()

    from vllm import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from tandem.rollout.vllm import sched
    from tandem.rollout.vllm.turns import ChunkRule

    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(32, sha256_cbor)

    from benchmarks.sched_step import _model_dir, _scheduler, _tables

    root = tempfile.mkdtemp(prefix="tandem-stop-rule-")
    scheds = {V: _scheduler(_model_dir(root, V), a.rows, a.tokens + 1000, 32) for V in a.vocab}  # real ones
    tables = {V: _tables(V, V, root)[0] for V in a.vocab}

    def args(V: int, row: int) -> dict:
        return {"kind": "word", "role": 1, "row": row, "seed": 7, "p_senior": 1.0, "max_gap_tokens": 32, "max_rounds": 150,
                "budget": a.tokens + 10, "t0": 0, "gap": 0, "newline": False, "turns": 0, "tables": tables[V],
                "hold": True}

    def one(V: int) -> float:
        rng = random.Random(0)
        toks = [rng.randrange(V) for _ in range(a.tokens)]
        reqs = [Request(f"r{i}", list(range(100)), SamplingParams(max_tokens=a.tokens + 10,
                                                                  extra_args={"tandem": args(V, i)}),
                        None, block_hasher=hasher) for i in range(a.rows)]
        update = scheds[V]._update_request_with_output
        t = time.perf_counter()
        for tok in toks:
            for r in reqs:
                update(r, [tok])
        return 1e6 * (time.perf_counter() - t) / (a.tokens * a.rows)

    best = {V: float("inf") for V in a.vocab}
    for _ in range(a.repeats):  # the vocabularies take turns; the best of each is kept
        for V in a.vocab:
            best[V] = min(best[V], one(V))
    tb = sched.load_tables(tables[a.vocab[0]])
    n = 20000
    t = time.perf_counter()
    for i in range(n):
        ChunkRule(args(a.vocab[0], i), tb)
    chunk_us = 1e6 * (time.perf_counter() - t) / n
    large, small = a.vocab
    print(json.dumps({"us_per_token_" + str(large): best[large], "us_per_token_" + str(small): best[small],
                      "large_over_small": best[large] / best[small], "chunk_rule_us": chunk_us,
                      "rows": a.rows, "tokens": a.tokens}))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
