"""`TandemWorker`: methods added to vLLM's worker (`worker_extension_cls`), called by the rollout service with
`AsyncLLM.collective_rpc("tandem_load_weights", args=(path,))`.

The engines run in their own processes (vLLM's engine core), so a weights iterator cannot be handed over:
the service names a safetensors file or a model directory, and the worker streams it into the model in place
with vLLM's RL reload (`model_runner.reload_weights`, which re-runs the kernels' weight post-processing: the
CPU build repacks linear weights). The tied LM head's post-processing is redone after it: the reload
post-processes a tied parameter for one of its layers only (the embedding), so on the CPU build the head kept
the GEMM handle packed from the old weights (measured: log-probs off by > 1 after a push).

`tandem_install_patches`, which the service calls on every worker once its engine has started (never at import),
installs `RowArrays` into the model runner's batch (`install_row_arrays`; `TANDEM_VLLM_ROW_ARRAYS=0` leaves vLLM's batch as it is). vLLM
resumes a streaming session as a new request of the step whose `prompt_token_ids` is the session's whole
history, and `InputBatch.add_request` converts that Python list into the batch's int32 token array at every
chunk: ~57 us at 1,500 tokens, ~95 us at 3,000 on the CPU build, O(history) per chunk. A session's history only
grows by appending (vLLM's `_update_request_as_session` extends it), so `RowArrays` keeps each tandem session's
tokens as an int32 array, converts only the tokens added since its last chunk, and hands the batch that array
(a memory copy, ~1 us). Dropped when the request finishes. The same call installs `install_cpu_generator_rewind`:
on the CPU build a seeded request whose prompt is split over steps otherwise kills the engine.
"""

from __future__ import annotations

import os
from pathlib import Path


def safetensors_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


def iter_weights(path: Path):
    from safetensors.torch import load_file

    for f in safetensors_files(path):
        yield from load_file(str(f)).items()


def refresh_tied_head(model) -> None:
    """Redo the output layer's weight post-processing (idempotent; a no-op where nothing is packed)."""
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if head is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)


class TandemWorker:
    """Mixed into vLLM's worker class by `worker_extension_cls`."""

    def tandem_load_weights(self, path: str) -> int:
        """Load the weights at `path` (a safetensors file or a model directory) in place; returns the tensors."""
        n = 0

        def counted():
            nonlocal n
            for item in iter_weights(Path(path)):
                n += 1
                yield item

        self.model_runner.reload_weights(weights_iterator=counted())
        refresh_tied_head(self.model_runner.get_model())
        return n

    def tandem_install_patches(self) -> dict[str, bool]:
        """Install the model-runner patches in this worker's process (`install_patches`); the service calls it on
        every worker once its engine has started (`engines.EngineHost._start`), before any rollout."""
        return install_patches()


class RowArrays:
    """Each tandem session's token history as a growing int32 array (see the module docstring)."""

    def __init__(self):
        import numpy as np

        self.np = np
        self.rows: dict[str, tuple] = {}  # request id -> (buffer, tokens valid in it)

    def array(self, req_id: str, ids: list[int]):
        """`ids` (the session's whole history) as an int32 array, converting only what is new since the last
        call for `req_id`. Falls back to a full conversion if the known prefix does not match (checked at its
        first and last token: O(1))."""
        np = self.np
        n = len(ids)
        buf, p = self.rows.get(req_id, (None, 0))
        if buf is not None and (p > n or (p and (int(buf[0]) != ids[0] or int(buf[p - 1]) != ids[p - 1]))):
            buf, p = None, 0
        if buf is None or len(buf) < n:
            grown = np.empty(max(2 * n, 256), dtype=np.int32)
            if p:
                grown[:p] = buf[:p]
            buf = grown
        if n > p:
            buf[p:n] = ids[p:n]
        self.rows[req_id] = (buf, n)
        return buf[:n]

    def drop(self, req_ids) -> None:
        for r in req_ids:
            self.rows.pop(r, None)


def install_row_arrays() -> RowArrays | None:
    """Patch vLLM's `InputBatch.add_request` (and the model runner's `_update_states`, to drop finished
    requests) to use `RowArrays` for tandem chunks; once per process. None where vLLM is absent or disabled."""
    if os.environ.get("TANDEM_VLLM_ROW_ARRAYS", "1") == "0":
        return None
    try:
        from vllm.v1.worker.gpu_input_batch import InputBatch
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:  # the pipeline's environment
        return None
    if hasattr(InputBatch, "_tandem_rows"):
        return InputBatch._tandem_rows
    from tandem.rollout.vllm.turns import tandem_args

    rows = RowArrays()
    add, update = InputBatch.add_request, GPUModelRunner._update_states

    def add_request(self, request):
        ids = request.prompt_token_ids
        if type(ids) is not list or tandem_args(request.sampling_params) is None:
            return add(self, request)
        request.prompt_token_ids = rows.array(request.req_id, ids)
        try:
            return add(self, request)
        finally:
            request.prompt_token_ids = ids

    def _update_states(self, scheduler_output):
        rows.drop(scheduler_output.finished_req_ids)
        return update(self, scheduler_output)

    InputBatch.add_request, GPUModelRunner._update_states = add_request, _update_states
    InputBatch._tandem_rows = rows
    return rows


def install_cpu_generator_rewind() -> bool:
    """Make vLLM's rewind of a seeded request's generator work on the CPU build; once per process.

    A step that computes only part of a prompt (chunked prefill: the step's token budget ends inside it) still
    samples for that request and discards the token; vLLM then rewinds the request's generator so that the
    seeded stream does not depend on how prefills were split (`_bookkeeping_sync`: `gen.set_offset(
    gen.get_offset() - 4)`, the Philox offset of a CUDA generator). A CPU generator has no offset (torch raises
    "CPU Generator does not use offset") and the engine dies. Here the state of every CPU generator whose sample
    will be discarded is saved before `_sample` and restored after it, the same rewind by the generator's own
    state, and vLLM's offset rewind skips those generators. CUDA generators are left to vLLM."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:  # the pipeline's environment
        return False
    if getattr(GPUModelRunner, "_tandem_cpu_rewind", False):
        return True
    import numpy as np

    sample, bookkeeping = GPUModelRunner._sample, GPUModelRunner._bookkeeping_sync

    def _sample(self, *args, **kwargs):
        gens = self.input_batch.generators
        saved = {}
        if gens:
            for i in np.nonzero(self.discard_request_mask.np[:self.input_batch.num_reqs])[0]:
                g = gens.get(int(i))
                if g is not None and g.device.type == "cpu":
                    saved[int(i)] = g.get_state()
        out = sample(self, *args, **kwargs)
        for i, state in saved.items():
            gens[i].set_state(state)
        self._tandem_rewound = tuple(saved)
        return out

    def _bookkeeping_sync(self, *args, **kwargs):
        gens, done = self.input_batch.generators, getattr(self, "_tandem_rewound", ())
        hidden = {i: gens.pop(i) for i in done if i in gens}
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            gens.update(hidden)
            self._tandem_rewound = ()

    GPUModelRunner._sample, GPUModelRunner._bookkeeping_sync = _sample, _bookkeeping_sync
    GPUModelRunner._tandem_cpu_rewind = True
    return True


def install_patches() -> dict[str, bool]:
    """Install both V1-model-runner patches and say in the engine's log which act (the service runs the V1
    runner: `compat.ENGINE_ENV`). Inert where vLLM is absent (the pipeline's environment, where this module is
    imported for its helpers only)."""
    import logging

    try:
        import vllm  # noqa: F401
    except ImportError:
        return {}
    from tandem.rollout.vllm.lifecycle import die_with_parent

    die_with_parent()  # a worker process of its own (multi-GPU engines) dies with its engine core
    got = {"row_arrays": install_row_arrays() is not None, "cpu_generator_rewind": install_cpu_generator_rewind()}
    runner = os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "unset")
    log = logging.getLogger("tandem.vllm.worker")
    if all(got.values()) or (not got["row_arrays"] and os.environ.get("TANDEM_VLLM_ROW_ARRAYS", "1") == "0"):
        log.info("V1 model runner patches installed: %s (VLLM_USE_V2_MODEL_RUNNER=%s)", got, runner)
    else:
        log.warning("V1 model runner patches NOT installed: %s (VLLM_USE_V2_MODEL_RUNNER=%s): this vLLM has no V1 "
                    "model runner to patch; see tandem/rollout/vllm/compat.py", got, runner)
    return got
