"""The lockstep reference: both models decode every token of every row; the author's sample is kept.

This is the paper's implementation of a tandem rollout (about 2x the cost of a solo rollout) and the oracle
of the tests: with the same seed it must produce exactly the tokens of the catch-up engine, because both use
the same schedule state machine and the same (seed, row, position) noise.

Two forwards are available:
- `hf`  : each model is called through its own transformers forward with a `DynamicCache` over all rows
          (left padding, attention mask, position ids). Independent of `kernel.FastDecoder`, so the
          identity test also checks the hand-written forward. Works for any causal LM.
- `fast`: the same `FastDecoder` kernel as the engine, every row every round; the benchmark uses it so that
          lockstep and catch-up differ only in the algorithm, not in the kernel.
"""

from __future__ import annotations

from typing import Any

import torch

from tandem.rollout.core import RolloutBatch, run_rounds, sample_rows, start_rounds
from tandem.rollout.kernel import FastDecoder
from tandem.rollout.request import ModelPair, RolloutRequest


class HFStepper:
    """One model advanced through its own HF forward and a DynamicCache, all rows every call."""

    def __init__(self, model: Any):
        self.model = model

    def start(self, hist_BS: torch.Tensor, off_B: torch.Tensor, p_max: int) -> None:
        from transformers import DynamicCache

        self.device = next(self.model.parameters()).device
        self.off_B = off_B.to(self.device)
        self.key_ok_BS = (torch.arange(hist_BS.shape[1], device=self.device)[None, :] >= self.off_B[:, None])
        self.cache = DynamicCache(config=self.model.config)
        self.seen = 0

    def step(self, hist_BS: torch.Tensor, slot: int) -> torch.Tensor:
        """Encode slots [seen, slot) for every row; return logits at slot - 1 [B, V]."""
        ids = hist_BS[:, self.seen:slot].to(self.device)
        pos = (torch.arange(self.seen, slot, device=self.device)[None, :] - self.off_B[:, None]).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=self.key_ok_BS[:, :slot].to(torch.int64),
                         position_ids=pos, cache=self.cache, use_cache=True)
        self.seen = slot
        return out.logits[:, -1]

    def release(self) -> None:
        self.cache = None


class FastStepper:
    """`FastDecoder` used lockstep-style: every row, every round."""

    def __init__(self, model: Any):
        self.dec = FastDecoder(model)

    def start(self, hist_BS: torch.Tensor, off_B: torch.Tensor, p_max: int) -> None:
        self.dec.start(hist_BS, off_B, p_max)  # same prompt sharing as the engine: compare algorithms only
        self.rows = torch.arange(hist_BS.shape[0])

    def step(self, hist_BS: torch.Tensor, slot: int) -> torch.Tensor:
        return self.dec.catch_up(hist_BS, self.rows, slot)

    def release(self) -> None:
        self.dec.release()


def lockstep_generate(pair: ModelPair, request: RolloutRequest, forward: str = "hf",
                      device: torch.device | str | None = None) -> RolloutBatch:
    """Generate a batch the naive way (see the module docstring): `request` over `pair`, `device` None = the
    senior's. Models must already be in eval mode."""
    if forward not in ("hf", "fast"):
        raise ValueError(f"forward must be 'hf' or 'fast', got {forward!r}")
    sampling, seed = request.sampling, request.seed
    r = start_rounds(pair, request, device, HFStepper if forward == "hf" else FastStepper)
    dev, rows_B, models = r.device, r.rows_B, r.steppers

    def propose(t, slot, active_B, author_B, hist):
        logits = {m: st.step(hist, slot).to(dev) for m, st in models.items()}
        if len(logits) == 2:
            logits_BV = torch.where(author_B[:, None], logits[1], logits[0])
        else:
            logits_BV = next(iter(logits.values()))
        return sample_rows(logits_BV, sampling, seed, rows_B, t)

    with torch.no_grad():
        try:
            return run_rounds(r.hist_BS, r.p_max, r.sched, sampling, request.eos(pair.eos_ids), propose)
        finally:
            r.release()
