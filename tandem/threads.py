"""`torch_threads(n)`: run a block with `n` torch intra-op CPU threads, restoring the previous count after it.

The one place every stage sets its `cpu_threads`. Why it matters: a tiny model's matmuls are too small to split,
and on a busy 2-core machine two OpenMP threads spin-waiting on each other made generation 40x slower than one
thread (measured).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with `n` torch CPU threads (0 = leave as is); the previous count is restored after it."""
    import torch  # lazily: the memory plan and the CLI import this package without paying for torch

    old = torch.get_num_threads()
    if n > 0:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)
