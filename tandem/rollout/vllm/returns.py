"""Chunk returns: each engine core sends the direct sessions' finished chunks to the frontend on a socket of its own.

A direct session's chunk comes back as one merged output when it stops (`sched.TandemScheduler` holds the
per-step outputs back). Through vLLM's own output path that output costs the frontend, per engine-core message:
a `zmq.asyncio` receive (a future and poller events per message), the msgpack decode of `EngineCoreOutputs`
with its log-prob arrays, and `AsyncLLM`'s output handler; counted with the thread's CPU clock (the benchmark service's cProfile,
`TANDEM_VLLM_PROFILE_DIR`), the receive, decode and handler were about 43% of the service's frontend CPU
in a tandem rollout. Here the scheduler sends the chunks that stopped in one step as one small msgpack
message, a list of `(request id, token ids, sampled log-probs or None, finish reason, stop reason, time of the
first token, time of the last)`, over a ZMQ PUSH socket to an `ipc://` path inside the service's private inbox;
the frontend (`Returns`) reads it with a plain reader callback on the socket's file descriptor, draining every
message waiting, and hands each chunk to its session. vLLM's own path still carries everything else (other
requests' outputs, errors, utility results), so an engine core that fails still fails its sessions.

`install()` (called by `sched.TandemScheduler` when the engine core builds it at start) adds the engine-core utility that
connects the socket (`open_returns`); without it, or before it, the chunks go vLLM's way as before.
"""

from __future__ import annotations

import logging
import time

LOG = logging.getLogger("tandem.vllm.returns")
UTILITY = "tandem_open_returns"


class Returner:
    """The engine-core side: one message per step with every held chunk that stopped in it."""

    def __init__(self, address: str):
        import msgspec
        import zmq

        self.sock = zmq.Context.instance().socket(zmq.PUSH)
        self.sock.setsockopt(zmq.SNDHWM, 0)  # never block the busy loop; the frontend drains every message
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.encode = msgspec.msgpack.Encoder().encode

    @staticmethod
    def record(o, t_first: float, t_last: float, state: dict | None = None) -> tuple:
        """One merged `EngineCoreOutput` as the frontend needs it (column 0 of the log-prob rows: the sampled
        token's), with the row's schedule state after the chunk (`RowSchedule.state()`, None when the row
        ended): the engine core decided the switch, the frontend continues from its state."""
        lp = o.new_logprobs
        lps = None if lp is None else lp.logprobs[:, 0].tolist()
        # stop_reason is vLLM's int | str | None: msgpack-ready as it is
        return (o.request_id, list(o.new_token_ids), lps, str(o.finish_reason), o.stop_reason, t_first, t_last,
                state)

    def send(self, records: list[tuple]) -> None:
        self.sock.send(self.encode(records), copy=True)


def open_returns(self, address: str) -> bool:
    """Engine-core utility (runs once, in the busy loop; `self` is vLLM's `EngineCoreProc`): connect the
    scheduler's chunk returns to `address`. The socket is used from the busy loop only."""
    sched = self.scheduler
    if getattr(sched, "tandem_returns", None) is None:
        sched.tandem_returns = Returner(address)
    return True


def install() -> None:
    """Make `open_returns` an engine-core utility method (in the engine-core process)."""
    from tandem.rollout.vllm.submit import install_utility

    install_utility(UTILITY, open_returns)


class Returns:
    """The frontend side for one engine: a PULL socket read by a reader callback on the event loop; every
    record goes to `sessions[request id].on_chunk(...)` (records of closed sessions are dropped)."""

    def __init__(self, engine, address: str, sessions: dict):
        import msgspec
        import zmq

        self.zmq = zmq
        self.client = engine.engine_core
        self.sessions = sessions
        self.sock = zmq.Context.instance().socket(zmq.PULL)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(address)
        self.address = address
        self.decode = msgspec.msgpack.Decoder().decode
        self.messages = 0
        self.chunks = 0
        self.cpu_seconds = 0.0  # this thread's CPU in receiving, decoding and handing out the chunks
        self.loop = None

    async def start(self) -> None:
        import asyncio

        self.loop = asyncio.get_running_loop()
        self.loop.add_reader(self.sock.getsockopt(self.zmq.FD), self._drain)
        await self.client.call_utility_async(UTILITY, self.address)
        self._drain()  # the descriptor is edge-triggered: anything that came before the reader was added

    def _drain(self) -> None:
        c0 = time.thread_time()
        sock, sessions, zmq = self.sock, self.sessions, self.zmq
        # ZMQ_EVENTS, not recv until zmq.Again: raising and catching that error cost more than the receive
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            buf = sock.recv(zmq.NOBLOCK)
            recs = self.decode(buf)
            self.messages += 1
            self.chunks += len(recs)
            for rec in recs:
                s = sessions.get(rec[0])
                if s is not None:
                    s.on_chunk(*rec[1:])
        self.cpu_seconds += time.thread_time() - c0

    def close(self) -> None:
        """From any thread: the reader goes with the socket, on the loop's own thread when it runs."""
        loop = self.loop
        if loop is not None and loop.is_running():
            loop.call_soon_threadsafe(self._close)
        else:
            self._close()

    def _close(self) -> None:
        if self.sock.closed:
            return
        if self.loop is not None and not self.loop.is_closed():
            self.loop.remove_reader(self.sock.getsockopt(self.zmq.FD))
        self.sock.close(0)
