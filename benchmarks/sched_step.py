"""The engine core's scheduler step in isolation: CPU per step against the history and the vocabulary size
(`tandem/rollout/vllm/stepbench.py`, which says what it runs and measures).

Run in vLLM's environment: `.venv-vllm/bin/python benchmarks/sched_step.py [--rows 32] [--tokens 500] [--history
16 2500] [--repeats 3] [--block-size 32]`; prints one JSON line.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.rollout.vllm.stepbench import main  # noqa: E402

if __name__ == "__main__":
    main()
