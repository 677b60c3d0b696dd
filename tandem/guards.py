"""Training fault guards: a trainer callback that catches a NaN or infinite loss before it reaches the weights.

A non-finite loss makes non-finite gradients (clipping cannot fix a NaN norm), and one optimizer step on them
turns every weight NaN; every checkpoint after it would be garbage. `NonFiniteGuard` looks at the gradients
just before each optimizer step (transformers' `on_pre_optimizer_step`, after clipping):

- `skip` (`train.nonfinite_loss: skip`): drop every gradient (`p.grad = None`), so torch's optimizers leave
  those parameters and their moment estimates untouched: the weights after the step equal those before it.
  A warning names the step; the count is kept in `skipped_steps`.
- `stop`: drop the gradients the same way and raise `NonFiniteLossError` (a `UserError`: exit code 1, one
  message). No checkpoint is written for that step, so the last good checkpoint stays as it was and a rerun
  resumes from it.

The learning-rate schedule still advances on a skipped step, like a step with zero gradient would.
Hook: `callbacks.append(NonFiniteGuard(train.nonfinite_loss))` where the trainer's callbacks are built.
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch
from transformers import TrainerCallback

from tandem.errors import NonFiniteLossError

log = logging.getLogger(__name__)


def grads_finite(params: Iterable[torch.nn.Parameter]) -> bool:
    """Whether every existing gradient is finite (one fused norm per tensor: NaN/inf anywhere shows in it)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return True
    norms = torch._foreach_norm([g.detach().float() if g.dtype in (torch.float16, torch.bfloat16) else g.detach()
                                 for g in grads])
    return bool(torch.isfinite(torch.stack([n.to(norms[0].device) for n in norms])).all())


def drop_grads(params: Iterable[torch.nn.Parameter]) -> None:
    """Remove every gradient: torch optimizers skip a parameter whose `.grad` is None (state untouched)."""
    for p in params:
        p.grad = None


class NonFiniteGuard(TrainerCallback):
    """Skip (with a warning) or stop on a step whose gradients hold NaN or inf; see the module docstring."""

    def __init__(self, mode: str = "skip"):
        if mode not in ("skip", "stop"):
            raise ValueError(f"NonFiniteGuard mode must be 'skip' or 'stop', got {mode!r}")
        self.mode = mode
        self.skipped_steps: list[int] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if model is None or grads_finite(model.parameters()):
            return
        step = state.global_step + 1  # the step being taken (global_step counts finished ones)
        drop_grads(model.parameters())
        if self.mode == "stop":
            raise NonFiniteLossError(
                f"training step {step}: the loss or its gradient is NaN or infinite; stopped before the optimizer "
                f"step (train.nonfinite_loss: stop). Checkpoints up to step {state.global_step} are intact. Lower "
                f"train.learning_rate or check the data and model dtype, or set train.nonfinite_loss: skip.")
        self.skipped_steps.append(step)
        log.warning("training step %d: NaN or infinite loss/gradient; the optimizer step was skipped "
                    "(weights unchanged; %d skipped so far)", step, len(self.skipped_steps))
