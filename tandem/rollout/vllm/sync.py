"""Weight sync for the vLLM rollout service during training: a transformers `TrainerCallback`.

After every optimizer step (and once when training begins, after a checkpoint may have been loaded into the
model) the live senior's weights are pushed to the service (`VLLMEngine.push_weights`), which reloads them in
place and resets its prefix cache, so the next rollout samples from exactly the weights trl trains.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from transformers import TrainerCallback


class VLLMWeightSync(TrainerCallback):
    """`engine` is a `VLLMEngine` or a function returning the current one (built after the trainer); engines
    without `push_weights` (the hf backend, which reads the module directly) are left alone."""

    def __init__(self, engine: Any | Callable[[], Any], stats: Any | None = None):
        self._engine = engine
        self.stats = stats
        self.pushes = 0

    def _push(self, model: Any | None) -> None:
        engine = self._engine() if callable(self._engine) and not hasattr(self._engine, "generate") else self._engine
        push = getattr(engine, "push_weights", None)
        if push is None or not getattr(engine, "live", False):
            return
        t0 = time.perf_counter()
        push(getattr(model, "module", model) if model is not None else None)
        self.pushes += 1
        if self.stats is not None and hasattr(self.stats, "add_time"):
            self.stats.add_time("weight_sync", time.perf_counter() - t0)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._push(model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self._push(model)
