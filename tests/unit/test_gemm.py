"""The compiled parity GEMM (parity/csrc/gemm.cpp): its summation order is fixed by
construction, so its bits equal a plain scalar loop of the same order, on every code path this
CPU has (AVX-512 / AVX2 / scalar), for any M, any row position, any thread count; and that loop
equals a pure-PyTorch statement of the order. Equality is torch.equal, never a tolerance."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parity import kernels, tp
from parity.native import ops

DTYPES = st.sampled_from([torch.float32, torch.bfloat16])


def _randn(seed: int, *shape, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


@pytest.fixture
def threads():
    """set(n) for the test's duration; the caller's thread count comes back afterwards."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@settings(max_examples=30, deadline=None)
@given(m=st.integers(1, 200), n=st.integers(1, 1100), k=st.integers(1, 1100), dtype=DTYPES,
       splits=st.sampled_from([1, 1, 2, 3, 4, 8]), seed=st.integers(0, 2**16))
def test_every_code_path_equals_the_scalar_reference(m, n, k, dtype, splits, seed):
    k = max(splits, k - k % splits)  # whole K-slices
    x, w = _randn(seed, m, k, dtype=dtype), _randn(seed + 1, n, k, dtype=dtype)
    reference = ops().gemm_reference(x, w, splits)
    packed = ops().pack(w)
    for isa in ops().isas():
        assert torch.equal(ops().gemm_on(x, packed, n, isa, splits, True), reference), isa
    assert torch.equal(kernels.linear(x, w, k_splits=splits), reference.to(dtype))


@settings(max_examples=15, deadline=None)
@given(m=st.integers(1, 40), n=st.integers(1, 300), k=st.integers(1, 300), seed=st.integers(0, 2**16))
def test_a_bf16_weight_is_packed_in_bf16_pairs(m, n, k, seed):
    """The pack of a bf16 weight keeps its dtype and bytes (K padded to even), the pairs of k
    interleaved per column; an fp32 input with it runs the same pair order on every path."""
    w = _randn(seed + 1, n, k, dtype=torch.bfloat16)
    packed = ops().pack(w)
    panels, kp = -(-n // 16), k + k % 2
    assert packed.dtype == torch.bfloat16 and packed.shape == (panels, kp, 16)
    unpacked = packed.view(panels, kp // 2, 16, 2).permute(0, 2, 1, 3).reshape(panels * 16, kp)
    assert torch.equal(unpacked[:n, :k], w) and not unpacked[n:].any() and not unpacked[:, k:].any()
    x = _randn(seed, m, k) * 3  # fp32 values that bf16 cannot hold
    reference = ops().gemm_reference(x, w, 1)
    for isa in ops().isas():
        assert torch.equal(ops().gemm_on(x, packed, n, isa, 1, True), reference), isa


def _bf16(values: list[float]) -> torch.Tensor:
    """bf16 values from their fp32 bits' high halves (torch's fp32 -> bf16 conversion flushes
    denormals on CPUs with AVX512-BF16)."""
    out = (torch.tensor(values, dtype=torch.float32).view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)
    assert out.float().tolist() == values  # every value is a bf16 (denormals included)
    return out


def test_bf16_pair_order_rounds_like_the_instruction():
    """x = (2^-75, 1): column c computes fma(2^-75, w0, fma(1, w1, 0)) (the odd k first), with
    denormal operands read as zero and results tiny after rounding flushed. The first sum,
    2^-126 - 1.5 * 2^-151, rounds to 2^-126 as a denormal but to 2^-126 - 2^-150 (tiny: flushed)
    with an unbounded exponent, as MXCSR.FTZ and VDPBF16PS round it; even first, or without the
    flushes, the results differ."""
    cases = [  # (w1, w0, the result)
        (2.0**-126, -1.5 * 2.0**-76, 0.0), (2.0**-126, -1.5 * 2.0**-75, 0.0), (-(2.0**-126), 1.5 * 2.0**-76, -0.0),
        (2.0**-126, -(2.0**-52), 0.0), (2.0**-125, -1.5 * 2.0**-51, 0.0), (-0.0, 0.0, 0.0),
        (2.0**-126, 2.0**-130, 2.0**-126), (2.0**-130, -0.0, 0.0), (-(2.0**-130), 2.0**-40, 2.0**-115),
        (2.0**-126, -(2.0**-51), 0.0), (1.0, 2.0**-60, 1.0), (2.0**-100, -(2.0**-25), 0.0),
    ]
    w = torch.stack([_bf16([w0, w1]) for w1, w0, _ in cases])
    x = _bf16([2.0**-75, 1.0]).view(1, 2)
    expected = torch.tensor([[r for _, _, r in cases]])
    for xx in (x, x.float()):
        assert torch.equal(ops().gemm_reference(xx, w, 1), expected)
        assert torch.equal(kernels.linear_reference(xx.float(), w).float(), expected)
        for isa in ops().isas():
            assert torch.equal(ops().gemm_on(xx, ops().pack(w), len(cases), isa, 1, True), expected), isa


def test_the_instruction_computes_the_order_where_the_cpu_has_it():
    """On a CPU with AVX512-BF16, VDPBF16PS passed the start-up self-test against the pair order
    in fp32 FMAs (so the avx512_bf16 path runs it), and a process's default path is avx512_bf16
    exactly when the instruction was also the faster at start-up."""
    status = ops().bf16_dot_status()
    if "avx512_bf16" not in ops().isas():
        assert status.startswith("not on this CPU"), status
        return
    assert status.startswith(("on: ", "exact but slower here")), status
    env = {k: v for k, v in os.environ.items() if k != "KIMI_RL_ISA"}
    code = "from parity import native; print(native.isa()); print(native.bf16_dot())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    default, dot = out.stdout.strip().splitlines()[-2:]
    assert default == ("avx512_bf16" if dot.startswith("on: ") else "avx512"), (default, dot)


@settings(max_examples=20, deadline=None)
@given(m=st.integers(1, 60), n=st.integers(1, 300), per_slice=st.integers(1, 120), dtype=DTYPES,
       splits=st.sampled_from([2, 4, 6, 8]), seed=st.integers(0, 2**16))
def test_tp_shards_over_whole_slices_give_the_tp1_bits(m, n, per_slice, dtype, splits, seed):
    """The TP-compatible K-order: any TP size dividing the slice count, each rank's fp32
    partials of its column shard all-gathered in rank order and added by rank_ordered_sum,
    equals the TP = 1 product (the kernel's in-place slice sum), bit for bit."""
    k = splits * per_slice
    x, w = _randn(seed, m, k, dtype=dtype), _randn(seed + 1, n, k, dtype=dtype)
    tp1 = kernels.linear(x, w, k_splits=splits)
    assert torch.equal(tp1, kernels.linear_reference(x, w, splits))
    for size in (s for s in range(2, splits + 1) if splits % s == 0):
        parts = [
            kernels.linear_partials(tp.shard_cols(x, r, size), tp.shard_cols(w, r, size), splits // size)
            for r in range(size)
        ]
        assert torch.equal(tp.rank_ordered_sum(torch.cat(parts), dtype), tp1), size


@settings(max_examples=15, deadline=None)
@given(m=st.integers(1, 9), n=st.integers(1, 40), k=st.integers(1, 300), dtype=DTYPES,
       seed=st.integers(0, 2**16))
def test_scalar_reference_is_the_torch_statement_of_the_order(m, n, k, dtype, seed):
    # Scaled so that partial sums span many binades and roundings really happen at every step.
    x = _randn(seed, m, k, dtype=dtype) * torch.logspace(-3, 3, k).to(dtype)
    w = _randn(seed + 1, n, k, dtype=dtype)
    assert torch.equal(kernels.linear_reference(x, w), ops().gemm_reference(x, w).to(dtype))
    if k % 3 == 0:
        assert torch.equal(kernels.linear_reference(x, w, 3), ops().gemm_reference(x, w, 3).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_bits_do_not_depend_on_m_position_or_threads(dtype, threads):
    """Every row position of every register block, M = 1..200, 1 and 2 threads."""
    x, w = _randn(0, 200, 203, dtype=dtype), _randn(1, 77, 203, dtype=dtype)
    threads(2)
    full = kernels.linear(x, w)
    for m in range(1, 201):
        assert torch.equal(kernels.linear(x[:m], w), full[:m]), m
        assert torch.equal(kernels.linear(x[m - 1 : m], w), full[m - 1 : m]), m
        assert torch.equal(kernels.linear(x[m - 1 :], w), full[m - 1 :]), m
    threads(1)
    assert torch.equal(kernels.linear(x, w), full)


@pytest.mark.parametrize("m,n,k", [(0, 5, 7), (3, 0, 7), (3, 5, 0), (0, 0, 0)])
def test_empty_shapes(m, n, k):
    """A zero-width shared expert (kimi-mini with n_shared_experts = 0) has K = 0: sums of no
    terms are +0."""
    x, w = torch.randn(2, m, k, requires_grad=True), torch.randn(n, k, requires_grad=True)
    out = kernels.linear(x, w)
    assert out.shape == (2, m, n) and torch.equal(out, torch.zeros(2, m, n))
    out.sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == w.shape


def test_writes_through_data_are_seen():
    """A full-weight sync writes through `param.data` (vLLM's default_weight_loader), which does
    not bump the parameter's version counter: the next forward must use the new weights."""
    w = torch.nn.Parameter(_randn(0, 33, 50), requires_grad=False)
    x = _randn(1, 4, 50)
    kernels.linear(x, w)
    w.data.copy_(_randn(2, 33, 50))
    assert torch.equal(kernels.linear(x, w), ops().gemm_reference(x, w.detach()))


def test_gradients_are_plain_and_correct():
    x = _randn(0, 5, 24).requires_grad_()
    w = _randn(1, 7, 24).requires_grad_()
    kernels.linear(x, w).square().sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    torch.nn.functional.linear(x2, w2).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(w.grad, w2.grad)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(e=st.integers(1, 40), m=st.integers(1, 12), n=st.integers(1, 300), k=st.integers(0, 300),
       dtype=DTYPES, seed=st.integers(0, 2**16), pick=st.integers(0, 39))
def test_bmm_entries_are_independent_gemms(e, m, n, k, dtype, seed, pick, threads):
    """The attention / indexer products (`bmm`): on every code path, every entry equals the
    scalar reference of that entry alone, whatever the number of entries or the thread count.
    torch.bmm failed this on an AVX-512 EPYC (1 or 3 entries against 2)."""
    a, b = _randn(seed, e, m, k, dtype=dtype), _randn(seed + 1, e, k, n, dtype=dtype)
    i = pick % e
    # bf16 operands are widened: bmm runs the fp32 chain (the pair order is the bf16 weights')
    reference = ops().gemm_reference(a[i], b[i].t().float().contiguous(), 1) if k else torch.zeros(m, n)
    for isa in ops().isas():
        for count in (1, 2):
            threads(count)
            assert torch.equal(ops().bmm_on(a, b, isa)[i], reference), (isa, count)
    assert torch.equal(ops().bmm(a[i : i + 1], b[i : i + 1])[0], reference)
    assert torch.equal(ops().bmm(a[i:], b[i:])[0], reference)
