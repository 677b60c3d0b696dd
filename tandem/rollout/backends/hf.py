"""The `hf` backend: catch-up tandem decoding over transformers models in this process.

Each round, for each model, the active rows it authors are caught up (every token the partner wrote since the
model last ran, plus its own last token) and sampled in one forward of the hand-written KV-cache kernel
(`tandem.rollout.kernel.FastDecoder`); a model authoring no row this round does not run at all. Models the
kernel does not support fall back to the lockstep algorithm through their own forward (`lockstep.py`); the
tests check token identity with that reference.
"""

from __future__ import annotations

from typing import Any

import torch

from tandem.rollout.kernel import COMPACT_AT, FastDecoder, self_check, unsupported_reason
from tandem.threads import torch_threads


def catch_up_generate(pair: Any, request: Any, device: torch.device | str | None = None):
    """One batch of tandem rollouts with catch-up prefill: `request` (a `RolloutRequest`) over `pair` (a
    `ModelPair`), models already in eval mode, under no_grad; `device` None = the senior's.

    Each round: for each model, the active rows it authors are caught up and sampled in one forward; a model
    authoring no row this round does not run at all.
    """
    from tandem.rollout.core import run_rounds, sample_rows, start_rounds

    B, sampling, seed = len(request), request.sampling, request.seed
    eos = request.eos(pair.eos_ids)
    r = start_rounds(pair, request, device, FastDecoder)
    dev, rows_B, decoders = r.device, r.rows_B, r.steppers

    def propose(t, slot, active_B, author_B, hist):
        tok_B = torch.zeros(B, dtype=torch.int64, device=dev)
        lp_B = torch.zeros(B, dtype=torch.float64, device=dev)
        n_active = int(active_B.sum())
        for m, dec in decoders.items():
            mine_B = active_B & (author_B if m == 1 else ~author_B)
            rows_R = mine_B.nonzero().flatten()
            if rows_R.numel() == 0:
                continue
            # Drop finished rows from this model's cache: at once when it authors every active row (then the
            # round runs on cache views, no gathers), else once a quarter of its rows are finished.
            if n_active < dec.n_phys and (rows_R.numel() == n_active or n_active <= COMPACT_AT * dec.n_phys):
                dec.compact(active_B)
            logits_RV = dec.catch_up(hist, rows_R, slot).to(dev)
            ids_R, lp_R = sample_rows(logits_RV, sampling, seed, rows_B[rows_R], t)
            tok_B[rows_R] = ids_R
            lp_B[rows_R] = lp_R.to(torch.float64)
        return tok_B, lp_B

    try:
        return run_rounds(r.hist_BS, r.p_max, r.sched, sampling, eos, propose, progress=request.progress)
    finally:
        r.release()


class HFBackend:
    """The `hf` backend: transformers modules in this process, the catch-up kernel (or the lockstep fallback).

    `pair`: a `tandem.rollout.request.ModelPair`; `options`: an `HFOptions`. `fast`: None picks the catch-up
    kernel when the architecture supports it and otherwise falls back, with a warning, to the lockstep
    algorithm through the models' own forward (same distribution, about twice the cost); True requires the
    kernel; False forces the fallback. `cpu_threads` sets torch's intra-op threads during `generate` (restored
    after). Models are put in eval mode under `torch.no_grad()` while generating and their modes are restored
    after.
    """

    name = "hf"

    def __init__(self, pair: Any, options: Any = None):
        import warnings

        from tandem.rollout.request import HFOptions

        options = options if options is not None else HFOptions()
        self.pair = pair
        senior, junior, fast = pair.senior, pair.junior, options.fast
        self.device = torch.device(options.device) if options.device is not None else None
        self.cpu_threads = options.cpu_threads or None
        self.fast = False
        reasons = [r for r in (unsupported_reason(senior), junior is not None and unsupported_reason(junior)) if r]
        if fast is None or fast:
            if reasons:
                if fast:
                    raise ValueError(f"catch-up kernel unavailable: {'; '.join(reasons)}")
                warnings.warn(f"hf backend: catch-up kernel unavailable ({'; '.join(reasons)}); falling back "
                              f"to lockstep decoding through the models' own forward (same distribution, "
                              f"about 2x slower)", stacklevel=3)
            else:
                for m in {id(senior): senior, id(junior): junior}.values():
                    if m is not None:
                        self_check(m)
                self.fast = True

    def generate(self, request: Any):
        import time

        from tandem.rollout.core import RolloutBatch

        if len(request) == 0:
            return RolloutBatch([], [], [], [], [])
        models = [m for m in (self.pair.senior, self.pair.junior) if isinstance(m, torch.nn.Module)]
        modes = [m.training for m in models]
        t0 = time.perf_counter()
        parts = []
        try:
            for m in models:
                m.eval()
            with torch_threads(self.cpu_threads or 0), torch.no_grad():
                for g in request.groups():
                    parts.append((g, self._run(request.subset(g))))
        finally:
            for m, mode in zip(models, modes):
                m.train(mode)
        out = RolloutBatch.scatter(len(request), parts)
        out.timings = {"seconds": time.perf_counter() - t0}
        return out

    def _run(self, req: Any):
        if self.fast:
            return catch_up_generate(self.pair, req, self.device)
        from tandem.rollout.lockstep import lockstep_generate

        return lockstep_generate(self.pair, req, forward="hf", device=self.device)
