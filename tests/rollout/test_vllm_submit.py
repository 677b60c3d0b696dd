"""Batched chunk submissions (`tandem/rollout/vllm/submit.py`), both sides over a real ZMQ `ipc://` socket in
vLLM's environment, with a stand-in for the engine core: the chunks sent in one event-loop turn arrive as one
message of one ZMQ frame and reach the input queue in order, preprocessed (a payload with a large tensor takes
more frames and arrives whole); an abort flushes the row's pending chunk first and
lands after it in both of vLLM's queues; a request whose preprocessing fails gets vLLM's error path and does
not stop the others. The service tests (test_vllm_service.py) run the same path on real engines."""

from __future__ import annotations

import pytest

from vllm_fixtures import run_in_vllm

pytestmark = [pytest.mark.integration]

SCRIPT = r"""
import asyncio, queue, sys, tempfile, time
import torch
from vllm.v1.engine import EngineCoreRequest, EngineCoreRequestType
from vllm.v1.serial_utils import MsgpackEncoder
from tandem.rollout.vllm import submit

class Proc:  # what open_submissions uses of vLLM's EngineCoreProc
    def __init__(self):
        self.input_queue, self.aborts_queue, self.errors = queue.Queue(), queue.Queue(), []
    def preprocess_add_request(self, req):
        if req.request_id == "bad":
            raise ValueError("refused")
        emb = None if req.prompt_embeds is None else req.prompt_embeds.tolist()
        return (req.request_id, list(req.prompt_token_ids), req.client_index, emb), 0
    def _handle_request_preproc_error(self, req):
        self.errors.append(req.request_id)

proc = Proc()

class Client:  # what Submitter uses of vLLM's engine-core client
    client_index = 3
    encoder = MsgpackEncoder()
    async def call_utility_async(self, name, address):
        assert name == submit.UTILITY
        return getattr(proc, name)(address)

class Engine:
    engine_core = Client()

submit.install()
Proc.tandem_open_submissions = submit.open_submissions  # on vLLM's EngineCore by install(); here the stand-in

def req(rid, toks, emb=None):
    return EngineCoreRequest(rid, toks, None, None, None, time.time(), None, None, None, prompt_embeds=emb,
                             resumable=True)

def take(n):
    out = []
    deadline = time.monotonic() + 20
    while len(out) < n and time.monotonic() < deadline:
        try:
            out.append(proc.input_queue.get(timeout=0.5))
        except queue.Empty:
            pass
    return out

async def main():
    d = tempfile.mkdtemp()
    s = submit.Submitter(Engine(), f"ipc://{d}/submit-test")
    await s.start()
    assert "tandem_open_submissions" in dir(__import__("vllm.v1.engine.core", fromlist=["EngineCore"]).EngineCore)
    for i in range(3):  # three rows in one turn
        s.add(req(f"r{i}", [i, i + 1]))
    assert s.messages == 0  # nothing sent before the turn ends
    await asyncio.sleep(0)
    assert (s.messages, s.requests, s.frames) == (1, 3, 1), (s.messages, s.requests, s.frames)
    s.add(req("bad", [9]))
    s.add(req("r3", [7]))
    s.abort(["r3"])  # flushes r3 (and bad) first
    assert (s.messages, s.requests, s.frames) == (2, 5, 3)  # the abort is one frame too
    emb = torch.arange(128, dtype=torch.float32).reshape(2, 64)  # 512 bytes: out of band, a frame of its own
    s.add(req("e0", [4, 5], emb))
    await asyncio.sleep(0)
    assert (s.messages, s.requests, s.frames) == (3, 6, 5), (s.messages, s.requests, s.frames)
    got = take(6)
    kinds = [k for k, _ in got]
    assert kinds == [EngineCoreRequestType.ADD] * 4 + [EngineCoreRequestType.ABORT, EngineCoreRequestType.ADD], kinds
    assert [x[0][0] for _, x in got[:4]] == ["r0", "r1", "r2", "r3"], got
    assert got[0][1][0] == ("r0", [0, 1], 3, None)  # the client index travels with the request
    assert got[4][1] == ["r3"] and proc.aborts_queue.get(timeout=5) == ["r3"]
    assert got[5][1][0] == ("e0", [4, 5], 3, emb.tolist()), got[5]
    assert proc.errors == ["bad"]
    s.close()
    print("ok")

asyncio.run(main())
"""


def test_batched_submissions_in_order():
    run_in_vllm(SCRIPT)
