"""The vLLM rollout service: a small HTTP server, run in vLLM's own environment, that makes tandem rollouts.

    .venv-vllm/bin/python -m tandem.rollout.vllm_service --senior models/base --junior models/base --port 8471

vLLM cannot live in the pipeline's environment (prefect needs fastapi >= 0.139, vLLM < 0.137; vLLM 0.31-0.33
need transformers < 5.20), so it runs here, in its own virtual environment (`make vllm-env`), and the
pipeline talks to it through `tandem.rollout.vllm_client`. This module imports only the standard library,
torch, safetensors, vLLM and the pure schedule code of `tandem.rollout` (which needs only torch).

It hosts two vLLM engines in one process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, so weights can be reloaded in
place): the senior (its weights replaced during training) and the frozen junior, and runs the tandem
schedule next to them (`tandem.rollout.backends.vllm.run_turns`: catch-up through prefix caching, turns that
stop exactly where authorship may change). One service serves a whole run: every arm and every evaluation
unit names the weights it wants (`{"tag", "dir" | "file"}`), and the service reloads an engine only when its
loaded tag differs, then resets that engine's prefix cache (cached KV blocks of shared prompt prefixes would
otherwise come from the old weights).

Endpoints (JSON in and out; requests are served one at a time, except /health):
- GET  /health: {"ok", "pid", "vllm", "senior": tag, "junior": tag, "tables": [keys], "uptime_s"}
- POST /tables {"key", "vocab_size", "word_start", "step_end", "starts_newline", "ends_newline", "empty"}
  (id lists): the schedule's token tables, computed by the client from its tokenizer (so both sides use the
  same tables whatever transformers version each environment has).
- POST /weights {"role", "tag", "dir" | "file"}: load weights now (the trainer calls it after each optimizer
  step), then reset the prefix cache. POST /upload?tag=T (raw safetensors body): store weights sent over HTTP
  (a service on another machine); later requests name them by tag alone.
- POST /generate {"tables", "senior", "junior", "prompts", "rows", "schedule", "sampling", "seed", "eos",
  "p_senior", "max_gap_tokens", "max_rounds"}: a `RolloutBatch` as JSON plus {"stats": decoded/kept tokens,
  turns, rounds, seconds}. Unknown tables or tags answer 409 so that the client re-sends them (a restarted
  service starts empty).
- POST /score {"role", "weights", "sequences", "starts"}: teacher-forced log-probs (temperature 1) of each
  sequence's tokens from position `starts[i]` on (vLLM `prompt_logprobs`).
- POST /shutdown.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

ROLES = {"senior": 1, "junior": 0}


class Conflict(Exception):
    """The request names state the service does not hold (a restarted service): the client re-sends it."""


def _safetensors_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


def _iter_weights(path: Path):
    from safetensors.torch import load_file

    for f in _safetensors_files(path):
        yield from load_file(str(f)).items()


def resolve_dtype(dtype: str, model_dir: str) -> str:
    """`auto` keeps a float32 checkpoint in float32: vLLM's own `auto` serves float32 models in half precision,
    whose log-probs then differ from the trainer's float32 recomputation (measured: up to 0.46 nats on the
    tiny base)."""
    if dtype != "auto":
        return dtype
    cfg_path = Path(model_dir) / "config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    return "float32" if (cfg.get("dtype") or cfg.get("torch_dtype")) == "float32" else "auto"


def _refresh_tied_head(model) -> None:
    """Redo the output layer's weight post-processing after a reload. vLLM's in-place reload post-processes a
    tied parameter for one of its layers only (the embedding), so on the CPU build the LM head kept the GEMM
    handle packed from the old weights (measured: log-probs off by > 1 after a push). Idempotent; a no-op
    where the embedding method has nothing to pack (CUDA)."""
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if head is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)


class Service:
    """Two vLLM engines, their loaded weight tags, the token tables, and the rollout logic."""

    def __init__(self, senior: str, junior: str, dtype: str = "auto", max_model_len: int = 0,
                 gpu_memory_utilization: float = 0.35, enforce_eager: bool = True, seed: int = 0,
                 weights_dir: str | None = None):
        from vllm import LLM

        common: dict[str, Any] = dict(dtype=resolve_dtype(dtype, senior), enforce_eager=enforce_eager, enable_prefix_caching=True,
                                      seed=seed, gpu_memory_utilization=gpu_memory_utilization)
        if max_model_len:
            common["max_model_len"] = max_model_len
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            # The CPU build defaults to 128-token KV blocks; prefix caching reuses whole blocks only, so short
            # histories would never hit the cache and every catch-up would re-encode the whole history.
            common["block_size"] = 32
        # processed_logprobs: the sampled token's log-prob after temperature, log_softmax(logits / T), which
        # is what trl recomputes (training uses top-p 1 and no top-k).
        self.engines = {1: LLM(model=senior, logprobs_mode="processed_logprobs", **common),
                        0: LLM(model=junior, **common)}
        self.loaded = {1: f"dir:{Path(senior).resolve()}", 0: f"dir:{Path(junior).resolve()}"}
        self.tables: dict[str, Any] = {}
        self.uploads: dict[str, Path] = {}
        self.weights_dir = Path(weights_dir or tempfile.mkdtemp(prefix="tandem-vllm-weights-"))
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        self.lock = threading.Lock()
        self.t0 = time.time()
        self.reloads = 0

    # -- state -------------------------------------------------------------------------------------
    def health(self) -> dict:
        import vllm

        return {"ok": True, "pid": os.getpid(), "vllm": vllm.__version__, "senior": self.loaded[1],
                "junior": self.loaded[0], "tables": sorted(self.tables), "reloads": self.reloads,
                "uptime_s": round(time.time() - self.t0, 1)}

    def set_tables(self, req: dict) -> dict:
        import torch

        from tandem.rollout.vocab import TokenTables

        V = int(req["vocab_size"])

        def col(name: str) -> torch.Tensor:
            t = torch.zeros(V, dtype=torch.bool)
            t[torch.as_tensor(req[name], dtype=torch.int64)] = True
            return t

        self.tables[req["key"]] = TokenTables(col("word_start"), col("step_end"), col("starts_newline"),
                                              col("ends_newline"), col("empty"))
        return {"ok": True, "key": req["key"]}

    def upload(self, tag: str, body: bytes) -> dict:
        path = self.weights_dir / f"upload-{len(self.uploads)}-{os.getpid()}.safetensors"
        path.write_bytes(body)
        self.uploads[tag] = path
        return {"ok": True, "tag": tag, "bytes": len(body)}

    def ensure(self, role: int, spec: dict | None) -> bool:
        """Load the weights `spec` names into engine `role` unless already loaded; reset its prefix cache."""
        if not spec or spec.get("tag") == self.loaded[role]:
            return False
        tag = spec["tag"]
        if spec.get("dir"):
            path = Path(spec["dir"])
        elif spec.get("file"):
            path = Path(spec["file"])
        elif tag in self.uploads:
            path = self.uploads[tag]
        else:
            raise Conflict(f"unknown weights {tag!r}: upload them first")
        if not path.exists():
            raise FileNotFoundError(f"weights {tag!r}: {path} does not exist on the service's machine")
        llm = self.engines[role]
        # reload_weights (vLLM's in-place RL reload) re-runs the kernels' weight post-processing (the CPU build
        # repacks linear weights); plain model.load_weights would write into the repacked parameters.
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": _iter_weights(path)})
        llm.apply_model(_refresh_tied_head)
        llm.reset_prefix_cache()
        self.loaded[role] = tag
        self.reloads += 1
        return True

    # -- work --------------------------------------------------------------------------------------
    def _tables(self, key: str):
        if key not in self.tables:
            raise Conflict(f"unknown token tables {key!r}: send them first (POST /tables)")
        return self.tables[key]

    def generate(self, req: dict) -> dict:
        from vllm import SamplingParams as VSP

        from tandem.rollout.backends.vllm import run_turns, stop_sets

        tables = self._tables(req["tables"])
        self.ensure(1, req.get("senior"))
        self.ensure(0, req.get("junior"))
        s = req["sampling"]
        eos = [int(e) for e in req["eos"]]
        stops = stop_sets(tables, eos)
        temp, top_p, top_k = float(s["temperature"]), float(s["top_p"]), int(s["top_k"])

        def generate_turns(author: int, reqs):
            sps, prompts = [], []
            for hist, turn, vseed, want_lp in reqs:
                kw: dict[str, Any] = dict(n=1, temperature=temp, top_p=top_p, top_k=top_k if top_k > 0 else -1,
                                          max_tokens=int(turn.max_tokens), seed=int(vseed),
                                          stop_token_ids=stops[turn.stops], ignore_eos=False, detokenize=False,
                                          skip_special_tokens=False)
                if want_lp:
                    kw["logprobs"] = 0  # the sampled token's log-prob only
                sps.append(VSP(**kw))
                prompts.append({"prompt_token_ids": hist})
            outs = self.engines[author].generate(prompts, sps, use_tqdm=False)
            res = []
            for out in outs:
                o = out.outputs[0]
                toks = list(o.token_ids)
                lps = None
                if o.logprobs is not None:
                    lps = [d[t].logprob if d is not None and t in d else float("nan")
                           for d, t in zip(o.logprobs, toks)]
                res.append((toks, lps))
            return res

        t0 = time.perf_counter()
        batch, stats = run_turns([list(map(int, p)) for p in req["prompts"]], [int(r) for r in req["rows"]],
                                 req["schedule"], tables, int(s["max_new_tokens"]), int(req["seed"]), eos,
                                 float(req["p_senior"]), int(req["max_gap_tokens"]), int(req["max_rounds"]),
                                 generate_turns)
        stats["seconds"] = time.perf_counter() - t0
        return {"completion_ids": batch.completion_ids, "owner": batch.owner,
                "senior_logprobs": batch.senior_logprobs, "handoffs": batch.handoffs,
                "finish_reason": batch.finish_reason, "stats": stats}

    def score(self, req: dict) -> dict:
        from vllm import SamplingParams as VSP

        role = ROLES[req.get("role", "senior")]
        self.ensure(role, req.get("weights"))
        seqs, starts = req["sequences"], req["starts"]
        outs = self.engines[role].generate([{"prompt_token_ids": list(map(int, q))} for q in seqs],
                                           VSP(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False),
                                           use_tqdm=False)
        res = []
        for q, st, out in zip(seqs, starts, outs):
            plp = out.prompt_logprobs
            res.append([plp[t][int(q[t])].logprob for t in range(int(st), len(q))])
        return {"logprobs": res}


def make_handler(service: Service, server_ref: list):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # one line per request on stderr is noise at a step a second
            pass

        def _send(self, code: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if urlparse(self.path).path == "/health":
                return self._send(200, service.health())
            return self._send(404, {"error": f"no route {self.path}"})

        def do_POST(self):
            url = urlparse(self.path)
            n = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(n) if n else b""
            try:
                if url.path == "/shutdown":
                    self._send(200, {"ok": True})
                    threading.Thread(target=server_ref[0].shutdown, daemon=True).start()
                    return
                if url.path == "/upload":
                    tag = parse_qs(url.query).get("tag", [""])[0]
                    if not tag:
                        return self._send(400, {"error": "upload needs ?tag="})
                    with service.lock:
                        return self._send(200, service.upload(tag, body))
                req = json.loads(body or b"{}")
                routes = {"/tables": service.set_tables, "/generate": service.generate, "/score": service.score,
                          "/weights": lambda r: {"ok": True, "reloaded": service.ensure(ROLES[r["role"]], r)}}
                if url.path not in routes:
                    return self._send(404, {"error": f"no route {url.path}"})
                with service.lock:
                    out = routes[url.path](req)
                return self._send(200, out)
            except Conflict as e:
                return self._send(409, {"error": str(e)})
            except Exception as e:  # noqa: BLE001 - the client gets the message and the traceback
                return self._send(500, {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})

    return Handler


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--senior", required=True, help="model directory the senior engine starts from")
    ap.add_argument("--junior", required=True, help="model directory of the frozen junior")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    ap.add_argument("--port", type=int, default=8471)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-model-len", type=int, default=0)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.35, help="per engine (two share a GPU)")
    ap.add_argument("--no-enforce-eager", action="store_true", help="let vLLM compile / capture graphs (GPU)")
    ap.add_argument("--weights-dir", default=None, help="where uploaded weights are kept")
    a = ap.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engines live in this process: in-place reloads
    service = Service(a.senior, a.junior, a.dtype, a.max_model_len, a.gpu_memory_utilization,
                      not a.no_enforce_eager, weights_dir=a.weights_dir)
    ref: list = []
    server = ThreadingHTTPServer((a.host, a.port), make_handler(service, ref))
    ref.append(server)
    print(json.dumps({"listening": f"http://{a.host}:{server.server_address[1]}", "pid": os.getpid()}),
          flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
