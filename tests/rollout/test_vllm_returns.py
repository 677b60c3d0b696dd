"""Chunk returns (`tandem/rollout/vllm/returns.py`), both sides over a real ZMQ `ipc://` socket in vLLM's
environment, with a stand-in for the engine core: the utility connects the scheduler's socket once; a merged
`EngineCoreOutput` becomes one record (tokens, the sampled log-probs from column 0, vLLM's finish reason as
text, the stop reason, both times, the row's schedule state after a switch); messages sent before the event loop looks all arrive (the socket's
descriptor is edge-triggered: one wake-up must take every message waiting); each record reaches its own session
and a closed session's record is dropped; the counters count messages and chunks. The service tests (test_vllm_service.py) run the same path on real engines
and compare it with vLLM's output path (`direct-vllm-out`)."""

from __future__ import annotations

import pytest

from vllm_fixtures import run_in_vllm

pytestmark = [pytest.mark.integration]

SCRIPT = r"""
import asyncio, tempfile, time
import numpy as np
from vllm.v1.engine import EngineCoreOutput, FinishReason
from vllm.v1.outputs import LogprobsLists
from tandem.rollout.vllm import returns

class Sched:
    tandem_returns = None

class Proc:  # what open_returns uses of vLLM's EngineCoreProc
    scheduler = Sched()

proc = Proc()

class Client:  # what Returns uses of vLLM's engine-core client
    async def call_utility_async(self, name, address):
        assert name == returns.UTILITY
        return getattr(proc, name)(address)

class Engine:
    engine_core = Client()

class Sess:
    def __init__(self):
        self.got = []
    def on_chunk(self, *a):
        self.got.append(a)

returns.install()
assert "tandem_open_returns" in dir(__import__("vllm.v1.engine.core", fromlist=["EngineCore"]).EngineCore)
Proc.tandem_open_returns = returns.open_returns  # on vLLM's EngineCore by install(); here the stand-in

def out(rid, toks, lps, finish, stop):
    lp = None if lps is None else LogprobsLists(np.zeros((len(toks), 2), dtype=np.int32),
                                                np.asarray([[x, -9.0] for x in lps], dtype=np.float32),
                                                np.zeros(len(toks), dtype=np.int32))
    return EngineCoreOutput(rid, toks, lp, finish_reason=finish, stop_reason=stop)

async def main():
    d = tempfile.mkdtemp()
    a, b = Sess(), Sess()
    sessions = {"a": a, "b": b}
    r = returns.Returns(Engine(), f"ipc://{d}/returns-test", sessions)
    await r.start()
    rt = proc.scheduler.tandem_returns
    assert rt is not None
    proc.tandem_open_returns("ipc://unused")  # once: a second call keeps the socket
    assert proc.scheduler.tandem_returns is rt
    state = {"author": 0, "gap": 0, "newline": False, "turns": 0}  # the row's schedule after a switch
    rec = rt.record(out("a", [5, 6, 7], [-0.5, -1.25, float("-inf")], FinishReason.STOP, "tandem_switch"), 1.0, 2.0,
                    state)
    assert rec == ("a", [5, 6, 7], [-0.5, -1.25, float("-inf")], "stop", "tandem_switch", 1.0, 2.0, state), rec
    rt.send([rec, rt.record(out("b", [9], None, FinishReason.LENGTH, None), 3.0, 3.5)])
    rt.send([rt.record(out("gone", [1], None, FinishReason.STOP, 4), 5.0, 5.0)])  # a closed session's
    rt.send([rt.record(out("b", [2, 3], None, FinishReason.STOP, 151645), 6.0, 7.0)])  # EOS: an int stop reason
    deadline = time.monotonic() + 20
    while r.messages < 3 and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert (r.messages, r.chunks) == (3, 4), (r.messages, r.chunks)
    assert a.got == [([5, 6, 7], [-0.5, -1.25, float("-inf")], "stop", "tandem_switch", 1.0, 2.0, state)], a.got
    assert b.got == [([9], None, "length", None, 3.0, 3.5, None), ([2, 3], None, "stop", 151645, 6.0, 7.0, None)], b.got
    assert r.cpu_seconds > 0
    r.close()
    await asyncio.sleep(0)
    assert r.sock.closed
    print("ok")

asyncio.run(main())
"""


def test_chunk_returns_reach_their_sessions():
    run_in_vllm(SCRIPT)
