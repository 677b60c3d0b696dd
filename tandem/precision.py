"""Training precision: which dtype each model is loaded in, and the flags trl's `GRPOConfig` needs.

`train.precision` names a recipe, not a dtype:

- `fp32`: the senior is trained in float32 (float64 when `model.dtype` is float64, as some tests use); no
  autocast. Slow on GPUs, exact everywhere.
- `bf16_mixed`: fp32 master weights (the senior is loaded in float32, and the optimizer updates float32
  values, so an lr of 1e-6 is not rounded away as it is on bf16 weights) with bf16 autocast of the forward and
  backward on CUDA. On a CPU there is no autocast: the run is plain fp32 (CPU bf16 kernels are slow and the
  recipe exists for GPUs).

The frozen copies (the junior and trl's KL reference) never receive updates, so they stay in `model.dtype`
(bf16 for a real model halves their memory). The reference must be loaded in the junior's dtype: trl builds it
from the senior's path with `model_init_kwargs`, and the train stage checks that it equals the base.
"""

from __future__ import annotations

from dataclasses import dataclass

PRECISIONS = ("fp32", "bf16_mixed")
# The optimizer every arm trains with (transformers' name, passed to GRPOConfig as `optim`): AdamW as one fused
# kernel over all parameters, which updates weights and moments in place with no temporary copy of the weights
# (the unfused "foreach" AdamW holds one). tandem/plan.py prices the optimizer step by this choice.
OPTIMIZER = "adamw_torch_fused"
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class PrecisionPlan:
    """What a precision recipe means on one device kind: load dtypes, autocast, and byte sizes."""

    name: str
    senior_dtype: str          # master weights (what the optimizer updates)
    frozen_dtype: str          # junior and KL reference
    autocast: str | None       # dtype of the autocast region, None = no autocast

    @property
    def master_bytes(self) -> int:
        return DTYPE_BYTES[self.senior_dtype]

    @property
    def frozen_bytes(self) -> int:
        return DTYPE_BYTES[self.frozen_dtype]

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of matmul inputs/outputs in the forward (the autocast dtype, else the master)."""
        return DTYPE_BYTES[self.autocast] if self.autocast else self.master_bytes


def precision_plan(precision: str, model_dtype: str, device: str) -> PrecisionPlan:
    """The recipe `precision` (fp32 | bf16_mixed) for weights stored as `model_dtype`, on `device` (cuda | cpu)."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose from {list(PRECISIONS)}")
    master = "float64" if model_dtype == "float64" else "float32"
    autocast = "bfloat16" if precision == "bf16_mixed" and device == "cuda" else None
    return PrecisionPlan(precision, master, model_dtype, autocast)


def trainer_precision_kwargs(train_cfg, device: str, model_dtype: str = "float32") -> dict:
    """Keyword arguments for trl's `GRPOConfig` that implement `train_cfg.precision` on `device`.

    `bf16` turns on accelerate's bf16 autocast (the senior's weights stay float32: fp32 master weights);
    `fp16` is never used; `model_init_kwargs` makes trl load its KL reference model in the junior's dtype
    (otherwise it copies the senior's float32). Pure: nothing is imported or allocated.
    """
    p = precision_plan(train_cfg.precision, model_dtype, device)
    return {"bf16": p.autocast == "bfloat16", "fp16": False,
            "model_init_kwargs": {"dtype": p.frozen_dtype}}


def load_dtypes(train_cfg, model_dtype: str, device: str) -> tuple[str, str]:
    """(senior dtype, junior dtype) to load the base in for training under `train_cfg.precision`."""
    p = precision_plan(train_cfg.precision, model_dtype, device)
    return p.senior_dtype, p.frozen_dtype
