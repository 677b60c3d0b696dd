"""The catch-up kernel: a hand-written KV-cache forward over transformers' Llama-family modules (`FastDecoder`).

`FastDecoder` runs a Llama-family decoder (Qwen3, Qwen2, Llama, Mistral without sliding windows) directly
from the HF module's own parameters, read at every call (the senior is trained in place between calls, so
no weight is copied or cached across calls). Why not `model(..., past_key_values=cache)`? HF caches advance
every row of a batch together, while a tandem round needs, per model, a *different subset of rows*, each with
its *own catch-up length*. Each model keeps its own caches for the batch:
- a prompt cache with one row per distinct prompt (GRPO repeats every prompt G times), filled once;
- a completion cache with one row per batch row, indexed by completion position (same for all rows).

Round at frontier slot S: a model authoring rows R encodes, for each row r in R, slots [cached_r, S) -- its
own last token plus every token the partner wrote since -- in ONE forward pass: the chunks of all rows are
packed into one [J, hidden] matrix for the projections and MLP (no padding FLOPs); attention reads the row's
prompt (grouped by prompt, never copied per row) and its completion cache; the last layer runs only at each
row's newest position, and logits are computed there alone. The idle model does nothing until its next turn.

The forward reproduces the HF modules op for op (RMSNorm in float32 like HF, the model's own rotary module for
cos/sin); `self_check` compares it with the model's own forward on every code path before first use. Used by
the `hf` backend (`backends/hf.py`, catch-up rounds) and by the lockstep reference's `fast` forward
(`lockstep.py`), which is why it lives in neither.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

SUPPORTED_TYPES = ("qwen3", "qwen2", "llama", "mistral")
STATIC_ROPE = ("default", "linear", "llama3", "yarn")
MERGE_C = 8  # catch-up chunks up to this long share one attention call with the one-token rows
COMPACT_AT = 0.75  # drop finished rows from a cache once a quarter of its rows are finished


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
    if mtype == "mistral" and getattr(cfg, "sliding_window", None):
        return "Mistral with a sliding window"
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


def _group_rows(u_R: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Slot of each row in a [prompt, rank-within-prompt] grid (flattened: u * mx + rank), and mx, the largest
    number of rows sharing one prompt."""
    R = u_R.numel()
    u_sorted, order = torch.sort(u_R, stable=True)
    _, counts = torch.unique_consecutive(u_sorted, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    j_sorted = torch.arange(R, device=u_R.device) - torch.repeat_interleave(starts, counts)
    j_R = torch.empty_like(j_sorted)
    j_R[order] = j_sorted
    mx = int(counts.max())
    return u_R * mx + j_R, mx


class FastDecoder:
    """One model's KV caches for a batch and the catch-up forward (see the module docstring).

    Two caches per layer, so that the rows of a GRPO group share their prompt's keys and values:
    - prompt cache  `pk/pv[l]`: [Hkv, U, Pm, D], one row per distinct prompt, slots [0, Pm) with Pm = p_max - 1
      (every prompt token but the last, left-padded; `pbias_PS` is -inf on pad slots);
    - completion cache `ck/cv[l]`: [P, Hkv, T, D], one row per live batch row, slot s at index s - Pm (the last
      prompt token, then the completion).
    Rows are named by their batch index b ("logical"); the completion cache stores them at physical rows
    `phys_B[b]`, so finished rows can be dropped (`compact`) and later rounds run on cache views.
    Attention over a row's history is one softmax over [prompt scores, completion scores].
    """

    def __init__(self, model: Any):
        reason = unsupported_reason(model)
        if reason:
            raise ValueError(f"FastDecoder cannot run this model: {reason}")
        self.model = model
        cfg = model.config
        attn0 = model.model.layers[0].self_attn
        self.head_dim = attn0.head_dim
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.scale = float(attn0.scaling)
        self.pk: list[torch.Tensor] = []
        self.pv: list[torch.Tensor] = []
        self.ck: list[torch.Tensor] = []
        self.cv: list[torch.Tensor] = []

    # ---------------------------------------------------------------------------------------------
    def start(self, hist_BS: torch.Tensor, off_B: torch.Tensor, p_max: int) -> None:
        """Allocate caches for a batch (history buffer `hist_BS`, left pads `off_B`) and encode its prompts.

        Every prompt token but the last is encoded here, once per distinct prompt; the last one is left to the
        first catch-up, which yields the logits of the first completion token.
        """
        p = next(self.model.parameters())
        dev = self.device = p.device
        self.dtype = p.dtype
        B, S_max = hist_BS.shape
        Z, D = self.n_kv, self.head_dim
        self.Pm = Pm = p_max - 1
        self.T = S_max - Pm
        n_layers = len(self.model.model.layers)
        off_B = off_B.to(dev)
        if Pm > 0:
            prefix_BS = hist_BS[:, :Pm].to(dev)
            _, inv_B = torch.unique(prefix_BS, dim=0, return_inverse=True)
            P = int(inv_B.max()) + 1
            first_P = torch.full((P,), B, dtype=torch.int64, device=dev).scatter_reduce(
                0, inv_B, torch.arange(B, device=dev), reduce="amin")
        else:
            inv_B, P, first_P = torch.zeros(B, dtype=torch.int64, device=dev), 0, None
        self.P = P
        self.u_B = inv_B  # distinct prompt of each row
        self.phys_B = torch.arange(B, device=dev)
        self.n_phys = B
        self.off_Y = off_B.clone()
        self.cached_B = torch.full((B,), Pm, dtype=torch.int64, device=dev)
        slots = torch.arange(S_max, device=dev)
        dummy = torch.empty(1, dtype=self.dtype, device=dev)
        cos, sin = self.model.model.rotary_emb(dummy, slots[None, :])
        self.cos_SD, self.sin_SD = cos[0], sin[0]
        # zeros, not empty: masked slots get probability 0, but 0 * uninitialised memory can be NaN
        self.ck = [torch.zeros(B, Z, self.T, D, dtype=self.dtype, device=dev) for _ in range(n_layers)]
        self.cv = [torch.zeros(B, Z, self.T, D, dtype=self.dtype, device=dev) for _ in range(n_layers)]
        # kv-head-major, so that [G * U, Pm, D] is a view for the grouped matmuls of `_attn`
        self.pk = [torch.zeros(Z, P, Pm, D, dtype=self.dtype, device=dev) for _ in range(n_layers)]
        self.pv = [torch.zeros(Z, P, Pm, D, dtype=self.dtype, device=dev) for _ in range(n_layers)]
        if P:
            off_P = off_B[first_P]
            self.pbias_PS = torch.zeros(P, Pm, dtype=self.dtype, device=dev).masked_fill(
                slots[None, :Pm] < off_P[:, None], float("-inf"))
            self._encode_prompts(hist_BS[first_P].to(dev), off_P)

    def release(self) -> None:
        self.pk, self.pv, self.ck, self.cv = [], [], [], []

    def compact(self, keep_B: torch.Tensor) -> None:
        """Drop the completion-cache rows of rows not in `keep_B` (bool over logical rows), keeping order."""
        keep_B = keep_B.to(self.device) & (self.phys_B >= 0)
        src_Y = self.phys_B[keep_B]
        if src_Y.numel() == self.n_phys:
            return
        self.ck = [c[src_Y] for c in self.ck]
        self.cv = [c[src_Y] for c in self.cv]
        self.off_Y = self.off_Y[src_Y]
        self.n_phys = int(src_Y.numel())
        self.phys_B = torch.full_like(self.phys_B, -1)
        self.phys_B[keep_B] = torch.arange(self.n_phys, device=self.device)

    # ---------------------------------------------------------------------------------------------
    def _layer_qkv(self, layer: Any, h_J: torch.Tensor, cos_N1D: torch.Tensor, sin_N1D: torch.Tensor):
        at, ln = layer.self_attn, layer.input_layernorm
        J, H, Z, D = h_J.shape[0], self.n_heads, self.n_kv, self.head_dim
        x = _rms(h_J, ln.weight, ln.variance_epsilon)
        q = F.linear(x, at.q_proj.weight, at.q_proj.bias).view(J, H, D)
        k = F.linear(x, at.k_proj.weight, at.k_proj.bias).view(J, Z, D)
        v = F.linear(x, at.v_proj.weight, at.v_proj.bias).view(J, Z, D)
        if hasattr(at, "q_norm"):
            q = _rms(q, at.q_norm.weight, at.q_norm.variance_epsilon)
            k = _rms(k, at.k_norm.weight, at.k_norm.variance_epsilon)
        q = q * cos_N1D + _rotate_half(q) * sin_N1D
        k = k * cos_N1D + _rotate_half(k) * sin_N1D
        return q, k, v

    @staticmethod
    def _layer_rest(layer: Any, h_J: torch.Tensor, attn_J: torch.Tensor) -> torch.Tensor:
        at, mlp, ln = layer.self_attn, layer.mlp, layer.post_attention_layernorm
        h_J = h_J + F.linear(attn_J, at.o_proj.weight, at.o_proj.bias)
        x = _rms(h_J, ln.weight, ln.variance_epsilon)
        gate = F.linear(x, mlp.gate_proj.weight, mlp.gate_proj.bias)
        up = F.linear(x, mlp.up_proj.weight, mlp.up_proj.bias)
        return h_J + F.linear(mlp.act_fn(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)

    def _encode_prompts(self, ids_PS: torch.Tensor, off_P: torch.Tensor) -> None:
        """Fill the prompt cache: all U distinct prompts, slots [0, Pm), pads included (masked as keys)."""
        P, Pm, H, D = self.P, self.Pm, self.n_heads, self.head_dim
        ids = ids_PS[:, :Pm]
        pos_PS = (torch.arange(Pm, device=self.device)[None, :] - off_P[:, None]).clamp(min=0)
        cos, sin = self.cos_SD[pos_PS].view(P * Pm, 1, D), self.sin_SD[pos_PS].view(P * Pm, 1, D)
        eye = torch.eye(Pm, dtype=torch.bool, device=self.device)
        causal = torch.ones(Pm, Pm, dtype=torch.bool, device=self.device).tril()
        # a pad query attends to itself only, so that no row is fully masked (finite values everywhere)
        mask = ((self.pbias_PS == 0)[:, None, None, :] & causal[None, None]) | eye[None, None]
        m = self.model.model
        h = m.embed_tokens(ids).view(P * Pm, -1)
        for li, layer in enumerate(m.layers):
            q, k, v = self._layer_qkv(layer, h, cos, sin)
            self.pk[li].copy_(k.view(P, Pm, self.n_kv, D).permute(2, 0, 1, 3))
            self.pv[li].copy_(v.view(P, Pm, self.n_kv, D).permute(2, 0, 1, 3))
            if li == len(m.layers) - 1:
                break  # the last layer's output feeds no cache
            o = F.scaled_dot_product_attention(q.view(P, Pm, H, D).transpose(1, 2), self.pk[li].transpose(0, 1),
                                               self.pv[li].transpose(0, 1), attn_mask=mask, scale=self.scale,
                                               enable_gqa=H != self.n_kv)
            h = self._layer_rest(layer, h, o.transpose(1, 2).reshape(P * Pm, H * D))

    # ---------------------------------------------------------------------------------------------
    def _attn(self, q_RCHD: torch.Tensor, phys_R: torch.Tensor | None, u_R: torch.Tensor,
              grp: tuple[torch.Tensor, int] | None, li: int, tq: int) -> torch.Tensor:
        """Attention of C queries per row at completion indices tq-C .. tq-1 over the row's prompt and its
        completion keys [0, tq) (causal within the completion). Returns [R, C, H*D].

        Completion part: rows `phys_R` of the completion cache (None = every physical row, in order: cache
        views, no copy). Prompt part: the queries are grouped by prompt ([U, group, ...]) so that each distinct
        prompt's keys are read once and never copied per row. One softmax over both parts, in batched matmuls
        over kv-head groups (no head expansion; q heads [i*Hg, (i+1)*Hg) share kv head i, as HF's repeat_kv).
        """
        R, C, H, D = q_RCHD.shape
        Z, Hg = self.n_kv, self.n_heads // self.n_kv
        ck, cv = self.ck[li][:, :, :tq], self.cv[li][:, :, :tq]
        if phys_R is not None:
            ck, cv = ck.index_select(0, phys_R), cv.index_select(0, phys_R)
        q_RZCHD = q_RCHD.view(R, C, Z, Hg, D).permute(0, 2, 1, 3, 4)
        sc = torch.bmm(q_RZCHD.reshape(R * Z, C * Hg, D), ck.reshape(R * Z, tq, D).transpose(1, 2))
        sc = sc.view(R, Z, C, Hg, tq) * self.scale
        if C > 1:
            q_idx = torch.arange(tq - C, tq, device=self.device)
            future_CT = torch.arange(tq, device=self.device)[None, :] > q_idx[:, None]
            sc = sc.masked_fill(future_CT[None, None, :, None, :], float("-inf"))
        if self.P:
            idx_R, mx = grp
            P, Pm, X = self.P, self.Pm, C * Hg
            q_ZRX = q_RZCHD.permute(1, 0, 2, 3, 4).reshape(Z, R, X * D)
            q_ZPX = q_ZRX.new_zeros((Z, P * mx, X * D)).index_copy_(1, idx_R, q_ZRX)
            sp = torch.bmm(q_ZPX.view(Z * P, mx * X, D), self.pk[li].view(Z * P, Pm, D).transpose(1, 2))
            sp = sp.view(Z, P * mx, X * Pm).index_select(1, idx_R).view(Z, R, C, Hg, Pm).permute(1, 0, 2, 3, 4)
            sp = sp * self.scale + self.pbias_PS.index_select(0, u_R)[:, None, None, None, :]
            probs = torch.softmax(torch.cat((sp, sc), dim=-1), dim=-1)
            pc = probs[..., Pm:]
        else:
            probs = pc = torch.softmax(sc, dim=-1)
        out = torch.bmm(pc.reshape(R * Z, C * Hg, tq), cv.reshape(R * Z, tq, D)).view(R, Z, C, Hg, D)
        if self.P:
            p_ZRX = probs[..., :Pm].permute(1, 0, 2, 3, 4).reshape(Z, R, X * Pm)
            p_ZPX = p_ZRX.new_zeros((Z, P * mx, X * Pm)).index_copy_(1, idx_R, p_ZRX)
            op = torch.bmm(p_ZPX.view(Z * P, mx * X, Pm), self.pv[li].view(Z * P, Pm, D))
            out = out + op.view(Z, P * mx, X * D).index_select(1, idx_R).view(Z, R, C, Hg, D).permute(1, 0, 2, 3, 4)
        return out.permute(0, 2, 1, 3, 4).reshape(R, C, H * D)

    def catch_up(self, hist_BS: torch.Tensor, rows_R: torch.Tensor, slot: int) -> torch.Tensor:
        """Encode slots [cached_r, slot) of each row r of `rows_R` (sorted ascending) in one forward pass and
        return the next-token logits at slot - 1, [R, V]."""
        dev = self.device
        rows_R = rows_R.to(dev)
        R = rows_R.numel()
        cached_R, phys_R, u_R = self.cached_B[rows_R], self.phys_B[rows_R], self.u_B[rows_R]
        c_R = slot - cached_R
        C = int(c_R.max())
        if int(c_R.min()) < 1 or int(phys_R.min()) < 0:
            raise RuntimeError("catch_up: a row is already encoded up to the frontier, or was compacted away")
        tq = slot - self.Pm
        if C == 1:
            rows_J, phys_J = rows_R, phys_R
            slots_J = torch.full((R,), slot - 1, dtype=torch.int64, device=dev)
            last_R = torch.arange(R, device=dev)
        else:
            # Right-align every row's chunk in a [R, C] grid; keep only the real (not yet encoded) slots.
            slots_C = torch.arange(slot - C, slot, device=dev)
            keep_RC = slots_C[None, :] >= cached_R[:, None]
            r_loc_N, j_J = keep_RC.nonzero(as_tuple=True)  # row-major: each row's tokens contiguous, in order
            rows_J, phys_J, slots_J = rows_R[r_loc_N], phys_R[r_loc_N], slots_C[j_J]
            last_R = torch.cumsum(c_R, 0) - 1
            grid_RC = torch.cumsum(keep_RC.flatten().to(torch.int64), 0).view(R, C) - 1
            grid_RC = torch.where(keep_RC, grid_RC, -1)  # packed index of each real cell, -1 on padding
            dec_loc = (c_R == 1).nonzero().flatten()
            dec_q = last_R[dec_loc]
            dec_grp = _group_rows(u_R[dec_loc]) if self.P and dec_loc.numel() else None
            ch_loc = (c_R > 1).nonzero().flatten()
            ch_grid = grid_RC[ch_loc]
            ch_real = ch_grid >= 0
            ch_src, ch_dst = ch_grid.clamp(min=0), ch_grid[ch_real]
            ch_grp = _group_rows(u_R[ch_loc]) if self.P else None
            all_real = grid_RC >= 0
            all_src = grid_RC.clamp(min=0)
        ids_J = hist_BS[rows_J.to(hist_BS.device), slots_J.to(hist_BS.device)].to(dev)
        pos_J = slots_J - self.off_Y[phys_J]
        cos_N1D, sin_N1D = self.cos_SD[pos_J][:, None, :], self.sin_SD[pos_J][:, None, :]
        all_phys = None if R == self.n_phys else phys_R  # sorted rows + order-preserving phys map
        grp = _group_rows(u_R) if self.P else None
        H, Z, D = self.n_heads, self.n_kv, self.head_dim
        w_idx = (phys_J[:, None], torch.arange(Z, device=dev)[None, :], (slots_J - self.Pm)[:, None])
        m = self.model.model
        h_J = m.embed_tokens(ids_J)
        J = h_J.shape[0]
        n_last = len(m.layers) - 1
        for li, layer in enumerate(m.layers):
            q, k, v = self._layer_qkv(layer, h_J, cos_N1D, sin_N1D)
            self.ck[li].index_put_(w_idx, k)
            self.cv[li].index_put_(w_idx, v)
            if li == n_last or C == 1:
                # The last layer only matters at each row's newest slot (its keys/values for the whole chunk
                # are written above), so it attends and runs its MLP for those R queries alone.
                if C > 1:
                    q, h_J = q[last_R], h_J[last_R]
                attn = self._attn(q[:, None], all_phys, u_R, grp, li, tq)[:, 0]
            elif C <= MERGE_C:
                # short chunks: every row in one call, one-token rows padded to C queries (fewer small ops)
                attn = self._attn(q[all_src], all_phys, u_R, grp, li, tq)[all_real]
            else:
                attn = torch.empty(J, H * D, dtype=q.dtype, device=dev)
                if dec_loc.numel():
                    attn[dec_q] = self._attn(q[dec_q][:, None], phys_R[dec_loc], u_R[dec_loc], dec_grp, li,
                                             tq)[:, 0]
                o = self._attn(q[ch_src], phys_R[ch_loc], u_R[ch_loc], ch_grp, li, tq)  # [Rc, C, H*D]
                attn[ch_dst] = o[ch_real]
            h_J = self._layer_rest(layer, h_J, attn)
        self.cached_B[rows_R] = slot
        h_R = _rms(h_J, m.norm.weight, m.norm.variance_epsilon)
        head = self.model.lm_head
        return F.linear(h_R, head.weight, getattr(head, "bias", None))


def self_check(model: Any, atol: float | None = None) -> None:
    """Compare `FastDecoder` with the model's own forward on a short ragged batch; raise if they differ.

    Covers every code path: deduplicated prompt prefill (rows 0 and 2 share a prompt), left padding (row 1),
    a whole-batch decode, a decode on a subset, rounds mixing short and long (> MERGE_C) catch-ups with
    one-token rows, and decodes after compaction. Cheap: a few dozen forwards over at most 20 tokens.
    """
    p = next(model.parameters())
    V = int(model.config.vocab_size)
    gen = torch.Generator().manual_seed(1234)
    lens, n_new = [5, 3, 5], 15
    p_max, total = max(lens), max(lens) + n_new
    hist = torch.zeros(3, total, dtype=torch.int64)
    off = torch.tensor([p_max - n for n in lens])
    for b, n in enumerate(lens):
        hist[b, off[b]:] = torch.randint(0, V, (n + n_new,), generator=gen)
    hist[2, :p_max] = hist[0, :p_max]
    hist = hist.to(p.device)
    dec = FastDecoder(model)
    was_training = model.training
    model.eval()
    tol = atol if atol is not None else (1e-3 if p.dtype in (torch.float32, torch.float64) else 5e-2)
    try:
        with torch.no_grad():
            dec.start(hist, off, p_max)
            plan = [([0, 1, 2], p_max), ([1], p_max + 1), ([1], p_max + 2), ([0, 1], p_max + 3),
                    ([0, 1, 2], p_max + 4), (None, None), ([0, 1], p_max + 5)]
            plan += [([1], p_max + i) for i in range(6, 15)] + [([0, 1], p_max + 15)]  # a chunk > MERGE_C
            for rows, slot in plan:
                if rows is None:
                    dec.compact(torch.tensor([True, True, False]))
                    continue
                logits = dec.catch_up(hist, torch.tensor(rows), slot)
                for i, b in enumerate(rows):
                    ref = model(input_ids=hist[b:b + 1, int(off[b]):slot]).logits[0, -1]
                    err = float((logits[i].float() - ref.float()).abs().max())
                    if err > tol * max(1.0, float(ref.abs().max())):
                        raise RuntimeError(
                            f"FastDecoder disagrees with {type(model).__name__}'s forward (max |logit diff| "
                            f"{err:.3g} at row {b}, slot {slot}); use TandemEngine(..., hf=HFOptions(fast=False))")
    finally:
        dec.release()
        model.train(was_training)

