"""Per-step diagnostics shared by the rollout function, the reward and the callbacks (one object per run)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class StepStats:
    """Diagnostics of the step in flight; `pop` hands them to the trainer's log and starts afresh."""

    values: dict[str, float] = field(default_factory=dict)
    phase_s: dict[str, float] = field(default_factory=dict)

    def add_time(self, phase: str, seconds: float) -> None:
        self.phase_s[phase] = self.phase_s.get(phase, 0.0) + seconds

    @contextmanager
    def timed(self, phase: str):
        """Add the wall time of the `with` body to `phase` (also when the body raises)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add_time(phase, time.perf_counter() - t0)

    def pop(self) -> dict[str, float]:
        out = dict(self.values)
        out.update({f"time/{k}": v for k, v in self.phase_s.items()})
        self.values, self.phase_s = {}, {}
        return out

