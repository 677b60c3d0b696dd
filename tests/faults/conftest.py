"""Fixtures shared by the fault tests: one tiny evaluation tree for the whole session (built once, copied by
each test that damages it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def fault_tree(tmp_path_factory) -> Path:
    """A tiny base and two checkpoints per arm (steps 2 and 4, complete, with recorded checksums) and one
    benchmark of one problem."""
    from fault_fixtures import F

    return F.build_tree(tmp_path_factory.mktemp("fault-tree") / "src", steps=(2, 4), n_problems=1,
                        benchmarks=("arith-short",))
