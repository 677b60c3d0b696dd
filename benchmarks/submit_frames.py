"""The frontend's CPU per batched chunk submission: `submit.Submitter`'s one-frame message (the kind byte and the
msgpack payload in one ZMQ frame) against the two-frame layout it replaces (the kind as a frame of its own, then
the payload), interleaved in one process over a real `ipc://` PUSH socket to a draining receiver in another
process (as the engine core's submission thread receives: `recv_multipart(copy=False)`).

Each message carries `--requests` chunk-shaped `EngineCoreRequest`s (a few new tokens, resumable, sampling
parameters with the tandem chunk arguments), encoded by vLLM's `MsgpackEncoder` as the service does. Measured:
the sending thread's CPU (`time.thread_time`) for the encode and the send, per message, best of five interleaved
rounds. Prints one JSON line with both and their ratio.

Run in vLLM's environment: `.venv-vllm/bin/python benchmarks/submit_frames.py [--requests 2] [--messages 20000]`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def drain(address: str, n: int) -> None:
    import zmq

    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(address)
    for _ in range(n):
        sock.recv_multipart(copy=False)


def chunk_request(i: int):
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    args = {"kind": "word", "seed": 1, "row": i, "p_senior": 0.5, "max_gap_tokens": 32, "max_rounds": 150, "budget": 3000,
            "t0": 100 + i, "gap": 2, "newline": False, "turns": 10, "role": 1, "tables": "/tmp/tables", "hold": True}
    sp = SamplingParams(max_tokens=2900, logprobs=0, temperature=1.0, extra_args={"tandem": args})
    return EngineCoreRequest(f"call-{i}-1", [11, 12, 13], None, sp, None, time.time(), None, None, None,
                             resumable=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2, help="chunk requests per message")
    ap.add_argument("--messages", type=int, default=20000, help="messages per timed round")
    opt = ap.parse_args()
    import zmq
    from vllm.v1.serial_utils import MsgpackEncoder

    from tandem.rollout.vllm import submit

    engine = SimpleNamespace(engine_core=SimpleNamespace(client_index=0, encoder=MsgpackEncoder()))
    reqs = [chunk_request(i) for i in range(opt.requests)]

    def two_frames(s: submit.Submitter, kind: bytes, bufs) -> None:  # the layout `_send` replaces
        s.sock.send_multipart([kind, *bufs], copy=False)

    inbox = tempfile.mkdtemp()
    best = {"one_frame": float("inf"), "two_frames": float("inf")}
    for rep in range(5):
        for name in best:
            address = f"ipc://{inbox}/{name}-{rep}"
            s = submit.Submitter(engine, address)
            rx = mp.get_context("spawn").Process(target=drain, args=(address, opt.messages))
            rx.start()
            time.sleep(0.5)  # the receiver connects
            c0 = time.thread_time()
            for k in range(opt.messages):
                s.pending = list(reqs)
                if name == "one_frame":
                    s._flush()
                else:
                    two_frames(s, submit.ADD, s.client.encoder.encode(s.pending))
                if k % 50 == 0:
                    time.sleep(0.0002)  # yield the cores now and then, as the service's event loop does
            cpu = time.thread_time() - c0
            rx.join()
            s.close()
            best[name] = min(best[name], cpu / opt.messages * 1e6)
    print(json.dumps({"requests_per_message": opt.requests, "zmq": zmq.zmq_version(), "pyzmq": zmq.__version__,
                      "one_frame_us_per_message": round(best["one_frame"], 2),
                      "two_frames_us_per_message": round(best["two_frames"], 2),
                      "one_over_two": round(best["one_frame"] / best["two_frames"], 3)}))


if __name__ == "__main__":
    main()
