"""`TandemScheduler`: vLLM's scheduler, stopping a tandem chunk exactly at the authorship switch, with counters.

Loaded inside each vLLM engine-core process (`scheduler_cls="tandem.rollout.vllm.sched.TandemScheduler"`; the
service puts the repository on PYTHONPATH). For every sampled token of a request whose sampling parameters
carry `extra_args["tandem"]` (see `turns.chunk_args`), after vLLM's own stop checks (EOS, stop ids, its
`max_tokens`), it advances the row's schedule by one token (`turns.ChunkRule`: a byte-table lookup and, at a
redraw, one counter-based uniform) and stops the chunk with `stop_reason = "tandem_switch"` when the next token
belongs to the other model, or at the budget / the step schedule's rounds cap. The resumable session then
parks with its KV blocks kept (`WAITING_FOR_STREAMING_REQ`) until the row sends its next chunk. Nothing scales
with the vocabulary: no word-start stop list ever enters `stop_token_ids`.

Counters (cumulative, float64, in a small shared file named by `additional_config["tandem_stats"]`, read by
the service before and after each rollout): see `FIELDS`. A custom scheduler class turns vLLM's asynchronous
scheduling off (vLLM says so in its log); the handoff is then at most one step late.
"""

from __future__ import annotations

import time
from pathlib import Path

try:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.sched.utils import check_stop
    from vllm.v1.request import RequestStatus
except ImportError:  # the pipeline's environment has no vLLM: the module imports, the class is never used there
    Scheduler, check_stop, RequestStatus = object, None, None

from tandem.rollout.schedule import LookupTables
from tandem.rollout.vllm.turns import STOP_SWITCH, ChunkRule

FIELDS = ("steps", "busy_seconds", "sched_cpu_seconds", "computed_tokens", "generated_tokens", "chunks",
          "add_cpu_seconds", "switch_stops", "scheduled_rows_sum", "max_scheduled_rows", "rule_cpu_seconds",
          "length_stops", "preemptions", "rule_tokens", "context_tokens", "rounds_stops")
_TABLES: dict[str, LookupTables] = {}


def load_tables(path: str) -> LookupTables:
    """The token tables the service wrote (5 byte rows of the vocabulary size), read once per file."""
    t = _TABLES.get(path)
    if t is None:
        data = Path(path).read_bytes()
        V = len(data) // 5
        t = LookupTables(*(data[i * V:(i + 1) * V] for i in range(5)))
        _TABLES[path] = t
    return t


class Counters:
    """Cumulative counters in a shared file (or in memory when no file is named)."""

    def __init__(self, path: str | None):
        import numpy as np

        self.i = {k: j for j, k in enumerate(FIELDS)}
        if path:
            self.a = np.memmap(path, dtype=np.float64, mode="r+", shape=(len(FIELDS),))
        else:
            self.a = np.zeros(len(FIELDS), dtype=np.float64)

    def add(self, key: str, v: float) -> None:
        self.a[self.i[key]] += v

    def max(self, key: str, v: float) -> None:
        j = self.i[key]
        if v > self.a[j]:
            self.a[j] = v


class TandemScheduler(Scheduler):
    """See the module docstring."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        extra = getattr(self.vllm_config, "additional_config", None) or {}
        self.tandem_counters = Counters(extra.get("tandem_stats"))
        self._t_step = None
        self._cpu_step = 0.0

    # -- counters around a step --------------------------------------------------------------------
    def schedule(self, *args, **kwargs):
        t, c = time.perf_counter(), time.thread_time()
        out = super().schedule(*args, **kwargs)
        self._cpu_step = time.thread_time() - c
        n = out.total_num_scheduled_tokens
        self._t_step = t if n > 0 else None
        if n > 0:
            k = self.tandem_counters
            k.add("steps", 1)
            k.add("computed_tokens", n)
            rows = len(out.num_scheduled_tokens)
            reqs = self.requests
            # KV tokens each scheduled row attends to in this step (what a GPU reads from its KV cache):
            # schedule() has already advanced num_computed_tokens by the tokens it scheduled
            k.add("context_tokens", sum(reqs[r].num_computed_tokens for r in out.num_scheduled_tokens if r in reqs))
            k.add("scheduled_rows_sum", rows)
            k.max("max_scheduled_rows", rows)
            if out.preempted_req_ids:
                k.add("preemptions", len(out.preempted_req_ids))
        return out

    def update_from_output(self, scheduler_output, model_runner_output):
        c = time.thread_time()
        out = super().update_from_output(scheduler_output, model_runner_output)
        k = self.tandem_counters
        k.add("sched_cpu_seconds", self._cpu_step + time.thread_time() - c)
        self._cpu_step = 0.0
        if self._t_step is not None:
            k.add("busy_seconds", time.perf_counter() - self._t_step)
            self._t_step = None
        return out

    def add_request(self, request):
        c = time.thread_time()
        super().add_request(request)
        sp = request.sampling_params
        if request.resumable and sp is not None and sp.extra_args and "tandem" in sp.extra_args:
            self.tandem_counters.add("chunks", 1)  # a session's chunk (its closing request is not resumable)
        self.tandem_counters.add("add_cpu_seconds", time.thread_time() - c)

    # -- the stop rule -----------------------------------------------------------------------------
    def _update_request_with_output(self, request, new_token_ids, is_stale=False):
        sp = request.sampling_params
        args = sp.extra_args.get("tandem") if sp is not None and sp.extra_args else None
        if args is None:
            return super()._update_request_with_output(request, new_token_ids, is_stale)
        c = time.thread_time()
        rule = getattr(request, "_tandem_rule", None)
        if rule is None or rule[0] is not sp:  # a new chunk: its sampling parameters replaced the last ones
            rule = (sp, ChunkRule(args, load_tables(args["tables"])))
            request._tandem_rule = rule
            request.stop_reason = None  # the last chunk's "tandem_switch" must not label this chunk's EOS
        k = self.tandem_counters
        stopped = False
        for num_new, tok in enumerate(new_token_ids, 1):
            request.append_output_token_ids(tok)
            k.add("generated_tokens", 1)
            stopped = check_stop(request, self.max_model_len)
            if not stopped:
                why = rule[1].step(int(tok), request.num_output_tokens - 1)
                k.add("rule_tokens", 1)
                if why == "length":
                    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
                    k.add("length_stops", 1)
                    stopped = True
                elif why is not None:
                    request.status = RequestStatus.FINISHED_STOPPED
                    request.stop_reason = why
                    k.add("switch_stops" if why == STOP_SWITCH else "rounds_stops", 1)
                    stopped = True
            if stopped:
                del new_token_ids[num_new:]
                break
        k.add("rule_cpu_seconds", time.thread_time() - c)
        return new_token_ids, stopped
