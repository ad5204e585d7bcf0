"""The compiled parity GEMM (parity/csrc/gemm.cpp): its summation order is fixed by
construction, so its bits equal a plain scalar loop of the same order, on every code path this
CPU has (AVX-512 / AVX2 / scalar), for any M, any row position, any thread count; and that loop
equals a pure-PyTorch statement of the order. Equality is torch.equal, never a tolerance."""

from __future__ import annotations

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
def test_a_bf16_weight_is_packed_in_bf16_and_computes_the_fp32_pack_bits(m, n, k, seed):
    """The pack keeps the weight's dtype (bf16: as many bytes as the weight, half an fp32
    pack), holds the same values as the pack of the weight widened to fp32, and every code path
    gives the fp32 pack's bits from it (bf16 -> fp32 widening is exact)."""
    x, w = _randn(seed, m, k, dtype=torch.bfloat16), _randn(seed + 1, n, k, dtype=torch.bfloat16)
    packed, wide = ops().pack(w), ops().pack(w.float())
    assert packed.dtype == torch.bfloat16 and wide.dtype == torch.float32
    assert packed.numel() == wide.numel() and torch.equal(packed.float(), wide)
    for isa in ops().isas():
        assert torch.equal(ops().gemm_on(x, packed, n, isa, 1, True), ops().gemm_on(x, wide, n, isa, 1, True)), isa


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
    reference = ops().gemm_reference(a[i], b[i].t().contiguous(), 1) if k else torch.zeros(m, n)
    for isa in ops().isas():
        for count in (1, 2):
            threads(count)
            assert torch.equal(ops().bmm_on(a, b, isa)[i], reference), (isa, count)
    assert torch.equal(ops().bmm(a[i : i + 1], b[i : i + 1])[0], reference)
    assert torch.equal(ops().bmm(a[i:], b[i:])[0], reference)
