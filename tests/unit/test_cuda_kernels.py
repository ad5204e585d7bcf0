"""The CUDA parity kernels (parity/cuda.py).

CPU part (always runs): launch plans, shape checks, the dispatch in parity.kernels, the dense
reference and backward math, and the Triton kernels' indexing and masking through Triton's
interpreter (TRITON_INTERPRET=1, in a subprocess, fp32 / fp16: the interpreter has no bf16).

GPU part (skipped without CUDA): the same invariance properties as tests/unit/test_kernels.py on the
device, bitwise (torch.equal): a row alone vs. in a batch, decode vs. whole sequence.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parity import cuda, kernels, tp

ROOT = Path(__file__).resolve().parents[2]
CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def _randn(seed: int, *shape, dtype=torch.float32, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)


# --- CPU: plans and checks --------------------------------------------------------------------


def test_kv_block_matches_cpu_kernel():
    assert cuda.KV_BLOCK == kernels.KV_BLOCK


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_linear_config_keeps_one_k_walk_whatever_m(dtype):
    """M and the K-slices may pick the tile (bf16 / fp16), never the K walk: the same BLOCK_K
    from k = 0, no split-K field, 64-row multiples with four warps per 64 rows (one warpgroup
    MMA shape)."""
    assert list(inspect.signature(cuda.linear_config).parameters) == ["n", "k", "dtype", "m", "k_splits"]
    assert "split" not in " ".join(f.name for f in cuda.LinearConfig.__dataclass_fields__.values())
    ms = (None, 1, cuda.SMALL_M, cuda.SMALL_M + 1, cuda.MID_M, cuda.MID_M + 1, 4096)
    configs = {cuda.linear_config(4096, 4096, dtype, m, s) for m in ms for s in (1, 4)}
    assert len({c.block_k for c in configs}) == 1
    assert len({c.input_precision for c in configs}) == 1
    for cfg in configs:
        for b in (cfg.block_m, cfg.block_n, cfg.block_k):
            assert b >= 16 and b & (b - 1) == 0  # tl.dot needs power-of-two blocks of >= 16
        assert (cfg.input_precision == "ieee") == (dtype == torch.float32)  # fp32 never goes tf32
        if dtype != torch.float32:
            assert cfg.block_m % 64 == 0 and cfg.num_warps == 4 * (cfg.block_m // 64)
    assert len(configs) == (1 if dtype == torch.float32 else 3)
    assert cuda.linear_config(4096, 4096, dtype, 7) == cuda.linear_config(4096, 4096, dtype, 1)


def test_linear_config_rejects_other_dtypes():
    with pytest.raises(TypeError):
        cuda.linear_config(8, 8, torch.float64)


def test_attention_config_depends_on_the_model_only():
    assert list(inspect.signature(cuda.attention_config).parameters) == ["head_dim", "dtype"]
    assert cuda.attention_config(64, torch.float32).input_precision == "ieee"


@settings(max_examples=50, deadline=None)
@given(seqs=st.lists(st.integers(0, 5), min_size=0, max_size=200), block=st.sampled_from([1, 4, 16, 64]))
def test_attention_tile_plan(seqs, block):
    q_seq = torch.tensor(seqs, dtype=torch.long)
    tiles, tile_seq = cuda.attention_tile_plan(q_seq, block)
    assert tiles.dtype == tile_seq.dtype == torch.int32
    assert tiles.shape == (tile_seq.shape[0], block)
    used = tiles[tiles >= 0]
    assert sorted(used.tolist()) == list(range(len(seqs)))  # every query exactly once
    for t in range(tiles.shape[0]):
        row = tiles[t][tiles[t] >= 0]
        assert row.numel() > 0
        assert (tiles[t][row.numel():] == -1).all()  # padding only at the end
        assert (q_seq[row.long()] == int(tile_seq[t])).all()  # one sequence per tile
        assert row.tolist() == sorted(row.tolist())  # order kept within a sequence
    # the fewest tiles: ceil(count / block) per sequence
    counts = torch.bincount(q_seq, minlength=6) if seqs else torch.zeros(6, dtype=torch.long)
    assert tiles.shape[0] == int((-(-counts // block)).sum())


def test_check_attention_shapes():
    q, k = torch.zeros(3, 4, 16), torch.zeros(2, 10, 2, 16)
    seq, pos = torch.tensor([0, 1, 1]), torch.tensor([0, 9, 3])
    cuda.check_attention_shapes(q, k, k, seq, pos)
    bad = [
        (torch.zeros(3, 4, 32), k, k, seq, pos),  # head_dim mismatch
        (torch.zeros(3, 3, 16), k, k, seq, pos),  # heads not a multiple
        (q, k, torch.zeros(2, 9, 2, 16), seq, pos),  # k / v shapes
        (q, k, k, seq[:2], pos),  # q_seq length
        (q, k, k, torch.tensor([0, 2, 1]), pos),  # sequence out of range
        (q, k, k, seq, torch.tensor([0, 10, 3])),  # position past the context
        (torch.zeros(3, 4, 8), torch.zeros(2, 10, 2, 8), torch.zeros(2, 10, 2, 8), seq, pos),
    ]
    for args in bad:
        with pytest.raises(ValueError):
            cuda.check_attention_shapes(*args)


def test_attention_reference_matches_cpu_reference():
    q = _randn(0, 50, 4, 16).requires_grad_()
    k = _randn(1, 3, 40, 2, 16).requires_grad_()
    v = _randn(2, 3, 40, 2, 16).requires_grad_()
    seq = torch.randint(0, 3, (50,), generator=torch.Generator().manual_seed(3))
    pos = torch.randint(0, 40, (50,), generator=torch.Generator().manual_seed(4))
    ours = cuda.attention_reference(q, k, v, seq, pos, 0.25)
    ref = kernels._attention_reference(q, k, v, seq, pos, 0.25)
    assert (ours - ref).abs().max() < 1e-5
    g = _randn(5, 50, 4, 16)
    ga = torch.autograd.grad(ours, (q, k, v), g)
    gb = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(ga, gb, strict=True):
        assert (a - b).abs().max() < 1e-4


def test_rms_normalize_backward_is_the_derivative():
    x = _randn(0, 7, 48, dtype=torch.float64).requires_grad_()
    eps = 1e-6
    inv = torch.rsqrt(x.pow(2).mean(-1) + eps)
    n = x * inv.unsqueeze(-1)
    g = _randn(1, 7, 48, dtype=torch.float64)
    (auto,) = torch.autograd.grad(n, x, g)
    ours = cuda.rms_normalize_backward(x.detach(), inv.detach(), g)
    assert (ours - auto).abs().max() < 1e-10


def test_parity_check_cuda_graphs_flag(model_factory):
    """`--cuda-graphs on` asks vLLM for its default mode (eager otherwise); the report says which."""
    from rl.checker import validate
    from rl.cli import build_parser

    base = ["parity", "check", "--model", model_factory("llama")]
    for extra, expected in (([], False), (["--cuda-graphs", "off"], False), (["--cuda-graphs", "on"], True)):
        assert validate(build_parser().parse_args(base + extra)).cuda_graphs is expected
    with pytest.raises(SystemExit):
        build_parser().parse_args(base + ["--cuda-graphs", "yes"])


# --- CPU: dispatch ----------------------------------------------------------------------------


class _FakeCuda(torch.Tensor):
    """A CPU tensor that answers is_cuda = True, to see which path kernels.* takes."""

    @property
    def is_cuda(self):
        return True


def test_cpu_tensors_never_reach_the_cuda_module(monkeypatch):
    def boom():
        raise AssertionError("CPU input dispatched to parity.cuda")

    monkeypatch.setattr(kernels, "_cuda", boom)
    x, w = _randn(0, 5, 32), _randn(1, 8, 32)
    kernels.linear(x, w)
    kernels.rms_norm(x, _randn(2, 32), 1e-6)
    kernels.silu_and_mul(x)
    kernels.row_sum(x)
    kernels.apply_rope(x.view(5, 1, 32), torch.arange(5), kernels.rope_table(32, 10000.0, 64))
    q = _randn(3, 5, 2, 16)
    kv = _randn(4, 1, 5, 1, 16)
    kernels.attention(q, kv, kv, torch.zeros(5, dtype=torch.long), torch.arange(5), 0.25)


def test_cuda_tensors_dispatch_to_the_cuda_module(monkeypatch):
    calls = []

    class Recorder:
        def __getattr__(self, name):
            def fn(*args, **kwargs):
                calls.append(name)
                return "cuda-" + name

            return fn

    monkeypatch.setattr(kernels, "_cuda", lambda: Recorder())
    x = _randn(0, 5, 32).as_subclass(_FakeCuda)
    assert x.is_cuda
    table = kernels.rope_table(32, 10000.0, 64)
    assert kernels.linear(x, _randn(1, 8, 32)) == "cuda-linear"
    assert kernels.rms_norm(x, _randn(2, 32), 1e-6) == "cuda-rms_norm"
    assert kernels.row_sum(x) == "cuda-row_sum"
    assert kernels.silu(x) == "cuda-pointwise"
    assert kernels.apply_rope(x, torch.arange(5), table) == "cuda-apply_rope"
    assert kernels.attention(x, x, x, torch.arange(5), torch.arange(5), 0.1) == "cuda-attention"
    assert calls == ["linear", "rms_norm", "row_sum", "pointwise", "apply_rope", "attention"]


# --- CPU: the Triton kernels under Triton's interpreter -----------------------------------------

_INTERPRETED = textwrap.dedent(
    """
    import torch
    from parity import cuda, kernels

    def randn(seed, *shape, dtype=torch.float32):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(*shape, generator=g).to(dtype)

    def same_values(a, b, tol):
        # The interpreter runs tl.dot as numpy's matmul, whose BLAS picks its kernel (and so its
        # summation order) by shape and by the CPU's ISA: bits are not a property of the Triton
        # program here (they are tested bitwise on the GPU). What the interpreter does check is
        # the indexing: the right rows, the right keys, and no NaN/inf slot ever read.
        return bool(torch.isfinite(a).all()) and (a.double() - b.double()).abs().max() <= tol

    small = cuda.LinearConfig(16, 16, 16, num_warps=1, num_stages=1, input_precision="ieee")
    for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 2e-2)):
        cfg = small if dtype == torch.float32 else None
        x, w = randn(0, 37, 80, dtype=dtype), randn(1, 50, 80, dtype=dtype)
        y = cuda.linear_forward(x, w, cfg)
        ref = x.double() @ w.double().t()
        assert ((y.double() - ref).norm() / ref.norm()) < tol, dtype
        for i in (0, 5, 36):
            assert same_values(cuda.linear_forward(x[i : i + 1], w, cfg)[0], y[i], tol * float(y[i].abs().max())), (dtype, i)
            assert same_values(cuda.linear_forward(x[i:], w, cfg)[0], y[i], tol * float(y[i].abs().max())), (dtype, i)

    x = randn(2, 9, 80)
    n, inv = cuda.rms_normalize_forward(x, 1e-6)
    ref = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert (n.double() - ref).abs().max() < 1e-5
    assert (cuda.row_sum_forward(x).double() - x.double().sum(-1)).abs().max() < 1e-4

    acfg = cuda.AttentionConfig(16, num_warps=1, num_stages=1, input_precision="ieee")
    for dtype, tol, cfg in ((torch.float32, 1e-5, acfg), (torch.float16, 3e-3, None)):
        L, hkv, g, d = 150, 2, 2, 32
        q = randn(3, L, hkv * g, d, dtype=dtype)
        k, v = randn(4, 1, L, hkv, d, dtype=dtype), randn(5, 1, L, hkv, d, dtype=dtype)
        seq, pos = torch.zeros(L, dtype=torch.long), torch.arange(L)
        full = cuda.attention_forward(q, k, v, seq, pos, 0.2, cfg)
        ref = kernels._attention_reference(q.float(), k.float(), v.float(), seq, pos, 0.2)
        assert (full.float() - ref).abs().max() < tol, dtype
        nan = torch.full((1, 70, hkv, d), float("nan"), dtype=dtype)
        kd, vd = torch.cat([k, nan], 1), torch.cat([v, nan.abs() * float("inf")], 1)
        for t in (0, 63, 64, 100, L - 1):
            one = cuda.attention_forward(q[t : t + 1], kd, vd, seq[:1], pos[t : t + 1], 0.2, cfg)
            assert same_values(one[0], full[t], tol), (dtype, t)
        kb, vb = torch.cat([randn(6, 2, L + 70, hkv, d, dtype=dtype), kd]), torch.cat([randn(7, 2, L + 70, hkv, d, dtype=dtype), vd])
        qb = torch.cat([randn(8, 2, hkv * g, d, dtype=dtype), q[L - 1 :]])
        out = cuda.attention_forward(qb, kb, vb, torch.arange(3), torch.tensor([5, 200, L - 1]), 0.2, cfg)
        assert same_values(out[-1], full[L - 1], tol), dtype
    for splits in (2, 3):  # row-parallel K-slices: summed in order, or the fp32 partials
        x, w = randn(9, 37, 96), randn(10, 50, 96)
        parts = cuda.linear_forward(x, w, small, k_splits=splits, partials=True)
        s = 96 // splits
        for i in range(splits):
            ref = x[:, i * s : (i + 1) * s].double() @ w[:, i * s : (i + 1) * s].double().t()
            assert (parts[i].double() - ref).abs().max() < 1e-4, (splits, i)
        summed = cuda.linear_forward(x, w, small, k_splits=splits)
        assert (summed - parts.sum(0)).abs().max() < 1e-5, splits

    # the paged kernel reads vLLM's layout: pages in any order, garbage in unused slots
    acfg, page, hkv, g, d = cuda.AttentionConfig(16, 1, 1, "ieee"), 16, 2, 2, 32
    lens, qlens = [5, 150, 1, 70], [5, 20, 1, 3]
    k, v = randn(11, 4, 150, hkv, d), randn(12, 4, 150, hkv, d)
    cache = torch.full((64 * page, 2, hkv, d), float("nan"))
    pages = (torch.randperm(63, generator=torch.Generator().manual_seed(0)) + 1).tolist()
    bt = torch.zeros(4, 10, dtype=torch.int32)
    for r, length in enumerate(lens):
        for p in range(-(-length // page)):
            bt[r, p] = pages.pop()
        pos = torch.arange(length)
        slots = bt[r, pos // page].long() * page + pos % page
        cuda.kv_cache_store(k[r, :length], v[r, :length], cache, slots)
    qsl = torch.tensor([0, 5, 25, 26, 29], dtype=torch.int32)
    q = randn(13, 32, hkv * g, d)
    q_seq = torch.repeat_interleave(torch.arange(4), torch.tensor(qlens))
    q_pos = torch.cat([torch.arange(n - m, n) for n, m in zip(lens, qlens)])
    want = cuda.attention_forward(q[:29], k, v, q_seq, q_pos, 0.2, acfg)
    tiles = torch.cat([cuda.paged_tile_plan(qsl, acfg.block_q), torch.full((3, 2), -1, dtype=torch.int32)])
    out = torch.full_like(q, 7.0)
    cuda.paged_attention_forward(q, cache, bt, page, qsl, torch.tensor(lens, dtype=torch.int32), tiles, 0.2, out, acfg)
    assert same_values(out[:29], want, 1e-5)
    assert bool((out[29:] == 7.0).all())  # rows no tile covers are left alone
    c2 = torch.zeros(8, 2, hkv, d)
    cuda.kv_cache_store(k[0, :4], v[0, :4], c2, torch.tensor([3, -1, 0, 7]))
    assert torch.equal(c2[3, 0], k[0, 0]) and torch.equal(c2[7, 1], v[0, 3]) and torch.equal(c2[0, 0], k[0, 2])
    assert bool((c2[[1, 2, 4, 5, 6]] == 0).all())  # slot -1 (a padded token) writes nothing
    print("interpreted kernels ok")
    """
)


@pytest.mark.skipif(CUDA, reason="on a GPU the compiled kernels are tested instead")
def test_triton_kernels_under_the_interpreter():
    # Triton's interpreter changes between releases (3.6's cannot loop over a runtime bound);
    # this runs with the CPU stack's triton (3.9).
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "interpreted kernels ok" in done.stdout


# --- GPU ------------------------------------------------------------------------------------------

DTYPES = st.sampled_from([torch.float32, torch.bfloat16])
GPU_SETTINGS = settings(max_examples=20, deadline=None)


@gpu
@GPU_SETTINGS
@given(
    rows=st.integers(1, 300), k=st.sampled_from([32, 96, 576, 1000, 1001]),
    n=st.sampled_from([32, 192, 1000]), dtype=DTYPES, seed=st.integers(0, 2**16),
    pick=st.integers(0, 299),
)
def test_gpu_linear_row_invariant(rows, k, n, dtype, seed, pick):
    x = _randn(seed, rows, k, dtype=dtype, device="cuda")
    w = _randn(seed + 1, n, k, dtype=dtype, device="cuda")
    i = pick % rows
    full = kernels.linear(x, w)
    assert torch.equal(kernels.linear(x[i : i + 1], w)[0], full[i])
    assert torch.equal(kernels.linear(x[i:], w)[0], full[i])  # another tile position
    assert torch.equal(kernels.linear(x.view(1, rows, k), w)[0], full)
    big = torch.cat([_randn(seed + 2, 2000, k, dtype=dtype, device="cuda"), x[i : i + 1]])
    assert torch.equal(kernels.linear(big, w)[-1], full[i])  # among 2000 other rows
    ref = x.double() @ w.double().t()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (full.double() - ref).norm() / ref.norm() < tol


@gpu
@GPU_SETTINGS
@given(
    rows=st.integers(1, 200), per_slice=st.sampled_from([16, 48, 100, 288]),
    splits=st.sampled_from([2, 3, 4, 8]), n=st.sampled_from([32, 192, 1000]), dtype=DTYPES,
    seed=st.integers(0, 2**16), pick=st.integers(0, 199),
)
def test_gpu_linear_k_splits_equal_tp_shards(rows, per_slice, splits, n, dtype, seed, pick):
    """The row-parallel K-order on the GPU (parity.tp.row_splits): TP=1 equals every TP size
    that divides the slice count (rank partials all-gathered, rank-ordered sum), bitwise, and
    a row's bits do not depend on the batch."""
    k = splits * per_slice
    x = _randn(seed, rows, k, dtype=dtype, device="cuda")
    w = _randn(seed + 1, n, k, dtype=dtype, device="cuda")
    tp1 = kernels.linear(x, w, k_splits=splits)
    i = pick % rows
    assert torch.equal(kernels.linear(x[i : i + 1], w, k_splits=splits)[0], tp1[i])
    for size in (s for s in range(2, splits + 1) if splits % s == 0):
        parts = [
            kernels.linear_partials(tp.shard_cols(x, r, size), tp.shard_cols(w, r, size), splits // size)
            for r in range(size)
        ]
        assert torch.equal(tp.rank_ordered_sum(torch.cat(parts), dtype), tp1), size
    ref = x.double() @ w.double().t()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (tp1.double() - ref).norm() / ref.norm() < tol


@gpu
def test_gpu_linear_bias_and_backward():
    x = _randn(0, 3, 40, 96, device="cuda").requires_grad_()
    w = _randn(1, 64, 96, device="cuda").requires_grad_()
    b = _randn(2, 64, device="cuda").requires_grad_()
    out = kernels.linear(x, w, b)
    ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
    assert (out.double() - ref).abs().max() < 1e-4
    g = _randn(3, 3, 40, 64, device="cuda")
    ours = torch.autograd.grad(out, (x, w, b), g)
    theirs = torch.autograd.grad(ref, (x, w, b), g.double())
    for a, e in zip(ours, theirs, strict=True):
        assert (a.double() - e).abs().max() < 1e-3


@gpu
@GPU_SETTINGS
@given(rows=st.integers(1, 300), h=st.sampled_from([32, 128, 576, 4096]), dtype=DTYPES,
       seed=st.integers(0, 2**16), pick=st.integers(0, 299))
def test_gpu_rms_norm_silu_row_sum_row_invariant(rows, h, dtype, seed, pick):
    x = _randn(seed, rows, h, dtype=dtype, device="cuda")
    w = _randn(seed + 1, h, dtype=dtype, device="cuda")
    i = pick % rows
    full = kernels.rms_norm(x, w, 1e-6)
    assert torch.equal(kernels.rms_norm(x[i : i + 1], w, 1e-6)[0], full[i])
    assert torch.equal(kernels.rms_norm(x[i:], w, 1e-6)[0], full[i])
    assert torch.equal(kernels.silu_and_mul(x[i : i + 1])[0], kernels.silu_and_mul(x)[i])
    assert torch.equal(kernels.row_sum(x[i : i + 1])[0], kernels.row_sum(x)[i])
    ref = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    ref = w.double() * ref.to(dtype).double()
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: a rounding flip of the normalised value
    assert (full.double() - ref).abs().max() <= tol * ref.abs().max()


@gpu
def test_gpu_rms_norm_gradients():
    x = _randn(0, 2, 9, 64, device="cuda").requires_grad_()
    w = _randn(1, 64, device="cuda").requires_grad_()
    out = kernels.rms_norm(x, w, 1e-6)
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = wr * (xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-6))
    g = _randn(2, 2, 9, 64, device="cuda")
    ours = torch.autograd.grad(out, (x, w), g)
    theirs = torch.autograd.grad(ref, (xr, wr), g.double())
    for a, e in zip(ours, theirs, strict=True):
        assert (a.double() - e).abs().max() < 1e-4


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_elementwise_ops_depend_only_on_the_value(dtype):
    """What lets pointwise() skip the CPU's chunking on CUDA: position-free element bits."""
    x = (_randn(0, 100_003) * 5).to(dtype=dtype, device="cuda")
    for fn in (torch.nn.functional.silu, torch.exp, torch.sigmoid):
        whole = fn(x)
        tails = torch.cat([fn(x[i : i + 7].clone()) for i in range(1, 7001, 7)])
        assert torch.equal(tails, whole[1:7001]), fn
        assert torch.equal(fn(x[3:].clone()), whole[3:]), fn  # misaligned start


@gpu
@GPU_SETTINGS
@given(t=st.integers(1, 300), d=st.sampled_from([16, 64, 128]), dtype=DTYPES, seed=st.integers(0, 2**16))
def test_gpu_rope_depends_only_on_position(t, d, dtype, seed):
    table = kernels.rope_table(d, 10000.0, 4096)
    x = _randn(seed, t, 3, d, dtype=dtype, device="cuda")
    pos = torch.randint(0, 4096, (t,), generator=torch.Generator().manual_seed(seed))
    full = kernels.apply_rope(x, pos, table)
    assert torch.equal(kernels.apply_rope(x[-1:], pos[-1:], table)[0], full[-1])
    assert torch.equal(kernels.apply_rope(x, pos.cuda(), table), full)


@gpu
@settings(max_examples=25, deadline=None)
@given(
    length=st.integers(1, 400), hkv=st.sampled_from([1, 2, 4]), group=st.sampled_from([1, 2, 3]),
    d=st.sampled_from([16, 64, 128]), dtype=DTYPES, seed=st.integers(0, 2**16),
    others=st.integers(0, 4),
)
def test_gpu_attention_decode_equals_whole_sequence(length, hkv, group, d, dtype, seed, others):
    hq = hkv * group
    dev = "cuda"
    q = _randn(seed, length, hq, d, dtype=dtype, device=dev)
    k = _randn(seed + 1, 1, length, hkv, d, dtype=dtype, device=dev)
    v = _randn(seed + 2, 1, length, hkv, d, dtype=dtype, device=dev)
    scale = kernels.attention_scale(d)
    full = kernels.attention(q, k, v, torch.zeros(length, dtype=torch.long), torch.arange(length), scale)
    pad = 70  # a paged cache's unused slots: garbage
    kd = torch.cat([k, torch.full((1, pad, hkv, d), float("nan"), dtype=dtype, device=dev)], dim=1)
    vd = torch.cat([v, torch.full((1, pad, hkv, d), float("inf"), dtype=dtype, device=dev)], dim=1)
    for t in sorted({0, length // 2, length - 1}):
        one = kernels.attention(q[t : t + 1], kd, vd, torch.zeros(1, dtype=torch.long), torch.tensor([t]), scale)
        assert torch.equal(one[0], full[t]), t
    # a chunked prefill: the last chunk of queries against the whole cached context
    c = max(1, length // 3)
    chunk = kernels.attention(q[-c:], kd, vd, torch.zeros(c, dtype=torch.long), torch.arange(length - c, length), scale)
    assert torch.equal(chunk, full[-c:])
    t = length - 1
    if others:
        ko = _randn(seed + 3, others, length + pad, hkv, d, dtype=dtype, device=dev)
        vo = _randn(seed + 4, others, length + pad, hkv, d, dtype=dtype, device=dev)
        kb, vb = torch.cat([ko, kd]), torch.cat([vo, vd])
        qb = torch.cat([_randn(seed + 5, others, hq, d, dtype=dtype, device=dev), q[t:]])
        seqs = torch.arange(others + 1)
        pos = torch.cat([torch.randint(0, length + pad, (others,)), torch.tensor([t])])
        assert torch.equal(kernels.attention(qb, kb, vb, seqs, pos, scale)[-1], full[t])
    ref = kernels._attention_reference(q.cpu().float(), k.cpu().float(), v.cpu().float(),
                                       torch.zeros(length, dtype=torch.long), torch.arange(length), scale)
    assert (full.cpu().float() - ref).abs().max() < (1e-5 if dtype == torch.float32 else 3e-2)


@gpu
def test_gpu_attention_gradients():
    dev = "cuda"
    q = _randn(0, 2 * 90, 4, 32, device=dev).requires_grad_()
    k = _randn(1, 2, 90, 2, 32, device=dev).requires_grad_()
    v = _randn(2, 2, 90, 2, 32, device=dev).requires_grad_()
    seq, pos = torch.arange(2).repeat_interleave(90), torch.arange(90).repeat(2)
    out = kernels.attention(q, k, v, seq, pos, 0.2)
    cpu = [t.detach().cpu().requires_grad_() for t in (q, k, v)]
    ref = kernels._attention_reference(*cpu, seq, pos, 0.2)
    assert (out.cpu() - ref).abs().max() < 1e-5
    out.square().sum().backward()
    ref.square().sum().backward()
    for t, r in zip((q, k, v), cpu, strict=True):
        assert (t.grad.cpu() - r.grad).abs().max() < 1e-4


@gpu
@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 64), vocab=st.sampled_from([512, 2048, 49152, 151936]),
       dtype=DTYPES, seed=st.integers(0, 2**16), temperature=st.sampled_from([1.0, 0.7]),
       top_p=st.sampled_from([1.0, 0.9]), top_k=st.sampled_from([0, 20]))
def test_gpu_sampling_tail_is_the_cpu_one(rows, vocab, dtype, seed, temperature, top_p, top_k):
    """CUDA logits get the compiled log-softmax, temperature division and kept set of the CPU
    (parity.sampling): the same bits on either device, so a CUDA rollout and a CUDA trainer
    agree by construction."""
    from parity.sampling import Sampling, processed_logprobs

    logits = _randn(seed, rows, vocab, dtype=dtype)
    assert torch.equal(kernels.log_softmax(logits.cuda()).cpu(), kernels.log_softmax(logits))
    sampling = Sampling(temperature=temperature, top_p=top_p, top_k=top_k)
    assert torch.equal(processed_logprobs(logits.cuda(), sampling).cpu(), processed_logprobs(logits, sampling))


# --- GPU: the decode path vLLM captures in CUDA graphs ----------------------------------------


def _mma_instructions(compiled) -> set[str]:
    """The tensor-core MMA instructions of a compiled kernel, without their N width (N says
    which outputs one instruction covers, not how an output is summed)."""
    import re

    return {re.sub(r"n\d+", "nN", m) for m in re.findall(r"\b(w?gmma\.mma_async\.\S+|mma\.sync\.\S+)", compiled.asm["ptx"])}


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "k", "splits"), [(4096, 4096, 1), (1000, 576, 1), (4096, 14336, 8), (192, 1152, 3)])
def test_gpu_linear_tiles_give_one_result(dtype, n, k, splits):
    """The decode and 64 x 64 tiles give every element the bits of the 128 x 128 tile, at
    every M from 1 to 512 (each tile's rows, both sides of each switch), and compile to the
    same MMA instruction: same operand types, same k16 step, fp32 accumulator."""
    x = _randn(0, 512, k, dtype=dtype, device="cuda")
    w = _randn(1, n, k, dtype=dtype, device="cuda")
    tiles = [cuda.linear_config(n, k, dtype, m) for m in (1, cuda.MID_M, 4096)]
    assert len(set(tiles)) == 3
    outs = [torch.empty(64, n, dtype=dtype, device="cuda") for _ in tiles]
    mma = [_mma_instructions(cuda._launch_linear(x[:64], w, o, c, splits)) for o, c in zip(outs, tiles, strict=True)]
    assert mma[0] and mma[0] == mma[1] == mma[2], mma
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[2])
    whole = cuda.linear_forward(x, w, tiles[2], k_splits=splits)
    for m in range(1, 513):
        got = cuda.linear_forward(x[:m], w, k_splits=splits)
        assert torch.equal(got, whole[:m]), m


def _paged_case(seed: int, lens: list[int], qlens: list[int], page: int, hkv: int, group: int, d: int,
                dtype: torch.dtype, pages_total: int):
    """A vLLM-like paged cache (pages in random order, NaN in unused slots) holding `lens`
    tokens per request, the contiguous k / v it holds, and the last `qlens` queries of each."""
    dev = "cuda"
    gen = torch.Generator().manual_seed(seed)
    r, longest = len(lens), max(lens)
    k = _randn(seed, r, longest, hkv, d, dtype=dtype, device=dev)
    v = _randn(seed + 1, r, longest, hkv, d, dtype=dtype, device=dev)
    cache = torch.full((pages_total * page, 2, hkv, d), float("nan"), dtype=dtype, device=dev)
    free = (torch.randperm(pages_total - 1, generator=gen) + 1).tolist()  # page 0: vLLM's null block
    bt = torch.zeros(r, -(-longest // page) + 2, dtype=torch.int32)
    for i, length in enumerate(lens):
        for p in range(-(-length // page)):
            bt[i, p] = free.pop()
    bt = bt.to(dev)
    for i, length in enumerate(lens):
        pos = torch.arange(length, device=dev)
        cuda.kv_cache_store(k[i, :length], v[i, :length], cache, bt[i, pos // page].long() * page + pos % page)
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
    q = _randn(seed + 2, int(qsl[-1]), hkv * group, d, dtype=dtype, device=dev)
    q_seq = torch.repeat_interleave(torch.arange(r), torch.tensor(qlens))
    q_pos = torch.cat([torch.arange(n - m, n) for n, m in zip(lens, qlens, strict=True)])
    return q, k, v, cache, bt, qsl, q_seq, q_pos


@gpu
@settings(max_examples=25, deadline=None)
@given(
    reqs=st.lists(st.tuples(st.integers(1, 600), st.integers(1, 80)), min_size=1, max_size=12),
    page=st.sampled_from([16, 32]), hkv=st.sampled_from([1, 2, 8]), group=st.sampled_from([1, 4]),
    d=st.sampled_from([64, 128]), dtype=DTYPES, seed=st.integers(0, 2**16), spare=st.integers(0, 5),
)
def test_gpu_paged_attention_is_the_contiguous_kernel(reqs, page, hkv, group, d, dtype, seed, spare):
    """vLLM's paged cache read in place gives the bits of the contiguous kernel (which the
    trainer runs), for mixed decode / chunked-prefill batches; spare (-1) tiles and rows no
    tile covers (a captured graph's padding) change nothing."""
    lens = [n for n, _ in reqs]
    qlens = [min(n, m) if i % 2 else 1 for i, (n, m) in enumerate(reqs)]  # decodes among prefills
    pages_total = sum(-(-n // page) for n in lens) + 7
    q, k, v, cache, bt, qsl, q_seq, q_pos = _paged_case(seed, lens, qlens, page, hkv, group, d, dtype, pages_total)
    scale = kernels.attention_scale(d)
    want = cuda.attention_forward(q, k, v, q_seq, q_pos, scale)
    plan = cuda.paged_tile_plan(qsl, cuda.attention_config(d, dtype).block_q)
    tiles = torch.cat([plan, torch.full((spare, 2), -1, dtype=torch.int32)]).cuda()
    t = q.shape[0]
    qp = torch.cat([q, q[:3]])  # padded rows past the last request
    out = torch.full_like(qp, 5.0)
    cuda.paged_attention_forward(qp, cache, bt, page, qsl.cuda(), torch.tensor(lens, dtype=torch.int32).cuda(),
                                 tiles, scale, out)
    assert torch.equal(out[:t], want)
    assert bool((out[t:] == 5.0).all())


@gpu
def test_gpu_kv_cache_store_copies_bits_and_skips_padding():
    key = _randn(0, 6, 2, 64, dtype=torch.bfloat16, device="cuda")
    value = _randn(1, 6, 2, 64, dtype=torch.bfloat16, device="cuda")
    cache = torch.zeros(32, 2, 2, 64, dtype=torch.bfloat16, device="cuda")
    slots = torch.tensor([9, -1, 0, 31, 4, -1], device="cuda")
    cuda.kv_cache_store(key, value, cache, slots)
    want = torch.zeros_like(cache)
    keep = slots >= 0
    want[slots[keep], 0], want[slots[keep], 1] = key[keep], value[keep]
    assert torch.equal(cache, want)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_decode_step_replayed_from_a_cuda_graph_equals_eager(dtype):
    """What vLLM's FULL decode graphs do: capture store + paged attention + GEMM once over
    fixed buffers, then replay with other requests written into those buffers (other lengths,
    pages and padding), bitwise equal to eager launches."""
    page, hkv, group, d, cap = 16, 2, 4, 64, 8
    w = _randn(9, 256, hkv * group * d, dtype=dtype, device="cuda")
    scale = kernels.attention_scale(d)
    block_q = cuda.attention_config(d, dtype).block_q

    def case(seed: int, lens: list[int]):
        q, _, _, cache, bt, qsl, _, _ = _paged_case(seed, lens, [1] * len(lens), page, hkv, group, d, dtype, 80)
        new_k = _randn(seed + 7, len(lens), hkv, d, dtype=dtype, device="cuda")
        # this step's token goes into the slot after each context (its position is len - 1)
        pos = torch.tensor(lens, device="cuda") - 1
        slots = bt[torch.arange(len(lens), device="cuda"), pos // page].long() * page + pos % page
        return q, cache, bt, qsl, torch.tensor(lens, dtype=torch.int32), new_k, slots

    def step(q, cache, bt, qsl, seq_lens, tiles, new_k, slots, out):
        cuda.kv_cache_store(new_k, new_k, cache, slots)
        cuda.paged_attention_forward(q, cache, bt, page, qsl, seq_lens, tiles, scale, out)
        return cuda.linear_forward(out.view(out.shape[0], -1), w)

    # static buffers sized for `cap` requests, as vLLM's runner keeps them
    sq = torch.zeros(cap, hkv * group, d, dtype=dtype, device="cuda")
    scache = torch.zeros(80 * page, 2, hkv, d, dtype=dtype, device="cuda")
    sbt = torch.zeros(cap, 64, dtype=torch.int32, device="cuda")
    sqsl = torch.zeros(cap + 1, dtype=torch.int32, device="cuda")
    slens = torch.zeros(cap, dtype=torch.int32, device="cuda")
    stiles = torch.full((cap, 2), -1, dtype=torch.int32, device="cuda")
    sk = torch.zeros(cap, hkv, d, dtype=dtype, device="cuda")
    sslots = torch.full((cap,), -1, dtype=torch.long, device="cuda")
    sout = torch.zeros_like(sq)

    def load(q, cache, bt, qsl, seq_lens, new_k, slots):
        r = q.shape[0]
        sq.zero_(), sq[:r].copy_(q)
        scache.copy_(cache)
        sbt.zero_(), sbt[:r, : bt.shape[1]].copy_(bt)
        sqsl.fill_(r), sqsl[: r + 1].copy_(qsl)  # padded requests: zero queries
        slens.zero_(), slens[:r].copy_(seq_lens)
        plan = cuda.paged_tile_plan(qsl, block_q)
        stiles.fill_(-1), stiles[: plan.shape[0]].copy_(plan)
        sk.zero_(), sk[:r].copy_(new_k)
        sslots.fill_(-1), sslots[:r].copy_(slots)

    load(*case(0, [40] * cap))
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(sq, scache, sbt, sqsl, slens, stiles, sk, sslots, sout)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sy = step(sq, scache, sbt, sqsl, slens, stiles, sk, sslots, sout)

    for seed, lens in ((1, [5, 300, 17]), (2, [1, 2, 3, 4, 5, 6, 7, 600]), (3, [129])):
        q, cache, bt, qsl, seq_lens, new_k, slots = case(seed, lens)
        load(q, cache, bt, qsl, seq_lens, new_k, slots)
        graph.replay()
        eager_cache = cache.clone()
        out = torch.empty_like(q)
        tiles = cuda.paged_tile_plan(qsl, block_q).cuda()
        y = step(q, eager_cache, bt, qsl.cuda(), seq_lens.cuda(), tiles, new_k, slots, out)
        r = len(lens)
        assert torch.equal(sout[:r], out), seed
        assert torch.equal(sy[:r], y), seed
        assert torch.equal(scache.view(torch.uint8), eager_cache.view(torch.uint8)), seed  # NaN slots too
