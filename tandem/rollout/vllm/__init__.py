"""The vLLM rollout path: the service (vLLM's environment) and its client (the pipeline's environment).

| module | environment | what |
|---|---|---|
| `client.py` | pipeline | `VLLMService` (start, attach, health, restart, stop), `VLLMEngine` (the `vllm` backend), `shared_service`, `engine_from_config` |
| `knobs.py` | both | `EngineKnobs`: the engines' knobs, the service's flags on one side and parsed back on the other |
| `submit.py` | vLLM (both sides) | batched chunk submissions: one message per engine per event-loop turn, a thread in the engine core |
| `sync.py` | pipeline | `VLLMWeightSync`: a `TrainerCallback` pushing the senior after every optimizer step |
| `turns.py` | both | the row state machine over two streaming sessions, the per-chunk stop rule, the counters |
| `service.py` | vLLM | `Service`: the token tables, the weights, the rollouts and scores over two `AsyncLLM` engines (`python -m` entry) |
| `httpd.py` | vLLM | the HTTP layer: the bounded server, the request handler, `main` (port, secret, clean exits) |
| `engines.py` | vLLM | the engines: their arguments, each on its devices (`placement`), start, sockets, weight loads, counters |
| `sessions.py` | vLLM | `DirectSession` (one row's resumable request per model) and the `Router` of their outputs |
| `sched.py` | vLLM engine core | `TandemScheduler`: stops chunks exactly at authorship switches; engine counters |
| `worker.py` | vLLM engine core | `TandemWorker`: weights reloaded in place; `RowArrays` in the model runner's batch |
| `returns.py` | vLLM (both sides) | chunk returns: the chunks that stop in a step, one message to the frontend |
| `lifecycle.py` | both | the service's port report, the health challenge's proof, its process group |
| `compat.py` | both | the supported vLLM versions, the engine settings the service fixes, every private touchpoint |

The benchmarks of this path (`tandem bench rollout --backend vllm`, the benchmark's service with the session kinds
it was measured against, the replayed text, the scheduler step in isolation) live in `benchmarks/`, the GPU cost
model in `tandem/rollout/cost.py`.

Nothing here imports vLLM at package import; the pipeline imports only `client`, `knobs`, `lifecycle`, `sync`, `turns`.
"""
