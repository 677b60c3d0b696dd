"""GPU accounting: the GPUs a task held, GPU-seconds, and the tokens it generated per GPU-second.

Arithmetic on numbers the caller collects (`tasks/record.py` reads the stages' metrics), and `gpu_names`, the
GPUs torch sees (also `tandem.machine`'s device list). A task holds every GPU its machine gives the run, on every
machine it runs on, for its whole wall time (what a cluster bills), whether or not each GPU is busy all along. A
CPU run holds zero GPUs: its GPU-seconds are 0 and its tokens per GPU-second are None ("no GPU"), never a
division by zero and never a missing field.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence

NO_GPU = "none (a CPU run)"


def gpu_names() -> list[str]:
    """The names of the GPUs this process sees (`CUDA_VISIBLE_DEVICES` applied), [] without CUDA or torch. torch
    is imported only here, when it is importable (a CPU build says so without starting CUDA)."""
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def gpu_type(names: Sequence[str]) -> str:
    """One line for the GPUs `names` lists: the model when all are one model, `A x2, B x1` for a mix, and
    `NO_GPU` for none."""
    if not names:
        return NO_GPU
    counts = Counter(names)
    if len(counts) == 1:
        return next(iter(counts))
    return ", ".join(f"{name} x{n}" for name, n in sorted(counts.items()))


def gpu_inventory(names: Sequence[str], machines: int = 1) -> dict:
    """The GPUs a task holds: `names` on each of `machines` machines (`count` = len(names) x machines)."""
    if machines < 1:
        raise ValueError(f"machines is {machines}: a task runs on at least one machine")
    return {"count": len(names) * machines, "type": gpu_type(names), "per_machine": len(names),
            "machines": machines}


def gpu_seconds(wall_seconds: float, gpus: int) -> float:
    """GPU-seconds held: wall time x GPUs (0.0 for a CPU run)."""
    if wall_seconds < 0 or gpus < 0:
        raise ValueError(f"wall time {wall_seconds} s and {gpus} GPUs: neither can be negative")
    return float(wall_seconds) * gpus


def tokens_per_gpu_second(tokens: int | None, held_gpu_seconds: float) -> float | None:
    """Generated tokens per GPU-second held; None when no GPU was held or the task generated no tokens."""
    if tokens is None or held_gpu_seconds <= 0:
        return None
    return tokens / held_gpu_seconds


def task_accounting(wall_seconds: float, gpus: int, tokens: int | None) -> dict:
    """One task's record: GPUs held, GPU-seconds, generated tokens (None: the task generates none) and tokens
    per GPU-second (None without a GPU)."""
    held = gpu_seconds(wall_seconds, gpus)
    rate = tokens_per_gpu_second(tokens, held)
    return {"gpus": gpus, "gpu_seconds": round(held, 3), "tokens": tokens,
            "tokens_per_gpu_second": None if rate is None else round(rate, 3)}


def rollout_tokens(mean_length_by_step: Iterable[float], rows_per_step: int) -> int:
    """Tokens a training run generated: each step's mean completion length x the step's rows."""
    return int(round(sum(float(x) for x in mean_length_by_step) * rows_per_step))


def generation_tokens(batches: Iterable[tuple[int, float]]) -> int:
    """Tokens of (number of generations, their mean length) batches, e.g. an evaluation's benchmarks."""
    return int(round(sum(n * float(mean) for n, mean in batches)))


def accounting_line(inventory: dict, per_task: dict[str, dict]) -> str:
    """The report's line: the GPUs, then each task's GPU-seconds and tokens per GPU-second; a CPU run says it
    held zero GPUs."""
    if inventory["count"] == 0:
        return f"0 GPUs, {NO_GPU}: 0 GPU-seconds for every task, no tokens per GPU-second"
    parts = []
    for task, acc in per_task.items():
        rate = acc.get("tokens_per_gpu_second")
        parts.append(f"{task} {acc['gpu_seconds']:.1f} GPU-s"
                     + (f" ({rate:.1f} tokens/GPU-s)" if rate is not None else ""))
    head = f"{inventory['count']} GPUs ({inventory['type']})"
    return head + (": " + ", ".join(parts) if parts else "")
