"""The vLLM versions the rollout service supports, the engine settings it relies on, and every private vLLM
touchpoint of `tandem/rollout/vllm/` (and of the benchmarks that drive it, `benchmarks/`), in one place.

The service reaches into vLLM where no public API does the job (docs/rollout.md says why for each piece): a
scheduler subclass that stops a row at an authorship switch inside the engine core, engine-core utilities that
take batched submissions and send chunk returns, and worker patches on the CPU build. Those touchpoints are
checked against the versions in `SUPPORTED` only, so the service refuses any other installed vLLM with one line
(`check_version`) instead of failing late, or silently, inside an engine. A new vLLM version is supported by
reading each touchpoint below against its source, running the vLLM tests (`make test` with `.venv-vllm`), and
adding its minor series here.

This module imports nothing from vLLM: the pipeline's tests read it too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SUPPORTED: tuple[tuple[int, int], ...] = ((0, 32),)  # (major, minor) series whose touchpoints were checked
TESTED = "0.32.0"  # the version `make vllm-env` installs and the vLLM tests run on (the CPU build on CPU)

# Environment the service sets before vLLM is imported (the engine-core processes inherit it).
# V1 model runner: vLLM 0.32 on CUDA defaults to the V2 runner, where the worker patches (worker.py) do not act
# and V1-interface logits processors (the benchmark's replay) are rejected at start; the CPU build runs V1 anyway.
ENGINE_ENV: dict[str, str] = {"VLLM_USE_V2_MODEL_RUNNER": "0"}

# Engine arguments the service always passes (engines.engine_kwargs), whatever vLLM's defaults on the platform.
# async_scheduling: vLLM 0.32 on CUDA turns asynchronous scheduling on by default for the `uni` executor; with it,
# a synchronous scheduler subclass under the batch queue schedules new chunks into the next batch while rows in
# flight skip a step, so tandem rows can split into two alternating cohorts (each batch reading the weights).
# The CPU build forces it off; the service states it for every platform.
ENGINE_FIXED: dict[str, object] = {"async_scheduling": False}


class UnsupportedVLLMError(RuntimeError):
    """The installed vLLM is outside `SUPPORTED`."""


def parse_version(text: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a version string such as "0.32.0", "0.32.1+cpu" or "0.33.0rc1"."""
    m = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", str(text))
    if m is None:
        raise ValueError(f"not a version: {text!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def supported_text() -> str:
    return ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED)


def check_version(installed: str) -> None:
    """Raise UnsupportedVLLMError (one line naming both) unless `installed` is in a supported series."""
    try:
        major, minor, _ = parse_version(installed)
    except ValueError:
        major = minor = -1
    if (major, minor) not in SUPPORTED:
        raise UnsupportedVLLMError(
            f"vLLM {installed} is installed, but the tandem rollout service supports vLLM {supported_text()} "
            f"only (its private touchpoints, listed in tandem/rollout/vllm/compat.py, were checked against "
            f"those): install vllm=={TESTED} in the service's environment (`make vllm-env`)")


@dataclass(frozen=True)
class Touchpoint:
    """One place where the service relies on vLLM beyond its public API: `names` are the vLLM names (methods,
    attributes, fields, keyword arguments, and attributes the code writes onto vLLM's objects) that the code at
    `where` uses; tests/rollout/test_vllm_compat.py finds each in that code and finds no reliance left unlisted."""

    where: str      # our module and function
    vllm: str       # the vLLM symbol
    kind: str       # import | subclass | override | patch | utility | attribute
    relies_on: str  # what must stay true for it to work
    names: tuple[str, ...]  # the vLLM names the code at `where` spells (required: the tests check each)


TOUCHPOINTS: tuple[Touchpoint, ...] = (
    # the scheduler subclass (engine core): the stop at authorship switches
    Touchpoint("sched.TandemScheduler", "vllm.v1.core.sched.scheduler.Scheduler", "subclass",
               "loaded by `scheduler_cls`; a synchronous scheduler (async_scheduling off); its engine's "
               "`additional_config` reaches it as `vllm_config`", ("Scheduler", "vllm_config", "additional_config")),
    Touchpoint("sched.TandemScheduler.schedule", "Scheduler.schedule -> SchedulerOutput; Scheduler.requests; "
               "Request.num_computed_tokens", "override",
               "the step's counters: SchedulerOutput.total_num_scheduled_tokens (computed tokens), "
               "num_scheduled_tokens (rows scheduled), preempted_req_ids; schedule() has already advanced each "
               "request's num_computed_tokens by the tokens it scheduled (the KV context read)",
               ("schedule", "total_num_scheduled_tokens", "num_scheduled_tokens", "preempted_req_ids", "requests",
                "num_computed_tokens")),
    Touchpoint("sched.TandemScheduler._update_request_with_output",
               "Scheduler._update_request_with_output(request, new_token_ids, is_stale)", "override",
               "vLLM's own update, called here once per token (one per step without speculative decoding), "
               "appends the token, checks vLLM's stops and returns (kept tokens, stopped); the switch rule stops "
               "after it by setting request.status and stop_reason as vLLM's own stop does; the chunk's rule is "
               "cached on the Request (`_tandem_rule`, an attribute written onto vLLM's object)",
               ("_update_request_with_output", "num_output_tokens", "sampling_params", "status", "stop_reason",
                "FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED", "_tandem_rule", "request_id")),
    Touchpoint("sched.TandemScheduler.update_from_output", "Scheduler.update_from_output", "override",
               "returns {client index: EngineCoreOutputs}; held outputs are taken out before they are sent",
               ("update_from_output",)),
    Touchpoint("sched.TandemScheduler._hold_back, sched.merge_outputs", "vllm.v1.engine.EngineCoreOutputs, "
               "EngineCoreOutput fields", "attribute",
               "an EngineCoreOutputs with no outputs and none of finished_requests, scheduler_stats, "
               "utility_output, wave_complete, start_wave may be dropped; a chunk's outputs merge by their "
               "new_token_ids and new_logprobs, with SCHEDULED events for its first and last step",
               ("outputs", "finish_reason", "stop_reason", "events", "new_token_ids", "new_logprobs",
                "is_finished", "__struct_fields__", "__struct_defaults__")),
    Touchpoint("sched", "vllm.v1.engine.EngineCoreEvent, EngineCoreEventType", "import",
               "SCHEDULED events mark a merged chunk's first and last step", ("EngineCoreEvent", "SCHEDULED")),
    Touchpoint("sched.merge_outputs", "vllm.v1.outputs.LogprobsLists", "import",
               "the per-step log-prob lists of a row can be concatenated",
               ("LogprobsLists", "logprob_token_ids", "logprobs", "sampled_token_ranks")),
    Touchpoint("sched.TandemScheduler.add_request, sched.TandemScheduler._enqueue_waiting_request",
               "Scheduler.add_request, Scheduler._enqueue_waiting_request, Request.resumable, "
               "vllm.v1.request.RequestStatus.WAITING_FOR_STREAMING_REQ", "override",
               "a paused streaming session waits in the waiting queue until its next chunk resumes it",
               ("add_request", "_enqueue_waiting_request", "WAITING_FOR_STREAMING_REQ", "WAITING", "resumable")),
    Touchpoint("sched.TandemScheduler.get_request_counts, sched.TandemScheduler.get_num_unfinished_requests",
               "Scheduler.get_request_counts, Scheduler._pause_state", "override",
               "the counts vLLM derives from its queues",
               ("get_request_counts", "get_num_unfinished_requests", "_pause_state")),
    Touchpoint("sched.TandemScheduler.finish_requests", "Scheduler.finish_requests", "override",
               "returns the finished Request objects", ("finish_requests",)),
    # engine-core utilities: batched submissions and chunk returns
    Touchpoint("submit.install_utility", "vllm.v1.engine.core.EngineCore (utility methods)", "patch",
               "call_utility_async(name, ...) runs EngineCore.<name> in the busy loop", ("EngineCore",)),
    Touchpoint("submit.open_submissions", "EngineCoreProc.preprocess_add_request, "
               "_handle_request_preproc_error, input_queue, aborts_queue", "attribute",
               "what vLLM's input thread does with an ADD or ABORT message; the thread is kept on the engine "
               "core (`_tandem_submissions`, written onto vLLM's object)",
               ("preprocess_add_request", "_handle_request_preproc_error", "input_queue", "aborts_queue",
                "_tandem_submissions")),
    Touchpoint("submit", "vllm.v1.engine.EngineCoreRequest, EngineCoreRequestType; "
               "vllm.v1.serial_utils.MsgpackDecoder/Encoder", "import", "the engine core's request wire format",
               ("EngineCoreRequest", "EngineCoreRequestType", "MsgpackDecoder", "ADD", "ABORT")),
    Touchpoint("submit.Submitter", "AsyncLLM.engine_core (client_index, call_utility_async, encoder)", "attribute",
               "the engine-core client of an AsyncLLM; its msgpack `encoder` encodes EngineCoreRequests as its own "
               "add_request_async does", ("engine_core", "client_index", "call_utility_async", "encoder")),
    Touchpoint("returns.open_returns", "EngineCoreProc.scheduler", "attribute",
               "the engine core's scheduler object (our TandemScheduler)", ("scheduler", "tandem_returns")),
    # the service (frontend)
    Touchpoint("sessions.DirectSession.send", "AsyncLLM.input_processor.process_inputs(..., resumable=True); "
               "EngineCoreRequest fields", "attribute",
               "a session's first chunk is built by vLLM's input processor as a resumable request; later chunks "
               "are shallow copies (msgspec structs) with new prompt_token_ids, sampling_params and arrival_time",
               ("input_processor", "process_inputs", "resumable", "get_supported_tasks", "external_req_id",
                "prompt_token_ids", "sampling_params", "arrival_time", "max_tokens", "__copy__")),
    Touchpoint("sessions.Router", "AsyncLLM.output_processor, AsyncLLM._run_output_handler", "attribute",
               "the output handler loop is started lazily and feeds output_processor.process_outputs; its "
               "propagate_error reports an engine error",
               ("output_processor", "process_outputs", "propagate_error", "_run_output_handler")),
    Touchpoint("sessions.DirectSession.send, service.Service._score", "vllm.inputs.TokensPrompt", "import",
               "token prompts", ("TokensPrompt", "prompt_token_ids")),
    Touchpoint("service.Service._generate, engines.engine_kwargs", "SamplingParams.extra_args, logprobs_mode='processed_logprobs'", "attribute",
               "extra_args reach the scheduler with the request; processed log-probs are after temperature",
               ("extra_args", "logprobs_mode", "processed_logprobs")),
    # the worker (CPU build, V1 model runner)
    Touchpoint("worker.TandemWorker.tandem_load_weights, worker.refresh_tied_head", "model_runner.reload_weights, "
               "quant_method.process_weights_after_loading", "attribute", "vLLM's in-place RL weight reload",
               ("model_runner", "reload_weights", "get_model", "quant_method", "process_weights_after_loading")),
    Touchpoint("worker.install_row_arrays", "vllm.v1.worker.gpu_input_batch.InputBatch.add_request, "
               "vllm.v1.worker.gpu_model_runner.GPUModelRunner._update_states", "patch",
               "V1 model runner only: the batch converts prompt_token_ids at add_request; the patch marks the "
               "class (`_tandem_rows`, written onto vLLM's class)",
               ("InputBatch", "add_request", "_update_states", "prompt_token_ids", "_tandem_rows")),
    Touchpoint("worker.install_cpu_generator_rewind", "vllm.v1.worker.gpu_model_runner.GPUModelRunner._sample, _bookkeeping_sync, "
               "discard_request_mask, input_batch.generators", "patch",
               "V1 model runner only: a discarded sample's generator is rewound by offset (CUDA) in bookkeeping; "
               "the patch marks the class (`_tandem_cpu_rewind`, written onto vLLM's class)",
               ("GPUModelRunner", "_sample", "_bookkeeping_sync", "discard_request_mask", "input_batch", "generators",
                "num_reqs", "_tandem_cpu_rewind")),
    # benchmark only (benchmarks/, which the service never imports)
    Touchpoint("benchmarks/vllm_ab_service.StreamSession", "vllm.engine.protocol.StreamingInput", "import",
               "AsyncLLM.generate's streaming-input sessions (the frontend A/B)", ("StreamingInput",)),
    Touchpoint("benchmarks/sched_step", "vllm.config (VllmConfig, ModelConfig, CacheConfig, SchedulerConfig); "
               "vllm.v1.kv_cache_interface; vllm.v1.structured_output.StructuredOutputManager; "
               "vllm.v1.core.kv_cache_utils; vllm.utils.hashing; vllm.v1.request.Request", "import",
               "a Scheduler can be built and stepped without engines (the isolated step bench); the block count "
               "is set on the CacheConfig (`num_gpu_blocks`)",
               ("VllmConfig", "SchedulerConfig", "CacheConfig", "StructuredOutputManager", "num_gpu_blocks",
                "block_hasher")),
    Touchpoint("benchmarks/stop_rule", "Scheduler._update_request_with_output (through TandemScheduler)", "attribute",
               "the stop rule timed alone, called as the engine core calls it", ("_update_request_with_output",)),
    Touchpoint("benchmarks/vllm_replay.ReplayLogitsProcessor", "vllm.v1.sample.logits_processor.LogitsProcessor, BatchUpdate",
               "subclass", "V1-interface logits processors (the benchmark's replay; V1 model runner only)",
               ("LogitsProcessor", "BatchUpdate", "is_argmax_invariant", "update_state", "apply", "added",
                "removed", "moved")),
    Touchpoint("benchmarks/vllm_stock.StepTally", "vllm.v1.metrics.loggers.StatLoggerBase; SchedulerStats "
               "(iteration_details, num_running_reqs, num_waiting_reqs); IterationStats (num_generation_tokens, "
               "num_preempted_reqs)", "subclass",
               "a stat logger passed to AsyncLLM.from_engine_args(stat_loggers=...) gets one SchedulerStats per "
               "executed batch, with iteration_details when enable_logging_iteration_details is set (the stock "
               "solo's engine steps)",
               ("StatLoggerBase", "record", "log_engine_initialized", "iteration_details", "num_running_reqs",
                "num_waiting_reqs", "num_generation_tokens", "num_preempted_reqs", "num_ctx_tokens")),
    Touchpoint("benchmarks/vllm_ab_service.ABService.health",
               "AsyncLLM.vllm_config.scheduler_config.async_scheduling", "attribute",
               "the scheduling mode vLLM resolved for the engine (the CPU platform forces it off)",
               ("vllm_config", "scheduler_config", "async_scheduling")),
)


# vLLM's public API as the service uses it (not touchpoints): documented entry points and types.
PUBLIC_IMPORTS: frozenset[str] = frozenset({
    "vllm", "vllm.engine.arg_utils", "vllm.platforms", "vllm.sampling_params", "vllm.inputs",
    "vllm.v1.engine.async_llm"})


def touchpoints_table() -> str:
    """The touchpoints as a Markdown table (docs/rollout.md shows it)."""
    rows = ["| where (tandem/rollout/vllm/, else as named) | vLLM | kind | relies on |", "|---|---|---|---|"]
    rows += [f"| `{t.where}` | `{t.vllm}` | {t.kind} | {t.relies_on} |" for t in TOUCHPOINTS]
    return "\n".join(rows)
