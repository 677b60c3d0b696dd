"""Timing values in run records: which keys measure the run (wall time, throughput, memory, clock time) or
record what it found on disk (a resumed checkpoint) rather than its result, and how to split them off a JSON
document and merge them back."""

from __future__ import annotations

import re
from typing import Any

# Keys whose values measure the run (wall time, throughput, memory, clock time) or say what it found on disk
# (the checkpoint a training run resumed from, the stale ones it removed), not its result. A rerun with the
# same inputs on the same machine writes bit-identical outputs only when none of them is in an output that DVC
# hashes (a fresh clone finds no checkpoint to resume); `tasks.common.write_metrics` moves them to a sidecar
# file that neither git nor DVC tracks.
_TIMING_KEY = re.compile(r"(^|[_/])seconds?($|_)|per_second|^time[/_]|_time$|_runtime$|^timing$|^resources$"
                         r"|rss_mb|^saved_at$|^resumed_from$|^removed_stale$")


def is_timing_key(key: str) -> bool:
    return bool(_TIMING_KEY.search(str(key)))


def split_timing(obj: Any) -> tuple[Any, Any]:
    """(obj without its timing keys, the timing keys alone in the same nesting; None when there are none).

    Lists keep their length in the timing part (an entry with no timing is `{}`), so the two merge back."""
    if isinstance(obj, dict):
        kept, timing = {}, {}
        for k, v in obj.items():
            if is_timing_key(k):
                timing[k] = v
                continue
            kept[k], t = split_timing(v)
            if t is not None:
                timing[k] = t
        return kept, (timing or None)
    if isinstance(obj, list):
        parts = [split_timing(v) for v in obj]
        if all(t is None for _, t in parts):
            return [k for k, _ in parts], None
        return [k for k, _ in parts], [t if t is not None else {} for _, t in parts]
    return obj, None


def merge_timing(obj: Any, timing: Any) -> Any:
    """The inverse of `split_timing`."""
    if isinstance(obj, dict) and isinstance(timing, dict):
        out = dict(obj)
        for k, v in timing.items():
            out[k] = merge_timing(out[k], v) if k in out else v
        return out
    if isinstance(obj, list) and isinstance(timing, list) and len(obj) == len(timing):
        return [merge_timing(a, b) for a, b in zip(obj, timing)]
    return obj
