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

One output per chunk. vLLM emits an `EngineCoreOutput` per request per step: for a chunk of n tokens the engine
core serialises n messages and the frontend decodes them and wakes the row n times, though the row only acts at
the chunk's end. For the chunks of direct sessions (`args["hold"]`: `service.DirectSession`; chunks without it, such as
`AsyncLLM`'s own streaming sessions, are left alone) the scheduler holds each step's output back and
emits one merged output when the chunk stops: all its tokens, the sampled log-prob rows concatenated, the
finish and stop reason of its last step, and two `events` whose timestamps are the engine-core times of the
chunk's first and last token (`time.perf_counter`, CLOCK_MONOTONIC on Linux: the frontend's clock too), so the
frontend still measures handoff latency at token resolution. An aborted request's held outputs are dropped.
Once the frontend has opened the chunk returns (`returns.py`), the chunks whose `hold` is "returns" that stop
in a step leave in one message of their own on that socket instead of vLLM's output path, and the step's
`EngineCoreOutputs` is not sent when nothing else is left in it.

Paused sessions wait outside vLLM's waiting queue (`_parked`; see `_enqueue_waiting_request`), so a step does not
walk every row that waits for its partner.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

try:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import EngineCoreEvent, EngineCoreEventType
    from vllm.v1.outputs import LogprobsLists
    from vllm.v1.request import RequestStatus
except ImportError:  # the pipeline's environment has no vLLM: the module imports, the class is never used there
    Scheduler = object
    RequestStatus = EngineCoreEvent = EngineCoreEventType = LogprobsLists = None

from tandem.rollout.schedule import LookupTables
from tandem.rollout.vllm import lifecycle, returns, submit
from tandem.rollout.vllm.turns import STOP_SWITCH, ChunkRule, tandem_args


FIELDS = ("steps", "busy_seconds", "sched_cpu_seconds", "computed_tokens", "generated_tokens", "chunks",
          "add_cpu_seconds", "switch_stops", "scheduled_rows_sum", "max_scheduled_rows", "rule_cpu_seconds",
          "length_stops", "preemptions", "rule_tokens", "context_tokens", "rounds_stops", "held_outputs",
          "sent_outputs", "row_seconds", "steps_ctx0", "steps_ctx1", "steps_ctx2", "sched_cpu_ctx0",
          "sched_cpu_ctx1", "sched_cpu_ctx2", "rows_ctx0", "rows_ctx1", "rows_ctx2")
# steps binned by the mean KV context of their rows (< 1,000, 1,000-2,000, >= 2,000 tokens): the scheduler CPU
# per step and per scheduled row at short and long histories, compared inside one rollout
CONTEXT_BINS = (1000, 2000)
_I = {k: j for j, k in enumerate(FIELDS)}  # a counter's slot in `Counters.pending` (the per-token path indexes it)
_I_GEN, _I_RULED, _I_RULE_CPU = _I["generated_tokens"], _I["rule_tokens"], _I["rule_cpu_seconds"]
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
    """Cumulative counters in a shared file (or in memory when no file is named).

    `add` accumulates in a Python list and `flush` writes the list once per engine step: a scalar add to the
    shared numpy array costs ~0.8 us, and the stop rule counts every sampled token (it adds to `pending` by
    index). Chunk adds between steps are written with the next step."""

    def __init__(self, path: str | None):
        import numpy as np

        self.i = _I
        if path:
            self.a = np.memmap(path, dtype=np.float64, mode="r+", shape=(len(FIELDS),))
        else:
            self.a = np.zeros(len(FIELDS), dtype=np.float64)
        self.pending = [0.0] * len(FIELDS)

    def add(self, key: str, v: float) -> None:
        self.pending[self.i[key]] += v

    def flush(self) -> None:
        self.a += self.pending
        self.pending = [0.0] * len(self.pending)

    def max(self, key: str, v: float) -> None:
        j = self.i[key]
        if v > self.a[j]:
            self.a[j] = v


class TandemScheduler(Scheduler):
    """See the module docstring."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        lifecycle.die_with_parent()  # this engine core dies with the service, however the service dies
        # installed here, when the engine core builds its scheduler at start (never at import): the engine core's
        # utilities for batched chunk submissions (submit.py) and for the chunks' returns (returns.py)
        submit.install()
        returns.install()
        extra = getattr(self.vllm_config, "additional_config", None) or {}
        self.tandem_counters = Counters(extra.get("tandem_stats"))
        self._t_step = None
        self._cpu_step = 0.0
        self._bin = 0
        self._rows = 0
        # requests whose chunks are emitted once, at their end -> whether to the chunk returns (returns.py)
        self._hold: dict[str, bool] = {}
        self._held: dict[str, tuple[float, list]] = {}  # request -> (time of its chunk's first token, outputs)
        self._parked: dict[str, object] = {}  # paused tandem sessions, outside the waiting queue (see below)
        self._park = os.environ.get("TANDEM_VLLM_PARK", "1") != "0"
        self.tandem_returns = None  # the chunk returns' socket, once the frontend opens it (returns.py)

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
            ctx = sum(reqs[r].num_computed_tokens for r in out.num_scheduled_tokens if r in reqs)
            k.add("context_tokens", ctx)
            self._bin, self._rows = sum(ctx >= b * rows for b in CONTEXT_BINS), rows
            k.add("scheduled_rows_sum", rows)
            k.max("max_scheduled_rows", rows)
            if out.preempted_req_ids:
                k.add("preemptions", len(out.preempted_req_ids))
        return out

    def update_from_output(self, scheduler_output, model_runner_output):
        c = time.thread_time()
        out = super().update_from_output(scheduler_output, model_runner_output)
        ret = self._hold_back(out) if self._hold else None
        k = self.tandem_counters
        cpu = self._cpu_step + time.thread_time() - c
        k.add("sched_cpu_seconds", cpu)
        self._cpu_step = 0.0
        if self._t_step is not None:
            k.add(f"sched_cpu_ctx{self._bin}", cpu)
            k.add(f"steps_ctx{self._bin}", 1)
            k.add(f"rows_ctx{self._bin}", self._rows)
            dt = time.perf_counter() - self._t_step
            k.add("busy_seconds", dt)
            # rows in this step's batch x its duration: the time rows spent in a batch of this engine, which the
            # service sets against the rows' lifetimes (`idle_row_step_fraction`)
            k.add("row_seconds", dt * len(scheduler_output.num_scheduled_tokens))
            self._t_step = None
        k.flush()
        if ret:  # after the counters: the service reads them once a rollout's last chunk has come back
            c = time.thread_time()
            self.tandem_returns.send(ret)
            k.add("sched_cpu_seconds", time.thread_time() - c)  # the busy loop's too: written with the next step
        return out

    def _hold_back(self, out: dict) -> list:
        """Take the held requests' outputs out of this step's `EngineCoreOutputs`; one merged output per chunk
        that stopped goes back in, or to the chunk returns when they are open (all of this step's in one
        message: the records returned, sent by the caller). Messages left with nothing to say are not sent."""
        hold, held, k = self._hold, self._held, self.tandem_counters
        rt, ret = self.tandem_returns, []
        now = time.perf_counter()
        n_held = n_sent = 0
        for client in list(out):
            eco = out[client]
            keep = []
            for o in eco.outputs:
                rid = o.request_id
                if rid not in hold:
                    keep.append(o)
                    continue
                part = held.get(rid)
                if o.finish_reason is None:
                    if part is None:
                        part = held[rid] = (now, [])
                    part[1].append(o)
                    n_held += 1
                    continue
                if part is not None:
                    del held[rid]
                    o = merge_outputs(part[1] + [o])
                t_first = part[0] if part else now
                req = self.requests.get(rid)
                if rt is not None and hold[rid]:
                    rule = getattr(req, "_tandem_rule", None) if o.stop_reason == STOP_SWITCH else None
                    ret.append(rt.record(o, t_first, now, None if rule is None else rule[1].state.state()))
                else:
                    o.events = [EngineCoreEvent(EngineCoreEventType.SCHEDULED, t_first),
                                EngineCoreEvent(EngineCoreEventType.SCHEDULED, now)]
                    keep.append(o)
                n_sent += 1
                if req is None or req.is_finished():  # not resumable any more: nothing further to hold
                    hold.pop(rid, None)
            eco.outputs = keep
            if not keep and says_nothing(eco):
                del out[client]
        if n_held:  # once per step, not per output: the counters are on the engine core's hot path
            k.add("held_outputs", n_held)
        if n_sent:
            k.add("sent_outputs", n_sent)
        return ret

    def finish_requests(self, request_ids, finished_status):
        done = super().finish_requests(request_ids, finished_status)
        for req in done:  # aborted (a closed session, a cancelled row): its held tokens go nowhere
            self._hold.pop(req.request_id, None)
            self._held.pop(req.request_id, None)
            self._parked.pop(req.request_id, None)
        return done

    def add_request(self, request):
        c = time.thread_time()
        parked = self._parked.pop(request.request_id, None) if self._park else None
        super().add_request(request)
        if parked is not None:
            if parked.status == RequestStatus.WAITING:  # this chunk resumed it: queued as vLLM queues a request
                super()._enqueue_waiting_request(parked)
            elif parked.status == RequestStatus.WAITING_FOR_STREAMING_REQ:
                self._parked[parked.request_id] = parked
        sp = request.sampling_params
        if request.resumable and tandem_args(sp) is not None:
            self.tandem_counters.add("chunks", 1)  # a session's chunk (its closing request is not resumable)
        # written with the next step's counters: every chunk is scheduled, so its step follows (only a streaming
        # session's closing request, counted in no chunk, may fall to the next rollout's figures)
        self.tandem_counters.add("add_cpu_seconds", time.thread_time() - c)

    # -- parked sessions out of the waiting queue -------------------------------------------------------
    # vLLM 0.32 keeps a paused streaming session (WAITING_FOR_STREAMING_REQ) in its waiting queue, and every
    # step's scheduling loop peeks, skips and re-queues each one: O(parked sessions) per step, and in a tandem
    # rollout about half of all rows are parked on each engine (waiting for the partner). A tandem session is
    # parked in `_parked` instead and queued again when its next chunk resumes it; the counts vLLM derives
    # from its queues include the parked sessions as before. TANDEM_VLLM_PARK=0 leaves vLLM's queueing alone.
    def _enqueue_waiting_request(self, request):
        if self._park and request.status == RequestStatus.WAITING_FOR_STREAMING_REQ \
                and tandem_args(request.sampling_params) is not None:
            self._parked[request.request_id] = request
            return
        super()._enqueue_waiting_request(request)

    def get_request_counts(self):
        running, waiting = super().get_request_counts()
        return running, waiting + len(self._parked)

    def get_num_unfinished_requests(self):
        n = super().get_num_unfinished_requests()
        if getattr(getattr(self, "_pause_state", None), "name", "") == "PAUSED_NEW":
            n += len(self._parked)  # that count reads the KV-holding queue alone, where they would be
        return n

    # -- the stop rule -----------------------------------------------------------------------------
    def _update_request_with_output(self, request, new_token_ids, is_stale=False):
        # once per scheduled row and step: the chunk's rule is cached on the request with the sampling
        # parameters it was built from (a new chunk brings new ones), so a decode step costs one getattr
        sp = request.sampling_params
        rule = getattr(request, "_tandem_rule", None)
        if rule is None or rule[0] is not sp:
            args = tandem_args(sp)
            if args is None:
                return super()._update_request_with_output(request, new_token_ids, is_stale)
            rule = request._tandem_rule = (sp, ChunkRule(args, load_tables(args["tables"])))
            request.stop_reason = None  # the last chunk's "tandem_switch" must not label this chunk's EOS
            if args.get("hold"):
                self._hold[request.request_id] = args["hold"] == "returns"
        # wall clock, not thread CPU: a call is a few microseconds (a preemption inside one is rare), and
        # time.thread_time is a system call of ~1 us, twice per row and step
        c = time.perf_counter()
        step = rule[1].step
        pend = self.tandem_counters.pending
        update = super()._update_request_with_output
        stopped = False
        kept: list = []
        n = ruled = 0
        # vLLM's own update, one token at a time (one per step without speculative decoding, which the service
        # never enables), then the switch rule on the token it kept: vLLM's stop conditions and bookkeeping stay
        # vLLM's, and the rule only adds a stop after them
        for tok in list(new_token_ids):
            got, stopped = update(request, [tok], is_stale)
            kept += got
            n += len(got)
            if stopped:
                break
            if got:
                why = step(int(got[-1]), request.num_output_tokens - 1)
                ruled += 1
                if why is not None:
                    stopped = True
                    if why == "length":
                        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
                        pend[_I["length_stops"]] += 1
                    else:
                        request.status = RequestStatus.FINISHED_STOPPED
                        request.stop_reason = why
                        pend[_I["switch_stops" if why == STOP_SWITCH else "rounds_stops"]] += 1
                    break
        new_token_ids[:] = kept
        pend[_I_GEN] += n
        pend[_I_RULED] += ruled
        pend[_I_RULE_CPU] += time.perf_counter() - c
        return new_token_ids, stopped


# Fields of a step's `EngineCoreOutputs` that every message carries; any other field away from its default is
# something the frontend must hear (finished requests, stats, a utility's answer, a wave, a weight version, ...).
ALWAYS_SET = frozenset({"engine_index", "outputs", "timestamp"})


def says_nothing(eco) -> bool:
    """Whether a step's outputs message (a msgspec struct), its outputs taken out, has nothing left to say: every
    field but `ALWAYS_SET` at its default. Read off the struct's own fields, so a field a vLLM version adds is
    kept rather than dropped."""
    if eco.outputs:
        return False
    cls = type(eco)
    names = cls.__struct_fields__
    defaults = cls.__struct_defaults__
    for name, default in zip(names[len(names) - len(defaults):], defaults):
        if name in ALWAYS_SET:
            continue
        factory = getattr(default, "factory", None)
        if getattr(eco, name) != (factory() if callable(factory) else default):
            return False
    # a field without a default is always meaningful
    return all(n in ALWAYS_SET for n in names[:len(names) - len(defaults)])


def merge_outputs(parts: list) -> object:
    """One `EngineCoreOutput` for a chunk's per-step outputs (in order): their tokens, their sampled log-prob
    rows concatenated (None unless every part that carries tokens has them: the frontend then refuses the
    chunk), the last part's finish and stop reasons and other fields."""
    import numpy as np

    last = parts[-1]
    if len(parts) == 1:
        return last
    with_tokens = [o for o in parts if o.new_token_ids]
    lps = [o.new_logprobs for o in with_tokens]
    last.new_token_ids = [t for o in with_tokens for t in o.new_token_ids]
    if lps and all(lp is not None for lp in lps):
        last.new_logprobs = LogprobsLists(np.concatenate([lp.logprob_token_ids for lp in lps]),
                                          np.concatenate([lp.logprobs for lp in lps]),
                                          np.concatenate([lp.sampled_token_ranks for lp in lps]), None)
    else:
        last.new_logprobs = None
    return last
