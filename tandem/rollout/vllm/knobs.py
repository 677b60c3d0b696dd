"""`EngineKnobs`: how the rollout service sizes and runs its two vLLM engines, declared once for both sides.

The pipeline (`client.LaunchOptions`, no vLLM there) turns the knobs into the service's command-line flags; the
service (`service.main`, in vLLM's environment) parses the same flags back into the same dataclass and starts
its engines from it (`service.EngineSpec`). One field is one flag, `--<name with dashes>` (booleans as
`--name` / `--no-name`), so a knob added here reaches the engines without touching either side's plumbing.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

HELP = {
    "dtype": "engine precision (auto: vLLM's, but float32 for a float32 checkpoint; see service.resolve_dtype)",
    "max_model_len": "context length of both engines (0 = the model's)",
    "gpu_memory": "GPU memory share per engine (two engines share a GPU)",
    "enforce_eager": "eager mode (--no-enforce-eager lets vLLM compile and capture CUDA graphs)",
    "kv_blocks": "KV-cache blocks per engine (0 = vLLM's sizing)",
    "max_num_seqs": "rows each engine batches at most",
    "block_size": "KV block size (0 = 32 on the CPU build, else vLLM's)",
    "max_num_batched_tokens": "tokens each engine computes per step at most (0 = vLLM's); a longer prefill is split",
}


@dataclass(frozen=True)
class EngineKnobs:
    """The engines' precision, context length, memory and batching (see HELP for each field)."""

    dtype: str = "auto"
    max_model_len: int = 0
    gpu_memory: float = 0.35
    enforce_eager: bool = True
    kv_blocks: int = 0
    max_num_seqs: int = 256
    block_size: int = 0
    max_num_batched_tokens: int = 0

    def __post_init__(self):
        if not 0.0 < self.gpu_memory <= 1.0:
            raise ValueError(f"gpu_memory is a share of one GPU's memory per engine, in (0, 1]: got {self.gpu_memory}")
        for name in ("max_model_len", "kv_blocks", "block_size", "max_num_batched_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: vLLM's choice), got {getattr(self, name)}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")

    def to_argv(self) -> list[str]:
        """The service's flags for these knobs (every field, so the service never falls back on a default)."""
        argv: list[str] = []
        for f in fields(self):
            v, flag = getattr(self, f.name), "--" + f.name.replace("_", "-")
            argv += [flag if v else "--no-" + flag[2:]] if isinstance(v, bool) else [flag, str(v)]
        return argv

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Declare one flag per field on the service's parser, with the field's type and default."""
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            if isinstance(f.default, bool):
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=HELP[f.name])
            else:
                parser.add_argument(flag, type=type(f.default), default=f.default, help=HELP[f.name])

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> "EngineKnobs":
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls)})
