"""Kimi Linear math (kimi-mini is a set of its presets), shared by both engines: the KDA mixer,
the MLA mixer with its optional sparse indexer, and the MoE (or dense) feed-forward. The vLLM rollout model (rollout/kimi.py) and the Megatron trainer
(trainer/megatron/kimi.py) call these very functions; each engine only supplies its parameters and the
per-request context (the trainer: the whole sequence; vLLM: its caches and recurrent state).

Modules passed in as `m` follow the HF checkpoint names (a linear is any callable submodule;
engines add their LoRA delta inside it through `adapted_linear`):

- KDA: q_proj k_proj v_proj f_a_proj f_b_proj b_proj o_proj, the low-rank output gate
  g_a_proj -> g_b_proj, conv1d.weight [3HD, K] (the checkpoint's q/k/v_conv1d stacked),
  dt_bias [HD], A_log (H values, any shape), o_norm.weight [D].
- MLA: q_proj (with q_lora_rank: q_a_proj, q_a_layernorm.weight, q_b_proj) kv_a_proj_with_mqa
  kv_b_proj o_proj (with mla_use_output_gate: g_proj too), kv_a_layernorm.weight [C], and with
  an indexer DeepSeek-V3.2's indexer.wq_b indexer.wk indexer.k_norm.{weight,bias}
  indexer.weights_proj (index_query_source "latent"), or old kimi-mini's indexer.wq indexer.wk
  indexer.weights_proj ("hidden", parity/kimi_formats.py).
- MoE: gate.weight [E, h] and gate.e_score_correction_bias [E] (router),
  experts[e].gate_up_proj / down_proj, shared_experts.gate_up_proj / down_proj ([gate; up]
  fused, as Megatron holds them); a dense layer's MLP: gate_up_proj / down_proj.

The model computes the function of its reference: transformers' KimiLinearForCausalLM
(tests/integration/test_kimi_linear.py compares logits), its optional indexer transformers'
DeepseekV32Indexer (tests/unit/test_kimi_indexer.py), its optional MLA output gate Kimi K3's as
vLLM's kimi_k3 model applies it; an old kimi-mini directory, converted, the old model's bit for
bit (tests/integration/test_kimi_mini_format.py).

Why each piece is batch invariant and identical between decode and training:

- KDA runs its recurrence token by token in both engines (the chunked WY form reorders sums).
  A step is element-wise products plus two products S^T k, S^T q on the compiled `bmm` (one
  fixed-order FMA chain over dk per element) of an fp32 state laid out [H, dv, dk], so a row's
  bits depend only on its own values; training walks a whole
  sequence with the same step that decode runs once. The short conv is a fixed-order sum of K
  products over a window that the rollout side fills from its conv state.
- The indexer scores each (query, key-block) pair with a fixed-shape `bmm` and reduces
  over index heads with `row_sum`; top-k is a stable descending sort (ties: lower position
  first) over positions 0..t, whatever the padded length.
- MLA uses the non-absorbed form on both sides: the selected latents are expanded with
  kv_b_proj (a row-wise invariant linear) and attended with `kernels.attention`, each query
  over its own gathered context of <= index_topk keys in position order.
- MoE routes with an fp32 router and a stable top-k; each expert runs on the rows routed to it
  through the tiled linear (a row's result does not depend on how many rows share the call);
  the weighted sum over the top-k slots runs in slot order in fp32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from parity import fp8, kernels
from parity import moe as moe_lib
from parity.kernels import KV_BLOCK, bmm, exp, row_sum, rsqrt, sigmoid, silu, softplus
from parity.model_spec import KimiSpec

Pair = tuple[torch.Tensor, torch.Tensor]
L2_EPS = 1e-6


def adapted_linear(
    x: torch.Tensor, weight: torch.Tensor, parts: Sequence[tuple[str, int]],
    pairs: dict[str, Pair], scaling: float, packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """linear(x, W) plus the LoRA delta of each covered part (parts: (name, out size) in the
    weight's row order; uncovered parts add exact zeros). Both engines' linears end here.
    `packed`: the caller's pack of W (kernels.linear), if it keeps one."""
    out = kernels.linear(x, weight, packed=packed)
    if not pairs:
        return out
    deltas = [
        kernels.linear(kernels.linear(x, pairs[n][0]), pairs[n][1]) * scaling if n in pairs
        else x.new_zeros(*x.shape[:-1], size)
        for n, size in parts
    ]
    return out + (torch.cat(deltas, dim=-1) if len(deltas) > 1 else deltas[0])


# --- KDA ------------------------------------------------------------------------------------------


def _l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * rsqrt(row_sum(x * x) + L2_EPS).unsqueeze(-1)


def _request_rows(lengths: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens are grouped by request, in order: (request of each token, its index in the request,
    offset of each request)."""
    lens = torch.tensor(list(lengths), dtype=torch.int64)
    offsets = torch.cumsum(lens, 0) - lens
    req = torch.repeat_interleave(torch.arange(len(lens)), lens)
    return req, torch.arange(int(lens.sum())) - offsets[req], offsets


def kda_recurrence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, lengths: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The KDA (gated delta rule) recurrence over tokens grouped by request (`lengths`, in order):

        S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T q_t

    q, k [N, H, dk] (kda_mixer passes q already scaled by dk^-0.5 and both L2-normalised),
    v [N, H, dv], alpha [N, H, dk] the per-channel decay exp(g) in (0, 1], beta [N, H], all fp32;
    state [R, H, dv, dk] fp32: each request's S^T before its first token. Returns
    (o [N, H, dv] fp32, new state [R, H, dv, dk]).

    One token per request per step; S^T is [dv, dk] so that both S^T k and S^T q are products
    over the contiguous last axis on the compiled `bmm`.
    """
    n, nh, dv = v.shape
    num_reqs, max_len = len(lengths), max(lengths)
    _, _, offsets = _request_rows(lengths)
    lens = torch.tensor(list(lengths), dtype=torch.int64)
    outs, rows_seen = [], []
    for j in range(max_len):
        active = (lens > j).nonzero().squeeze(1)
        everyone = active.numel() == num_reqs
        rows = offsets[active] + j
        s = state if everyone else state[active]
        s = s * alpha[rows].unsqueeze(2)
        # S^T k and S^T q: one fixed-order product per (token, head) on the compiled GEMM.
        u = beta[rows].unsqueeze(-1) * (v[rows] - bmm(s, k[rows].unsqueeze(-1)).squeeze(-1))  # [n, H, dv]
        s = s + u.unsqueeze(-1) * k[rows].unsqueeze(2)
        outs.append(bmm(s, q[rows].unsqueeze(-1)).squeeze(-1))
        rows_seen.append(rows)
        state = s if everyone else state.index_copy(0, active, s)
    o = torch.zeros(n, nh, dv).index_put((torch.cat(rows_seen),), torch.cat(outs))
    return o, state


def kda_mixer(
    m, spec: KimiSpec, h: torch.Tensor, lengths: Sequence[int], conv_state: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One KDA layer over tokens h [N, hidden] grouped by request (`lengths`, in order).

    conv_state [R, K-1, 3HD] fp32: each request's last K-1 pre-conv q/k/v inputs (zeros for a
    new sequence); state [R, H, dv, dk] fp32: each request's recurrent state S^T (zeros for a
    new sequence). Returns (output [N, hidden] in h's dtype, new conv_state, new state).
    """
    n = h.shape[0]
    nh, d, k_size = spec.kda_num_heads, spec.kda_head_dim, spec.kda_conv_size
    num_reqs, max_len = len(lengths), max(lengths)
    req, idx, _ = _request_rows(lengths)

    # Short causal depthwise conv: window = [the request's K-1 earlier inputs; this chunk].
    raw = torch.cat([m.q_proj(h), m.k_proj(h), m.v_proj(h)], dim=-1).float()  # [N, 3HD]
    chunk = raw.new_zeros(num_reqs, max_len, raw.shape[-1])
    chunk[req, idx] = raw
    seq = torch.cat([conv_state, chunk], dim=1)  # [R, K-1+T, 3HD]
    w = m.conv1d.weight.float()  # [3HD, K]
    conv = seq[:, 0:max_len] * w[:, 0]
    for j in range(1, k_size):
        conv = conv + seq[:, j : j + max_len] * w[:, j]
    lens = torch.tensor(list(lengths), dtype=torch.int64)
    tail = lens.view(-1, 1) + torch.arange(k_size - 1)  # seq rows of each request's last K-1 inputs
    new_conv_state = seq.gather(1, tail.unsqueeze(-1).expand(-1, -1, seq.shape[-1]))
    x = silu(conv[req, idx])  # [N, 3HD]
    q, k, v = (t.reshape(n, nh, d) for t in x.split(nh * d, dim=-1))
    q = _l2_normalize(q) * (d**-0.5)
    k = _l2_normalize(k)

    # Channel-wise decay (log space) and the per-head delta-rule step size.
    f = m.f_b_proj(m.f_a_proj(h)).float() + m.dt_bias.float()
    a = exp(m.A_log.float().reshape(nh))
    g = -(a.view(1, nh, 1) * softplus(f).view(n, nh, d))
    alpha = exp(g)  # [N, H, dk]
    beta = sigmoid(m.b_proj(h).float())  # [N, H]
    o, state = kda_recurrence(q, k, v, alpha, beta, state, lengths)

    # Per-head RMSNorm, sigmoid low-rank output gate, output projection.
    gate = m.g_b_proj(m.g_a_proj(h))
    o = kernels.rms_norm(o, m.o_norm.weight, spec.rms_norm_eps)
    o = o * sigmoid(gate.float()).view(n, nh, d)
    return m.o_proj(o.reshape(n, nh * d).to(h.dtype)), new_conv_state, state


# --- MLA + indexer --------------------------------------------------------------------------------


def _cached(spec: KimiSpec, entry: torch.Tensor) -> torch.Tensor:
    """A cache entry as a reader of the cache sees it: with an FP8 cache, each part rounded
    to e4m3 under its own per-token scale (the rollout stores exactly these values; the
    trainer attends over them too)."""
    return fp8.fake_quantize_groups(entry, spec.mla_cache_parts) if spec.kv_cache_dtype == "fp8" else entry


def mla_entries(
    m, spec: KimiSpec, h: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Per-token MLA inputs: (q [N, Hm, dn+dr] with RoPE on its last dr, cache entry
    [N, mla_cache_width] = [RMS-normed latent; RoPE key; index key] in h's dtype, as the cache
    keeps it (rounded to FP8 with spec.kv_cache_dtype "fp8"), index
    queries [N, hI, dI] fp32, index head weights [N, hI] fp32). With `mla_use_nope` the last
    dr of q and the shared key stay unrotated; without an indexer the entry ends at the key
    and the index outputs are None."""
    n = h.shape[0]
    hm, dn, dr, dc = spec.num_attention_heads, spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.kv_lora_rank
    q_latent = None
    if spec.q_lora_rank:
        q_latent = kernels.rms_norm(m.q_a_proj(h), m.q_a_layernorm.weight, spec.kv_layernorm_eps)
        q = m.q_b_proj(q_latent).view(n, hm, dn + dr)
    else:
        q = m.q_proj(h).view(n, hm, dn + dr)
    kv = m.kv_a_proj_with_mqa(h)
    latent = kernels.rms_norm(kv[:, :dc], m.kv_a_layernorm.weight, spec.kv_layernorm_eps)
    k_pe = kv[:, dc:]
    if not spec.mla_use_nope:
        table = kernels.rope_table(dr, spec.rope_theta, spec.max_position_embeddings)
        q = torch.cat([q[..., :dn], kernels.apply_rope(q[..., dn:], positions, table)], dim=-1)
        k_pe = kernels.apply_rope(k_pe.reshape(n, 1, dr), positions, table).view(n, dr)
    if not spec.has_indexer:
        return q, _cached(spec, torch.cat([latent.to(h.dtype), k_pe], dim=-1)), None, None
    if spec.index_query_source == "latent":
        index_q, index_k, index_w = _v32_index_inputs(m.indexer, spec, h, q_latent, positions)
    else:  # old kimi-mini's indexer: every input a plain projection of h
        index_k = m.indexer.wk(h)
        index_q = m.indexer.wq(h).view(n, spec.index_n_heads, spec.index_head_dim).float()
        index_w = m.indexer.weights_proj(h).float()
    entry = _cached(spec, torch.cat([latent.to(h.dtype), k_pe, index_k], dim=-1))
    return q, entry, index_q, index_w


def _layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """torch.nn.LayerNorm over the last dim, in fp32, cast back to x's dtype. Row-wise: the mean
    and the variance are row_sums in a fixed order, the rest is element-wise."""
    xf = x.float()
    d = xf.shape[-1]
    centered = xf - (row_sum(xf) / d).unsqueeze(-1)
    inv = rsqrt(row_sum(centered * centered) / d + eps).unsqueeze(-1)
    return (centered * inv * weight.float() + bias.float()).to(x.dtype)


V32_K_NORM_EPS = 1e-6  # DeepseekV32Indexer builds k_norm as nn.LayerNorm(index_head_dim, eps=1e-6)


def _v32_index_inputs(
    ix, spec: KimiSpec, h: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The indexer inputs of index_query_source "latent", DeepSeek-V3.2's function (transformers'
    DeepseekV32Indexer.forward): index queries wq_b(q latent) [N, hI, dI] and the index key
    k_norm(wk(h)) [N, dI] (LayerNorm with a bias), both with rotate-half RoPE on their first
    qk_rope_head_dim dims (the indexer rotates even where the MLA keys are NoPE); head weights
    weights_proj(h) * hI^-0.5 * dI^-0.5, the reference's softmax scale folded in (it multiplies
    ReLU'd dots by dI^-0.5, a positive factor, so where it sits changes rounding only).
    Returns (index_q fp32, index_k in h's dtype, as cached, index_w fp32)."""
    n, hi, di, dr = h.shape[0], spec.index_n_heads, spec.index_head_dim, spec.qk_rope_head_dim
    table = kernels.rope_table(dr, spec.rope_theta, spec.max_position_embeddings)
    q = ix.wq_b(q_latent).view(n, hi, di)
    q = torch.cat([kernels.apply_rope(q[..., :dr].contiguous(), positions, table), q[..., dr:]], dim=-1)
    k = _layer_norm(ix.wk(h), ix.k_norm.weight, ix.k_norm.bias, V32_K_NORM_EPS)
    k_rot = kernels.apply_rope(k[:, :dr].reshape(n, 1, dr).contiguous(), positions, table).view(n, dr)
    k = torch.cat([k_rot, k[:, dr:]], dim=-1)
    w = ix.weights_proj(h).float() * (hi**-0.5 * di**-0.5)
    return q.float(), k, w


def indexer_scores(
    spec: KimiSpec, index_q: torch.Tensor, index_w: torch.Tensor, index_k: torch.Tensor,
    q_seq: torch.Tensor, q_pos: torch.Tensor,
) -> torch.Tensor:
    """The indexer's scores I[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s]) for s <= t, -inf
    elsewhere: [N, Lp] fp32, Lp = L rounded up to whole key blocks and to at least index_topk.

    index_k [R, L, dI]: each sequence's index keys at positions 0..L-1."""
    n, topk = index_q.shape[0], spec.index_topk
    length = index_k.shape[1]
    padded = max(-(-length // KV_BLOCK) * KV_BLOCK, topk)
    kt = F.pad(index_k.float(), (0, 0, 0, padded - length)).transpose(1, 2).contiguous()  # [R, dI, Lp]
    scores = torch.full((n, padded), -math.inf)
    offsets = torch.arange(KV_BLOCK)
    num_blocks = int(q_pos.max()) // KV_BLOCK + 1 if n else 0
    for j in range(num_blocks):
        start = j * KV_BLOCK
        rows = torch.arange(n) if j == 0 else (q_pos >= start).nonzero().squeeze(1)
        kb = kt[q_seq[rows], :, start : start + KV_BLOCK]  # [r, dI, B]
        dots = bmm(index_q[rows], kb)  # [r, hI, B]
        weighted = dots.clamp_min(0.0) * index_w[rows].unsqueeze(-1)
        block = row_sum(weighted.transpose(1, 2))  # [r, B], summed over index heads
        valid = (start + offsets).unsqueeze(0) <= q_pos[rows].unsqueeze(1)
        scores[rows, start : start + KV_BLOCK] = block.masked_fill(~valid, -math.inf)
    return scores


def indexer_topk(
    spec: KimiSpec, index_q: torch.Tensor, index_w: torch.Tensor, index_k: torch.Tensor,
    q_seq: torch.Tensor, q_pos: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sparse indexer's top-k of `indexer_scores` (same arguments). Returns (selected
    [N, topk] int64 positions in ascending order, padded with 0; count [N] = min(t + 1, topk))."""
    topk = spec.index_topk
    scores = indexer_scores(spec, index_q, index_w, index_k, q_seq, q_pos)
    padded = scores.shape[1]
    # Stable: equal scores keep position order. Positions past t score -inf and sort last.
    best = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :topk]
    count = torch.clamp(q_pos + 1, max=topk)
    rank = torch.arange(topk).unsqueeze(0)
    best = torch.where(rank < count.unsqueeze(1), best, padded)  # unused ranks sort last
    selected = torch.sort(best, dim=-1).values
    return torch.where(rank < count.unsqueeze(1), selected, 0), count


def mla_gate(m, spec: KimiSpec, h: torch.Tensor) -> torch.Tensor | None:
    """The MLA output gate's pre-activation g_proj(h) [N, Hm * dv] for the layer's input h, or
    None without one (spec.mla_output_gate: kimi-linear's mla_use_output_gate)."""
    return m.g_proj(h) if spec.mla_output_gate else None


def _mla_output(m, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """o_proj of the attention output [N, Hm * dv], gated element-wise by sigmoid(gate) first
    when there is a gate. The gate is Kimi K3's (vLLM 0.32,
    vllm/models/kimi_k3/nvidia/mla.py: `attn_out * g_proj(hidden_states).sigmoid()` before
    o_proj); here the sigmoid and the product run in fp32 and round once to the model dtype."""
    if gate is not None:
        out = (out.float() * sigmoid(gate.float())).to(out.dtype)
    return m.o_proj(out)


def mla_attend(
    m, spec: KimiSpec, q: torch.Tensor, ctx: torch.Tensor, q_seq: torch.Tensor,
    selected: torch.Tensor, count: torch.Tensor, gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """MLA over the indexer's positions. ctx [R, L, entry width]: each sequence's cache entries
    (mla_entries) at positions 0..L-1; gate: mla_gate's. Returns the o_proj output [N, hidden]."""
    n = q.shape[0]
    hm, dn, dr, dc, dv = (
        spec.num_attention_heads, spec.qk_nope_head_dim, spec.qk_rope_head_dim,
        spec.kv_lora_rank, spec.v_head_dim,
    )
    chosen = ctx[q_seq.unsqueeze(1), selected]  # [N, topk, width]
    kv = m.kv_b_proj(chosen[..., :dc]).view(n, -1, hm, dn + dv)
    k_pe = chosen[..., dc : dc + dr].unsqueeze(2).expand(-1, -1, hm, -1)
    k = torch.cat([kv[..., :dn], k_pe], dim=-1)
    # kernels.attention takes one head size for q, k and v: pad v with zero columns.
    v = F.pad(kv[..., dn:], (0, dn + dr - dv))
    out = kernels.attention(
        q, k, v, torch.arange(n), count - 1, kernels.attention_scale(dn + dr)
    )[..., :dv]
    return _mla_output(m, out.reshape(n, hm * dv), gate)


def mla_attend_full(
    m, spec: KimiSpec, q: torch.Tensor, ctx: torch.Tensor, q_seq: torch.Tensor, q_pos: torch.Tensor,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """MLA without an indexer: each query over every key of its sequence up to
    its position. ctx [R, L, width]: each sequence's cache entries at positions 0..L-1 (rows
    past a sequence's end are never attended); gate: mla_gate's. Returns the o_proj output
    [N, hidden].

    Each sequence's latents are expanded once with kv_b_proj (row-wise invariant, so a key's
    bits do not depend on how many keys are expanded with it) and attended with
    `kernels.attention`, the fixed-block online softmax both engines share."""
    n = q.shape[0]
    r, length = ctx.shape[:2]
    hm, dn, dr, dc, dv = (
        spec.num_attention_heads, spec.qk_nope_head_dim, spec.qk_rope_head_dim,
        spec.kv_lora_rank, spec.v_head_dim,
    )
    kv = m.kv_b_proj(ctx[..., :dc]).view(r, length, hm, dn + dv)
    k_pe = ctx[..., dc : dc + dr].unsqueeze(2).expand(-1, -1, hm, -1)
    k = torch.cat([kv[..., :dn], k_pe], dim=-1)
    v = F.pad(kv[..., dn:], (0, dn + dr - dv))
    out = kernels.attention(q, k, v, q_seq, q_pos, kernels.attention_scale(dn + dr))[..., :dv]
    return _mla_output(m, out.reshape(n, hm * dv), gate)


# --- MoE ------------------------------------------------------------------------------------------


# The stable top-k and the expert dispatch are parity/moe.py's (shared with Qwen3-MoE); the
# routing below is Kimi's.


def route(
    spec: KimiSpec, router_weight: torch.Tensor, h: torch.Tensor, bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts [N, k] int64 in choice order, weights [N, k] fp32) for tokens h.

    DeepSeek-V3 / Kimi Linear routing: sigmoid scores of an fp32 router; `bias`
    (e_score_correction_bias) is added for the choice only; with expert groups, only the
    topk_group groups with the best sums of their two best choice scores compete; the chosen
    experts' scores (without the bias) are renormalised (+1e-20, as the reference) and scaled
    by routed_scaling_factor. Zero bias, one group and factor 1 reduce it to plain top-k (an
    old kimi-mini's routing)."""
    scores = sigmoid(moe_lib.router_logits(router_weight, h))  # [N, E], fp32 router
    choice = scores if bias is None else scores + bias.float()
    groups = spec.num_expert_group
    if groups > 1:
        grouped = choice.view(-1, groups, spec.n_routed_experts // groups)
        best2 = torch.sort(grouped, dim=-1, descending=True, stable=True).values[..., :2]
        keep = moe_lib.top(best2[..., 0] + best2[..., 1], spec.topk_group)  # [N, topk_group]
        mask = torch.zeros(choice.shape[0], groups, dtype=torch.bool, device=choice.device).scatter(1, keep, True)
        choice = grouped.masked_fill(~mask.unsqueeze(-1), -math.inf).view_as(choice)
    experts = moe_lib.top(choice, spec.num_experts_per_tok)
    weights = scores.gather(1, experts)
    if spec.moe_renormalize:
        weights = weights / (row_sum(weights) + 1e-20).unsqueeze(-1)
    if spec.routed_scaling_factor != 1.0:
        weights = weights * spec.routed_scaling_factor
    return experts, weights


def dense_mlp(m, h: torch.Tensor) -> torch.Tensor:
    """A dense layer's SwiGLU MLP (the first first_k_dense_replace layers)."""
    return moe_lib.swiglu(m, h)


def route_module(m, spec: KimiSpec, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`route` with the router of MoE module m (its gate and e_score_correction_bias)."""
    return route(spec, m.gate.weight, h, m.gate.e_score_correction_bias)


def moe(m, spec: KimiSpec, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MoE feed-forward on tokens h [N, hidden]: (output [N, hidden], chosen experts [N, k])."""
    experts, weights = route_module(m, spec, h)
    shared = m.shared_experts if spec.n_shared_experts else None
    return moe_lib.dispatch(m.experts, spec.n_routed_experts, h, experts, weights, shared), experts


# --- checkpoint names -----------------------------------------------------------------------------


def _outer_shapes(spec: KimiSpec) -> dict[str, tuple[int, ...]]:
    """The embedding, the final norm and an untied LM head."""
    h = spec.hidden_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, h), "model.norm.weight": (h,)}
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = (spec.vocab_size, h)
    return out


def _layer_norm_shapes(p: str, h: int) -> dict[str, tuple[int, ...]]:
    return {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}


def _mla_shapes(spec: KimiSpec, a: str) -> dict[str, tuple[int, ...]]:
    h, hm = spec.hidden_size, spec.num_attention_heads
    if spec.q_lora_rank:
        query = {
            a + "q_a_proj.weight": (spec.q_lora_rank, h),
            a + "q_a_layernorm.weight": (spec.q_lora_rank,),
            a + "q_b_proj.weight": (hm * spec.qk_head_dim, spec.q_lora_rank),
        }
    else:
        query = {a + "q_proj.weight": (hm * spec.qk_head_dim, h)}
    return {
        **query,
        a + "kv_a_proj_with_mqa.weight": (spec.kv_lora_rank + spec.qk_rope_head_dim, h),
        a + "kv_a_layernorm.weight": (spec.kv_lora_rank,),
        a + "kv_b_proj.weight": (hm * (spec.qk_nope_head_dim + spec.v_head_dim), spec.kv_lora_rank),
        a + "o_proj.weight": (h, hm * spec.v_head_dim),
    }


def _swiglu_shapes(prefix: str, h: int, inter: int, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
                   ) -> dict[str, tuple[int, ...]]:
    gate, up, down = names
    return {prefix + gate + ".weight": (inter, h), prefix + up + ".weight": (inter, h), prefix + down + ".weight": (h, inter)}


def hf_weight_shapes(spec: KimiSpec) -> dict[str, tuple[int, ...]]:
    """Every weight of the checkpoint by HF name, with its shape: the published Kimi Linear
    tensor names (what moonshotai/Kimi-Linear-48B-A3B-* store and transformers' conversion
    mapping for kimi_linear reads): KDA convs as three [HD, 1, K] depthwise weights, A_log
    [1, 1, H, 1], MoE under `block_sparse_moe` with experts w1 (gate), w3 (up), w2 (down), dense
    `mlp` for the first first_k_dense_replace layers."""
    h = spec.hidden_size
    out = _outer_shapes(spec)
    nh, d = spec.kda_num_heads, spec.kda_head_dim
    for i, kind in enumerate(spec.layer_types):
        p = f"model.layers.{i}."
        out.update(_layer_norm_shapes(p, h))
        a = p + "self_attn."
        if kind == "kda":
            for name in ("q_proj", "k_proj", "v_proj"):
                out[a + name + ".weight"] = (nh * d, h)
            for name in KIMI_LINEAR_CONVS:
                out[a + name + ".weight"] = (nh * d, 1, spec.kda_conv_size)
            out[a + "A_log"] = (1, 1, nh, 1)
            out[a + "dt_bias"] = (nh * d,)
            out[a + "f_a_proj.weight"] = (d, h)
            out[a + "f_b_proj.weight"] = (nh * d, d)
            out[a + "b_proj.weight"] = (nh, h)
            out[a + "g_a_proj.weight"] = (spec.gate_rank, h)
            out[a + "g_b_proj.weight"] = (nh * d, spec.gate_rank)
            out[a + "o_norm.weight"] = (d,)
            out[a + "o_proj.weight"] = (h, nh * d)
        else:
            out.update(_mla_shapes(spec, a))
            if spec.mla_output_gate:
                out[a + "g_proj.weight"] = (spec.num_attention_heads * spec.v_head_dim, h)
            if spec.has_indexer:  # DeepSeek-V3.2's names (transformers' DeepseekV32Indexer)
                x, width = a + "indexer.", spec.index_n_heads * spec.index_head_dim
                if spec.index_query_source == "latent":
                    out[x + "wq_b.weight"] = (width, spec.q_lora_rank)
                    out[x + "k_norm.weight"] = (spec.index_head_dim,)
                    out[x + "k_norm.bias"] = (spec.index_head_dim,)
                else:
                    out[x + "wq.weight"] = (width, h)
                out[x + "wk.weight"] = (spec.index_head_dim, h)
                out[x + "weights_proj.weight"] = (spec.index_n_heads, h)
        if not spec.is_moe_layer(i):
            out.update(_swiglu_shapes(p + "mlp.", h, spec.intermediate_size))
            continue
        b = p + "block_sparse_moe."
        out[b + "gate.weight"] = (spec.n_routed_experts, h)
        out[b + "gate.e_score_correction_bias"] = (spec.n_routed_experts,)
        for e in range(spec.n_routed_experts):
            out.update(_swiglu_shapes(f"{b}experts.{e}.", h, spec.moe_intermediate_size, ("w1", "w3", "w2")))
        if spec.n_shared_experts:
            out.update(_swiglu_shapes(b + "shared_experts.", h, spec.shared_intermediate_size))
    return out


KIMI_LINEAR_CONVS = ("q_conv1d", "k_conv1d", "v_conv1d")
# LoRA targets (peft `target_modules` names: the checkpoint's module names) and the fused
# linears both engines hold. Routed experts: w1 / w3 / w2 (shared experts and dense MLPs keep
# the *_proj names).
LORA_TARGETS = (
    "q_proj", "k_proj", "v_proj", "o_proj", "kv_a_proj_with_mqa", "kv_b_proj", "q_a_proj", "q_b_proj",
    "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3",
)
_GATE_UP = {"gate_proj": 0, "up_proj": 1, "w1": 0, "w3": 1}


def lora_linears(spec: KimiSpec) -> dict[str, tuple[int, tuple[tuple[str, int], ...]]]:
    """Every linear LoRA can adapt, by HF module path (fused [gate; up] ones named
    `...gate_up_proj`): (in_features, parts), parts = ((HF module path, out_features), ...) in
    row order."""
    shapes = hf_weight_shapes(spec)
    out: dict[str, tuple[int, tuple[tuple[str, int], ...]]] = {}
    for name, shape in shapes.items():
        if not name.endswith(".weight") or len(shape) != 2:
            continue
        path = name[: -len(".weight")]
        target = path.rsplit(".", 1)[-1]
        if target not in LORA_TARGETS or ".indexer." in path:
            continue
        if target in _GATE_UP:
            fused = path[: -len(target)] + "gate_up_proj"
            fan_in, parts = out.get(fused, (shape[1], ()))
            out[fused] = (fan_in, (*parts, (path, shape[0])))
        else:
            out[path] = (shape[1], ((path, shape[0]),))
    return out


def peft_name(module_path: str, which: str) -> str:
    """peft's state-dict name of a LoRA matrix for an HF module path (which: "A" | "B")."""
    return f"base_model.model.{module_path}.lora_{which}.weight"
