"""The memory plan of a params set: bytes per device for training (per arm) and evaluation, and whether it fits.

A pure model (no torch, no allocation): every figure is a formula over the model's shape and the params, with
the terms named in `breakdown`. Per device (GPU, or the whole CPU machine divided between processes):

peak = persistent + max(rollout phase, training phase)

- persistent: the senior's weights (the optimizer's master copy: float32 under `bf16_mixed`), the AdamW moments
  (two per weight, master dtype), the frozen junior (`model.dtype`), trl's KL reference for arms with a KL
  weight, and with the vLLM backend the two engines' reservations (`rollout.vllm_gpu_memory` of the GPU each);
  with `train.sharding: fsdp` the weights and moments are split over `train.num_processes`;
- rollout phase (hf backend): both models' KV caches for this process's rows, laid out as the hf backend lays
  them out (one prompt row per distinct prompt, one completion row per sample), plus one step's logits; under
  fsdp the senior is gathered whole for generation (as trl's unwrap for generation does);
- training phase: max(forward/backward, optimizer step). The forward/backward holds the activations autograd
  saves for one micro-batch (`activation_bytes_per_token`: read off transformers' Qwen3 decoder layer, every
  tensor it saves, in fp32 or under bf16 autocast; with gradient checkpointing only each layer's input plus
  one recomputed layer), the attention mask, the fused LM head's tiles (trl scores log-probs in tiles of at most
  4,096 tokens x 32,768 vocabulary entries, never the full `[tokens, vocab]` logits) and its float32 weight
  gradient, and the gradients of earlier micro-batches when an update has several. The optimizer step holds the
  gradients (twice under DDP) plus AdamW's temporaries: none on CUDA for the fused AdamW the trainer runs
  (`precision.OPTIMIZER`), and on a CPU two copies of the largest tensor (measured).

The shape comes from the model directory's config.json when it exists, else from the `model` section (tiny),
else from `KNOWN_SHAPES` for a hub id. `tests/test_plan.py` checks the training phase against the peak memory
of a real step on a CPU. Not modelled: allocator fragmentation and CUDA context (`CUDA_OVERHEAD_GIB` is added
on GPUs as a flat margin), the in-training validation pass and the KL-to-base diagnostic (no-grad passes over
fewer rows than a training micro-batch; they must be computed in chunks, as the log-prob path is).

With the vLLM backend the plan also prices the rollout layout on GPUs (`plan_rollout`, `rollout.vllm_layout`):
shared (both engines on each trainer GPU, `rollout.vllm_gpu_memory` of it each) or dedicated (a rollout service
with one GPU per model, the trainer's GPUs free of engines, a step's rows in one call from the main process):
the GPUs each engine runs on, rows per engine, resident rows at the memory share, admission waves and the
predicted tandem/solo (`tandem.rollout.layout`). On GPUs the plan states how many GPUs the run needs on one node
(`gpus_needed`: the trainer's, plus the rollout service's in the dedicated layout) and, given the node's count
(`tandem plan --gpus N`), refuses in one line a layout that needs more. `compare_layouts` prices every layout
for the run on the node's GPUs (GPUs used, rollout, training and trainer-idle seconds per step, tandem/solo) and
recommends the one with the fewest seconds per step.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from tandem.errors import BadInputError
from tandem.geometry import BatchGeometry
from tandem.precision import DTYPE_BYTES, precision_plan
from tandem.rollout.cost import GPUS, gpu_for_memory
from tandem.rollout.layout import RolloutLayout, price_layout
from tandem.rollout.placement import LAYOUTS, PlacementError, layout_gpus, place_engines, rollout_positions

GIB = 2**30
CUDA_OVERHEAD_GIB = 2.0      # CUDA context, cuBLAS workspaces, allocator slack (flat margin per GPU)
LOGPROB_TOKEN_TILE = 4096    # trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE
LOGPROB_VOCAB_TILE = 32768   # trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE
CPU_TILE_TEMPS = 8           # float32 tile-sized temporaries of trl's torch fallback (no Triton) in the backward
VLLM_OVERHEAD_GIB = 1.5      # vLLM's activations and CUDA graphs inside its reservation, next to weights and KV


class PlanError(BadInputError):
    """The plan cannot be computed (no model shape known) or does not fit (the message says what to change)."""


# --------------------------------------------------------------------------------------------------
# Model shape
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer (Qwen3 family: GQA, SwiGLU MLP, RMSNorm incl. q/k norms)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    source: str = field(default="", compare=False)  # where the numbers came from (not part of the shape)

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_linear_params(self) -> int:
        H, Q, K, I = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        return H * Q + 2 * H * K + Q * H + 3 * H * I

    @property
    def layer_params(self) -> int:
        return self.layer_linear_params + 2 * self.hidden + 2 * self.head_dim  # + two RMSNorms and q/k norms

    @property
    def n_params(self) -> int:
        head = 0 if self.tied else self.vocab * self.hidden
        return self.vocab * self.hidden + self.layers * self.layer_params + self.hidden + head

    @property
    def largest_param(self) -> int:
        return max(self.vocab * self.hidden, self.hidden * self.intermediate, self.hidden * self.q_dim)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Key + value cache of one token across all layers."""
        return self.layers * self.kv_dim * 2 * dtype_bytes


# Hub ids whose config.json is not on this machine. Qwen3-4B(-Instruct-2507): hidden 2560, 36 layers, 32 query
# heads, 8 KV heads, head_dim 128, MLP 9728, vocabulary 151,936, tied embeddings (its published config.json;
# 4.02B parameters by `ModelShape.n_params`, matching the model card's 4.0B / 3.6B non-embedding).
KNOWN_SHAPES: dict[str, dict] = {
    "Qwen/Qwen3-4B-Instruct-2507": dict(hidden=2560, layers=36, heads=32, kv_heads=8, head_dim=128,
                                        intermediate=9728, vocab=151936, tied=True),
    "Qwen/Qwen3-4B": dict(hidden=2560, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=9728,
                          vocab=151936, tied=True),
}


def shape_from_config(cfg: dict, source: str = "config.json") -> ModelShape:
    """The shape of a Hugging Face `config.json` (text config of a multimodal one)."""
    cfg = cfg.get("text_config", cfg)
    heads = int(cfg["num_attention_heads"])
    return ModelShape(hidden=int(cfg["hidden_size"]), layers=int(cfg["num_hidden_layers"]), heads=heads,
                      kv_heads=int(cfg.get("num_key_value_heads") or heads),
                      head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
                      intermediate=int(cfg["intermediate_size"]), vocab=int(cfg["vocab_size"]),
                      tied=bool(cfg.get("tie_word_embeddings", False)), source=source)


def _dir_matches(d: Path, m) -> bool:
    """Whether model dir `d` was built from the `model` section (its tandem_source.json, when present, agrees):
    a tiny base left in models/base must not stand in for the hub model of another params file."""
    try:
        info = json.loads((d / "tandem_source.json").read_text())
    except (OSError, ValueError):
        return True
    if info.get("source") not in (None, m.source):
        return False
    return m.source != "hub" or info.get("model_id") in (None, m.hub_id)


def model_shape(params, model_dir: str | Path | None = None) -> ModelShape:
    """The model's shape: `model_dir/config.json`, else the tiny build's settings, else `KNOWN_SHAPES`."""
    m = params.model
    dirs = [Path(model_dir)] if model_dir else []
    if m.source == "path" and m.path:
        dirs.append(Path(m.path))
    for d in dirs:
        if (d / "config.json").is_file() and _dir_matches(d, m):
            return shape_from_config(json.loads((d / "config.json").read_text()), f"{d / 'config.json'}")
    if m.source == "tiny":
        # The tiny build's vocabulary is the trained tokenizer's, at most model.vocab_size entries
        return ModelShape(hidden=m.hidden_size, layers=m.num_layers, heads=m.num_heads, kv_heads=m.num_kv_heads,
                          head_dim=m.head_dim or m.hidden_size // m.num_heads, intermediate=m.intermediate_size,
                          vocab=m.vocab_size, tied=True, source="model section (tiny build)")
    if m.source == "hub" and m.hub_id in KNOWN_SHAPES:
        return ModelShape(**KNOWN_SHAPES[m.hub_id], source=f"built-in table ({m.hub_id})")
    where = ", ".join(str(d / "config.json") for d in dirs) or "no model directory"
    raise PlanError(f"plan: no shape for model {m.hub_id if m.source == 'hub' else m.path!r}: {where} not found "
                    f"and not in the built-in table ({', '.join(KNOWN_SHAPES)}); run the base stage first")


# --------------------------------------------------------------------------------------------------
# Activations
# --------------------------------------------------------------------------------------------------

def activation_bytes_per_token(shape: ModelShape, autocast: bool, master_bytes: int = 4) -> int:
    """Bytes autograd saves per token in one decoder layer (padded batch: an attention mask is present).

    Read off transformers' Qwen3 layer (sdpa attention; with a padding mask the keys and values are repeated
    to all query heads before attention). f = master bytes (float32 residual stream and norm internals),
    c = compute bytes. Without autocast every saved tensor is in f, and the norm outputs are shared by
    their consumers: 6H + 6Q + 2K + 4I elements. Under bf16 autocast every linear saves its own bf16 cast of
    its input (three casts of the attention norm's output, two of the MLP norm's), the q/k norms save an
    fp32 upcast and a bf16 downcast: (4f + 5c)H + (f + 5c)Q + (f + c)K + 4cI bytes. Small per-row terms
    (rsqrt of the two layer norms and of the q/k norms per head, attention log-sum-exp) add
    (2 + 2 heads + kv_heads) floats.
    """
    H, Q, K, I = shape.hidden, shape.q_dim, shape.kv_dim, shape.intermediate
    f = master_bytes
    small = 4 * (2 + 2 * shape.heads + shape.kv_heads)
    if not autocast:
        return f * (6 * H + 6 * Q + 2 * K + 4 * I) + small
    c = 2
    return (4 * f + 5 * c) * H + (f + 5 * c) * Q + (f + c) * K + 4 * c * I + small


# --------------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------------

@dataclass
class Plan:
    """One device's memory: named terms in bytes, the peak, the budget, and what to change if it does not fit."""

    stage: str
    arm: str | None
    device: str
    gpus: int
    budget_bytes: float
    persistent: dict[str, float]
    rollout: dict[str, float]
    training: dict[str, float]
    peak_bytes: float
    notes: list[str] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)   # failed side conditions (e.g. vLLM KV does not fit)
    geometry: dict = field(default_factory=dict)
    training_phase_bytes: float = 0.0  # what one training step adds on top of the persistent terms (measured
    #                                    against a real step by tests/test_plan.py)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.budget_bytes and not self.checks

    def to_json(self) -> dict:
        g = lambda d: {k: round(v / GIB, 3) for k, v in d.items()}  # noqa: E731
        return {"stage": self.stage, "arm": self.arm, "device": self.device, "gpus": self.gpus,
                "per_gpu_gib": round(self.peak_bytes / GIB, 2), "budget_gib": round(self.budget_bytes / GIB, 2),
                "fits": self.fits, "persistent_gib": g(self.persistent), "rollout_gib": g(self.rollout),
                "training_gib": g(self.training), "training_phase_gib": round(self.training_phase_bytes / GIB, 3),
                "geometry": self.geometry, "checks": self.checks, "notes": self.notes}


def arm_group_and_beta(arm: str, train) -> tuple[int, float]:
    """(group size, KL weight) of `arm`, as `tandem.train.arm_spec` defines them (a test keeps the two equal);
    restated here so that planning imports neither torch nor trl."""
    if arm == "grpo_g16":
        return 16, 0.0
    return train.group_size, (train.kl_beta if arm == "kl_reg" else 0.0)


def train_geometry(params, group_size: int) -> dict:
    """Rows per step, per process, per update and per micro-batch, and micro-batches per update: the cut the
    trainer makes (`tandem.geometry.BatchGeometry`); raises ValueError when the batch does not split."""
    t = params.train
    geo = BatchGeometry.of(t, group_size)
    return {"rows_per_step": geo.rollout_rows, "rows_per_process": geo.rows_per_process,
            "rows_per_update": geo.rows_per_update, "micro_batch_size": geo.micro_batch_size,
            "micro_batches_per_update": geo.grad_accum, "prompts_per_process": geo.prompts_per_process,
            "seq_tokens": t.max_prompt_tokens + t.max_new_tokens}


def micro_batch_bytes(shape: ModelShape, mb: int, seq: int, autocast: bool, master_bytes: int, device: str,
                      checkpointing: bool) -> tuple[dict[str, float], dict[str, float]]:
    """Forward/backward memory of one micro-batch of `mb` rows x `seq` tokens: (held, passing) terms.

    Held through the backward: `activations` (saved by autograd; with checkpointing each layer's input),
    `attention_mask` ([mb, 1, seq, seq] in the compute dtype), `loss_terms` (trl's per-token loss tensors).
    Passing, one after the other (the peak is the held terms plus the larger): `lm_head_backward` (trl's fused
    LM head runs first in the backward: one [<=4096, <=32768] logits tile, plus the torch fallback's float32
    temporaries off CUDA, and the float32 weight gradient [V, H] and hidden gradient [N, H] it allocates), then,
    with checkpointing, `recompute` (one layer's saved tensors again, plus the gradients flowing through it).
    """
    N = mb * seq
    c = 2 if autocast else master_bytes
    per_layer = activation_bytes_per_token(shape, autocast, master_bytes)
    H = shape.hidden
    # final norm (input, normalised) + the head's flattened copy of its input, all in the master dtype
    tail = N * 3 * H * master_bytes
    rope = 2 * seq * shape.head_dim * master_bytes
    held: dict[str, float] = {}
    passing: dict[str, float] = {}
    if checkpointing:
        held["activations"] = shape.layers * N * H * master_bytes + tail + rope
        # one recomputed layer, and the gradients flowing through it (the MLP's widest ones dominate)
        passing["recompute"] = N * per_layer + N * (3 * shape.intermediate + 2 * H) * master_bytes
    else:
        held["activations"] = shape.layers * N * per_layer + tail + rope
    held["attention_mask"] = mb * seq * seq * c
    held["loss_terms"] = 12 * N * 4
    tile = min(N, LOGPROB_TOKEN_TILE) * min(shape.vocab, LOGPROB_VOCAB_TILE)
    passing["lm_head_backward"] = (tile * (c + (0 if device == "cuda" else CPU_TILE_TEMPS * 4))
                                   + 4 * shape.vocab * H + 4 * N * H)
    return held, passing


def _budget(params, device: str) -> float:
    if device == "cuda":
        return params.train.gpu_memory_gib * GIB
    return cpu_ram_bytes() / max(params.train.num_processes, 1)


def cpu_ram_bytes() -> float:
    """Physical memory of this machine (MemTotal), the CPU budget shared by all training processes."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    import os
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def plan_train_arm(params, arm: str, shape: ModelShape, device: str = "cuda") -> Plan:
    """The training plan of one arm on one device (GPU or, on a CPU machine, one process's share of RAM)."""
    t, ro = params.train, params.rollout
    group, beta = arm_group_and_beta(arm, t)
    prec = precision_plan(t.precision, params.model.dtype, device)
    autocast = prec.autocast is not None
    procs, shard = t.num_processes, t.sharding
    P, m, fz = shape.n_params, prec.master_bytes, prec.frozen_bytes
    # the values of train.sharding (tandem.config.SHARDING): none (DDP, nothing split) or fsdp (all split)
    split_w = split_o = procs if shard == "fsdp" else 1
    geo = train_geometry(params, group)
    notes: list[str] = [f"shape: {shape.source}; {P:,} parameters",
                        f"precision {t.precision} on {device}: master {prec.senior_dtype}, frozen "
                        f"{prec.frozen_dtype}, autocast {prec.autocast or 'off'}"]
    checks: list[str] = []

    persistent = {"senior_weights": P * m / split_w}
    persistent["optimizer_state"] = 2 * P * m / split_o
    persistent["junior"] = P * fz
    if beta > 0:
        persistent["kl_reference"] = P * fz / split_w
    seq = geo["seq_tokens"]
    rows, prompts = geo["rows_per_process"], geo["prompts_per_process"]
    kv_tokens = rows * t.max_new_tokens + prompts * t.max_prompt_tokens
    if ro.backend == "vllm":
        reserve = _vllm_reserve(params, shape, device, ro.vllm_gpu_memory * _budget(params, "cuda"))
        dedicated = _dedicated(params, device)
        if dedicated:  # the engines sit on the rollout service's GPUs; they hold the rows of a whole step
            notes.append(f"rollout.vllm_layout dedicated: no engine on the trainer's GPUs; each engine on a "
                         f"GPU of its own ({ro.vllm_gpu_memory} of {t.gpu_memory_gib} GiB)")
        else:
            persistent["vllm_engines"] = 2 * reserve
        c, n = _vllm_check(shape, reserve, min(geo["rows_per_step"] if dedicated else rows, ro.batch_size), seq,
                           arm == "tandem",
                           _VllmAdvice(f"raise {_vllm_knob(device)}, or lower train.max_new_tokens",
                                       _vllm_knob(device)),
                           _budget(params, "cuda") if device == "cuda" else 0.0, dedicated)
        checks += c
        notes += n
        # the live senior's weights are copied into its engine before each call; sharded, they are gathered
        rollout: dict[str, float] = ({"weight_sync_gather": P * m * (split_w - 1) / split_w} if split_w > 1
                                     else {})
    else:
        rollout = {"kv_cache_senior": kv_tokens * shape.kv_bytes_per_token(m),
                   "kv_cache_junior": kv_tokens * shape.kv_bytes_per_token(fz),
                   "decode_logits": rows * shape.vocab * 4 * 2}
        if split_w > 1:
            rollout["gathered_senior"] = P * m * (split_w - 1) / split_w
    mb = geo["micro_batch_size"]
    held, passing = micro_batch_bytes(shape, mb, seq, autocast, m, device, t.gradient_checkpointing)
    grads = P * m / split_o
    if autocast:
        # autocast caches the bf16 cast of each weight for the forward; sharded: only the gathered layers
        held["autocast_weight_cache"] = 2 * (shape.layer_linear_params * 2 if split_w > 1
                                             else shape.layers * shape.layer_linear_params)
    if split_w > 1:  # fsdp gathers the current and the prefetched layer
        held["gathered_layers"] = 2 * shape.layer_params * m
    if geo["micro_batches_per_update"] > 1:
        held["accumulated_grads"] = grads
    if procs > 1 and shard == "none":
        held["ddp_buckets"] = P * m  # DDP's gradient buckets, a second copy of the gradients
    fwd_bwd = sum(held.values()) + max(passing.values())
    # AdamW step: gradients + temporaries. The fused kernel (precision.OPTIMIZER) updates in place: nothing more on
    # CUDA (an H200 step of a Qwen3-4B shape measured the forward/backward as the peak, docs/results.md); on a CPU
    # two copies of the largest tensor (tests/test_plan.py measures it)
    opt_temp = 0.0 if device == "cuda" else 2 * shape.largest_param * m
    step = grads + opt_temp + held.get("ddp_buckets", 0.0)
    training = {**held, **passing, "optimizer_step": step}
    margin = CUDA_OVERHEAD_GIB * GIB if device == "cuda" else 0.0
    if margin:
        persistent["cuda_overhead"] = margin
    train_phase = max(fwd_bwd, step)
    peak = sum(persistent.values()) + max(sum(rollout.values()), train_phase)
    notes.append("training phase = held terms + the larger passing term (lm_head_backward, recompute), or the "
                 f"optimizer step if larger; here: {'optimizer step' if step > fwd_bwd else 'forward/backward'}")
    return Plan("train", arm, device, procs, _budget(params, device), persistent, rollout, training, peak,
                notes, checks, geo, train_phase)


def _dedicated(params, device: str) -> bool:
    """Whether the vLLM engines run on a rollout service's own GPUs (rollout.vllm_layout dedicated, on GPUs;
    vLLM's CPU build always shares the machine with the trainer)."""
    return device == "cuda" and params.rollout.backend == "vllm" and params.rollout.vllm_layout == "dedicated"


def rollout_rows(params) -> tuple[int, int]:
    """(rows one engine holds in the layout, rows one call carries as the trainer sends them).

    Shared: each training process rolls out its own rows (`tandem.train.rollout`) through its own service, in
    calls of at most rollout.batch_size rows: min(rows per process, batch_size). Dedicated: one service for the
    whole trainer; the main process gathers every process's rows and makes one call of a step's rows
    (`tandem.train.one_call`), split in calls of at most batch_size: min(rows per step, batch_size)."""
    t, ro = params.train, params.rollout
    geo = train_geometry(params, t.group_size)
    if ro.vllm_layout == "dedicated":
        rows = min(geo["rows_per_step"], ro.batch_size)
        return rows, rows
    per_call = min(geo["rows_per_process"], ro.batch_size)
    return per_call, per_call


def _rollout_spec(params):
    """(the GPU's kind, the `RolloutLayout` priced) of the params' rollout: the `GPUS` entry whose memory is
    nearest train.gpu_memory_gib, and the tandem arm's rows per engine (`rollout_rows`) at the prompt and new
    token budgets, the memory share, and vLLM's runtime inside it."""
    t, ro = params.train, params.rollout
    rows, _ = rollout_rows(params)
    spec = RolloutLayout(ro.vllm_layout, rows, t.max_prompt_tokens, t.max_new_tokens, ro.vllm_gpu_memory,
                         t.gpu_memory_gib * GIB, VLLM_OVERHEAD_GIB * GIB, ro.p_senior)
    return GPUS[gpu_for_memory(t.gpu_memory_gib)], spec


def _rollout_gpus(params) -> int:
    """The GPUs the rollout engines run on: the rollout service's (dedicated), else the trainer's."""
    t, ro = params.train, params.rollout
    if ro.vllm_layout == "dedicated":
        return len(rollout_positions(ro.vllm_devices, t.num_processes))
    return t.num_processes


def plan_rollout(params, shape: ModelShape) -> dict | None:
    """The rollout layout on GPUs and its price (`tandem.rollout.layout.price_layout`), None without vLLM.

    The GPU's kind (bandwidth, throughput) is the `tandem.rollout.cost.GPUS` entry whose memory is nearest
    train.gpu_memory_gib; the rollout service's GPUs are of the trainer's kind. Rows are the tandem arm's
    (train.group_size)."""
    t, ro = params.train, params.rollout
    if ro.backend != "vllm":
        return None
    rows, per_call = rollout_rows(params)
    gpu, spec = _rollout_spec(params)
    price = price_layout(shape, gpu, spec)
    dedicated = ro.vllm_layout == "dedicated"
    out = {"layout": ro.vllm_layout, "rollout_gpus": _rollout_gpus(params),
           "trainer_gpus": t.num_processes, "gpu_memory_gib": t.gpu_memory_gib,
           "vllm_gpu_memory": ro.vllm_gpu_memory, "rows_per_call": per_call, **price.to_json()}
    if dedicated:
        pos = rollout_positions(ro.vllm_devices, t.num_processes)
        k = len(pos) // 2
        out["engine_devices"] = {"senior": pos[:k], "junior": pos[k:]}
        out["gpus_note"] = (f"one rollout service for the run, the senior's engine on GPU {_gpus(pos[:k])} and the "
                            f"junior's on GPU {_gpus(pos[k:])} (rollout.vllm_devices; positions the training "
                            f"processes see); trainer: GPU(s) 0..{t.num_processes - 1}; a step's rows in one call "
                            f"from the main process")
    else:
        out["gpus_note"] = (f"both engines on each of the trainer's {t.num_processes} GPU(s) (the process's "
                            f"LOCAL_RANK), one service per training process")
    if per_call < rows:
        per = price_layout(shape, gpu, replace(spec, rows=per_call))
        out["predicted_tandem_over_solo_per_call"] = (None if per.predicted_tandem_over_solo is None
                                                      else round(per.predicted_tandem_over_solo, 3))
        out["notes"].append(
            f"the trainer sends {per_call} rows per call: {per_call} rows per engine, predicted "
            f"{out['predicted_tandem_over_solo_per_call']}")
    return out


def _gpus(pos: list[int]) -> str:
    return ",".join(map(str, pos))


def _vllm_knob(device: str) -> str:
    """The setting that sizes a vLLM engine: its GPU fraction, or on a CPU (vLLM's CPU build) its KV cache."""
    return "rollout.vllm_gpu_memory" if device == "cuda" else "rollout.vllm_cpu_kv_cache_gb"


def _vllm_reserve(params, shape: ModelShape, device: str, gpu_reserve: float) -> float:
    """Memory one vLLM engine holds: on a GPU its reservation (`gpu_reserve`, a fraction of the GPU); on a CPU,
    vLLM's CPU build holds its bf16 weights, a KV cache of rollout.vllm_cpu_kv_cache_gb and its runtime."""
    if device == "cuda":
        return gpu_reserve
    return shape.n_params * 2 + params.rollout.vllm_cpu_kv_cache_gb * GIB + VLLM_OVERHEAD_GIB * GIB


@dataclass(frozen=True)
class _VllmAdvice:
    """What a failed vLLM check tells the user to change: the general `fix`, the memory `knob`, the row knobs."""

    fix: str
    knob: str = "rollout.vllm_gpu_memory"
    rows_knob: str = "train.prompts_per_step, train.num_processes, rollout.batch_size"


def _vllm_check(shape: ModelShape, reserve: float, rows: int, seq: int, tandem: bool, advice: _VllmAdvice,
                gpu_bytes: float = 0.0, dedicated: bool = False) -> tuple[list[str], list[str]]:
    """Both vLLM engines must hold every row of a call at its full length, rows x (prompt + max_new_tokens):
    a tandem row keeps a streaming session with its KV blocks in each engine for its whole rollout, and rows beyond
    the cache's capacity wait for others to finish (the service admits only what fits), which turns the
    overlapped, continuously batched rollout back into rounds of fewer rows. For tandem rollouts a shortfall is
    a failed check that names the layouts that fit; for solo rollouts (one engine, no parked sessions) it is
    ordinary continuous batching, and a note. Returns (checks, notes)."""
    checks: list[str] = []
    notes: list[str] = []
    fix, knob, rows_knob = advice.fix, advice.knob, advice.rows_knob
    kv_tok = shape.kv_bytes_per_token(2)
    weights, runtime = shape.n_params * 2, VLLM_OVERHEAD_GIB * GIB
    room = reserve - weights - runtime
    need_kv = rows * seq * kv_tok
    if room < seq * kv_tok:
        checks.append(f"a vLLM engine gets {reserve / GIB:.1f} GiB ({knob}), less than its bf16 "
                      f"weights + {VLLM_OVERHEAD_GIB} GiB + the KV cache of one {seq}-token sequence: {fix}")
        return checks, notes
    if room >= need_kv:
        notes.append(f"vLLM KV cache holds all {rows} rows at their full length in each engine "
                     f"({need_kv / GIB:.1f} of {room / GIB:.1f} GiB)")
        return checks, notes
    fit_rows = int(room // (seq * kv_tok))
    per_engine = weights + runtime + need_kv
    ways = []
    if gpu_bytes and dedicated:
        frac = per_engine / gpu_bytes
        if frac <= 0.95:
            ways.append(f"rollout.vllm_gpu_memory {math.ceil(frac * 100) / 100:.2f} (one GPU per engine)")
    elif gpu_bytes:
        frac = per_engine / gpu_bytes
        if 2 * frac <= 0.95:
            ways.append(f"rollout.vllm_gpu_memory {math.ceil(frac * 100) / 100:.2f} (both engines on one GPU)")
        elif frac <= 0.95:
            ways.append(f"one GPU per engine: a service on its own node (rollout.vllm_url) with "
                        f"--gpu-memory-utilization {math.ceil(frac * 100) / 100:.2f} per GPU")
    else:
        ways.append(f"{knob} {math.ceil(per_engine / GIB - weights / GIB - runtime / GIB)}")
    ways.append(f"at most {fit_rows} rows per call ({rows_knob})")
    max_len = int(room // (rows * kv_tok))
    if max_len > 0:
        ways.append(f"prompt + completion capped at {max_len} tokens (train.max_new_tokens, "
                    f"rollout.vllm_max_model_len)")
    msg = (f"vLLM KV cache holds {fit_rows} of the {rows} rows at their full length ({seq} tokens): "
           f"{room / GIB:.1f} GiB of the {need_kv / GIB:.1f} GiB each engine needs ({knob}); layouts "
           f"that fit: {'; '.join(ways)}")
    if tandem:
        checks.append(msg)
    else:
        notes.append(msg + " (solo rollouts: the rest wait for free slots)")
    return checks, notes


def plan_evaluate(params, shape: ModelShape, device: str = "cuda") -> Plan:
    """The evaluation plan: senior + junior weights in `model.dtype` and both KV caches for one engine call."""
    ev, ro = params.evaluate, params.rollout
    b = DTYPE_BYTES[params.model.dtype]
    P = shape.n_params
    rows = ev.batch_size
    kv_tokens = rows * ev.max_new_tokens + rows * params.train.max_prompt_tokens
    checks: list[str] = []
    notes = [f"shape: {shape.source}"]
    persistent = {"senior": P * b, "junior": P * b}
    rollout: dict[str, float] = {}
    if ro.backend == "vllm":
        reserve = _vllm_reserve(params, shape, device, ro.vllm_gpu_memory * params.train.gpu_memory_gib * GIB)
        dedicated = _dedicated(params, device)
        persistent = {} if dedicated else {"vllm_engines": 2 * reserve}
        c, n = _vllm_check(shape, reserve, rows, ev.max_new_tokens + params.train.max_prompt_tokens,
                           any(m != "solo" for m in ev.modes),
                           _VllmAdvice(f"raise {_vllm_knob(device)}, or lower evaluate.max_new_tokens",
                                       _vllm_knob(device), "evaluate.batch_size"),
                           params.train.gpu_memory_gib * GIB if device == "cuda" else 0.0, dedicated)
        checks += c
        notes += n
    else:
        rollout = {"kv_cache": 2 * kv_tokens * shape.kv_bytes_per_token(b), "decode_logits": rows * shape.vocab * 8}
    if device == "cuda":
        persistent["cuda_overhead"] = CUDA_OVERHEAD_GIB * GIB
        budget = params.train.gpu_memory_gib * GIB
    else:
        budget = cpu_ram_bytes() / max(ev.workers, 1)
    peak = sum(persistent.values()) + sum(rollout.values())
    return Plan("evaluate", None, device, 1, budget, persistent, rollout, {}, peak, notes, checks, {"rows": rows, "seq_tokens": ev.max_new_tokens +
                                                     params.train.max_prompt_tokens})


def gpus_needed(params) -> int:
    """The GPUs one node must show for the run: the trainer's (`train.num_processes`), and with the vLLM backend's
    dedicated layout every position up to the rollout service's last (`tandem.rollout.placement.layout_gpus`).
    Raises PlanError (one line) when the dedicated layout's GPUs overlap each other or the trainer's."""
    t, ro = params.train, params.rollout
    if ro.backend != "vllm" or ro.vllm_layout != "dedicated":
        return t.num_processes
    n = layout_gpus(ro.vllm_layout, t.num_processes, ro.vllm_devices)
    try:  # the placement's own rules on a node with exactly these GPUs
        place_engines(ro.vllm_layout, visible=[str(i) for i in range(n)], rollout_devices=tuple(ro.vllm_devices),
                      trainer_processes=t.num_processes)
    except PlacementError as e:
        raise PlanError(f"plan: {e}") from None
    return n


def check_node_gpus(params, node_gpus: int) -> int:
    """The GPUs the run needs (`gpus_needed`); PlanError (one line) when a node of `node_gpus` GPUs has fewer."""
    need = gpus_needed(params)
    if node_gpus and need > node_gpus:
        t, ro = params.train, params.rollout
        parts = f"train.num_processes {t.num_processes}"
        if ro.backend == "vllm" and ro.vllm_layout == "dedicated":
            parts += f", the rollout service on GPU(s) {_gpus(rollout_positions(ro.vllm_devices, t.num_processes))}"
        raise PlanError(f"plan: the run needs {need} GPUs on one node ({parts}) but --gpus says the node has "
                        f"{node_gpus}: lower train.num_processes (an update's rows, prompts_per_step x group_size / "
                        f"updates_per_batch, do not depend on it) or move rollout.vllm_devices")
    return need


# The memory share per engine a layout is compared at when the params file runs the other one (the paper presets'
# values: params.paper.yaml shares each trainer GPU at 0.3 per engine, params.paper-dedicated.yaml gives each engine
# 0.9 of its own GPU)
LAYOUT_SHARE = {"shared": 0.3, "dedicated": 0.9}
# training FLOPs per parameter and trained token: forward 2 + backward 4, + 2 for gradient checkpointing's
# recomputed forward, + 2 for the scoring pass of the old log-probs when a batch feeds several updates
TRAIN_FLOPS = {"fwd_bwd": 6, "recompute": 2, "old_logprobs": 2}


def layout_variant(params, layout: str, node_gpus: int):
    """The params as they would run in `layout` on a node of `node_gpus` GPUs: the params themselves for their own
    layout; for the other, `LAYOUT_SHARE[layout]` per engine, the rollout service on the two GPUs after the
    trainer's (dedicated), and the most training processes the node leaves that split the batch. None when no
    process count fits."""
    t, ro = params.train, params.rollout
    if layout == ro.vllm_layout:
        return params
    spare = 2 if layout == "dedicated" else 0
    for n in range(node_gpus - spare, 0, -1):
        try:  # the batch must split over n processes, and the settings obey their rules (fsdp needs n > 1)
            BatchGeometry.of(t, processes=n)
            return replace(params, train=replace(t, num_processes=n), rollout=replace(
                ro, vllm_layout=layout, vllm_gpu_memory=LAYOUT_SHARE[layout], vllm_devices=[]))
        except ValueError:
            continue
    return None


def training_seconds(params, shape: ModelShape, gpu) -> float:
    """A compute-bound lower bound of one training step's seconds (the tandem arm, every row at full length):
    `TRAIN_FLOPS` per parameter and token over the trainer's GPUs at the GPU table's achieved bf16 throughput."""
    t = params.train
    geo = train_geometry(params, t.group_size)
    per = TRAIN_FLOPS["fwd_bwd"] + (TRAIN_FLOPS["recompute"] if t.gradient_checkpointing else 0) \
        + (TRAIN_FLOPS["old_logprobs"] if t.updates_per_batch > 1 else 0)
    tokens = geo["rows_per_step"] * (t.max_prompt_tokens + t.max_new_tokens)
    return per * shape.n_params * tokens / (t.num_processes * gpu.flops)


def layout_step(params, shape: ModelShape, premises=None) -> dict:
    """What one layout costs a training step (`compare_layouts`): GPUs used, the rollout's seconds (its calls one
    after the other, each priced by `price_layout`: tandem and solo), the training's (`training_seconds`), the
    trainer's idle seconds (dedicated: the whole rollout, its GPUs wait; shared: none, they run the engines),
    seconds per step and tandem/solo."""
    t, ro = params.train, params.rollout
    geo = train_geometry(params, t.group_size)
    _, per_call = rollout_rows(params)
    scope = geo["rows_per_step"] if ro.vllm_layout == "dedicated" else geo["rows_per_process"]
    calls = math.ceil(scope / per_call)
    gpu, spec = _rollout_spec(params)
    price = price_layout(shape, gpu, spec, premises)
    out = {"layout": ro.vllm_layout, "gpus": gpus_needed(params), "trainer_gpus": t.num_processes,
           "rollout_gpus": _rollout_gpus(params), "vllm_gpu_memory": ro.vllm_gpu_memory, "rows_per_call": per_call,
           "calls_per_step": calls, "gpu": gpu.name,
           "fits": all(plan_train_arm(params, a, shape, "cuda").fits for a in t.arms)}
    if price.predicted_tandem_over_solo is None:
        return {**out, "rollout_s": None, "solo_rollout_s": None, "training_s": None, "trainer_idle_s": None,
                "step_s": None, "predicted_tandem_over_solo": None}
    rollout_s = calls * price.tandem_s
    training_s = training_seconds(params, shape, gpu)
    return {**out, "rollout_s": rollout_s, "solo_rollout_s": calls * price.solo_s, "training_s": training_s,
            "trainer_idle_s": rollout_s if ro.vllm_layout == "dedicated" else 0.0,
            "step_s": rollout_s + training_s, "predicted_tandem_over_solo": price.predicted_tandem_over_solo}


def _unfit(o: dict) -> str:
    """Why a layout of `compare_layouts` is not among those that fit: not priced, its memory plan, no prediction,
    or more GPUs than the node's."""
    if o.get("why"):
        return o["why"]
    if not o["fits"]:
        return "its memory plan"
    return "no prediction" if o["step_s"] is None else f"{o['gpus']} GPUs needed"


def compare_layouts(params, shape: ModelShape, node_gpus: int = 0, premises=None) -> dict:
    """Every layout priced for this run on a node of `node_gpus` GPUs (0: the GPUs the params' own layout needs),
    and the recommended one: the lowest seconds per training step among those that fit (memory and GPUs), with
    the reason in one line. {"node_gpus", "layouts": {layout: layout_step or {"why": ...}}, "recommended", "why"}."""
    node = node_gpus or gpus_needed(params)
    layouts: dict[str, dict] = {}
    for layout in LAYOUTS:
        v = layout_variant(params, layout, node)
        if v is None:
            layouts[layout] = {"layout": layout, "fits": False, "step_s": None,
                               "why": f"no training process count fits {node} GPUs beside the layout's engines"}
            continue
        layouts[layout] = {**layout_step(v, shape, premises), "params_layout": v is params}
    ok = {k: v for k, v in layouts.items() if v["fits"] and v["step_s"] is not None and v["gpus"] <= node}
    if not ok:
        return {"node_gpus": node, "layouts": layouts, "recommended": None,
                "why": "no layout fits these GPUs (see each layout's memory plan)"}
    best = min(ok, key=lambda k: ok[k]["step_s"])
    b = ok[best]
    why = (f"{best}: {b['step_s']:.1f} s per step (rollout {b['rollout_s']:.1f} + training {b['training_s']:.1f}) "
           f"on {b['gpus']} GPUs")
    for k, o in layouts.items():
        if k == best:
            continue
        if k not in ok:
            why += f"; {k} does not fit: {_unfit(o)}"
            continue
        why += f" against {k}'s {o['step_s']:.1f} s (rollout {o['rollout_s']:.1f} + training {o['training_s']:.1f})"
        if o["predicted_tandem_over_solo"] > b["predicted_tandem_over_solo"]:
            why += (f"; {k}'s higher tandem/solo ({o['predicted_tandem_over_solo']:.2f} against "
                    f"{b['predicted_tandem_over_solo']:.2f}) is against its own solo on its {o['rollout_gpus']} "
                    f"rollout GPUs, not against {best}")
    return {"node_gpus": node, "layouts": layouts, "recommended": best, "why": why}


def plan_all(params, model_dir: str | Path | None = None, device: str = "cuda", node_gpus: int = 0) -> dict:
    """Every arm's training plan and the evaluation plan; the headline is the worst arm. On GPUs, `gpus_needed`
    states the GPUs the run needs on one node; `node_gpus` (0 = not stated) refuses a run that needs more."""
    need = check_node_gpus(params, node_gpus) if device == "cuda" else 0
    shape = model_shape(params, model_dir)
    arms = {a: plan_train_arm(params, a, shape, device) for a in params.train.arms}
    worst = max(arms.values(), key=lambda p: (not p.fits, p.peak_bytes))
    ev = plan_evaluate(params, shape, device)
    return {"per_gpu_gib": round(worst.peak_bytes / GIB, 2), "gpus": params.train.num_processes, "gpus_needed": need,
            "fits": all(p.fits for p in arms.values()) and ev.fits, "device": device,
            "budget_gib": round(worst.budget_bytes / GIB, 2), "worst_arm": worst.arm,
            "model": {**asdict(shape), "n_params": shape.n_params},
            "train": {a: p.to_json() for a, p in arms.items()}, "evaluate": ev.to_json(),
            "rollout": plan_rollout(params, shape) if device == "cuda" else None,
            "layouts": (compare_layouts(params, shape, node_gpus)
                        if device == "cuda" and params.rollout.backend == "vllm" else None)}


# --------------------------------------------------------------------------------------------------
# Refusal
# --------------------------------------------------------------------------------------------------

def advice(plan: Plan, params) -> str:
    """What to change, most effective first, for a plan over budget."""
    t = params.train
    tips = []
    big = max({**plan.rollout, **plan.training}.items(), key=lambda kv: kv[1], default=("", 0))[0]
    if plan.stage == "train":
        if not t.gradient_checkpointing:
            tips.append("set train.gradient_checkpointing: true")
        if plan.geometry.get("micro_batch_size", 1) > 1:
            tips.append(f"lower train.micro_batch_size (now {plan.geometry['micro_batch_size']} rows per pass)")
        if t.sharding == "none" and t.num_processes > 1:
            tips.append("set train.sharding: fsdp (weights, gradients and optimizer split over GPUs)")
        tips.append(f"raise train.num_processes (now {t.num_processes})")
        if t.precision == "fp32" and plan.device == "cuda":
            tips.append("set train.precision: bf16_mixed")
        if big.startswith("kv_cache"):
            tips.insert(0, "lower train.max_new_tokens or train.prompts_per_step (KV cache), or use rollout.backend vllm")
    else:
        tips.append("lower evaluate.batch_size or evaluate.max_new_tokens")
    return "; ".join(tips)


def check_fits(params, stage: str, model_dir: str | Path | None = None, device: str | None = None,
               arms: list[str] | None = None) -> dict:
    """Raise PlanError before any work when `stage` (train | evaluate) does not fit its device; return the plan.

    `arms` limits the train check to those arms (default: train.arms).
    `device` defaults to cuda when torch sees a GPU, else cpu (budget: the machine's RAM split between the
    processes; a CPU run that needs more would be killed by the OS anyway).
    """
    if device is None:
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = model_shape(params, model_dir)
    plans = ([plan_train_arm(params, a, shape, device) for a in (arms or params.train.arms)] if stage == "train"
             else [plan_evaluate(params, shape, device)])
    bad = [p for p in plans if not p.fits]
    if bad:
        p = bad[0]
        what = f"arm {p.arm}" if p.arm else stage
        why = "; ".join(p.checks) if p.checks else (f"needs {p.peak_bytes / GIB:.1f} GiB per "
                                                     f"{'GPU' if device == 'cuda' else 'process'}, budget "
                                                     f"{p.budget_bytes / GIB:.1f} GiB")
        raise PlanError(f"{stage}: the memory plan of {what} does not fit: {why}. Change: {advice(p, params)}. "
                        f"See `tandem plan --params ...` for the breakdown.")
    return {p.arm or stage: p.to_json() for p in plans}
