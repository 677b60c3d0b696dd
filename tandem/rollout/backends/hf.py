"""The `hf` backend: catch-up tandem decoding over transformers models with a hand-written KV-cache forward.

`FastDecoder` runs a Llama-family decoder (Qwen3, Qwen2, Llama, Mistral without sliding windows) directly
from the HF module's own parameters, read at every call (the senior is trained in place between calls, so
nothing is copied or cached across calls). Why not `model(..., past_key_values=cache)`? HF caches advance
every row of a batch together, while a tandem round needs, per model, a *different subset of rows*, each with
its *own catch-up length*. Here each model keeps a position-indexed cache per row:

    cache_k[layer]: [B, Hkv, S_max, D]; slot s of row b holds history position s - offset_b (left padding),
    cached_B: how many slots of each row this model has already encoded.

When a model authors rows R at frontier slot S, it encodes, for each row r in R, slots [cached_r, S) -- its own
last token plus every token the partner wrote since -- in ONE forward pass: the catch-up chunks of all rows
are packed into one [N, hidden] matrix for the projections and MLP (no padding FLOPs), attention reads each
row's cache, and logits are computed only at each row's last position. The idle model does nothing.

The forward reproduces the HF modules op for op (RMSNorm in float32 like HF, the model's own rotary module
for cos/sin), and `self_check` compares it with the HF forward before first use.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

SUPPORTED_TYPES = ("qwen3", "qwen2", "llama", "mistral")
STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def unsupported_reason(model: Any) -> str | None:
    """Why `FastDecoder` cannot run this model exactly, or None when it can."""
    cfg = getattr(model, "config", None)
    mtype = getattr(cfg, "model_type", None)
    if mtype not in SUPPORTED_TYPES:
        return f"model_type {mtype!r} is not one of {SUPPORTED_TYPES}"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(model, "lm_head"):
        return "model does not have the .model.layers / .lm_head layout"
    layer_types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return f"layer types {sorted(set(layer_types))} include sliding-window attention"
    if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        return "sliding-window attention is enabled"
    rope_type = getattr(getattr(inner, "rotary_emb", None), "rope_type", None)
    if rope_type not in STATIC_ROPE:
        return f"rope type {rope_type!r} depends on the sequence length"
    act = getattr(inner.layers[0].mlp, "act_fn", None)
    if act is None:
        return "MLP has no act_fn"
    return None


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same ops and dtype round trip as transformers' LlamaRMSNorm / Qwen3RMSNorm.
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _attend(q_RHCD: torch.Tensor, k_RGSD: torch.Tensor, v_RGSD: torch.Tensor, mask_R1CS: torch.Tensor,
            scale: float) -> torch.Tensor:
    """Grouped-query attention: q heads [i*G, (i+1)*G) share kv head i (transformers' repeat_kv order)."""
    return F.scaled_dot_product_attention(q_RHCD, k_RGSD, v_RGSD, attn_mask=mask_R1CS, scale=scale,
                                          enable_gqa=q_RHCD.shape[1] != k_RGSD.shape[1])


class FastDecoder:
    """Per-model, per-row KV cache and the catch-up forward (see the module docstring)."""

    def __init__(self, model: Any):
        reason = unsupported_reason(model)
        if reason:
            raise ValueError(f"FastDecoder cannot run this model: {reason}")
        self.model = model
        cfg = model.config
        self.n_layers = cfg.num_hidden_layers
        attn0 = model.model.layers[0].self_attn
        self.head_dim = attn0.head_dim
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.scale = float(attn0.scaling)
        self.cache_k: list[torch.Tensor] = []
        self.cache_v: list[torch.Tensor] = []

    # ---------------------------------------------------------------------------------------------
    def start(self, hist_BS: torch.Tensor, off_B: torch.Tensor) -> None:
        """Allocate empty caches for a batch whose history buffer is `hist_BS` (slots) with left pads `off_B`."""
        p = next(self.model.parameters())
        self.device, self.dtype = p.device, p.dtype
        B, S_max = hist_BS.shape
        self.B, self.S_max = B, S_max
        shape = (B, self.n_kv, S_max, self.head_dim)
        self.cache_k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.n_layers)]
        self.cache_v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.n_layers)]
        self.off_B = off_B.to(self.device)
        self.cached_B = self.off_B.clone()  # pad slots are never encoded; attention masks them (zeros: masked garbage could still be NaN)
        self.key_ok_BS = torch.arange(S_max, device=self.device)[None, :] >= self.off_B[:, None]
        self.all_rows = torch.arange(B, device=self.device)
        pos = torch.arange(S_max, device=self.device)[None, :]
        dummy = torch.empty(1, dtype=self.dtype, device=self.device)
        cos, sin = self.model.model.rotary_emb(dummy, pos)
        self.cos_PD, self.sin_PD = cos[0], sin[0]

    def release(self) -> None:
        self.cache_k, self.cache_v = [], []

    # ---------------------------------------------------------------------------------------------
    def catch_up(self, hist_BS: torch.Tensor, rows_R: torch.Tensor, slot: int) -> torch.Tensor:
        """Encode slots [cached_r, slot) of each row r in `rows_R` in one pass; return logits at slot-1 [R, V]."""
        rows_R = rows_R.to(self.device)
        R = rows_R.numel()
        cached_R = self.cached_B[rows_R]
        c_R = slot - cached_R
        C = int(c_R.max())
        if int(c_R.min()) < 1:
            raise RuntimeError("catch_up called for a row whose cache is already at the frontier")
        if C == 1:
            rows_N = rows_R
            slots_N = torch.full((R,), slot - 1, dtype=torch.int64, device=self.device)
            last_R = torch.arange(R, device=self.device)
            chunk_local = None
        else:
            # Right-align every row's chunk in a [R, C] grid; keep only the real (not yet cached) slots.
            slots_C = torch.arange(slot - C, slot, device=self.device)
            keep_RC = slots_C[None, :] >= cached_R[:, None]
            r_loc_N, j_N = keep_RC.nonzero(as_tuple=True)  # row-major: each row's tokens contiguous, in order
            rows_N = rows_R[r_loc_N]
            slots_N = slots_C[j_N]
            last_R = torch.cumsum(c_R, 0) - 1
            # packed index of grid cell (r, j), for gathering padded queries of multi-token rows
            grid_RC = torch.cumsum(keep_RC.flatten().to(torch.int64), 0).view(R, C) - 1
            grid_RC = torch.where(keep_RC, grid_RC, -1)
            chunk_local = (c_R > 1).nonzero().flatten()
        ids_N = hist_BS[rows_N.to(hist_BS.device), slots_N.to(hist_BS.device)].to(self.device)
        pos_N = slots_N - self.off_B[rows_N]
        cos_N1D, sin_N1D = self.cos_PD[pos_N][:, None, :], self.sin_PD[pos_N][:, None, :]

        whole = R == self.B and C == 1 and bool((rows_R == self.all_rows).all())
        decode_local = (c_R == 1).nonzero().flatten() if C > 1 else None

        m = self.model.model
        h_N = m.embed_tokens(ids_N)
        N = h_N.shape[0]
        H, G, D = self.n_heads, self.n_kv, self.head_dim
        head_idx = torch.arange(G, device=self.device)[None, :]
        for li, layer in enumerate(m.layers):
            at = layer.self_attn
            x = _rms(h_N, layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)
            q = F.linear(x, at.q_proj.weight, at.q_proj.bias).view(N, H, D)
            k = F.linear(x, at.k_proj.weight, at.k_proj.bias).view(N, G, D)
            v = F.linear(x, at.v_proj.weight, at.v_proj.bias).view(N, G, D)
            if hasattr(at, "q_norm"):
                q = _rms(q, at.q_norm.weight, at.q_norm.variance_epsilon)
                k = _rms(k, at.k_norm.weight, at.k_norm.variance_epsilon)
            q = q * cos_N1D + _rotate_half(q) * sin_N1D
            k = k * cos_N1D + _rotate_half(k) * sin_N1D
            ck, cv = self.cache_k[li], self.cache_v[li]
            ck.index_put_((rows_N[:, None], head_idx, slots_N[:, None]), k)
            cv.index_put_((rows_N[:, None], head_idx, slots_N[:, None]), v)
            if whole:
                # every row, one new token each: attend over cache views, no gather
                o = _attend(q.view(N, 1, H, D).transpose(1, 2), ck[:, :, :slot], cv[:, :, :slot],
                            self.key_ok_BS[:, None, None, :slot], self.scale)
                out_N = o.transpose(1, 2).reshape(N, H * D)
            elif C == 1:
                o = _attend(q.view(N, 1, H, D).transpose(1, 2), ck[rows_R, :, :slot], cv[rows_R, :, :slot],
                            self.key_ok_BS[rows_R][:, None, None, :slot], self.scale)
                out_N = o.transpose(1, 2).reshape(N, H * D)
            else:
                out_N = torch.empty(N, H * D, dtype=q.dtype, device=self.device)
                if decode_local.numel():
                    rr = rows_R[decode_local]
                    qi = last_R[decode_local]
                    o = _attend(q[qi].view(-1, 1, H, D).transpose(1, 2), ck[rr, :, :slot], cv[rr, :, :slot],
                                self.key_ok_BS[rr][:, None, None, :slot], self.scale)
                    out_N[qi] = o.transpose(1, 2).reshape(-1, H * D)
                rr = rows_R[chunk_local]
                grid = grid_RC[chunk_local]                     # [Rc, C], -1 on padding cells
                real = grid >= 0
                qg = q[grid.clamp(min=0)].transpose(1, 2)       # [Rc, H, C, D]; padding cells are discarded
                q_slots = torch.arange(slot - C, slot, device=self.device)
                causal_CS = torch.arange(slot, device=self.device)[None, :] <= q_slots[:, None]
                mask = self.key_ok_BS[rr][:, None, None, :slot] & causal_CS[None, None]
                o = _attend(qg, ck[rr, :, :slot], cv[rr, :, :slot], mask, self.scale)  # [Rc, H, C, D]
                out_N[grid[real]] = o.transpose(1, 2)[real].reshape(-1, H * D)
            h_N = h_N + F.linear(out_N, at.o_proj.weight, at.o_proj.bias)
            mlp = layer.mlp
            x = _rms(h_N, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon)
            gate = F.linear(x, mlp.gate_proj.weight, mlp.gate_proj.bias)
            up = F.linear(x, mlp.up_proj.weight, mlp.up_proj.bias)
            h_N = h_N + F.linear(mlp.act_fn(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)
        self.cached_B[rows_R] = slot
        h_R = _rms(h_N[last_R], m.norm.weight, m.norm.variance_epsilon)
        head = self.model.lm_head
        return F.linear(h_R, head.weight, getattr(head, "bias", None))


def self_check(model: Any, atol: float | None = None) -> None:
    """Compare `FastDecoder` with the model's own forward on a short ragged batch; raise if they differ.

    Exercises a prefill, a one-token decode on a subset of rows and a multi-token catch-up next to a one-token
    row, with left padding, i.e. every code path of `catch_up`.
    """
    p = next(model.parameters())
    V = int(model.config.vocab_size)
    gen = torch.Generator().manual_seed(1234)
    lens = [5, 3]
    total = 5 + 6
    seqs = [torch.randint(0, V, (n + 6,), generator=gen) for n in lens]
    hist = torch.zeros(2, total, dtype=torch.int64)
    off = torch.tensor([0, 2])
    for b, s in enumerate(seqs):
        hist[b, off[b]:] = s
    dec = FastDecoder(model)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            dec.start(hist, off)
            got = {}
            got[(0, 5)] = dec.catch_up(hist, torch.tensor([0, 1]), 5)[0]
            got[(1, 6)] = dec.catch_up(hist, torch.tensor([1]), 6)[0]
            got[(0, 9)], got[(1, 9)] = dec.catch_up(hist, torch.tensor([0, 1]), 9)
            got[(1, 10)] = dec.catch_up(hist, torch.tensor([1]), 10)[0]
            for (b, slot), logits in got.items():
                ids = hist[b, off[b]:slot][None].to(p.device)
                ref = model(input_ids=ids).logits[0, -1]
                tol = atol if atol is not None else (1e-3 if p.dtype in (torch.float32, torch.float64) else 5e-2)
                scale = max(1.0, float(ref.abs().max()))
                err = float((logits.float() - ref.float()).abs().max())
                if err > tol * scale:
                    raise RuntimeError(
                        f"FastDecoder disagrees with {type(model).__name__}'s forward (max |logit diff| {err:.3g} "
                        f"at row {b}, slot {slot}); use backend 'hf' with fast=False")
    finally:
        dec.release()
        model.train(was_training)


def catch_up_generate(senior: Any, junior: Any | None, tables: Any, prompt_ids: list[list[int]], schedule: str,
                      sampling: Any, seed: int, eos_ids: list[int], p_senior: float = 0.5,
                      max_gap_tokens: int = 32, max_rounds: int = 150, row_ids: list[int] | None = None,
                      device: torch.device | str | None = None, progress: bool = False):
    """One batch of tandem rollouts with catch-up prefill (models already in eval mode, under no_grad).

    Each round: for each model, the active rows it authors are caught up and sampled in one forward; a model
    authoring no row this round does not run at all.
    """
    from tandem.rollout.core import left_pad, run_rounds, sample_rows
    from tandem.rollout.schedule import Schedule, uses_junior, uses_senior

    B = len(prompt_ids)
    row_ids = list(range(B)) if row_ids is None else list(row_ids)
    dev = torch.device(device) if device is not None else next(senior.parameters()).device
    hist_BS, off_B, p_max = left_pad(prompt_ids, max(len(p) for p in prompt_ids) + sampling.max_new_tokens,
                                     device=dev)
    rows_B = torch.as_tensor(row_ids, dtype=torch.int64, device=dev)
    sched = Schedule(schedule, tables.to(dev), seed, rows_B, p_senior, max_gap_tokens, max_rounds)
    decoders: dict[int, FastDecoder] = {}
    if uses_senior(schedule, p_senior):
        decoders[1] = FastDecoder(senior)
    if uses_junior(schedule, p_senior):
        if junior is None:
            raise ValueError(f"schedule {schedule!r} needs a junior model")
        decoders[0] = FastDecoder(junior)
    for d in decoders.values():
        d.start(hist_BS, off_B)

    def propose(t, slot, active_B, author_B, hist):
        tok_B = torch.zeros(B, dtype=torch.int64, device=dev)
        lp_B = torch.zeros(B, dtype=torch.float64, device=dev)
        for m, dec in decoders.items():
            mine_B = active_B & (author_B if m == 1 else ~author_B)
            rows_R = mine_B.nonzero().flatten()
            if rows_R.numel() == 0:
                continue
            logits_RV = dec.catch_up(hist, rows_R, slot).to(dev)
            ids_R, lp_R = sample_rows(logits_RV, sampling, seed, rows_B[rows_R], t)
            tok_B[rows_R] = ids_R
            lp_B[rows_R] = lp_R.to(torch.float64)
        return tok_B, lp_B

    try:
        return run_rounds(hist_BS, p_max, sched, sampling, eos_ids, propose, progress=progress)
    finally:
        for d in decoders.values():
            d.release()
