"""Helpers for the fault tests: fake checkpoints as training writes them, damage, a killer hook for child
processes, the command line in-process, and process-tree inspection."""

from __future__ import annotations

import json
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
for _p in (TESTS, TESTS / "tasks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import eval_fixtures as F  # noqa: E402


def flip(path: Path, at: int = 100) -> None:
    """Change one byte in place, keeping the size (what a checksum, not a size check, must catch)."""
    data = bytearray(path.read_bytes())
    data[at % len(data)] ^= 0xFF
    path.write_bytes(bytes(data))


def scratch_checkpoint(arm_dir: Path, step: int, fingerprint: str = "A", weights: bytes | None = None) -> Path:
    """A checkpoint as training writes it: model files and resume-only files, then the marker (with checksums)."""
    from tandem.checkpoints import write_state

    d = arm_dir / f"step-{step}"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(F.TINY_CONFIG))
    (d / "tokenizer.json").write_text("{}")
    (d / "model.safetensors").write_bytes(F.safetensors_bytes(weights or f"weights of step {step}".encode()))
    (d / "optimizer.pt").write_bytes(b"optimizer state " * 20)
    (d / "trainer_state.json").write_text(json.dumps({"log_history": [], "global_step": step}))
    write_state(d, {"fingerprint": fingerprint, "step": step, "complete": True})
    return d


def tandem(*args: str):
    """`tandem ARGS` in this process (typer's runner): exit code, stdout and stderr apart, the exception."""
    from typer.testing import CliRunner

    from cli.main import app

    return CliRunner().invoke(app, list(args))


def failure_line(res, what: str) -> str:
    """The one line `<what> failed: ...` of a failed command; asserts there is exactly one and no traceback."""
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), (res.exit_code, res.output[-3000:])
    assert "Traceback" not in res.output, res.output[-3000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith(f"{what} failed:")]
    assert len(lines) == 1, res.stderr[-3000:]
    return lines[0]


# Child-process prelude: SIGKILL this process right after the Nth rename/replace/exchange that moves one of
# WATCHED (as source or destination). Works on any version of the writers: it hooks the os calls themselves.
KILL_AFTER_MOVES = """
import os, signal, sys
from pathlib import Path
sys.path[:0] = [{repo!r}, {tests!r}, {tasks!r}]
_watched = {{str(Path(p).absolute()) for p in {watched!r}}}
_count = [0]

def _hook(fn):
    def moved(src, dst, *a, **k):
        out = fn(src, dst, *a, **k)
        if {{str(Path(os.fsdecode(src)).absolute()), str(Path(os.fsdecode(dst)).absolute())}} & _watched:
            _count[0] += 1
            if _count[0] >= {after}:
                os.kill(os.getpid(), signal.SIGKILL)
        return out
    return moved

os.replace, os.rename = _hook(os.replace), _hook(os.rename)
try:
    import tandem.transactions as _t
    _t.exchange = _hook(_t.exchange)
except ImportError:
    pass
"""


def kill_after_moves(watched: list[Path], after: int) -> str:
    return KILL_AFTER_MOVES.format(repo=str(REPO), tests=str(TESTS), tasks=str(TESTS / "tasks"),
                                   watched=[str(p) for p in watched], after=after)


def two_process_params(root: Path) -> Path:
    """`root/params.yaml` for a 4-step, 2-process run of the tandem arm on `root`'s base and prepared data (the
    kill tests' run: long enough to be killed in the middle, short enough to rerun)."""
    import yaml
    from params_files import complete_params

    params = root / "params.yaml"
    params.write_text(yaml.safe_dump(complete_params({
        "seed": 0, "out_root": str(root), "rollout": {"batch_size": 8},
        "train": {"arms": ["tandem"], "steps": 4, "save_every": 2, "prompts_per_step": 2, "group_size": 2,
                  "max_new_tokens": 8, "kl_rows": 2, "val_every": 0, "report_to": "none", "num_processes": 2,
                  "cpu_threads": 1, "learning_rate": 0.01}})))
    return params
