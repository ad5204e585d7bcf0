"""The parity kernels: one implementation of each numerically relevant op, shared by the vLLM
rollout model and the Megatron trainer.

Why stock kernels disagree: a float sum depends on the order of its terms, and stock kernels
pick that order from the shapes they see. On this CPU stack, measured: MKL's fp32 GEMM gives a
row different bits when the same row travels with 1, 2-3, or >= 7 rows (gemv vs. two GEMM
kernels); torch's vectorised SiLU/sigmoid differ in the last bit from their scalar tail loop,
so an element's bits depend on where it falls in the flattened tensor; attention that reduces
over "all keys so far" has a different length in decode (one query, t keys) and in training
(t queries, padded to the longest). Batch invariance therefore comes from one rule:

    every reduction and every transcendental op runs on a shape that is fixed by the model
    config alone (never by batch size, chunking or decode vs. training), in a fixed order.

Concretely, every op whose order matters is compiled code with its order fixed by construction,
the same on every ISA code path (AVX-512, AVX2, scalar) and on every thread:
GEMMs and the small batched products (parity/csrc/gemm.cpp: one FMA chain over K per output
element); exp / sigmoid / SiLU / softplus / rsqrt (parity/csrc/elementwise.cpp: our own
polynomial exp and log, correctly rounded IEEE steps only, one code path for every element);
row sums (a 16-lane accumulator with one fixed combine tree, RMSNorm's mean of squares among
them). Attention walks the keys in blocks of `KV_BLOCK` positions from position 0, so a query at
position t always sees the same blocks with the same values, whatever else is in the batch,
and the whole walk is compiled (parity/csrc/attention.cpp: its products are the `bmm`'s FMA
chains, its exp and row sums the element-wise kernels'). The rollout reads the blocks out of
vLLM's paged cache in place (`paged_attention`); training runs the same walk over contiguous
keys.
The vocabulary log-softmax and the sampler after it are compiled too (parity/csrc/sampling.cpp,
parity/sampling.py): the rollout samples with them instead of vLLM's sampler.

All functions are differentiable: the forward is the invariant kernel, the backward plain torch
math (gradients need not be batch invariant, only the forward log-probs must be), except that
the element-wise ops' derivatives are computed from the compiled ops too (an element's gradient
depends on its value alone) and that parity.autograd.ordered_backward fixes the order of the
linears' input gradients and attention's (the trainer's deterministic_layout). A pure-torch
reference of each compiled kernel's order lives in the tests.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from parity import native
from parity.autograd import (
    InvariantBmm,
    InvariantLinear,
    RecomputeAttention,
    RecomputeGrad,
    ordered,
)

# Keys per attention block. Queries visit blocks 0..t//KV_BLOCK in order.
KV_BLOCK = 64
# KIMI_RL_INVARIANT_KERNELS=0 swaps the invariant forms below for the plain torch ops (F.linear,
# fn(x), sum, dense attention) in every process that reads it. For benchmarks only: it measures
# what batch invariance costs on a model that has no stock engine (kimi-mini); log-probs then
# depend on batch composition again.
INVARIANT = os.environ.get("KIMI_RL_INVARIANT_KERNELS", "1") != "0"


def _cuda():
    """parity.cuda, imported on first use by a CUDA tensor (CPU runs never import Triton)."""
    from parity import cuda

    return cuda


def _elementwise(name: str, x: torch.Tensor) -> torch.Tensor:
    """The compiled element-wise op `name` (parity/csrc/elementwise.cpp), in x's dtype.

    Invariant by construction: every element runs one fixed sequence of correctly rounded fp32
    operations (exp is our own polynomial, not a vendor's vector math), so its bits are a
    function of its value alone - on any ISA code path, at any position, on any thread.
    Differentiable: the derivative is computed the same way (_DERIVATIVES).
    """
    reference = _ELEMENTWISE_TORCH[name]
    if x.is_cuda:
        return _cuda().pointwise(reference, x)
    if not INVARIANT:
        return reference(x)

    def forward(t: torch.Tensor) -> torch.Tensor:
        return native.ops().unary(t, name).to(t.dtype)

    if torch.is_grad_enabled() and x.requires_grad:
        return RecomputeGrad.apply(x, forward, reference, _DERIVATIVES[name])
    return forward(x)


_ELEMENTWISE_TORCH = {
    "exp": torch.exp, "sigmoid": torch.sigmoid, "silu": F.silu, "softplus": F.softplus, "rsqrt": torch.rsqrt,
}


def _sigmoid_derivative(x: torch.Tensor) -> torch.Tensor:
    s = sigmoid(x)
    return s * (1 - s)


def _silu_derivative(x: torch.Tensor) -> torch.Tensor:
    s = sigmoid(x)
    return s * (1 + x * (1 - s))  # torch's formula


def _rsqrt_derivative(x: torch.Tensor) -> torch.Tensor:
    r = rsqrt(x)
    return -0.5 * (r * r * r)


# Each op's derivative from the compiled ops and correctly rounded steps only, so an element's
# gradient is a function of its value alone, like its forward. (torch's own backward kernels
# run a vendor vector exp in their vector loop and libm's in the tail: an element's bits would
# depend on its position, hence on the tensor's width, e.g. a tensor-parallel rank's share.)
_DERIVATIVES = {
    "exp": lambda x: exp(x), "sigmoid": _sigmoid_derivative, "silu": _silu_derivative,
    "softplus": lambda x: torch.where(x > 20, torch.ones_like(x), sigmoid(x)),  # torch's threshold 20
    "rsqrt": _rsqrt_derivative,
}


def exp(x: torch.Tensor) -> torch.Tensor:
    return _elementwise("exp", x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return _elementwise("sigmoid", x)


def silu(x: torch.Tensor) -> torch.Tensor:
    return _elementwise("silu", x)


def softplus(x: torch.Tensor) -> torch.Tensor:
    """torch's softplus (beta 1, threshold 20)."""
    return _elementwise("softplus", x)


def rsqrt(x: torch.Tensor) -> torch.Tensor:
    return _elementwise("rsqrt", x)


def _row_sum_reference(x: torch.Tensor) -> torch.Tensor:
    return x.sum(-1)


def _row_sum_forward(x: torch.Tensor) -> torch.Tensor:
    return native.ops().row_sum(x).to(x.dtype)


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (compiled, parity/csrc/elementwise.cpp), in x's dtype.

    Invariant by construction: 16 lane accumulators, element i added in order to lane i % 16,
    then one fixed combine tree; the order depends on the row length alone, never on the number
    of rows, a row's position or the thread that runs it.
    """
    if x.is_cuda:
        return _cuda().row_sum(x)
    if not INVARIANT:
        return x.sum(-1)
    if torch.is_grad_enabled() and x.requires_grad:
        return RecomputeGrad.apply(x, _row_sum_forward, _row_sum_reference)
    return _row_sum_forward(x)


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The compiled GEMM's packed layout of a weight [N, K] (a copy in the weight's dtype:
    bytes moved, none changed; a bf16 pack is widened exactly as the kernel loads it), for
    `linear(..., packed=)` by a caller that holds the weight fixed and drops the pack whenever
    it writes the weight; None where `linear` takes no pack (CUDA, or the invariant kernels
    switched off)."""
    if weight.is_cuda or not INVARIANT:
        return None
    return native.ops().pack(weight.detach())


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, k_splits: int = 1,
    packed: torch.Tensor | None = None, input_grad: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """y = x @ weight.T (+ bias), for x of shape [..., K] and weight [N, K].

    Invariant by construction: the compiled GEMM (parity/csrc/gemm.cpp) computes every output
    element as one fp32 fused-multiply-add chain over k = 0..K-1, whatever M, the row's
    position, the thread count or the ISA; bf16 operands are widened exactly and the result is
    rounded once to x's dtype. With `k_splits` = S (a row-parallel layer's K-order,
    parity.tp.row_splits) the chain restarts at each of S equal K-slices and the S partials are
    added in order in fp32 before the one rounding: the order a TP shard over whole slices
    reproduces (`linear_partials` + parity.tp.rank_ordered_sum). Gradients (training only) come
    from plain GEMMs: they need not be bitwise reproducible across batch shapes, only correct;
    `input_grad(grad_out, weight)` (CPU), when given, computes the input's instead (a caller's
    fixed-order product: trainer.megatron.layers under parity.autograd.ordered_backward); under
    ordered_backward the weight's is the compiled GEMM over the tokens in order.
    `packed` (CPU: `pack(weight)`, made by the caller since its last write of the weight) skips
    the per-call pack; without it the weight is packed on every call.
    """
    if not INVARIANT and not x.is_cuda:
        return F.linear(x, weight, bias)
    if x.is_cuda:
        return _cuda().linear(x, weight, bias, k_splits)
    forward = functools.partial(_linear_fixed_order, k_splits=k_splits, packed=packed)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        weight_grad = _weight_grad_fixed_order if ordered() else None
        out = InvariantLinear.apply(x, weight, forward, input_grad, weight_grad)
    else:
        out = forward(x, weight)
    return out if bias is None else out + bias


def _weight_grad_fixed_order(grad_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """grad_out^T x [N, K] through the compiled GEMM: each element one FMA chain over the tokens
    in order, whatever the shapes around it (parity.autograd.ordered_backward)."""
    g = grad_out.reshape(math.prod(grad_out.shape[:-1]), grad_out.shape[-1]).t().contiguous()
    return _linear_fixed_order(g, x.reshape(math.prod(x.shape[:-1]), x.shape[-1]).t().contiguous())


def linear_partials(
    x: torch.Tensor, weight: torch.Tensor, k_splits: int, packed: torch.Tensor | None = None
) -> torch.Tensor:
    """The `k_splits` partial products of `linear` (x's K cut into equal contiguous slices, each
    one fp32 FMA chain) unsummed: fp32 [k_splits, ..., N]. A row-parallel rank's share of the
    cross-rank sum (parity.tp.rank_ordered_sum adds every rank's partials in order). No
    gradient: callers wrap it (InvariantLinear) with the plain linear's. `packed`: as in
    `linear`."""
    if x.dtype != weight.dtype:
        raise TypeError(f"linear: input is {x.dtype} but weight is {weight.dtype}")
    rows = x.detach().reshape(math.prod(x.shape[:-1]), x.shape[-1])
    if x.is_cuda:  # model-dtype operands on tensor cores, fp32 partials (never rounded)
        parts = _cuda().linear_forward(rows, weight.detach(), k_splits=k_splits, partials=True)
    else:
        if packed is None:
            packed = native.ops().pack(weight.detach())
        parts = native.ops().gemm(rows, packed, weight.shape[0], k_splits, False)
    return parts.view(k_splits, *x.shape[:-1], weight.shape[0])


def _linear_fixed_order(
    x: torch.Tensor, weight: torch.Tensor, k_splits: int = 1, packed: torch.Tensor | None = None
) -> torch.Tensor:
    if x.dtype != weight.dtype:
        raise TypeError(f"linear: input is {x.dtype} but weight is {weight.dtype}")
    # Rows counted explicitly: reshape(-1, 0) is ambiguous for K = 0 (a zero-width expert).
    rows = x.detach().reshape(math.prod(x.shape[:-1]), x.shape[-1])
    # Without a caller's pack: packed here, on every call (O(N K), against the product's
    # O(M N K)). A pack cached on the tensor and keyed by its version counter went stale:
    # writes through `param.data` (vLLM's default_weight_loader, Megatron's fp16 optimizer
    # copying main params back) do not bump the version. Only an owner that sees every write
    # of its weights keeps packs (rollout.sync.PackedWeight).
    if packed is None:
        packed = native.ops().pack(weight.detach())
    out = native.ops().gemm(rows, packed, weight.shape[0], k_splits, True)
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def linear_reference(x: torch.Tensor, weight: torch.Tensor, k_splits: int = 1) -> torch.Tensor:
    """The GEMM's summation order in plain PyTorch, for tests: per K-slice s (k_splits equal
    slices) acc_s = fma(x[:, k], w[:, k], acc_s) in fp32 over the slice's k in order from +0,
    then ((acc_0 + acc_1) + acc_2) + ... in fp32, rounded once to x's dtype. A bf16 weight has
    the pair order (parity/csrc/gemm.cpp): the slice's k in pairs (k, k + 1), k + 1 first, an odd
    slice's last k paired with a zero, operands below 2^-126 read as zero and results that are
    below it after rounding flushed to zero (VDPBF16PS's DAZ and FTZ).

    torch has no fp32 FMA, so each step is emulated exactly in fp64: the product of two fp32
    values is exact in fp64; the sum is rounded to odd (round to nearest, then, if inexact and
    the result is even, step one ulp toward the exact sum found by TwoSum), and a round-to-odd
    fp64 value rounds to the correctly rounded fp32 value (53 >= 24 + 2 bits).
    """
    rows = x.reshape(math.prod(x.shape[:-1]), x.shape[-1]).double()
    w = weight.double()
    pairs = weight.dtype == torch.bfloat16
    if pairs:
        rows, w = _below_normal_to_zero(rows), _below_normal_to_zero(w)
    width = rows.shape[1] // k_splits
    total = None
    for s in range(k_splits):
        start, end = s * width, (s + 1) * width
        order = [k for j in range(start, end, 2) for k in (j + 1, j)] if pairs else range(start, end)
        acc = torch.zeros(rows.shape[0], w.shape[0], dtype=torch.float64)
        for k in order:
            p = rows[:, k : k + 1] * w[:, k] if k < end else torch.zeros_like(acc)  # k == end: the pad
            t = p + acc
            b = t - p
            err = (p - (t - b)) + (acc - b)
            even = (t.view(torch.int64) & 1) == 0
            toward = torch.where(err > 0, math.inf, -math.inf).double()
            t = torch.where((err != 0) & even, torch.nextafter(t, toward), t)
            acc = _round_flushed(t) if pairs else t.float().double()
        total = acc.float() if total is None else total + acc.float()
    return total.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def _below_normal_to_zero(v: torch.Tensor) -> torch.Tensor:
    return torch.where(v.abs() < 2.0**-126, torch.copysign(torch.zeros_like(v), v), v)


def _round_flushed(t: torch.Tensor) -> torch.Tensor:
    """A round-to-odd fp64 sum rounded to fp32 as under FTZ: near 2^-126 it is rounded scaled by
    2^64 (24 bits, an unbounded exponent), and a result below 2^-126 then is a signed zero."""
    small = t.abs() < 2.0**-100
    r = torch.where(small, (t * 2.0**64).float().double() * 2.0**-64, t.float().double())
    return _below_normal_to_zero(torch.where(r == 0, t, r))


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Row gather: exact by construction."""
    return F.embedding(ids, weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF-style RMSNorm: normalise in fp32, cast back, then scale by the weight.

    Invariant because: the mean of squares is a row_sum over the hidden dim; the rest is
    element-wise with correctly rounded ops.
    """
    if x.is_cuda:
        return _cuda().rms_norm(x, weight, eps)
    dtype = x.dtype
    h = x.float()
    variance = row_sum(h * h) / h.shape[-1]
    inv = rsqrt(variance + eps)
    return weight * (h * inv.unsqueeze(-1)).to(dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused [gate; up] projection: silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return silu(gate) * up


@functools.lru_cache(maxsize=16)
def rope_table(head_dim: int, base: float, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin tables [max_positions, head_dim // 2] (compiled, parity/csrc/rope.cpp).

    The usual table (inv_freq = 1 / base^(2j / head_dim), angle = position * inv_freq in fp32),
    with pow, cos and sin our own double-precision code rounded once to fp32: an entry's bits
    are a function of (position, j, head_dim, base) alone, on every ISA code path. (torch's
    pow / cos / sin, which this replaces, change bits with ATEN_CPU_CAPABILITY.) Both engines
    build it once and then only index it by position. Always built on the CPU, whatever the
    ambient `torch.device(...)` context: vLLM constructs its model under a CUDA device context
    and Megatron on the CPU, and a GPU's cos/sin differ from the CPU's in thousands of entries
    (the H200 parity mismatch). Callers move the table where they compute.
    KIMI_RL_INVARIANT_KERNELS=0 builds it with torch's ops (`_rope_table_reference`).
    """
    if not INVARIANT:
        return _rope_table_reference(head_dim, base, max_positions)
    return tuple(native.ops().rope_table(head_dim, float(base), max_positions))


def _rope_table_reference(head_dim: int, base: float, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    cpu = torch.device("cpu")
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=cpu).float() / head_dim
    inv_freq = 1.0 / (base**exponent)
    positions = torch.arange(max_positions, dtype=torch.int64, device=cpu).float()
    freqs = torch.outer(positions, inv_freq)
    return torch.cos(freqs), torch.sin(freqs)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Neox-style (rotate-half) RoPE for x [T, H, D] at integer positions [T], computed in fp32.

    Element-wise with exactly rounded mul/add only: out1 = x1*cos - x2*sin, out2 = x2*cos + x1*sin.
    """
    if x.is_cuda:
        return _cuda().apply_rope(x, positions, table)
    cos, sin = table
    cos = cos[positions].unsqueeze(1)
    sin = sin[positions].unsqueeze(1)
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., M, K] @ b [..., K, N] (same leading dims) as independent products, in a's dtype.

    Invariant by construction: the compiled `bmm` (parity/csrc/gemm.cpp) computes every element
    of every entry as one fp32 FMA chain over k in order (the GEMM's order), so an entry's bits
    depend on its own operands only, never on how many entries share the call. (torch.bmm, which
    this replaced, picks MKL's kernel from the whole batch: on an AVX-512 EPYC one entry alone, or
    among 3, got other bits than among 2 - attention at batch 1 then disagreed with training.)
    Differentiable: gradients are plain batched matmuls."""
    if a.is_cuda:  # products, then the CUDA row sum's fixed order over K (small products only)
        return row_sum(a.float().unsqueeze(-2) * b.float().mT.unsqueeze(-3)).to(a.dtype)
    if not INVARIANT:
        return a @ b
    return InvariantBmm.apply(a, b, _bmm_forward)


def _bmm_forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    shape = a.shape[:-1] + b.shape[-1:]
    out = native.ops().bmm(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]))
    return out.to(a.dtype).view(shape)


def _attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_seq: torch.Tensor, q_pos: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The contiguous form (training, k and v [R, L, Hkv, D]) as the paged walk over a cache
    whose slot of (sequence r, position t) is r * L + t: one code path for both engines."""
    num_seqs, length, hkv, d = k.shape
    kv = torch.stack([k, v], dim=2).view(num_seqs * length, 2, hkv, d)
    slots = torch.arange(num_seqs * length).view(num_seqs, length)
    return _paged_attention_forward(q, kv, slots, q_seq, q_pos, scale)


def _paged_attention_forward(
    q: torch.Tensor, kv_cache: torch.Tensor, ctx_slots: torch.Tensor, q_seq: torch.Tensor,
    q_pos: torch.Tensor, scale: float,
) -> torch.Tensor:
    out = native.ops().paged_attention(q, kv_cache, ctx_slots, q_seq, q_pos, scale)
    return out.to(q.dtype)


def _paged_attention_walk(
    q: torch.Tensor, kv_cache: torch.Tensor, ctx_slots: torch.Tensor, q_seq: torch.Tensor,
    q_pos: torch.Tensor, scale: float,
) -> torch.Tensor:
    """The walk the compiled `paged_attention` runs (parity/csrc/attention.cpp), written with
    the parity ops: its readable statement, and the tests' reference for its bits."""
    nq, hq, d = q.shape
    hkv = kv_cache.shape[2]
    g = hq // hkv
    length = ctx_slots.shape[1]
    padded = -(-length // KV_BLOCK) * KV_BLOCK
    if padded != length:  # positions past the context read slot 0 and are masked below
        ctx_slots = F.pad(ctx_slots, (0, padded - length))
    qf = q.float().view(nq, hkv, g, d)
    m = torch.full((nq, hkv, g), -math.inf)
    denom = torch.zeros(nq, hkv, g)
    acc = torch.zeros(nq, hkv, g, d)
    offsets = torch.arange(KV_BLOCK)
    num_blocks = int(q_pos.max()) // KV_BLOCK + 1 if nq else 0
    for j in range(num_blocks):
        start = j * KV_BLOCK
        # Only queries at or past the block's start take part: a query runs exactly the blocks
        # 0 .. q_pos // KV_BLOCK, whatever the other queries are, so its bits depend on its own
        # position alone (decode and whole-sequence forms agree block for block).
        rows = slice(None) if j == 0 else (q_pos >= start).nonzero().squeeze(1)
        valid = (start + offsets).unsqueeze(0) <= q_pos[rows].unsqueeze(1)  # [n, B]
        n = valid.shape[0]
        # The block's keys and values, read from the cache in place (one gather of the block's
        # slots, no per-step copy of whole contexts), widened to fp32 straight into the
        # layouts the products take: keys [n, hkv, D, B], values [n, hkv, B, D].
        block = kv_cache[ctx_slots[q_seq[rows], start : start + KV_BLOCK]]  # [n, B, 2, hkv, D]
        kb = torch.empty(n, hkv, d, KV_BLOCK).copy_(block[:, :, 0].permute(0, 2, 3, 1))
        vb = torch.empty(n, hkv, KV_BLOCK, d).copy_(block[:, :, 1].transpose(1, 2))
        # Masked slots may hold garbage (a paged cache's unused slots): replace, never multiply.
        vb.masked_fill_(~valid[:, None, :, None], 0.0)
        scores = bmm(qf[rows], kb) * scale  # [n, hkv, g, B]
        scores = scores.masked_fill(~valid[:, None, None, :], -math.inf)
        m_old = m[rows]
        m_new = torch.maximum(m_old, scores.amax(-1))
        correction = exp(m_old - m_new)
        p = exp(scores - m_new.unsqueeze(-1))
        denom[rows] = denom[rows] * correction + row_sum(p)
        acc[rows] = acc[rows] * correction.unsqueeze(-1) + bmm(p, vb)
        m[rows] = m_new
    out = acc / denom.unsqueeze(-1)
    return out.view(nq, hq, d).to(q.dtype)


def _attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_seq: torch.Tensor, q_pos: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Dense differentiable attention with the same semantics, used to compute gradients only
    (gradients need not be bitwise reproducible, so this uses plain batched matmuls).

    It computes in the training layout, every sequence's queries in position order [R, hq, L, d];
    queries given in another layout (packed sequences, a ragged batch) are placed at their
    (sequence, position) slot there, the slots no query holds computed as zeros and dropped.
    Queries that share a slot (not a layout the engines make) are computed one by one."""
    nq, hq, d = q.shape
    num_seqs, length, hkv = k.shape[:3]
    g = hq // hkv
    per_seq = nq // num_seqs if num_seqs else 0
    regular = per_seq * num_seqs == nq and torch.equal(
        q_seq, torch.arange(num_seqs).repeat_interleave(per_seq)
    )
    if not regular and (q_seq * length + q_pos).unique().numel() < nq:
        kq = k[q_seq].float().repeat_interleave(g, dim=2)  # [nq, L, hq, d]
        vq = v[q_seq].float().repeat_interleave(g, dim=2)
        scores = torch.einsum("nhd,nlhd->nhl", q.float(), kq) * scale
        mask = torch.arange(length).unsqueeze(0) > q_pos.unsqueeze(1)  # [nq, L]
        probs = scores.masked_fill(mask[:, None, :], -math.inf).softmax(-1)
        return torch.einsum("nhl,nlhd->nhd", probs, vq).to(q.dtype)
    if regular:
        qr = q.float().view(num_seqs, per_seq, hq, d)
        pos = q_pos.view(num_seqs, 1, per_seq, 1)
    else:
        qr = q.new_zeros((num_seqs, length, hq, d), dtype=torch.float32).index_put((q_seq, q_pos), q.float())
        pos = torch.arange(length).view(1, 1, length, 1)
    qr = qr.transpose(1, 2)  # [R, hq, Lq, d]
    kr = k.float().repeat_interleave(g, dim=2).transpose(1, 2)  # [R, hq, L, d]
    vr = v.float().repeat_interleave(g, dim=2).transpose(1, 2)
    scores = qr @ kr.transpose(-1, -2) * scale  # [R, hq, Lq, L]
    mask = torch.arange(length).view(1, 1, 1, length) > pos
    probs = scores.masked_fill(mask, -math.inf).softmax(-1)
    out = (probs @ vr).transpose(1, 2)  # [R, Lq, hq, d]
    return (out.reshape(nq, hq, d) if regular else out[q_seq, q_pos]).to(q.dtype)


def _attention_grads_ordered(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_seq: torch.Tensor, q_pos: torch.Tensor,
    scale: float, grad_out: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`attention`'s gradients (q, k, v) in an order fixed by the model (parity.autograd.
    ordered_backward), in the layouts of `_attention_reference` (each query in its own
    (sequence, position) slot): see _ordered_attention_backward."""
    nq, hq, d = q.shape
    num_seqs, length = k.shape[:2]
    per_seq = nq // num_seqs if num_seqs else 0
    regular = per_seq * num_seqs == nq and torch.equal(
        q_seq, torch.arange(num_seqs).repeat_interleave(per_seq)
    )
    if regular:
        shape = (num_seqs, per_seq, hq, d)
        qs, gs, pos = q.float().view(shape), grad_out.float().view(shape), q_pos.view(num_seqs, per_seq)
    elif (q_seq * length + q_pos).unique().numel() == nq:  # placed at their slots of the training layout
        shape = (num_seqs, length, hq, d)
        qs = q.new_zeros(shape, dtype=torch.float32).index_put((q_seq, q_pos), q.float())
        gs = q.new_zeros(shape, dtype=torch.float32).index_put((q_seq, q_pos), grad_out.float())
        pos = torch.arange(length).expand(num_seqs, length)
    else:
        raise ValueError("ordered attention gradients need each query in its own (sequence, position) slot")
    dq, dk, dv = _ordered_attention_backward(qs, k.float(), v.float(), pos, scale, gs)
    dq = dq.reshape(nq, hq, d) if regular else dq[q_seq, q_pos]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _ordered_attention_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float, grad_out: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal attention's backward for q, grad_out [R, Lq, hq, d] at positions q_pos [R, Lq] over
    k, v [R, L, hkv, d], fp32. Every product is a compiled `bmm` entry of one (sequence, query
    head) or, for a key's and a value's sums over their KV group, of one (sequence, KV head)
    with the group's query heads end to end along K; the softmax is recomputed with the
    compiled exp and row sums, everything else is element-wise. So no bit depends on how many
    heads share the call (a tensor-parallel rank's share) or on the other sequences."""
    num_seqs, lq, hq, d = q.shape
    length, hkv = k.shape[1:3]
    g = hq // hkv
    heads = (num_seqs, lq, hkv, g, d)
    qh = q.view(heads).permute(0, 2, 3, 1, 4)  # [R, hkv, g, Lq, d]
    go = grad_out.view(heads).permute(0, 2, 3, 1, 4)
    kh = k.permute(0, 2, 1, 3).unsqueeze(2).expand(num_seqs, hkv, g, length, d)  # [R, hkv, g, L, d]
    vh = v.permute(0, 2, 1, 3).unsqueeze(2).expand(num_seqs, hkv, g, length, d)
    masked = torch.arange(length).view(1, 1, 1, 1, length) > q_pos.view(num_seqs, 1, 1, lq, 1)
    scores = (bmm(qh, kh.transpose(-1, -2)) * scale).masked_fill(masked, -math.inf)  # [R, hkv, g, Lq, L]
    e = exp(scores - scores.amax(-1, keepdim=True))  # the max is exact in any order
    p = e / row_sum(e).unsqueeze(-1)
    dp = bmm(go, vh.transpose(-1, -2))
    ds = p * (dp - row_sum(dp * p).unsqueeze(-1))
    dq = bmm(ds, kh) * scale

    def group_sum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a^T b summed over the group's heads and queries: [R, hkv, L, g * Lq] @ [R, hkv, g * Lq, d]."""
        return bmm(a.permute(0, 1, 4, 2, 3).reshape(num_seqs, hkv, length, g * lq), b.reshape(num_seqs, hkv, g * lq, d))

    dk = group_sum(ds, qh) * scale
    dv = group_sum(p, go)
    return dq.permute(0, 3, 1, 2, 4).reshape(num_seqs, lq, hq, d), dk.transpose(1, 2), dv.transpose(1, 2)


def attention_scale(head_dim: int) -> float:
    """The softmax scale, written once so both engines use the same Python float."""
    return head_dim**-0.5


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_seq: torch.Tensor, q_pos: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal GQA attention for a flat set of queries over per-sequence key/value contexts.

    q: [Nq, Hq, D]; k, v: [R, L, Hkv, D] (sequence r's keys at positions 0..L-1, any padding
    beyond a sequence's end is ignored); q_seq: [Nq] sequence index of each query; q_pos: [Nq]
    its position. Query i attends to keys 0..q_pos[i] of sequence q_seq[i]. Returns [Nq, Hq, D].

    Invariant because: a query's result is an online softmax over the fixed blocks
    0..q_pos // KV_BLOCK of its own sequence, visited in order, each block reduced over fixed
    lengths (D for scores, KV_BLOCK for the weighted values) with row_sum; the number of
    queries, other sequences, and the padded length never enter a query's arithmetic. Decode
    (one query per sequence, keys read from the paged cache) and training (all positions of a
    sequence at once) therefore give the same bits.
    """
    if q.is_cuda:
        return _cuda().attention(q, k, v, q_seq, q_pos, scale)
    if not INVARIANT:
        return _attention_reference(q, k, v, q_seq, q_pos, scale)
    return RecomputeAttention.apply(q, k, v, q_seq, q_pos, scale, _attention_forward, _attention_reference,
                                    _attention_grads_ordered)


def paged_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, ctx_slots: torch.Tensor, q_seq: torch.Tensor,
    q_pos: torch.Tensor, scale: float,
) -> torch.Tensor:
    """`attention` over a paged KV cache, read in place (inference only: no gradient).

    kv_cache: [S, 2, Hkv, D], slot-major (slot s holds a key at [s, 0] and its value at
    [s, 1]); ctx_slots: [R, L] int64, the slot of each sequence's positions 0..L-1 (any slot
    past a sequence's end: it is never attended). Each 64-key block is gathered from the cache
    when the walk reaches it, into the same values and layouts `attention` builds from
    contiguous keys, so a query's bits are the same in both forms: `attention` is this walk
    over a cache whose slots are the contiguous positions.
    """
    if q.is_cuda or not INVARIANT:
        ctx = kv_cache[ctx_slots]  # [R, L, 2, Hkv, D]
        return attention(q, ctx[:, :, 0], ctx[:, :, 1], q_seq, q_pos, scale)
    return _paged_attention_forward(q, kv_cache, ctx_slots, q_seq, q_pos, scale)


def _log_softmax_reference(x: torch.Tensor) -> torch.Tensor:
    return x.log_softmax(dim=-1, dtype=torch.float32)


def _log_softmax_forward(x: torch.Tensor) -> torch.Tensor:
    # A CUDA row goes to the host and back: the compiled kernel is the one implementation of
    # the tail, so a CUDA rollout and a CUDA trainer (and a CPU one) get the same bits.
    return native.ops().log_softmax(x.cpu()).to(x.device)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """fp32 log-softmax over the vocabulary (compiled, parity/csrc/sampling.cpp).

    Invariant by construction: per row, the fixed-order row max, our exp, the fixed-tree row
    sum and our log, so a row's bits are a function of the row alone, on every ISA code path.
    The rollout's sampler (rollout/sampler.py) and the trainer both call this. Differentiable:
    gradients come from torch's log-softmax. CUDA tensors are computed on the host (one copy of
    the logits each way); KIMI_RL_INVARIANT_KERNELS=0 keeps torch's kernel.
    """
    if not INVARIANT:
        return _log_softmax_reference(logits)
    if torch.is_grad_enabled() and logits.requires_grad:
        return RecomputeGrad.apply(logits, _log_softmax_forward, _log_softmax_reference)
    return _log_softmax_forward(logits)


def kernel_info() -> dict[str, object]:
    """What computes this process's log-probs: the compiled kernels' code path (KIMI_RL_ISA),
    whether its bf16 GEMMs run VDPBF16PS, torch's own path (ATEN_CPU_CAPABILITY) and whether the
    invariant kernels are on (KIMI_RL_INVARIANT_KERNELS), for reports and metrics."""
    return {"isa": native.isa(), "bf16_dot": native.bf16_dot(),
            "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(), "invariant_kernels": INVARIANT}


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) for logits [..., V] and integer targets [...], in fp32."""
    return log_softmax(logits).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
