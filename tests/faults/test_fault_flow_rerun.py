"""The Prefect flow killed (SIGKILL) in the middle of evaluation, then rerun: nothing completed is redone.

The real `tandem-evaluation` flow runs in a child process on a tiny checkpoint tree (tests/tasks/eval_fixtures.py)
with a temporary Prefect server; the child kills itself after a few generate calls of the rollout engine. The
rerun must make only the missing calls and leave the completed cache entries untouched. Analyze and report
are stubbed in the child (their own reruns are covered by their stage tests): this test is about evaluation.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from params_files import complete_params

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
if str(TESTS / "tasks") not in sys.path:
    sys.path.insert(0, str(TESTS / "tasks"))

CHILD = """
import os, signal, sys
sys.path[:0] = [{repo!r}]
import tasks.evaluate as ev
import flows.pipeline as pipeline

calls_file, kill_after = {calls!r}, {kill_after}
real_make = ev.rollout_engine

def make(*a, **k):
    eng = real_make(*a, **k)
    inner = eng.generate

    def generate(request):
        done = sum(1 for _ in open(calls_file)) if os.path.exists(calls_file) else 0
        if kill_after and done >= kill_after:
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no exception handler: a real crash
        out = inner(request)
        with open(calls_file, "a") as f:
            f.write(request.schedule.kind + "\\n")
        return out

    eng.generate = generate
    return eng

ev.rollout_engine = make
real_stage = pipeline._stage


class _Skipped:  # analyze and report are beside the point here: evaluation is what gets killed
    default_io = staticmethod(lambda params: ({{}}, {{}}))
    run = staticmethod(lambda params, inputs, outputs: {{}})
    existing_summary = staticmethod(lambda params: {{}})
    artifact_markdown = staticmethod(lambda params, summary: "(skipped in this test)")


pipeline._stage = lambda name: _Skipped if name in ("analyze", "report") else real_stage(name)
pipeline.tandem_evaluation(params_path={params!r}, dvc="off", live=False)
print("FLOW DONE", flush=True)
"""


def _run_flow(params: Path, calls: Path, kill_after: int, home: Path, log: Path) -> tuple[int, str]:
    """(exit code, output) of the flow in a child process; the temporary Prefect server dies with it."""
    code = CHILD.format(repo=str(REPO), calls=str(calls), kill_after=kill_after, params=str(params))
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_HOME": str(home),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)  # a temporary server of its own
    # output to a file, not a pipe: the server (a grandchild) would hold a pipe open after the child dies
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=900)
        finally:
            try:  # the child's whole session: the temporary Prefect server it started, if still there
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    return rc, log.read_text()


@pytest.mark.slow
@pytest.mark.integration
def test_flow_killed_mid_evaluation_reruns_only_what_is_missing(tmp_path):
    import eval_fixtures as F

    root = F.build_tree(tmp_path / "out", steps=(2,), n_problems=2)
    params = tmp_path / "params.yaml"
    p = F.small_params(root, modes=["solo", "word"])
    raw = complete_params({"out_root": str(root), "train": {"arms": list(F.ARMS)},
                           "evaluate": {k: getattr(p.evaluate, k) for k in ("n_samples", "ks", "modes", "max_new_tokens",
                                                                            "batch_size", "progress", "score_workers")}})
    params.write_text(yaml.safe_dump(raw))
    cache = root / "scratch" / "evaluate"
    calls = tmp_path / "calls.txt"

    rc, out = _run_flow(params, calls, kill_after=3, home=tmp_path / "prefect", log=tmp_path / "first.log")
    assert rc == -signal.SIGKILL, out[-4000:]
    done = {f: f.stat().st_mtime_ns for f in cache.glob("*.json")}
    assert len(done) == 3 and not (root / "metrics" / "eval.json").exists()

    calls.unlink()
    rc, out = _run_flow(params, calls, kill_after=0, home=tmp_path / "prefect", log=tmp_path / "second.log")
    assert rc == 0 and "FLOW DONE" in out, out[-4000:]
    total = len(list(cache.glob("*.json")))
    assert len(calls.read_text().splitlines()) == total - 3  # only the missing results were generated
    assert {f: f.stat().st_mtime_ns for f in done} == done  # completed results untouched
    assert total > 3 and (root / "metrics" / "eval.json").exists()
