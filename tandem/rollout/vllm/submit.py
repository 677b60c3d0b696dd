"""Batched chunk submissions: the chunks the rows send to one engine in one event-loop turn as one message.

vLLM 0.32's engine-core client sends one ZMQ message per request (`add_request_async`: the client identity,
the request type and the msgpack payload), and the engine core's input thread takes one request per message.
A tandem rollout sends a chunk per authorship turn, ~0.26 per generated token, and the rows whose turns end in
the same engine step all send theirs in the same event-loop turn; their messages were about half of the
service's frontend CPU per generated token. Here the service (`Submitter`, the frontend) collects the
chunk requests of one engine during one turn of its event loop and sends them as one message, a msgpack list
of `EngineCoreRequest`s, over a ZMQ PUSH socket on an `ipc://` path inside the service's private inbox; a
thread in the engine-core process (`open_submissions`, started by the frontend through an engine-core
utility call) receives it and does for each request what vLLM's input thread does for an ADD message: decode,
`preprocess_add_request` (off the engine's busy loop, as vLLM does it), then the input queue that the busy loop
drains before every step. Aborts of these requests go the same way, so that a row's abort never overtakes
its own last chunk. Nothing else changes: the busy loop adds each request exactly as before.

`install()` (called by `sched.TandemScheduler` when the engine core builds it at start) adds the utility method to vLLM's
`EngineCore`; without it the service falls back on one message per chunk.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

LOG = logging.getLogger("tandem.vllm.submit")
ADD, ABORT = b"A", b"X"
UTILITY = "tandem_open_submissions"


def open_submissions(self, address: str) -> bool:
    """Engine-core utility (runs once, in the busy loop; `self` is vLLM's `EngineCoreProc`): start the thread
    that takes batched submissions from `address` into the input queue."""
    import zmq
    from vllm.v1.engine import EngineCoreRequest, EngineCoreRequestType
    from vllm.v1.serial_utils import MsgpackDecoder

    if getattr(self, "_tandem_submissions", None) is not None:
        return True
    decoder = MsgpackDecoder(list[EngineCoreRequest])
    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(address)

    def loop() -> None:
        while True:
            frames = sock.recv_multipart(copy=False)
            head = frames[0].buffer  # the kind byte, then the payload (`Submitter._send`)
            kind, body = bytes(head[:1]), head[1:]
            if kind == ADD:
                for req in decoder.decode([body, *frames[1:]] if len(frames) > 1 else body):
                    try:
                        item = self.preprocess_add_request(req)
                    except Exception:  # noqa: BLE001 - what vLLM's input thread does: an error output for it
                        self._handle_request_preproc_error(req)
                        continue
                    self.input_queue.put_nowait((EngineCoreRequestType.ADD, item))
            elif kind == ABORT:
                ids = json.loads(bytes(body))
                self.aborts_queue.put_nowait(ids)  # as vLLM's input thread: eager, and in order in the queue
                self.input_queue.put_nowait((EngineCoreRequestType.ABORT, ids))

    t = threading.Thread(target=loop, name="tandem-submissions", daemon=True)
    t.start()
    self._tandem_submissions = t
    return True


def install_utility(name: str, fn) -> None:
    """Make `fn` the engine-core utility method `name` (in the engine-core process; a no-op without vLLM)."""
    try:
        from vllm.v1.engine.core import EngineCore
    except ImportError:  # the pipeline's environment
        return
    if not hasattr(EngineCore, name):
        setattr(EngineCore, name, fn)


def install() -> None:
    """Make `open_submissions` an engine-core utility method (in the engine-core process)."""
    install_utility(UTILITY, open_submissions)


class Submitter:
    """The frontend side for one engine: `add` and `abort` queue; one message per event-loop turn."""

    def __init__(self, engine, address: str):
        import zmq

        self.client = engine.engine_core
        self.address = address
        self.sock = zmq.Context.instance().socket(zmq.PUSH)
        self.sock.setsockopt(zmq.SNDHWM, 0)  # never block the event loop; the engine drains every step
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(address)
        self.pending: list = []
        self.flush_due = False
        self.messages = 0
        self.requests = 0
        self.frames = 0  # ZMQ frames those messages took (one each unless a payload carries a large tensor)
        self.send_cpu_seconds = 0.0  # this thread's CPU in the encode and the send, both kinds of message

    async def start(self) -> None:
        await self.client.call_utility_async(UTILITY, self.address)

    def add(self, req) -> None:
        req.client_index = self.client.client_index
        self.pending.append(req)
        if not self.flush_due:
            self.flush_due = True
            # after the rows already woken in this turn (their wake-ups are queued before this callback)
            asyncio.get_running_loop().call_soon(self._flush)

    def abort(self, request_ids: list[str]) -> None:
        self._flush()  # the row's last chunk goes first
        c0 = time.thread_time()
        self._send(ABORT, [json.dumps(request_ids).encode()])
        self.send_cpu_seconds += time.thread_time() - c0

    def _flush(self) -> None:
        self.flush_due = False
        if not self.pending:
            return
        reqs, self.pending = self.pending, []
        c0 = time.thread_time()
        self._send(ADD, self.client.encoder.encode(reqs))
        self.send_cpu_seconds += time.thread_time() - c0
        self.messages += 1
        self.requests += len(reqs)

    def _send(self, kind: bytes, bufs) -> None:
        """One ZMQ message whose first frame is the kind byte and the payload's first buffer: each extra frame
        costs the sender's CPU (`benchmarks/submit_frames.py`), and a chunk request's payload is one buffer
        (vLLM's encoder adds frames only for large tensors, which chunks do not carry)."""
        head = kind + bytes(bufs[0])
        if len(bufs) == 1:
            self.sock.send(head, copy=False)
        else:
            self.sock.send_multipart([head, *bufs[1:]], copy=False)
        self.frames += len(bufs)

    def close(self) -> None:
        self.sock.close(0)
