"""The engine core's scheduler step in isolation: CPU per step against the history and the vocabulary size.

What it runs: two real vLLM schedulers of the project's class (`sched.TandemScheduler`: senior and junior,
prefix caching on, the service's block size) in one process, driven step by step as the two engine cores of a
tandem rollout are, with the model replaced by a token stream: each step both schedulers `schedule()`, every
scheduled row "samples" its next token of the stream (the senior with a log-prob row, as the service asks),
both `update_from_output()`, and each chunk the stop rule ends resumes the row's session on the partner's
engine with exactly the tokens that session has not seen (what `turns.run_row` sends through
`service.DirectSession`, here one step later: the frontend's reaction). The schedule is the word schedule at
p = 0.5 on (seed, row), so chunks, switches and handoffs are a real tandem rollout's; the streams draw word
starts with the share of English text (0.6 of tokens). The harness raises if a chunk stops where the row's
`RowSchedule` does not switch, or a row does not end at its budget.

Four rollouts step in turn, so that the machine's drift falls on all alike: Qwen3's table size (151,936) and a
small one (334), each after a short and a long history (prompts of 16 and 2,500 tokens by default), the same
word-start pattern and so the same schedule token by token in all four (`schedules_equal`). Measured: each
scheduler's thread CPU per step (schedule + update_from_output, the figure the service reports as
`sched_cpu_us_per_step`) and per scheduled row, from the step after every session has opened (each opening
prefills the whole history) until the first row ends, plus the chunk adds (`add_request`) per chunk; best of
`repeats`. Nothing else shares the process (no workers, no frontend, no second service), so a growth here is
the scheduler's own.

A solo reference takes its turns too (`SoloRollout`, one per history): the same scheduler class with plain
requests (vLLM's own per-token path, no chunks), half the rows (a tandem engine schedules about half of them per
step), decoding the Qwen3 case's streams to the budget.

`measure()` returns one flat dict: per case and engine the CPU per step and per row, their ratios
(`<vocab>_long_over_short_<role>_<step|row>`, target within 10%), the vocabulary ratios
(`qwen3_over_small_<history>_<role>_<step|row>`) and the CPU per scheduled row over solo's
(`qwen3_<history>_<role>_over_solo_row`: what the chunks themselves cost, per row).

Run in vLLM's environment: `.venv-vllm/bin/python benchmarks/sched_step.py [--rows 32] [--tokens 500] [--history
16 2500] [--repeats 3] [--block-size 32]`; prints one JSON line. `tandem bench rollout --backend vllm --vocab
qwen3` runs it beside the service (`isolated_*`).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the library, from this checkout

WORD_SHARE_V = 53021 / 151936  # word starts among Qwen3's ids (the tables)
WORD_SHARE_TEXT = 0.6  # word starts among the tokens of English text


def _tables(V: int, seed: int, root: str) -> tuple[str, list[int], list[int]]:
    """A tables file in `root` (word-start row, then four empty rows, as the service writes them) and the
    word-start and other ids."""
    rng = random.Random(seed)
    word = bytes(int(rng.random() < WORD_SHARE_V) for _ in range(V))
    path = str(Path(root, f"tables-{V}"))
    Path(path).write_bytes(word + bytes(4 * V))
    starts = [i for i in range(2, V) if word[i]]
    others = [i for i in range(2, V) if not word[i]]
    return path, starts, others


def _streams(rows: int, n: int, prompt: int, seed: int) -> list[list[bool]]:
    """Per row the word-start pattern of its prompt and completion (the same in both vocabularies)."""
    rng = random.Random(seed)
    return [[rng.random() < WORD_SHARE_TEXT for _ in range(prompt + n)] for _ in range(rows)]


def _scheduler(model_dir: str, rows: int, max_len: int, block: int):
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    import torch

    from tandem.rollout.vllm.sched import TandemScheduler

    mc = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=max_len)
    sc = SchedulerConfig(max_num_seqs=max(rows, 8), max_num_batched_tokens=max(2048, 64 * rows),
                         max_model_len=max_len, is_encoder_decoder=False)
    cc = CacheConfig(block_size=block, enable_prefix_caching=True)
    vc = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc)
    blocks = rows * (-(-max_len // block) + 2) + 16
    cc.num_gpu_blocks = blocks
    kv = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["layer"], FullAttentionSpec(
                           block_size=block, num_kv_heads=2, head_size=32, dtype=torch.float32))])
    return TandemScheduler(vllm_config=vc, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(vc),
                           block_size=block, log_stats=False)


def _row_of(request_id: str) -> int:
    """The row of a harness request id (`r<row>-<role>`)."""
    return int(request_id[1:].split("-")[0])


def _runner_output(s, ids: list[str], tokens: list[list[int]], logprobs: bool):
    """What the model runner would return for the scheduled requests `ids` of scheduler `s`: per request the
    next token of its row's stream (nothing for a prefill that ends inside the prompt), and with `logprobs` a
    log-prob row per sampled token (the senior's sampling parameters)."""
    import numpy as np
    from vllm.v1.outputs import LogprobsLists, ModelRunnerOutput

    sampled = []
    for rid in ids:
        req = s.requests[rid]
        sampled.append([] if req.num_computed_tokens < req.num_tokens else [tokens[_row_of(rid)][req.num_tokens]])
    n = sum(map(len, sampled))
    lps = None
    if logprobs and n:
        lps = LogprobsLists(np.zeros((n, 1), dtype=np.int64), np.full((n, 1), -1.0, dtype=np.float32),
                            np.zeros(n, dtype=np.int64), None)
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=sampled, logprobs=lps)


class Rollout:
    """One tandem rollout over two schedulers, stepped in lock-step; see the module docstring."""

    roles = ((1, "senior"), (0, "junior"))  # (role, name) of each engine measured

    def __init__(self, model_dir: str, V: int, tables: tuple[str, list[int], list[int]], pattern: list[list[bool]],
                 prompt: int, budget: int, seed: int, block: int):
        from vllm.utils.hashing import sha256_cbor
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        from tandem.rollout.schedule import RowSchedule, ScheduleSpec
        from tandem.rollout.vllm.sched import load_tables

        init_none_hash(sha256_cbor)
        self.hasher = get_request_block_hasher(block, sha256_cbor)
        self.path, starts, others = tables
        rng = random.Random(seed + V)
        # the tokens: the same word-start pattern in both vocabularies, ids drawn from the matching class
        self.tokens = [[rng.choice(starts) if w else rng.choice(others) for w in row] for row in pattern]
        self.prompt, self.budget, self.seed = prompt, budget, seed
        self.scheds = {r: _scheduler(model_dir, len(pattern), prompt + budget + 64, block) for r in (0, 1)}
        tb = load_tables(self.path)
        self.state = [RowSchedule(ScheduleSpec("word", 0.5, 32, 150), tb, seed, b) for b in range(len(pattern))]
        self.comp = [0] * len(pattern)  # completion tokens decided per row
        self.owner: list[list[int]] = [[] for _ in pattern]  # the author of each completion token
        self.seen = [{0: 0, 1: 0} for _ in pattern]  # history tokens each session holds
        self.opened = [set() for _ in pattern]
        self.unopened = 2 * len(pattern)  # sessions not opened yet: steps before all are open carry prefills
        self.pending: list[tuple[int, int]] = []  # (row, role) chunks to send before the next step
        self.log: list[tuple] = []  # per measured step: role, thread CPU, rows
        self.warm = self._prefilled = False
        self.add_cpu = {0: 0.0, 1: 0.0}
        self.chunks = {0: 0, 1: 0}
        self.done = 0
        self.parked_max = self.queued_parked_max = 0
        for b in range(len(pattern)):
            self.pending.append((b, self.state[b].author))

    def _send(self, b: int, role: int) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        from tandem.rollout.vllm.turns import chunk_args, session_seed

        toks = self.tokens[b][self.seen[b][role]:self.prompt + self.comp[b]]  # what the row's session there lacks
        t0 = self.comp[b]
        a = {**chunk_args(self.state[b], role, t0, self.budget, self.path), "hold": True}
        sp = SamplingParams(temperature=1.0, seed=session_seed(self.seed, b, role), max_tokens=max(1, self.budget - t0),
                            logprobs=0 if role == 1 else None, extra_args={"tandem": a}, detokenize=False)
        req = Request(f"r{b}-{role}", list(toks), sp, None, block_hasher=self.hasher, resumable=True)
        s = self.scheds[role]
        if role not in self.opened[b]:
            self.opened[b].add(role)
            self.unopened -= 1
        c = time.thread_time()
        s.add_request(req)
        self.add_cpu[role] += time.thread_time() - c
        self.chunks[role] += 1

    def step(self) -> None:
        for b, role in self.pending:
            self._send(b, role)
        self.pending = []
        # measured from the step after every session has opened (each opening prefills the whole history) until the
        # first row ends (the rows' ends are staggered: a tail of thinner steps)
        self.warm = self.unopened == 0 and self._prefilled and self.done == 0
        self._prefilled = self.unopened == 0
        outs = {}
        for role, s in self.scheds.items():
            c = time.thread_time()
            so = s.schedule()
            cpu = time.thread_time() - c
            ids = list(so.num_scheduled_tokens)
            mro = _runner_output(s, ids, self.tokens, role == 1)
            outs[role] = (so, mro, cpu, len(ids))
        for role, (so, mro, cpu, rows) in outs.items():
            s = self.scheds[role]
            c = time.thread_time()
            eco = s.update_from_output(so, mro)
            cpu += time.thread_time() - c
            if rows and self.warm:
                self.log.append((role, cpu, rows))
            for client_out in eco.values():
                for o in client_out.outputs:
                    if o.finish_reason is not None:
                        self._chunk_done(o, role)
            self._count_parked(s)

    def _count_parked(self, s) -> None:
        """Paused sessions, and how many of them sit in vLLM's waiting queues (none: `sched`'s parking)."""
        from vllm.v1.request import RequestStatus

        paused = RequestStatus.WAITING_FOR_STREAMING_REQ
        queued = sum(r.status == paused for q in (s.waiting, s.kv_holding_waiting) for r in q)
        self.parked_max = max(self.parked_max, s.num_waiting_for_streaming_input)
        self.queued_parked_max = max(self.queued_parked_max, queued)

    def _chunk_done(self, o, role: int) -> None:
        from vllm.v1.request import RequestStatus

        from tandem.rollout.vllm.turns import STOP_SWITCH

        b = _row_of(o.request_id)
        toks = o.new_token_ids
        st = self.state[b]
        t0 = self.comp[b]
        for i, tok in enumerate(toks):
            st.advance(int(tok), t0 + i)
        self.comp[b] += len(toks)
        self.owner[b] += [role] * len(toks)
        self.seen[b][role] = self.prompt + self.comp[b] - 1
        if self.comp[b] < self.budget and (o.stop_reason == STOP_SWITCH) != (st.author != role):
            raise RuntimeError(f"row {b}: the scheduler stopped a chunk for {o.stop_reason!r} at {self.comp[b]}, "
                               f"the schedule's author there is {st.author}")
        if o.stop_reason == STOP_SWITCH and self.comp[b] < self.budget:
            self.pending.append((b, st.author))
        else:  # the row's end: close both sessions
            self.done += 1
            for r, s in self.scheds.items():
                if f"r{b}-{r}" in s.requests:
                    s.finish_requests(f"r{b}-{r}", RequestStatus.FINISHED_ABORTED)

    def finished(self) -> bool:
        return self.done >= len(self.tokens)

    def check(self) -> None:
        n = len(self.tokens)
        if self.comp != [self.budget] * n:
            raise RuntimeError(f"rows ended at {sorted(set(self.comp))} tokens, not the budget {self.budget}")


class SoloRollout:
    """The solo reference on the same scheduler class: each row one plain request (no tandem arguments, so
    vLLM's own per-token path), decoding its completion of the same token stream to the budget on one engine
    with a log-prob row per token (the senior's sampling parameters). Measured over its decode steps, until
    the rows end."""

    roles = ((1, "solo"),)  # (role, name) of each engine measured: the senior's engine alone

    def __init__(self, model_dir: str, tokens: list[list[int]], prompt: int, budget: int, seed: int, block: int):
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256_cbor
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        init_none_hash(sha256_cbor)
        hasher = get_request_block_hasher(block, sha256_cbor)
        self.tokens, self.prompt, self.budget = tokens, prompt, budget
        self.sched = _scheduler(model_dir, len(tokens), prompt + budget + 64, block)
        for b, row in enumerate(tokens):
            sp = SamplingParams(temperature=1.0, seed=seed + b, max_tokens=budget, logprobs=0, ignore_eos=True,
                                detokenize=False)
            self.sched.add_request(Request(f"r{b}-1", list(row[:prompt]), sp, None, block_hasher=hasher))
        self.log: list[tuple] = []
        self.comp = [0] * len(tokens)
        self.add_cpu, self.chunks = {1: 0.0}, {1: 0}  # no chunks: every row is one request

    def step(self) -> None:
        s = self.sched
        c = time.thread_time()
        so = s.schedule()
        cpu = time.thread_time() - c
        ids = list(so.num_scheduled_tokens)
        mro = _runner_output(s, ids, self.tokens, True)
        c = time.thread_time()
        eco = s.update_from_output(so, mro)
        cpu += time.thread_time() - c
        ended = False
        for client_out in eco.values():
            for o in client_out.outputs:
                self.comp[_row_of(o.request_id)] += len(o.new_token_ids)
                ended = ended or o.finish_reason is not None
        # decode steps only (the prefill of a long history takes several steps at the token budget)
        if ids and so.total_num_scheduled_tokens == len(ids) and not ended and min(self.comp) < self.budget:
            self.log.append((1, cpu, len(ids)))

    def finished(self) -> bool:
        return not self.sched.requests

    def check(self) -> None:
        if self.comp != [self.budget] * len(self.tokens):
            raise RuntimeError(f"solo rows ended at {sorted(set(self.comp))} tokens, not the budget {self.budget}")


def _model_dir(root: str, V: int) -> str:
    """A config-only model directory of the tiny Qwen3 body with V output rows (the scheduler reads no weights)."""
    cfg = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 128, "intermediate_size": 256,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
           "vocab_size": V, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 10000,
           "tie_word_embeddings": True, "torch_dtype": "float32", "bos_token_id": 0, "eos_token_id": 1}
    d = Path(root, f"v{V}")
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def _measure(ro: "Rollout | SoloRollout") -> dict:
    out = {}
    for role, name in ro.roles:
        sel = [(cpu, rows) for r, cpu, rows in ro.log if r == role]
        cpu = sum(c for c, _ in sel)
        out[name] = {"us_per_step": 1e6 * cpu / max(len(sel), 1),
                     "us_per_row": 1e6 * cpu / max(sum(r for _, r in sel), 1),
                     "rows_per_step": sum(r for _, r in sel) / max(len(sel), 1), "steps": len(sel),
                     "add_us_per_chunk": 1e6 * ro.add_cpu[role] / max(ro.chunks[role], 1)}
    return out


def measure(rows: int = 32, tokens: int = 500, history: tuple[int, int] = (16, 2500),
            vocab: tuple[int, int] = (151936, 334), repeats: int = 3, seed: int = 0, block_size: int = 32) -> dict:
    """Run the four interleaved rollouts `repeats` times; the figures described in the module docstring."""
    if rows < 1 or tokens < 2 or repeats < 1 or min(history) < 1 or history[0] >= history[1]:
        raise ValueError(f"the isolated step needs rows >= 1, tokens >= 2, repeats >= 1 and 1 <= short < long history "
                         f"(got rows={rows}, tokens={tokens}, repeats={repeats}, history={tuple(history)})")
    root = tempfile.mkdtemp(prefix="tandem-sched-step-")
    tables = {V: _tables(V, V, root) for V in vocab}
    rng = random.Random(seed)
    completion = _streams(rows, tokens + 8, 0, seed)
    prompts = {H: [[rng.random() < WORD_SHARE_TEXT for _ in range(H)] for _ in range(rows)] for H in history}
    cases = [(V, H) for V in vocab for H in history]
    best: dict = {}
    owners: dict = {}
    chunks: dict = {}
    parked = [0, 0]  # most paused sessions on one engine at once; most of them in vLLM's waiting queues
    try:
        dirs = {V: _model_dir(root, V) for V in vocab}
        for rep in range(repeats):
            ros = {c: Rollout(dirs[c[0]], c[0], tables[c[0]], [p + q for p, q in zip(prompts[c[1]], completion)],
                              c[1], tokens, seed, block_size) for c in cases}
            # the solo reference: the Qwen3-vocabulary rows' streams, half the rows (a tandem engine schedules
            # about half of them per step: per row the two are compared at about the same rows per step)
            solos = {("solo", H): SoloRollout(dirs[vocab[0]], ros[(vocab[0], H)].tokens[:max(1, rows // 2)], H, tokens,
                                              seed, block_size) for H in history}
            runs = {**ros, **solos}
            t = time.perf_counter()
            live = list(runs)
            while live:  # the rollouts step in turn
                for c in live:
                    runs[c].step()
                live = [c for c in live if not runs[c].finished()]
            for c in cases:
                ros[c].check()
                owners[c], chunks[c] = ros[c].owner, ros[c].chunks
                parked[0] = max(parked[0], ros[c].parked_max)
                parked[1] = max(parked[1], ros[c].queued_parked_max)
            for c in solos:
                solos[c].check()
            for c, ro in runs.items():
                for name, v in _measure(ro).items():
                    k = (c, name)
                    if v["steps"] and (k not in best or v["us_per_step"] < best[k]["us_per_step"]):
                        best[k] = v
            print(f"# repeat {rep}: {time.perf_counter() - t:.1f} s, "
                  f"{sum(ros[cases[0]].chunks.values())} chunks per rollout", file=sys.stderr)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    res = _figures(best, owners, chunks, cases, (rows, tokens, tuple(history), tuple(vocab), repeats, block_size))
    res["parked_max"], res["parked_in_waiting_queue_max"] = parked
    return res


def _figures(best: dict, owners: dict, chunks: dict, cases: list, run: tuple) -> dict:
    rows, tokens, history, vocab, repeats, block_size = run
    large, small = vocab
    short, long_ = history
    res: dict = {"rows": rows, "tokens": tokens, "history": list(history), "repeats": repeats,
                 "block_size": block_size,
                 # every case ran the same tandem schedule: the same authors token by token, the same chunks
                 "schedules_equal": all(owners[c] == owners[cases[0]] and chunks[c] == chunks[cases[0]] for c in cases),
                 "chunks_per_token": sum(chunks[cases[0]].values()) / (rows * tokens),
                 "senior_share": sum(map(sum, owners[cases[0]])) / (rows * tokens)}
    tag = {large: "qwen3", small: "small", short: "short", long_: "long"}
    for ((V, H), name), v in sorted(best.items(), key=str):
        if V == "solo":
            for k in ("us_per_step", "us_per_row", "rows_per_step"):
                res[f"solo_{tag[H]}_{k}"] = round(v[k], 2)
            continue
        for k in ("us_per_step", "us_per_row", "rows_per_step", "add_us_per_chunk"):
            res[f"{tag[V]}_{tag[H]}_{name}_{k}"] = round(v[k], 2)
    for H in history:  # the tandem engines' CPU per scheduled row over solo's, Qwen3's table (target: near 1)
        solo = best[(("solo", H), "solo")]["us_per_row"]
        for name in ("senior", "junior"):
            res[f"qwen3_{tag[H]}_{name}_over_solo_row"] = round(best[((large, H), name)]["us_per_row"] / solo, 3)
    for name in ("senior", "junior"):
        for w in ("step", "row"):
            for V in vocab:
                res[f"{tag[V]}_long_over_short_{name}_{w}"] = round(
                    best[((V, long_), name)][f"us_per_{w}"] / best[((V, short), name)][f"us_per_{w}"], 3)
            for H in history:
                res[f"qwen3_over_small_{tag[H]}_{name}_{w}"] = round(
                    best[((large, H), name)][f"us_per_{w}"] / best[((small, H), name)][f"us_per_{w}"], 3)
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=500, help="completion tokens per row")
    ap.add_argument("--history", type=int, nargs=2, default=[16, 2500], metavar=("SHORT", "LONG"),
                    help="tokens of history before the completion (prompts of these lengths)")
    ap.add_argument("--vocab", type=int, nargs=2, default=[151936, 334], metavar=("LARGE", "SMALL"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=32, help="KV block size (the service's on the CPU build: 32)")
    a = ap.parse_args(argv)
    print(json.dumps(measure(a.rows, a.tokens, tuple(a.history), tuple(a.vocab), a.repeats, a.seed, a.block_size)))


if __name__ == "__main__":
    main()
