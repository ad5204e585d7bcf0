"""Independent checks of the Kimi math in parity/kimi.py.

- KDA's recurrence against flash-linear-attention's pure-torch references
  (`naive_recurrent_kda`, `naive_chunk_kda` from fla/ops/kda/naive.py, package fla-core).
- Batch / chunking invariance (torch.equal) of kda_mixer, indexer_topk + mla_attend and moe.
- Semantics against straightforward dense float64 references written here from the formulas.
- Deterministic tie-breaking of the indexer's and the router's top-k.

Modules are small random ones with the HF checkpoint shapes of `hf_weight_shapes`; every linear
goes through `kernels.linear`, as both engines' linears do. SPEC is old kimi-mini's function
(full-rank query, the indexer on the hidden state, a zero e_score_correction_bias: plain top-k);
DeepSeek-V3.2's indexer has its own checks (test_kimi_indexer.py).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parity import kernels
from parity.kimi import (
    hf_weight_shapes,
    indexer_topk,
    kda_mixer,
    kda_recurrence,
    mla_attend,
    mla_entries,
    moe,
    route,
)
from parity.model_spec import KimiSpec

SPEC = KimiSpec(
    vocab_size=64, hidden_size=64, layer_types=("kda", "mla"), rms_norm_eps=1e-6,
    rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=True,
    kda_num_heads=2, kda_head_dim=16, kda_conv_size=4,
    num_attention_heads=2, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16, index_n_heads=4, index_head_dim=16, index_topk=8,
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
    index_query_source="hidden",
)
DTYPES = [torch.float32, torch.bfloat16]


# --- random modules with the checkpoint's names ---------------------------------------------------


class Linear(nn.Module):
    """A checkpoint linear (or a lone `.weight` holder: norms, conv1d): y = kernels.linear(x, W)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, self.weight)


def _random_weight(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if name.endswith("e_score_correction_bias"):  # plain top-k, as the references take it
        return torch.zeros(shape)
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(0.0, math.log(16.0), generator=gen)
    if name.endswith("dt_bias"):
        return torch.randn(shape, generator=gen) * 0.5
    if name.endswith("norm.weight"):
        return 1.0 + 0.2 * torch.randn(shape, generator=gen)
    if name.endswith("conv1d.weight"):
        return torch.randn(shape, generator=gen) * 0.5
    return torch.randn(shape, generator=gen) / math.sqrt(shape[-1])


def _set_path(root: nn.Module, path: str, value: torch.Tensor) -> None:
    *parents, leaf = path.split(".")
    mod = root
    for part in parents[:-1] if leaf == "weight" else parents:
        if not hasattr(mod, part):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    if leaf == "weight":
        mod.add_module(parents[-1], Linear(value))
    else:
        mod.register_parameter(leaf, nn.Parameter(value, requires_grad=False))


def build_layer(spec: KimiSpec, kind: str, dtype: torch.dtype, seed: int) -> tuple[nn.Module, nn.Module]:
    """(self_attn, mlp) of the first `kind` layer, random weights cast to dtype; MoE FFNs hold
    a fused [gate; up] gate_up_proj and the KDA convs one stacked conv1d, as both engines do."""
    layer = spec.layer_types.index(kind)
    prefix = f"model.layers.{layer}."
    gen = torch.Generator().manual_seed(seed)
    attn, mlp = nn.Module(), nn.Module()
    ffn: dict[str, dict[str, torch.Tensor]] = {}
    convs = []
    for name, shape in hf_weight_shapes(spec).items():
        if not name.startswith(prefix):
            continue
        w = _random_weight(name, shape, gen).to(dtype)
        rel = name[len(prefix):]
        if rel.endswith("_conv1d.weight"):  # q, k, v in order
            convs.append(w.reshape(shape[0], -1))
        elif rel.startswith("self_attn."):
            _set_path(attn, rel[len("self_attn."):], w)
        elif rel.startswith("block_sparse_moe.gate."):
            _set_path(mlp, rel[len("block_sparse_moe."):], w)
        elif rel.startswith("block_sparse_moe."):
            owner, proj = rel[len("block_sparse_moe."):].rsplit(".", 2)[:2]
            ffn.setdefault(owner, {})[proj] = w
    if convs:
        attn.conv1d = Linear(torch.cat(convs))

    def fused(parts: dict[str, torch.Tensor]) -> nn.Module:
        mod = nn.Module()
        gate, up, down = ("w1", "w3", "w2") if "w1" in parts else ("gate_proj", "up_proj", "down_proj")
        mod.gate_up_proj = Linear(torch.cat([parts[gate], parts[up]]))
        mod.down_proj = Linear(parts[down])
        return mod

    mlp.experts = nn.ModuleList(fused(ffn[f"experts.{e}"]) for e in range(spec.n_routed_experts))
    mlp.shared_experts = fused(ffn["shared_experts"])
    return attn, mlp


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * scale


def _kda_states(spec: KimiSpec, num_reqs: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    conv = _randn(gen, num_reqs, spec.kda_conv_size - 1, spec.kda_conv_channels)
    d = spec.kda_head_dim
    return conv, _randn(gen, num_reqs, spec.kda_num_heads, d, d, scale=0.3)


# --- 1. KDA recurrence vs flash-linear-attention's naive references -------------------------------


def _fla_naive():
    """fla/ops/kda/naive.py on its own (importing fla.ops needs triton); needs only torch+einops."""
    found = importlib.util.find_spec("fla")
    if found is None or not found.submodule_search_locations:
        pytest.skip("fla-core (flash-linear-attention's fla package) is not installed")
    path = Path(list(found.submodule_search_locations)[0]) / "ops" / "kda" / "naive.py"
    spec = importlib.util.spec_from_file_location("_fla_kda_naive", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _recurrence_inputs(lengths, heads, dk, dv, seed):
    gen = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    q = F.normalize(_randn(gen, n, heads, dk), dim=-1)
    k = F.normalize(_randn(gen, n, heads, dk), dim=-1)
    v = _randn(gen, n, heads, dv)
    g = -F.softplus(_randn(gen, n, heads, dk)) * 0.5  # log decay < 0
    beta = torch.sigmoid(_randn(gen, n, heads))
    state = _randn(gen, len(lengths), heads, dv, dk, scale=0.5)  # ours: S^T
    return q, k, v, g, beta, state


@pytest.mark.parametrize("dk,dv", [(16, 16), (16, 8)])
def test_kda_recurrence_matches_fla_naive_recurrent(dk, dv):
    naive = _fla_naive()
    lengths, heads = [5, 1, 23, 12], 3
    q, k, v, g, beta, state = _recurrence_inputs(lengths, heads, dk, dv, seed=0)
    scale = dk**-0.5
    o, final = kda_recurrence(q * scale, k, v, torch.exp(g), beta, state, lengths)
    start = 0
    for r, length in enumerate(lengths):
        rows = slice(start, start + length)
        start += length
        ref_o, ref_s = naive.naive_recurrent_kda(
            q[rows][None], k[rows][None], v[rows][None], g[rows][None], beta[rows][None],
            scale=scale, initial_state=state[r].transpose(-1, -2)[None], output_final_state=True,
        )
        torch.testing.assert_close(o[rows], ref_o[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(final[r], ref_s[0].transpose(-1, -2), rtol=0, atol=1e-5)


def test_kda_recurrence_matches_fla_naive_chunk():
    """The chunked WY form sums in another order: equal within float tolerance only."""
    naive = _fla_naive()
    lengths, heads, dk, dv = [48, 48], 2, 16, 16
    q, k, v, g, beta, state = _recurrence_inputs(lengths, heads, dk, dv, seed=1)
    o, final = kda_recurrence(q * dk**-0.5, k, v, torch.exp(g), beta, state, lengths)
    b = lambda x: x.view(len(lengths), lengths[0], *x.shape[1:])  # noqa: E731
    ref_o, ref_s = naive.naive_chunk_kda(
        b(q), b(k), b(v), b(g), b(beta), scale=dk**-0.5,
        initial_state=state.transpose(-1, -2), output_final_state=True, chunk_size=16,
    )
    torch.testing.assert_close(b(o), ref_o, rtol=0, atol=1e-4)
    torch.testing.assert_close(final, ref_s.transpose(-1, -2), rtol=0, atol=1e-4)


# --- 2. invariance (bitwise) ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_kda_mixer_chunked_equals_whole(dtype):
    """Prefill 7 tokens then decode 1 at a time (carrying conv state and S^T), with other
    requests of other lengths and random states in every batch == one whole-sequence call."""
    attn, _ = build_layer(SPEC, "kda", dtype, seed=1)
    gen = torch.Generator().manual_seed(2)
    length = 12
    h = _randn(gen, length, SPEC.hidden_size).to(dtype)
    conv0, state0 = _kda_states(SPEC, 1, gen)  # a continued sequence: non-zero starting states
    with torch.no_grad():
        whole, conv_w, state_w = kda_mixer(attn, SPEC, h, [length], conv0, state0)
        # The whole sequence packed between other sequences (training batches).
        other_h = _randn(gen, 9 + 20, SPEC.hidden_size).to(dtype)
        conv_o, state_o = _kda_states(SPEC, 2, gen)
        packed, conv_p, state_p = kda_mixer(
            attn, SPEC, torch.cat([other_h[:9], h, other_h[9:]]), [9, length, 20],
            torch.cat([conv_o[:1], conv0, conv_o[1:]]), torch.cat([state_o[:1], state0, state_o[1:]]),
        )
        assert torch.equal(packed[9 : 9 + length], whole)
        assert torch.equal(conv_p[1], conv_w[0]) and torch.equal(state_p[1], state_w[0])

        outs, conv, state, start = [], conv0, state0, 0
        for step, chunk in enumerate([7, 1, 1, 1, 1, 1]):
            before, after = [1, 3, 2, 5, 1, 4][step], [6, 1, 1, 2, 3, 9][step]
            xb, xa = _randn(gen, before, SPEC.hidden_size), _randn(gen, after, SPEC.hidden_size)
            cb, sb = _kda_states(SPEC, 1, gen)
            ca, sa = _kda_states(SPEC, 1, gen)
            out, new_conv, new_state = kda_mixer(
                attn, SPEC, torch.cat([xb.to(dtype), h[start : start + chunk], xa.to(dtype)]),
                [before, chunk, after], torch.cat([cb, conv, ca]), torch.cat([sb, state, sa]),
            )
            outs.append(out[before : before + chunk])
            conv, state, start = new_conv[1:2], new_state[1:2], start + chunk
    assert torch.equal(torch.cat(outs), whole)
    assert torch.equal(conv, conv_w) and torch.equal(state, state_w)


def _mla_full(attn, spec, h):
    n = h.shape[0]
    positions = torch.arange(n)
    q, entry, index_q, index_w = mla_entries(attn, spec, h, positions)
    zeros = torch.zeros(n, dtype=torch.int64)
    selected, count = indexer_topk(spec, index_q, index_w, entry[None, :, -spec.index_head_dim :], zeros, positions)
    out = mla_attend(attn, spec, q, entry[None], zeros, selected, count)
    return out, entry, selected, count


@pytest.mark.parametrize("dtype", DTYPES)
def test_mla_decode_equals_full_sequence(dtype):
    """A query at position t over a context of exactly t+1 cached entries (then garbage
    padding), in a batch with other sequences' queries == the same query in a full-sequence
    call: the same cache entry, the same selected positions, the same output bits."""
    attn, _ = build_layer(SPEC, "mla", dtype, seed=3)
    gen = torch.Generator().manual_seed(4)
    length, di = 150, SPEC.index_head_dim
    h = _randn(gen, length, SPEC.hidden_size).to(dtype)
    with torch.no_grad():
        full, entry, selected, count = _mla_full(attn, SPEC, h)
        width = entry.shape[-1]
        for t in [0, 3, 7, 8, 63, 64, 65, 127, 149]:
            q1, e1, iq1, iw1 = mla_entries(attn, SPEC, h[t : t + 1], torch.tensor([t]))
            assert torch.equal(e1, entry[t : t + 1])
            # Other requests: their own query rows and cache rows, all garbage to this one.
            hx = _randn(gen, 2, SPEC.hidden_size).to(dtype)
            pos_x = torch.tensor([90, 5])
            qx, _, iqx, iwx = mla_entries(attn, SPEC, hx, pos_x)
            ctx_len = t + 1 + 37
            ctx = (_randn(gen, 3, ctx_len + 100, width, scale=50.0)).to(dtype)
            ctx[1, : t + 1] = entry[: t + 1]
            ctx[1, t + 1 : t + 12] = float("nan")  # never-written cache slots
            q_seq, q_pos = torch.tensor([0, 1, 2]), torch.tensor([90, t, 5])
            sel_b, cnt_b = indexer_topk(
                SPEC, torch.cat([iqx[:1], iq1, iqx[1:]]), torch.cat([iwx[:1], iw1, iwx[1:]]),
                ctx[..., -di:], q_seq, q_pos,
            )
            assert torch.equal(sel_b[1], selected[t]) and torch.equal(cnt_b[1], count[t])
            out_b = mla_attend(attn, SPEC, torch.cat([qx[:1], q1, qx[1:]]), ctx, q_seq, sel_b, cnt_b)
            assert torch.equal(out_b[1], full[t]), t


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_token_alone_equals_in_batch(dtype):
    _, mlp = build_layer(SPEC, "mla", dtype, seed=5)
    gen = torch.Generator().manual_seed(6)
    h = _randn(gen, 100, SPEC.hidden_size).to(dtype)
    with torch.no_grad():
        out, experts = moe(mlp, SPEC, h)
        counts = torch.bincount(experts.flatten(), minlength=SPEC.n_routed_experts)
        assert (counts > 1).all()  # every expert sees a real multi-row batch here
        for i in [0, 1, 17, 63, 64, 99]:
            alone, chosen = moe(mlp, SPEC, h[i : i + 1])
            assert torch.equal(chosen[0], experts[i])
            assert torch.equal(alone[0], out[i]), i
        part, part_experts = moe(mlp, SPEC, h[30:37])
        assert torch.equal(part, out[30:37]) and torch.equal(part_experts, experts[30:37])


# --- 3. semantics vs dense float64 references ----------------------------------------------------


def _indexer_reference(index_q, index_w, index_k, q_seq, q_pos, topk):
    """Brute force in float64: I[t, s] = sum_h w[t, h] relu(q[t, h] . k[s]) over s <= t, the
    top-k by (score descending, position ascending), returned in ascending position order."""
    scores = torch.einsum("nhd,nsd->nhs", index_q.double(), index_k[q_seq].double()).clamp_min(0)
    scores = (scores * index_w.double().unsqueeze(-1)).sum(1)  # [N, L]
    out = []
    for i in range(index_q.shape[0]):
        t = int(q_pos[i])
        ranked = sorted(range(t + 1), key=lambda s, i=i: (-float(scores[i, s]), s))
        out.append(sorted(ranked[:topk]))
    return out, scores


def _indexer_inputs(gen, lengths, spec, integer):
    n_seqs, length = len(lengths), max(lengths)
    hi, di = spec.index_n_heads, spec.index_head_dim
    q_seq = torch.cat([torch.full((n,), r) for r, n in enumerate(lengths)])
    q_pos = torch.cat([torch.arange(n) for n in lengths])
    shapes = ((len(q_seq), hi, di), (len(q_seq), hi), (n_seqs, length, di))
    if integer:  # small integers: every fp32 sum is exact, so exact ties abound
        q, w, k = (torch.randint(-2, 3, s, generator=gen).float() for s in shapes)
        k[:, 1::3] = k[:, 0:1]  # many positions share one key: equal scores by construction
    else:
        q, w, k = (torch.randn(*s, generator=gen) for s in shapes)
    return q, w, k, q_seq, q_pos


@pytest.mark.parametrize("integer", [False, True], ids=["random", "exact-ties"])
def test_indexer_topk_is_brute_force_topk(integer):
    gen = torch.Generator().manual_seed(7)
    lengths = [140, 3, 70]
    q, w, k, q_seq, q_pos = _indexer_inputs(gen, lengths, SPEC, integer)
    selected, count = indexer_topk(SPEC, q, w, k, q_seq, q_pos)
    ref, scores = _indexer_reference(q, w, k, q_seq, q_pos, SPEC.index_topk)
    ties = 0
    for i, want in enumerate(ref):
        c = int(count[i])
        assert c == len(want) == min(int(q_pos[i]) + 1, SPEC.index_topk)
        assert selected[i, :c].tolist() == want, i
        assert (selected[i, c:] == 0).all()
        if len(want) < int(q_pos[i]) + 1:  # a real selection: was its boundary a tie?
            chosen = scores[i, want]
            rest = torch.ones(int(q_pos[i]) + 1, dtype=torch.bool)
            rest[want] = False
            ties += int(chosen.min() == scores[i, : int(q_pos[i]) + 1][rest].max())
    if integer:
        assert ties > 50  # the tie-break (lower position first) really was exercised


def _w(lin) -> torch.Tensor:
    return lin.weight.double()


def _mla_reference(attn, spec, q, entry, keep):
    """Dense MLA (non-absorbed) in float64 with plain softmax: query t attends to the positions
    s with keep[t, s] (causal), keys [kv_b(c_s)_nope; k_pe_s], values kv_b(c_s)_v."""
    n = q.shape[0]
    hm, dn, dr, dc, dv = (spec.num_attention_heads, spec.qk_nope_head_dim, spec.qk_rope_head_dim,
                          spec.kv_lora_rank, spec.v_head_dim)
    kv = (entry[:, :dc].double() @ _w(attn.kv_b_proj).T).view(n, hm, dn + dv)
    k = torch.cat([kv[..., :dn], entry[:, None, dc : dc + dr].double().expand(n, hm, dr)], dim=-1)
    scores = torch.einsum("thd,shd->hts", q.double(), k) / math.sqrt(dn + dr)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    probs = scores.masked_fill(~(keep & causal), -math.inf).softmax(-1)
    out = torch.einsum("hts,shd->thd", probs, kv[..., dn:]).reshape(n, hm * dv)
    return out @ _w(attn.o_proj).T


@pytest.mark.parametrize("sparse", [False, True], ids=["topk>=len", "topk<len"])
def test_mla_attend_matches_dense_reference(sparse):
    length = 90
    spec = SPEC if sparse else dataclasses.replace(SPEC, index_topk=length)
    attn, _ = build_layer(spec, "mla", torch.float32, seed=8)
    h = _randn(torch.Generator().manual_seed(9), length, spec.hidden_size)
    positions = torch.arange(length)
    with torch.no_grad():
        q, entry, index_q, index_w = mla_entries(attn, spec, h, positions)
        out, _, selected, count = _mla_full(attn, spec, h)
    keep = torch.zeros(length, length, dtype=torch.bool)
    if sparse:  # the positions a float64 brute-force indexer picks
        ref_sel, _ = _indexer_reference(
            index_q, index_w, entry[None, :, -spec.index_head_dim :], torch.zeros(length, dtype=torch.int64),
            positions, spec.index_topk,
        )
        for t, want in enumerate(ref_sel):
            keep[t, want] = True
        assert int((keep.sum(1) < positions + 1).sum()) > 60  # mostly a real selection
    else:
        keep[:] = True
        assert (count == positions + 1).all()
    ref = _mla_reference(attn, spec, q, entry, keep)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def _ffn_reference(expert, x):
    gate, up = (x @ _w(expert.gate_up_proj).T).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ _w(expert.down_proj).T


def test_moe_matches_dense_reference():
    """Every expert on every token in float64, weighted by the normalised top-k sigmoid scores,
    plus the shared expert."""
    _, mlp = build_layer(SPEC, "mla", torch.float32, seed=10)
    h = _randn(torch.Generator().manual_seed(11), 50, SPEC.hidden_size)
    with torch.no_grad():
        out, experts = moe(mlp, SPEC, h)
    x = h.double()
    scores = torch.sigmoid(x @ _w(mlp.gate).T)  # [N, E]
    top = scores.topk(SPEC.num_experts_per_tok, dim=-1)  # no ties in random data
    weights = top.values / top.values.sum(-1, keepdim=True)
    every = torch.stack([_ffn_reference(e, x) for e in mlp.experts], dim=1)  # [N, E, h]
    ref = _ffn_reference(mlp.shared_experts, x) + (
        weights.unsqueeze(-1) * every.gather(1, top.indices[..., None].expand(-1, -1, x.shape[-1]))
    ).sum(1)
    assert torch.equal(experts, top.indices)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def _kda_reference(attn, spec, h, lengths, conv_state, state):
    """kda_mixer in float64, written from the formulas: causal depthwise conv (F.conv1d) over
    [conv state; inputs], SiLU, L2-normalised q (times dk^-0.5) and k, g = -exp(A_log) *
    softplus(f_b(f_a(h)) + dt_bias), beta = sigmoid(b_proj h), then per token
    S_t = (I - beta k k^T) Diag(exp(g)) S_{t-1} + beta k v^T, o_t = S_t^T q_t (S [dk, dv]),
    per-head RMSNorm, sigmoid gate, o_proj."""
    nh, d = spec.kda_num_heads, spec.kda_head_dim
    x = h.double()
    outs, convs, states = [], [], []
    start = 0
    for r, length in enumerate(lengths):
        xr = x[start : start + length]
        start += length
        raw = torch.cat([xr @ _w(attn.q_proj).T, xr @ _w(attn.k_proj).T, xr @ _w(attn.v_proj).T], -1)
        seq = torch.cat([conv_state[r].double(), raw])  # [K-1+T, C]
        weight = attn.conv1d.weight.double()
        conv = F.conv1d(seq.T[None], weight[:, None, :], groups=weight.shape[0])[0].T  # [T, C]
        q, k, v = (t.reshape(length, nh, d) for t in F.silu(conv).split(nh * d, dim=-1))
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * d**-0.5
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        f = (xr @ _w(attn.f_a_proj).T) @ _w(attn.f_b_proj).T + attn.dt_bias.double()
        g = -torch.exp(attn.A_log.double().reshape(nh))[:, None] * F.softplus(f).view(length, nh, d)
        beta = torch.sigmoid(xr @ _w(attn.b_proj).T)  # [T, H]
        s = state[r].double().transpose(-1, -2).clone()  # [H, dk, dv]
        eye = torch.eye(d, dtype=torch.float64)
        o = torch.zeros(length, nh, d, dtype=torch.float64)
        for t in range(length):
            for hd in range(nh):
                kt, b = k[t, hd][:, None], beta[t, hd]
                s[hd] = (eye - b * kt @ kt.T) @ torch.diag(torch.exp(g[t, hd])) @ s[hd] + b * kt @ v[t, hd][None]
                o[t, hd] = s[hd].T @ q[t, hd]
        o = o * torch.rsqrt((o * o).mean(-1, keepdim=True) + spec.rms_norm_eps) * attn.o_norm.weight.double()
        o = o * torch.sigmoid((xr @ _w(attn.g_a_proj).T) @ _w(attn.g_b_proj).T).view(length, nh, d)
        outs.append(o.reshape(length, nh * d) @ _w(attn.o_proj).T)
        convs.append(seq[length:])
        states.append(s.transpose(-1, -2))
    return torch.cat(outs), torch.stack(convs), torch.stack(states)


def test_kda_mixer_matches_float64_reference():
    attn, _ = build_layer(SPEC, "kda", torch.float32, seed=12)
    gen = torch.Generator().manual_seed(13)
    lengths = [6, 1, 19, 2]  # also a request shorter than the conv window
    h = _randn(gen, sum(lengths), SPEC.hidden_size)
    conv0, state0 = _kda_states(SPEC, len(lengths), gen)
    conv0[0], state0[0] = 0.0, 0.0  # a new sequence
    with torch.no_grad():
        out, conv, state = kda_mixer(attn, SPEC, h, lengths, conv0, state0)
    ref_out, ref_conv, ref_state = _kda_reference(attn, SPEC, h, lengths, conv0, state0)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv.double(), ref_conv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.double(), ref_state, rtol=1e-5, atol=1e-5)


# --- 4. deterministic top-k ties in MoE routing --------------------------------------------------


def test_route_ties_take_lower_expert_first():
    spec, e = SPEC, SPEC.n_routed_experts
    h = _randn(torch.Generator().manual_seed(14), 5, spec.hidden_size)
    # All router rows equal: every score ties, the k lowest expert ids win, equal weights.
    experts, weights = route(spec, torch.zeros(e, spec.hidden_size), h)
    assert experts.tolist() == [list(range(spec.num_experts_per_tok))] * 5
    assert torch.equal(weights, torch.full_like(weights, 1.0 / spec.num_experts_per_tok))
    # Integer-valued router and tokens (exact fp32 logits): experts 6, 3 and 1 share the top
    # score, 6 and 3 share it exactly, so the order is 1, 3 (then 6 would follow).
    w = torch.zeros(e, spec.hidden_size)
    w[[1, 3, 6], 0] = 2.0
    w[[0, 2, 4, 5, 7], 0] = 1.0
    x = torch.zeros(3, spec.hidden_size)
    x[:, 0] = torch.tensor([1.0, 2.0, 3.0])
    experts, weights = route(spec, w, x)
    assert experts.tolist() == [[1, 3]] * 3
    # The same through moe, alone and in a batch.
    _, mlp = build_layer(spec, "mla", torch.float32, seed=15)
    mlp.gate.weight.data.copy_(w)
    with torch.no_grad():
        out, chosen = moe(mlp, spec, torch.cat([x, h]))
        alone, chosen1 = moe(mlp, spec, x[1:2])
    assert chosen[:3].tolist() == [[1, 3]] * 3 and chosen1.tolist() == [[1, 3]]
    assert torch.equal(alone[0], out[1])
