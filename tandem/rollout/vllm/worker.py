"""`TandemWorker`: methods added to vLLM's worker (`worker_extension_cls`), called by the rollout service with
`AsyncLLM.collective_rpc("tandem_load_weights", args=(path,))`.

The engines run in their own processes (vLLM's engine core), so a weights iterator cannot be handed over:
the service names a safetensors file or a model directory, and the worker streams it into the model in place
with vLLM's RL reload (`model_runner.reload_weights`, which re-runs the kernels' weight post-processing: the
CPU build repacks linear weights). The tied LM head's post-processing is redone after it: the reload
post-processes a tied parameter for one of its layers only (the embedding), so on the CPU build the head kept
the GEMM handle packed from the old weights (measured: log-probs off by > 1 after a push).
"""

from __future__ import annotations

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
