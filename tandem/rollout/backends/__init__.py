"""Rollout backends: one interface, `generate(request) -> RolloutBatch`, and a registry by name.

    backend = make_backend("hf", pair=ModelPair.build(senior, junior, tokenizer), options=HFOptions())
    batch = backend.generate(request)            # request: tandem.rollout.request.RolloutRequest

- `hf`: the catch-up kernel over transformers modules in this process (`backends/hf.py`);
- `vllm`: a client of the vLLM rollout service, which runs in vLLM's own environment
  (`tandem.rollout.vllm.client.VLLMEngine`).

A backend is registered as an import path ("module:attribute"), so that registering one never imports it:
the pipeline's environment has no vLLM, and `hf` needs no HTTP client. `TandemEngine`
(`tandem/rollout/engine.py`) checks the vocabulary, builds the token tables and EOS ids (one
`tandem.rollout.request.ModelPair`), and hands them to the backend it names as `pair=`, with the backend's
own options.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any, Protocol

from tandem.rollout.core import RolloutBatch


class Backend(Protocol):
    """What every backend implements (verl's rollout base is the model: one request in, one batch out)."""

    name: str

    def generate(self, request: Any) -> RolloutBatch: ...


_REGISTRY: dict[str, str] = {
    "hf": "tandem.rollout.backends.hf:HFBackend",
    "vllm": "tandem.rollout.vllm.client:VLLMEngine",
}


def register_backend(name: str, target: str) -> None:
    """Register `target` ("module:attribute", a class or factory taking the backend keyword arguments)."""
    if ":" not in target:
        raise ValueError(f"backend target must look like 'module:attribute', got {target!r}")
    _REGISTRY[name] = target


def backend_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def backend_factory(name: str):
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(_REGISTRY)}")
    module, attr = _REGISTRY[name].split(":")
    return getattr(import_module(module), attr)


def make_backend(name: str, **kwargs: Any) -> Backend:
    return backend_factory(name)(**kwargs)
