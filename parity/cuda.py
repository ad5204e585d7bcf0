"""The parity kernels on CUDA: Triton kernels for every reduction, torch for element-wise ops.

`parity.kernels` dispatches here when its input lives on a CUDA device (`if x.is_cuda:`); the
CPU code paths there are untouched. The rule is the one of `parity.kernels`, restated for a GPU:

    every reduction runs in a fixed order that depends on the model config alone (never on the
    number of rows, the batch, chunking or decode vs. training).

Stock CUDA kernels break it in two ways: cuBLAS picks its GEMM kernel (tile shape, split-K) from
M, N and K, so a row's bits depend on how many rows travel with it; torch's reductions (sum,
mean) pick their block layout, and whether a row is split across threads, from the number of
outputs. Here every reduction is a Triton kernel whose launch constants are functions of the
model shapes (N, K, hidden size, head dim, dtype) only, and in which one program owns each
output row or tile with no cross-program (split-K / split-KV) accumulation. Inside one program a
row's arithmetic never reads another row's data: a `tl.dot` output element only depends on its
own row of A and column of B, and padding rows (masked loads of 0) are never stored.

Element-wise ops (SiLU, exp, RoPE's mul/add, casts) stay plain torch: on CUDA each element is
computed by the same scalar functor whatever its position (vectorised and tail loads share
it), so no CPU-style chunking is needed; tests/unit/test_cuda_kernels.py checks it on the device.
`log_softmax` needs no CUDA branch: vLLM's sampler calls the very same torch op, whose CUDA
kernel reduces each row in one block sized from the vocabulary alone (checked on the device).

Backward passes (training) are plain torch math: correct, not bit-stable. Only the forward must
be invariant.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from parity.autograd import InvariantLinear, RecomputeAttention

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with every CUDA torch wheel
    triton = None
    tl = None

# Keys per attention block: the same block walk as parity.kernels (asserted by a test).
KV_BLOCK = 64


def _require_triton() -> None:
    if triton is None:  # pragma: no cover
        raise RuntimeError("the CUDA parity kernels need triton (it ships with CUDA torch)")


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """Contiguous, with a 16-byte aligned start. Triton specialises a kernel on its pointers'
    alignment; a sliced input (x[i:]) must not compile a second variant of a kernel."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


# --------------------------------------------------------------------------------------------
# Launch plans (pure Python: CPU-testable)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinearConfig:
    """Launch constants of the GEMM. No split-K field on purpose: one program owns a
    BLOCK_M x BLOCK_N output tile and walks K in BLOCK_K steps from 0 to K, in order."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    input_precision: str  # "ieee" for fp32 (exact fp32 FMAs, no tf32); bf16/fp16 use tensor cores
    group_m: int = 8  # program order swizzle for L2 reuse; changes no arithmetic


# bf16/fp16 tiles by rows: up to SMALL_M rows the decode tile, up to MID_M (or any M with
# row-parallel K-slices, whose second fp32 accumulator spills the 128 x 128 tile's registers)
# the 64 x 64 tile, above that the 128 x 128 tile.
SMALL_M = 64
MID_M = 256


def linear_config(n: int, k: int, dtype: torch.dtype, m: int | None = None, k_splits: int = 1) -> LinearConfig:
    """The GEMM's launch constants for a weight [n, k] of `dtype`, `m` rows (None: many) and
    `k_splits` row-parallel K-slices.

    One element's arithmetic never depends on M: fp32 has one tile whatever M is; bf16/fp16
    choose among three tiles that run the same K walk (BLOCK_K 64 from k = 0, one fp32
    accumulator per element and slice, no split-K) on the same instruction, Hopper's warpgroup
    MMA (BLOCK_M a multiple of 64, four warps per 64 rows), so an element sees the same
    sequence of k16 products-and-adds in any of them: only which elements share a program
    changes. Smaller tiles give small M more programs (a 4096-wide decode GEMM: 128 programs
    instead of 32 on 132 SMs) without split-K. That the tiles give every element the same bits
    is proven on the device for every M from 1 to 512, with and without K-slices, and their
    MMA instructions are compared (tests/unit/test_cuda_kernels.py). Measured on an H100:
    docs/gpu.md."""
    if dtype == torch.float32:
        return LinearConfig(64, 64, 32, num_warps=4, num_stages=3, input_precision="ieee")
    if dtype in (torch.bfloat16, torch.float16):
        if m is not None and m <= SMALL_M:
            return LinearConfig(64, 32, 64, num_warps=4, num_stages=4, input_precision="tf32")
        if k_splits > 1 or (m is not None and m <= MID_M):
            return LinearConfig(64, 64, 64, num_warps=4, num_stages=4, input_precision="tf32")
        return LinearConfig(128, 128, 64, num_warps=8, num_stages=3, input_precision="tf32")
    raise TypeError(f"parity linear supports fp32, bf16 and fp16, not {dtype}")


@dataclass(frozen=True)
class AttentionConfig:
    block_q: int  # query rows per program (all from one sequence)
    num_warps: int
    num_stages: int
    input_precision: str


def attention_config(head_dim: int, dtype: torch.dtype) -> AttentionConfig:
    """Attention's launch constants: a function of head_dim and dtype only (the model config)."""
    if dtype == torch.float32:
        return AttentionConfig(16, num_warps=4, num_stages=1, input_precision="ieee")
    if dtype in (torch.bfloat16, torch.float16):
        return AttentionConfig(64, num_warps=4, num_stages=2, input_precision="tf32")
    raise TypeError(f"parity attention supports fp32, bf16 and fp16, not {dtype}")


def attention_tile_plan(q_seq: torch.Tensor, block_q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group queries into tiles of at most `block_q` queries of one sequence.

    Returns (tiles [T, block_q] int32 query indices, -1 = empty slot; tile_seq [T] int32).
    Queries keep their given order inside a sequence. Which queries share a tile changes no
    query's bits (rows of a tile never mix; see `_attention_kernel`), it only decides how many
    key blocks a tile walks (up to its largest position)."""
    q_seq = q_seq.detach().to("cpu", torch.int64).reshape(-1)
    n = q_seq.numel()
    if n == 0:
        return torch.empty(0, block_q, dtype=torch.int32), torch.empty(0, dtype=torch.int32)
    order = torch.sort(q_seq, stable=True).indices
    s = q_seq[order]
    _, counts = torch.unique_consecutive(s, return_counts=True)
    run = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    run_start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(n) - run_start[run]
    tiles_per_run = -(-counts // block_q)
    tile_start = torch.cumsum(tiles_per_run, 0) - tiles_per_run
    tile_id = tile_start[run] + rank // block_q
    num_tiles = int(tiles_per_run.sum())
    tiles = torch.full((num_tiles, block_q), -1, dtype=torch.int32)
    tiles[tile_id, rank % block_q] = order.to(torch.int32)
    tile_seq = torch.empty(num_tiles, dtype=torch.int32)
    tile_seq[tile_id] = s.to(torch.int32)
    return tiles, tile_seq


def check_attention_shapes(q, k, v, q_seq, q_pos) -> None:
    """Shape / range checks of kernels.attention's contract (raises ValueError)."""
    if q.dim() != 3 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(
            f"attention wants q [Nq, Hq, D] and k, v [R, L, Hkv, D]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    nq, hq, d = q.shape
    r, length, hkv, dk = k.shape
    if dk != d:
        raise ValueError(f"head_dim of q ({d}) and k ({dk}) differ")
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) are not a multiple of KV heads ({hkv})")
    if q_seq.shape != (nq,) or q_pos.shape != (nq,):
        raise ValueError(f"q_seq and q_pos must have shape ({nq},)")
    if d < 16:
        raise ValueError(f"the CUDA attention kernel needs head_dim >= 16, got {d}")
    for name, t, hi in (("q_seq", q_seq, r), ("q_pos", q_pos, length)):
        if t.device.type == "cpu" and nq and (int(t.min()) < 0 or int(t.max()) >= hi):
            raise ValueError(f"{name} values must lie in [0, {hi})")


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit(do_not_specialize=["M"])
    def _linear_kernel(
        x_ptr, w_ptr, y_ptr, M, N, K_SLICE, stride_xm, stride_wn, stride_ym, stride_ys,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, PRECISION: tl.constexpr, SPLITS: tl.constexpr, SUM: tl.constexpr,
    ):
        # Why invariant: the K walk (0, BLOCK_K, 2 BLOCK_K, ... within each of SPLITS equal
        # K-slices) comes from the model's shapes, never from M; one program accumulates whole
        # slices (no split-K across programs); a tl.dot output element reads only its own row
        # of x, so rows that are padding (masked to 0) or other requests' rows cannot change it.
        # M is excluded from Triton's value specialisation so M = 1 compiles the same code as
        # M = 4096. SPLITS > 1 is the row-parallel K-order (parity.tp.row_splits): each slice's
        # chain starts from zero in fp32; SUM adds the slice partials in slice order, exactly
        # parity.tp.rank_ordered_sum's ((p0 + p1) + p2) ..., and rounds once; without SUM the
        # fp32 partials are stored ([SPLITS, M, N]) for a rank-ordered sum across ranks.
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        group = GROUP_M * num_n
        first_m = (pid // group) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % group) % size_m
        pid_n = (pid % group) // size_m
        rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        rk = tl.arange(0, BLOCK_K)
        out_mask = (rm[:, None] < M) & (rn[None, :] < N)
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in tl.static_range(SPLITS):
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K_SLICE, BLOCK_K):
                kk = k0 + rk
                col = s * K_SLICE + kk
                a = tl.load(
                    x_ptr + rm[:, None] * stride_xm + col[None, :],
                    mask=(rm[:, None] < M) & (kk[None, :] < K_SLICE), other=0.0,
                )
                b = tl.load(
                    w_ptr + rn[None, :] * stride_wn + col[:, None],
                    mask=(rn[None, :] < N) & (kk[:, None] < K_SLICE), other=0.0,
                )
                acc = tl.dot(a, b, acc, input_precision=PRECISION)
            if SUM:
                if s == 0:
                    total = acc
                else:
                    total = total + acc
            else:
                tl.store(y_ptr + s * stride_ys + rm[:, None] * stride_ym + rn[None, :], acc, mask=out_mask)
        if SUM:
            tl.store(
                y_ptr + rm[:, None] * stride_ym + rn[None, :],
                total.to(y_ptr.dtype.element_ty),
                mask=out_mask,
            )

    @triton.jit
    def _rms_normalize_kernel(x_ptr, y_ptr, inv_ptr, H, eps, BLOCK_H: tl.constexpr):
        # Why invariant: one program per row; the row is reduced by tl.sum over a block of
        # BLOCK_H = next_pow2(hidden) lanes, a reduction tree fixed at compile time by
        # BLOCK_H and num_warps (both from the hidden size), whatever the number of rows.
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_H)
        mask = offs < H
        h = tl.load(x_ptr + row * H + offs, mask=mask, other=0.0).to(tl.float32)
        var = tl.sum(h * h, axis=0) / H
        inv = 1.0 / tl.sqrt(var + eps)
        tl.store(inv_ptr + row, inv)
        tl.store(y_ptr + row * H + offs, (h * inv).to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _row_sum_kernel(x_ptr, y_ptr, N, BLOCK: tl.constexpr):
        # Why invariant: one program per row, a compile-time reduction tree over BLOCK lanes.
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * N + offs, mask=offs < N, other=0.0).to(tl.float32)
        tl.store(y_ptr + row, tl.sum(x, axis=0).to(y_ptr.dtype.element_ty))

    @triton.jit(do_not_specialize=["L", "stride_kr", "G"])
    def _attention_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, pos_ptr, tiles_ptr, tile_seq_ptr,
        qsl_ptr, seq_lens_ptr, block_table_ptr, stride_bt, v_shift,
        L, G, scale,
        stride_qn, stride_qh, stride_on, stride_oh, stride_kr, stride_kl, stride_kh,
        D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr,
        KV_BLOCK: tl.constexpr, PRECISION: tl.constexpr,
        PAGED: tl.constexpr, PAGE: tl.constexpr,
    ):
        # Why invariant: a query row's result is an online softmax over key blocks
        # 0, 1, ..., pos // KV_BLOCK of its own sequence, visited in that order, exactly the
        # walk of the CPU kernel. Within a block, scores = q . k over D and p @ v over
        # KV_BLOCK keys are tl.dot reductions whose order is fixed by (BLOCK_Q, KV_BLOCK,
        # BLOCK_D), all set by head_dim and dtype. Rows of a tile never mix (a dot output row
        # reads only its own q row / p row). A tile walks up to its largest position; a row
        # past its own last block keeps its state unchanged (tl.where, not arithmetic), so
        # it runs exactly blocks 0 .. pos // KV_BLOCK, as on the CPU. Keys past the tile's
        # largest position (a paged cache's unused slots, possibly NaN/inf) are never read:
        # masked loads return 0 and scores are replaced (never multiplied) by -inf. So the
        # same query gives the same bits alone in decode, or among its whole sequence in
        # training, or next to any other requests.
        #
        # Two ways to find rows and keys, with the same arithmetic:
        # - contiguous (training): `tiles` lists each tile's query rows, `pos` their positions,
        #   keys of sequence r at k[r, position];
        # - PAGED (the rollout): a tile is (request r, first query j0) in `tiles`; its rows and
        #   positions come from vLLM's device buffers (query_start_loc, seq_lens) and its keys
        #   from the KV cache through the block table (slot = block_table[r, p // PAGE] * PAGE
        #   + p % PAGE), read in place. Nothing is planned on the host per layer, and the
        #   launch reads only persistent buffers, so it can be captured in a CUDA graph.
        tile = tl.program_id(0)
        hq = tl.program_id(1)
        hkv = hq // G
        offs_q = tl.arange(0, BLOCK_Q)
        if PAGED:
            req = tl.load(tiles_ptr + 2 * tile)
            j0 = tl.load(tiles_ptr + 2 * tile + 1)
            live = req >= 0
            req = tl.where(live, req, 0)
            q_start = tl.load(qsl_ptr + req)
            q_len = tl.where(live, tl.load(qsl_ptr + req + 1) - q_start, 0)  # empty tile: no rows
            seq_len = tl.load(seq_lens_ptr + req)
            j = tl.where(live, j0, 0) + offs_q
            pos = seq_len - q_len + j
            row_ok = (j < q_len) & (pos >= 0)
            idx = (q_start + j).to(tl.int64)
            seq = req.to(tl.int64)
        else:
            idx = tl.load(tiles_ptr + tile * BLOCK_Q + offs_q)
            row_ok = idx >= 0
            idx = tl.where(row_ok, idx, 0).to(tl.int64)
            pos = tl.load(pos_ptr + idx, mask=row_ok, other=0)
            seq = tl.load(tile_seq_ptr + tile).to(tl.int64)
        idx = tl.where(row_ok, idx, 0)
        pos = tl.where(row_ok, pos, 0)
        max_pos = tl.max(pos, axis=0)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        q = tl.load(
            q_ptr + idx[:, None] * stride_qn + hq * stride_qh + offs_d[None, :],
            mask=row_ok[:, None] & d_ok[None, :], other=0.0,
        )
        m = tl.full((BLOCK_Q,), float("-inf"), dtype=tl.float32)
        denom = tl.zeros((BLOCK_Q,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_Q, BLOCK_D), dtype=tl.float32)
        offs_kv = tl.arange(0, KV_BLOCK)
        num_blocks = max_pos // KV_BLOCK + 1
        for jb in range(0, num_blocks):
            kpos = jb * KV_BLOCK + offs_kv
            k_ok = kpos <= max_pos
            if PAGED:
                page = tl.load(block_table_ptr + seq * stride_bt + kpos // PAGE, mask=k_ok, other=0)
                row = page.to(tl.int64) * PAGE + kpos % PAGE
                kv_off = row[:, None] * stride_kl + hkv * stride_kh + offs_d[None, :]
            else:
                kv_off = (
                    seq * stride_kr + hkv * stride_kh
                    + kpos.to(tl.int64)[:, None] * stride_kl + offs_d[None, :]
                )
            kv_mask = k_ok[:, None] & d_ok[None, :]
            kb = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
            scores = tl.dot(q, tl.trans(kb), input_precision=PRECISION) * scale
            valid = kpos[None, :] <= pos[:, None]
            scores = tl.where(valid, scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            correction = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            vb = tl.load(v_ptr + v_shift + kv_off, mask=kv_mask, other=0.0)
            pv = tl.dot(p.to(vb.dtype), vb, input_precision=PRECISION)
            # A row takes part in blocks 0 .. pos // KV_BLOCK only (the CPU kernel's rule):
            # past its own position its state is kept as is, whatever its tile-mates need.
            active = jb * KV_BLOCK <= pos
            denom = tl.where(active, denom * correction + tl.sum(p, axis=1), denom)
            acc = tl.where(active[:, None], acc * correction[:, None] + pv, acc)
            m = tl.where(active, m_new, m)
        out = acc / denom[:, None]
        tl.store(
            o_ptr + idx[:, None] * stride_on + hq * stride_oh + offs_d[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )

    @triton.jit
    def _kv_store_kernel(
        key_ptr, value_ptr, cache_ptr, slot_ptr, stride_key, stride_value, stride_slot,
        WIDTH: tl.constexpr, BLOCK: tl.constexpr,
    ):
        # One program per token: copy its key and value rows (Hkv * D values, in the cache's
        # dtype) to cache[slot, 0] and cache[slot, 1]. Padding tokens carry slot -1 and write
        # nothing. No host work, no data-dependent shapes: capturable in a CUDA graph.
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        ok = offs < tl.where(slot >= 0, WIDTH, 0)
        base = cache_ptr + slot * stride_slot
        k = tl.load(key_ptr + t * stride_key + offs, mask=ok, other=0.0)
        v = tl.load(value_ptr + t * stride_value + offs, mask=ok, other=0.0)
        tl.store(base + offs, k.to(cache_ptr.dtype.element_ty), mask=ok)
        tl.store(base + WIDTH + offs, v.to(cache_ptr.dtype.element_ty), mask=ok)


# --------------------------------------------------------------------------------------------
# Launchers (forward only, no autograd)
# --------------------------------------------------------------------------------------------


def linear_forward(
    rows: torch.Tensor, weight: torch.Tensor, config: LinearConfig | None = None,
    k_splits: int = 1, partials: bool = False,
) -> torch.Tensor:
    """rows [M, K] @ weight[N, K].T through `_linear_kernel`: [M, N] in rows.dtype, K walked in
    `k_splits` equal slices whose fp32 partials are added in order and rounded once; with
    `partials`, those unsummed fp32 partials [k_splits, M, N] instead."""
    _require_triton()
    m, k = rows.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"linear: x has K={k}, weight has shape {tuple(weight.shape)}")
    if weight.dtype != rows.dtype:
        raise TypeError(f"linear: x is {rows.dtype}, weight is {weight.dtype}")
    if k_splits < 1 or k % k_splits:
        raise ValueError(f"linear: K={k} does not split into {k_splits} equal slices")
    cfg = config or linear_config(n, k, rows.dtype, m, k_splits)
    rows = _aligned(rows)
    weight = _aligned(weight)
    if partials:
        out = torch.empty(k_splits, m, n, dtype=torch.float32, device=rows.device)
    else:
        out = torch.empty(m, n, dtype=rows.dtype, device=rows.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    _launch_linear(rows, weight, out, cfg, k_splits)
    return out


def _launch_linear(rows: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, cfg: LinearConfig, k_splits: int):
    """One `_linear_kernel` launch; returns Triton's compiled kernel (its `asm` is what the
    device tests read to check which MMA instruction a tile compiles to). `out` is [M, N] for
    the rounded sum, [k_splits, M, N] fp32 for the partials."""
    (m, k), n = rows.shape, weight.shape[0]
    partials = out.dim() == 3
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    return _linear_kernel[grid](
        rows, weight, out, m, n, k // k_splits, rows.stride(0), weight.stride(0),
        out.stride(-2), out.stride(0) if partials else 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        PRECISION=cfg.input_precision, SPLITS=k_splits, SUM=not partials,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _norm_warps(block: int) -> int:
    return 1 if block <= 256 else 4 if block <= 2048 else 8


def rms_normalize_forward(x2d: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype) per row, and the fp32 rsqrt per row."""
    _require_triton()
    rows, h = x2d.shape
    x2d = _aligned(x2d)
    y = torch.empty_like(x2d)
    inv = torch.empty(rows, dtype=torch.float32, device=x2d.device)
    if rows:
        block = _next_pow2(h)
        _rms_normalize_kernel[(rows,)](x2d, y, inv, h, eps, BLOCK_H=block, num_warps=_norm_warps(block))
    return y, inv


def row_sum_forward(x: torch.Tensor) -> torch.Tensor:
    _require_triton()
    n = x.shape[-1]
    rows = _aligned(x.reshape(-1, n))
    out = torch.empty(rows.shape[0], dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = _next_pow2(n)
        _row_sum_kernel[(rows.shape[0],)](rows, out, n, BLOCK=block, num_warps=_norm_warps(block))
    return out.view(x.shape[:-1])


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_seq: torch.Tensor, q_pos: torch.Tensor,
    scale: float, config: AttentionConfig | None = None,
) -> torch.Tensor:
    _require_triton()
    check_attention_shapes(q, k, v, q_seq, q_pos)
    nq, hq, d = q.shape
    _, length, hkv, _ = k.shape
    cfg = config or attention_config(d, q.dtype)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if nq == 0:
        return out
    q = _aligned(q)
    k = _aligned(k.to(q.dtype))
    v = _aligned(v.to(q.dtype))
    tiles, tile_seq = attention_tile_plan(q_seq, cfg.block_q)
    dev = q.device
    tiles = tiles.to(dev, non_blocking=True)
    tile_seq = tile_seq.to(dev, non_blocking=True)
    pos = q_pos.to(device=dev, dtype=torch.int32)
    grid = (tiles.shape[0], hq)
    _attention_kernel[grid](
        q, k, v, out, pos, tiles, tile_seq,
        pos, pos, pos, 0, 0,  # the paged-mode buffers: unused here
        length, hq // hkv, float(scale),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k.stride(0), k.stride(1), k.stride(2),
        D=d, BLOCK_D=max(16, _next_pow2(d)), BLOCK_Q=cfg.block_q, KV_BLOCK=KV_BLOCK,
        PRECISION=cfg.input_precision, PAGED=False, PAGE=1,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def paged_tile_plan(query_start_loc: torch.Tensor, block_q: int) -> torch.Tensor:
    """The paged attention's tiles from the host copy of vLLM's query_start_loc: int32
    [T, 2] of (request, first query of the tile), ceil(query_len / block_q) tiles per request
    in request order. Which queries share a tile changes no query's bits (see
    `_attention_kernel`)."""
    qsl = query_start_loc.to("cpu", torch.int64).reshape(-1)
    lens = qsl[1:] - qsl[:-1]
    per_req = -(-lens // block_q)
    req = torch.repeat_interleave(torch.arange(lens.numel()), per_req)
    first_tile = torch.cumsum(per_req, 0) - per_req
    j0 = (torch.arange(req.numel()) - first_tile[req]) * block_q
    return torch.stack([req, j0], 1).to(torch.int32)


def paged_attention_forward(
    q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, page: int,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, tiles: torch.Tensor,
    scale: float, out: torch.Tensor, config: AttentionConfig | None = None,
) -> torch.Tensor:
    """Attention of vLLM's scheduled queries over its paged KV cache, read in place, into `out`.

    q, out: [T, Hq, D] (rows of requests in query_start_loc order; rows no tile covers are
    left as they are); kv_cache: [S, 2, Hkv, D], slot-major; block_table [R, max_pages] int32;
    query_start_loc [R + 1] and seq_lens [R] int32 on the device; tiles: [>= T', 2] int32
    on the device, `paged_tile_plan`'s rows then (-1, -1) rows, one program per row. Every
    argument is a device buffer or a model constant, so the launch can be captured in a CUDA
    graph and replayed over new contents of the same buffers."""
    _require_triton()
    nq, hq, d = q.shape
    _, two, hkv, dk = kv_cache.shape
    if two != 2 or dk != d or hq % hkv:
        raise ValueError(f"paged attention: q {tuple(q.shape)} vs kv_cache {tuple(kv_cache.shape)}")
    if d < 16:
        raise ValueError(f"the CUDA attention kernel needs head_dim >= 16, got {d}")
    if q.stride(-1) != 1 or out.stride(-1) != 1 or out.shape != q.shape:
        raise ValueError("paged attention wants q and out [T, Hq, D] with unit stride in D")
    cfg = config or attention_config(d, q.dtype)
    if tiles.shape[0] == 0:
        return out
    grid = (tiles.shape[0], hq)
    # Keys at kv_cache[slot, 0], values kv_cache.stride(1) elements further.
    _attention_kernel[grid](
        q, kv_cache, kv_cache, out, tiles, tiles, tiles,
        query_start_loc, seq_lens, block_table, block_table.stride(0), kv_cache.stride(1),
        0, hq // hkv, float(scale),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        0, kv_cache.stride(0), kv_cache.stride(2),
        D=d, BLOCK_D=max(16, _next_pow2(d)), BLOCK_Q=cfg.block_q, KV_BLOCK=KV_BLOCK,
        PRECISION=cfg.input_precision, PAGED=True, PAGE=page,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def kv_cache_store(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """kv_cache[slot, 0] = key, kv_cache[slot, 1] = value for each token whose slot is >= 0
    (key, value: [T, Hkv, D]; kv_cache: [S, 2, Hkv, D]); capturable in a CUDA graph."""
    _require_triton()
    t = min(key.shape[0], slots.shape[0])
    if t == 0:
        return
    width = kv_cache.shape[2] * kv_cache.shape[3]
    key, value = key.reshape(key.shape[0], -1), value.reshape(value.shape[0], -1)
    if key.stride(-1) != 1 or value.stride(-1) != 1 or key.shape[1] != width:
        raise ValueError(f"kv_cache_store: key {tuple(key.shape)} does not fit cache rows of {width}")
    block = _next_pow2(width)
    _kv_store_kernel[(t,)](
        key, value, kv_cache, slots, key.stride(0), value.stride(0), kv_cache.stride(0),
        WIDTH=width, BLOCK=block, num_warps=_norm_warps(block),
    )


# --------------------------------------------------------------------------------------------
# The ops parity.kernels dispatches to (differentiable)
# --------------------------------------------------------------------------------------------


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, k_splits: int = 1
) -> torch.Tensor:
    """y = x @ weight.T (+ bias): the parity GEMM on CUDA (see `_linear_kernel`), K walked in
    `k_splits` slices (the row-parallel K-order, parity.tp.row_splits)."""

    k = x.shape[-1]
    forward = functools.partial(linear_forward, k_splits=k_splits)
    out = InvariantLinear.apply(x.reshape(-1, k), weight, forward)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


class _RMSNormalize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, eps):
        y, inv = rms_normalize_forward(x2d, eps)
        ctx.save_for_backward(x2d, inv)
        return y

    @staticmethod
    def backward(ctx, grad):
        x2d, inv = ctx.saved_tensors
        return rms_normalize_backward(x2d, inv, grad), None


def rms_normalize_backward(x2d: torch.Tensor, inv: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """d/dx of n = x * inv(x), inv = (mean(x^2) + eps)^-1/2: inv * (g - x * inv^2 * mean(g x))."""
    wide = torch.promote_types(x2d.dtype, torch.float32)
    h, g, inv = x2d.to(wide), grad.to(wide), inv.to(wide).unsqueeze(-1)
    dh = inv * (g - h * inv * inv * (g * h).mean(-1, keepdim=True))
    return dh.to(x2d.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF-style RMSNorm: normalise in fp32 (Triton, one program per row), cast back, then scale
    by the weight with torch's own element-wise multiply (same promotion as the CPU path)."""
    h = x.shape[-1]
    normed = _RMSNormalize.apply(x.reshape(-1, h), eps).view(x.shape)
    return weight * normed


class _RowSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.shape = x.shape
        return row_sum_forward(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.unsqueeze(-1).expand(ctx.shape)


def row_sum(x: torch.Tensor) -> torch.Tensor:
    return _RowSum.apply(x)


def pointwise(fn, x: torch.Tensor) -> torch.Tensor:
    """Element-wise `fn` on CUDA.

    Invariant because: torch's CUDA element-wise kernels compute each element with one scalar
    functor (in fp32 opmath for bf16), whether it sits in a vectorised chunk or in the tail, so
    an element's bits depend on its value alone; no padding or chunking is needed."""
    return fn(x)


_ROPE_ON_DEVICE: dict = {}


def _rope_on(table: tuple[torch.Tensor, torch.Tensor], device: torch.device):
    cos, sin = table
    key = (id(cos), id(sin), str(device))
    hit = _ROPE_ON_DEVICE.get(key)
    if hit is None or hit[0] is not cos or hit[1] is not sin:
        hit = (cos, sin, cos.to(device), sin.to(device))
        _ROPE_ON_DEVICE[key] = hit
    return hit[2], hit[3]


def apply_rope(x: torch.Tensor, positions: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Neox-style RoPE on CUDA: the CPU-built fp32 table (same bits for both engines), copied
    to the device once, indexed by position; element-wise mul/sub/add as separate torch ops
    (each correctly rounded, no fused multiply-add), as on the CPU."""
    cos, sin = _rope_on(table, x.device)
    positions = positions.to(x.device)
    cos = cos[positions].unsqueeze(1)
    sin = sin[positions].unsqueeze(1)
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


def attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_seq: torch.Tensor, q_pos: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Dense differentiable fp32 attention with kernels.attention's semantics, one sequence at a
    time (memory: one [Hq, n_r, L] score matrix per sequence, not a [Nq, L, Hq, D] gather)."""
    nq, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    dev = q.device
    q_seq = q_seq.to(dev)
    q_pos = q_pos.to(dev)
    keys = torch.arange(k.shape[1], device=dev)
    outs, order = [], []
    for r in torch.unique(q_seq).tolist():
        idx = (q_seq == r).nonzero().squeeze(1)
        qr = q[idx].float()  # [n, hq, d]
        kr = k[r].float().repeat_interleave(g, dim=1)  # [L, hq, d]
        vr = v[r].float().repeat_interleave(g, dim=1)
        scores = torch.einsum("nhd,lhd->hnl", qr, kr) * scale
        mask = keys.unsqueeze(0) > q_pos[idx].unsqueeze(1)  # [n, L]
        probs = scores.masked_fill(mask.unsqueeze(0), -math.inf).softmax(-1)
        outs.append(torch.einsum("hnl,lhd->nhd", probs, vr))
        order.append(idx)
    if not outs:
        return q.new_zeros(q.shape)
    out = torch.cat(outs)
    inverse = torch.empty_like(q_seq)
    inverse[torch.cat(order)] = torch.arange(nq, device=dev)
    return out[inverse].to(q.dtype)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_seq: torch.Tensor, q_pos: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """kernels.attention on CUDA: forward `_attention_kernel`, backward a dense recompute."""

    # No ordered backward on CUDA yet (ordered_fn None): the dense recompute.
    return RecomputeAttention.apply(q, k, v, q_seq, q_pos, scale, attention_forward, attention_reference, None)
