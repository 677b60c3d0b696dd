"""What the GPU accounting (`tandem.accounting`) is computed from: the GPUs this process sees and the tokens
each task generated, read from the stages' outputs. Used by the run's metadata (`tasks/record.py`,
results/run.json) and the report's metadata (`tasks/report.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from tasks.common import read_json, read_metrics


def held_gpus() -> list[str]:
    """The names of the GPUs this process sees (`tandem.accounting.gpu_names`), [] without CUDA."""
    from tandem.accounting import gpu_names

    return gpu_names()


def _eval_units(metrics: Path) -> dict[str, int]:
    """Generated tokens per evaluation unit (`evaluate-<arm>-step-<step>-<mode>`, the flow's task names), from
    metrics/eval.json: every benchmark's generations x their mean length."""
    from tandem.accounting import generation_tokens

    path = metrics / "eval.json"
    try:
        doc = read_json(path) if path.exists() else {}
    except ValueError:
        return {}
    out: dict[str, int] = {}
    for arm, a in (doc.get("arms") or {}).items():
        for ckpt in a.get("checkpoints") or []:
            for mode, m in (ckpt.get("modes") or {}).items():
                out[f"evaluate-{arm}-step-{ckpt.get('step')}-{mode}"] = generation_tokens(
                    (b.get("n_generations") or 0, b.get("mean_tokens") or 0.0)
                    for b in (m.get("benchmarks") or {}).values())
    return out


def _train_tokens(metrics: Path, arm: str) -> int | None:
    """Tokens an arm's last training run generated: its steps past the checkpoint it resumed from, each step's
    mean completion length (the step table's `joint_length`) x the step's rows (prompts x group size)."""
    import csv

    from tandem.accounting import rollout_tokens
    from tandem.checkpoints import parse_step

    summary, table = metrics / f"train_{arm}.json", metrics / "plots" / "train" / f"{arm}.csv"
    if not summary.exists() or not table.exists():
        return None
    try:
        doc = read_metrics(summary)  # `resumed_from` lives in the untracked sidecar (tandem.timing)
        with open(table, newline="") as f:
            rows = list(csv.DictReader(f))
    except (ValueError, OSError):
        return None
    start = parse_step(doc.get("resumed_from") or "step-0") or 0  # the checkpoint's folder name, step-<N>
    lengths = [float(r["joint_length"]) for r in rows if r.get("joint_length") and int(r["step"]) > start]
    return rollout_tokens(lengths, int(doc.get("prompts_per_step") or 0) * int(doc.get("group_size") or 0))


def task_tokens(root: Path, tasks: Sequence[str]) -> dict[str, int | None]:
    """Generated tokens per task, read from the outputs under `root`: each training arm's rollouts, each
    evaluation unit's generations, the base stage's evaluation; None for a task that generates none."""
    metrics = Path(root) / "metrics"
    units = _eval_units(metrics) if any(t.startswith("evaluate-") for t in tasks) else {}
    out: dict[str, int | None] = {}
    for task in tasks:
        if task.startswith("train@"):
            out[task] = _train_tokens(metrics, task.split("@", 1)[1])
        elif task in units:
            out[task] = units[task]
        elif task == "base" and (metrics / "base.json").exists():
            try:
                out[task] = int(((read_json(metrics / "base.json").get("generation") or {}).get("tokens")) or 0)
            except ValueError:
                out[task] = None
        else:
            out[task] = None
    return out
