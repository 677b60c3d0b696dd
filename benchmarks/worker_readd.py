"""The model runner's re-add of a resumed tandem chunk: vLLM's `InputBatch.add_request` with the session's history
as a Python list (vLLM as it is) against `worker.RowArrays` (the history kept as an int32 array, only new tokens
converted), interleaved in one process on a real `InputBatch` (128 rows, Qwen3's vocabulary size).

Each measured call is what a chunk costs the worker: the paused row removed, then added back with its history
(a few tokens longer than at its last chunk), at histories of 500, 1,500 and 3,000 tokens. Prints one JSON line:
microseconds per re-add for both and their ratio.

Run in vLLM's environment: `.venv-vllm/bin/python benchmarks/worker_readd.py`.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    import torch
    from vllm import SamplingParams
    from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

    vllm_add = InputBatch.add_request  # before the worker module patches it
    from tandem.rollout.vllm import worker

    rows = worker.install_row_arrays()
    if rows is None:
        raise SystemExit("RowArrays not installed (TANDEM_VLLM_ROW_ARRAYS=0?)")
    patched_add = InputBatch.add_request
    batch = InputBatch(max_num_reqs=128, max_model_len=4096, max_num_batched_tokens=8192,
                       device=torch.device("cpu"), vocab_size=151936, block_sizes=[32],
                       max_num_blocks_per_req=[128])
    sp = SamplingParams(temperature=1.0, seed=1, extra_args={"tandem": {"kind": "word"}})
    rng = random.Random(0)
    out = {}
    for hist in (500, 1500, 3000):
        ids = [rng.randrange(151936) for _ in range(hist)]
        best = {"list": float("inf"), "array": float("inf")}
        for rep in range(5):
            for name, add in (("list", vllm_add), ("array", patched_add)):
                req_id = f"{name}-{hist}"
                n = 200
                toks = list(ids)
                t_total = 0.0
                for k in range(n):
                    toks.extend((rng.randrange(151936) for _ in range(4)))  # the chunk's new tokens
                    st = CachedRequestState(req_id=req_id, prompt_token_ids=toks, mm_features=[], sampling_params=sp,
                                            generator=None, block_ids=([0] * (len(toks) // 32 + 1),),
                                            num_computed_tokens=len(toks) - 4, output_token_ids=[])
                    if req_id in batch.req_id_to_index:
                        batch.remove_request(req_id)  # the paused row leaves the batch (as vLLM does)
                    t = time.perf_counter()
                    add(batch, st)
                    t_total += time.perf_counter() - t
                    batch.condense()
                    batch.batch_update_builder.get_and_reset(batch.num_reqs)  # the step's end
                best[name] = min(best[name], 1e6 * t_total / n)
                batch.remove_request(req_id)
                batch.condense()
                batch.batch_update_builder.get_and_reset(batch.num_reqs)
                rows.drop([req_id])
        out[f"us_per_readd_list_{hist}"] = best["list"]
        out[f"us_per_readd_array_{hist}"] = best["array"]
        out[f"array_over_list_{hist}"] = best["array"] / best["list"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
