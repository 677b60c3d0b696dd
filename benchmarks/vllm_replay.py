"""`ReplayLogitsProcessor`: makes the engines emit predetermined text, so that the benchmark counts a rollout of
real text (real word starts, turns and handoffs) on a model that cannot write it (a random tiny body).

Loaded by the benchmark's service (`benchmarks/vllm_ab_service.py`) only in its replay mode (`--replay`:
`logits_processors` of both engines, vLLM's V1 logits-processor interface, the one the CPU build's runner uses).
A chunk whose `extra_args["tandem"]` names a replay file (`"replay"`, int32 rows x budget, written by the service
once per rollout) and its row (`"replay_row"`) gets, at each step, every logit but the row's next text token set to
-inf: position = the chunk's start `t0` + the tokens it has sampled. The text is forced, the engines still run
every step, the stop rule and the counters see real text; the sampled log-probs are 0 (a forced token).
"""

from __future__ import annotations

import numpy as np
import torch

from tandem.rollout.vllm.turns import tandem_args

try:
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
except ImportError:  # the pipeline's environment has no vLLM: the module imports, the class is never used there
    BatchUpdate, LogitsProcessor = None, object

_FILES: dict[str, np.ndarray] = {}


def replay_rows(path: str) -> np.ndarray:
    a = _FILES.get(path)
    if a is None:
        raw = np.fromfile(path, dtype=np.int32)
        rows, width = int(raw[0]), int(raw[1])
        a = raw[2:2 + rows * width].reshape(rows, width)
        _FILES.clear()  # one rollout at a time
        _FILES[path] = a
    return a


class ReplayLogitsProcessor(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.state: dict[int, tuple[np.ndarray, int, list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for i in batch_update.removed:
            self.state.pop(i, None)
        for i, params, _prompt, out in batch_update.added:
            args = tandem_args(params)
            if args and args.get("replay"):
                row = replay_rows(args["replay"])[int(args["replay_row"])]
                self.state[i] = (row, int(args["t0"]), out)
            else:
                self.state.pop(i, None)
        for a, b, kind in batch_update.moved:
            sa, sb = self.state.pop(a, None), self.state.pop(b, None)
            if sa is not None:
                self.state[b] = sa
            if sb is not None and kind.name == "SWAP":
                self.state[a] = sb

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.state:
            return logits
        idx, tok = [], []
        for i, (row, t0, out) in self.state.items():
            if i < logits.shape[0]:
                pos = t0 + len(out)
                if pos < len(row):
                    idx.append(i)
                    tok.append(int(row[pos]))
        if idx:
            rows = torch.tensor(idx, device=logits.device)
            keep = logits[rows, torch.tensor(tok, device=logits.device)].clone()
            logits[rows] = float("-inf")
            logits[rows, torch.tensor(tok, device=logits.device)] = keep
        return logits
