"""One weight push and one reload per training step per rollout service, whichever layout: two training processes
(gloo, `torch.distributed.run`) share one fake service and build their engines with `tandem.train.one_call.step_engine`,
as the trainer does; each step every process rolls out its rows and pushes its weights.

The fake service keeps the real one's rule for pushed weights (`service.Service._load`): a push loads its tag
(one reload) and the file is gone once loaded, so a call naming any other tag is answered 409. With the dedicated
layout, or the shared layout attached to one service (`rollout.vllm_url`), the service must see one push, one
reload and one call per step and no 409; the same processes each calling and pushing for themselves (what every
process did before: its own weights under its own tag) meet the 409 the check exists for."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

WORKER = r"""
import json, sys, types, urllib.error, urllib.request
from accelerate import Accelerator
from tandem.rollout.core import RolloutBatch, SamplingParams
from tandem.rollout.request import RolloutSettings
from tandem.rollout.schedule import ScheduleSpec
from tandem.train.one_call import OneCallEngine, step_engine

cases = json.loads(sys.argv[1])  # [[service url, layout, mode], ...], one after the other
acc = Accelerator(cpu=True)
rank = acc.process_index
url = None


def post(path, obj):
    req = urllib.request.Request(url + path, json.dumps(obj).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {}


class FakeClient:
    # a client of the service: its weights under its own tag (pid and version), as VLLMEngine.push_weights names them
    live = True

    def __init__(self):
        self.version, self.tag, self.conflicts = 0, None, 0

    def push_weights(self, module=None):
        self.version += 1
        self.tag = f"rank{rank}:{self.version}"
        post("/weights", {"tag": self.tag})
        return {"tag": self.tag}

    def generate(self, request):
        status, _ = post("/generate", {"senior": self.tag, "rows": len(request.prompts)})
        self.conflicts += status == 409
        n = len(request.prompts)
        return RolloutBatch([[1, 2]] * n, [[1, 0]] * n, [[0.0, 0.0]] * n, [1] * n, ["length"] * n)


settings = RolloutSettings(ScheduleSpec("word"), SamplingParams(max_new_tokens=2))
for case, (url, layout, mode) in enumerate(cases):
    rollout = types.SimpleNamespace(backend="vllm", vllm_layout=layout, vllm_url=url if layout == "shared" else "")
    engine = step_engine(FakeClient, rollout, acc) if mode == "step_engine" else FakeClient()
    client = engine.engine if isinstance(engine, OneCallEngine) else engine
    engine.push_weights(None)  # the weights of step 0 (the engine's start pushes the live senior)
    for step in range(3):
        acc.wait_for_everyone()
        batch = engine.generate(settings.request([[5, 6, 7]] * 2, seed=step, row_ids=[2 * rank, 2 * rank + 1]))
        assert len(batch) == 2
        acc.wait_for_everyone()
        engine.push_weights(None)  # after the optimizer step (VLLMWeightSync)
    print(json.dumps({"case": case, "rank": rank, "one_call": isinstance(engine, OneCallEngine),
                      "conflicts": client.conflicts if client is not None else 0}), flush=True)
"""


class FakeService:
    """The service's weights and calls: `pushes`, `reloads`, `calls`, `conflicts` (409s), per its rule above."""

    def __init__(self):
        self.loaded, self.pushes, self.reloads, self.calls, self.conflicts = None, 0, 0, 0, 0
        self.lock = threading.Lock()
        svc = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with svc.lock:
                    code = 200
                    if self.path == "/weights":
                        svc.pushes += 1
                        if body["tag"] != svc.loaded:
                            svc.loaded, svc.reloads = body["tag"], svc.reloads + 1
                    elif body["senior"] != svc.loaded:  # /generate naming weights the service no longer holds
                        svc.conflicts, code = svc.conflicts + 1, 409
                    else:
                        svc.calls += 1
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b"{}")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


CASES = (("dedicated", "step_engine"), ("shared", "step_engine"), ("shared", "each"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The three cases in one launch of two processes: {(layout, mode): (service, [rank results])}."""
    svcs = [FakeService() for _ in CASES]
    script = tmp_path_factory.mktemp("one_push") / "worker.py"
    script.write_text(WORKER)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cases = json.dumps([[svc.url, layout, mode] for svc, (layout, mode) in zip(svcs, CASES)])
    try:
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                            "127.0.0.1", "--master_port", str(port), str(script), cases],
                           env=env, capture_output=True, text=True, timeout=300, cwd=str(REPO))
    finally:
        for svc in svcs:
            svc.server.shutdown()
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    lines = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith('{"case"')]
    assert len(lines) == 2 * len(CASES), r.stdout
    return {c: (svc, [x for x in lines if x["case"] == i]) for i, (svc, c) in enumerate(zip(svcs, CASES))}


@pytest.mark.parametrize("layout", ["dedicated", "shared"])
def test_two_processes_on_one_service_push_once_per_step_and_never_meet_a_409(runs, layout):
    svc, ranks = runs[(layout, "step_engine")]
    assert all(r["one_call"] for r in ranks)
    assert svc.conflicts == 0 and all(r["conflicts"] == 0 for r in ranks)
    assert svc.pushes == svc.reloads == 4  # the start's push and one after each of the 3 steps
    assert svc.calls == 3  # one call per step, with both processes' rows


def test_each_process_pushing_its_own_weights_meets_a_409(runs):
    """The control: every process its own client of the one service (its weights under its own tag)."""
    svc, ranks = runs[("shared", "each")]
    assert not any(r["one_call"] for r in ranks)
    assert svc.pushes == svc.reloads == 8  # two reloads per step
    assert svc.conflicts >= 1 and sum(r["conflicts"] for r in ranks) == svc.conflicts
