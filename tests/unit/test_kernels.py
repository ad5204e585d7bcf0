"""Property tests: each parity kernel's result for a row equals its result for that row
computed alone (or among other rows), and attention's decode form equals its whole-sequence
form. Equality is torch.equal, never a tolerance."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from parity import kernels

DTYPES = st.sampled_from([torch.float32, torch.bfloat16])
SETTINGS = settings(max_examples=25, deadline=None)


def _randn(seed: int, *shape, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


@SETTINGS
@given(
    rows=st.integers(1, 70), k=st.sampled_from([32, 96, 128, 576]),
    n=st.sampled_from([32, 64, 192, 256]), dtype=DTYPES, seed=st.integers(0, 2**16),
    pick=st.integers(0, 69),
)
def test_linear_row_invariant(rows, k, n, dtype, seed, pick):
    x = _randn(seed, rows, k, dtype=dtype)
    w = _randn(seed + 1, n, k, dtype=dtype)
    i = pick % rows
    full = kernels.linear(x, w)
    assert torch.equal(kernels.linear(x[i : i + 1], w)[0], full[i])
    assert torch.equal(kernels.linear(x[i:], w)[0], full[i])  # different tile position
    assert torch.equal(kernels.linear(x.view(1, rows, k), w)[0], full)


def test_stock_gemm_is_not_row_invariant():
    """The problem the tiles solve: MKL's fp32 GEMM gives a row different bits alone."""
    x, w = _randn(0, 64, 576), _randn(1, 576, 576)
    assert not torch.equal(F.linear(x[:1], w)[0], F.linear(x, w)[0])


def test_stock_silu_depends_on_position():
    """The problem the compiled element-wise kernels solve: torch's SiLU scalar tail loop differs
    from its vector loop, so an element's bits depend on its position."""
    x = _randn(0, 100_000) * 5
    vec = F.silu(x)
    tails = torch.cat([F.silu(x[i : i + 7].clone()) for i in range(0, 7000, 7)])
    assert not torch.equal(tails, vec[:7000])
    tails = torch.cat([kernels.silu(x[i : i + 7].clone()) for i in range(0, 7000, 7)])
    assert torch.equal(tails, kernels.silu(x)[:7000])


@SETTINGS
@given(rows=st.integers(1, 50), h=st.sampled_from([32, 64, 128, 576]), dtype=DTYPES,
       seed=st.integers(0, 2**16), pick=st.integers(0, 49))
def test_rms_norm_and_silu_row_invariant(rows, h, dtype, seed, pick):
    x = _randn(seed, rows, h, dtype=dtype)
    w = _randn(seed + 1, h, dtype=dtype)
    i = pick % rows
    assert torch.equal(kernels.rms_norm(x[i : i + 1], w, 1e-6)[0], kernels.rms_norm(x, w, 1e-6)[i])
    assert torch.equal(kernels.silu_and_mul(x[i : i + 1])[0], kernels.silu_and_mul(x)[i])


@SETTINGS
@given(t=st.integers(1, 40), d=st.sampled_from([16, 32, 64]), dtype=DTYPES,
       seed=st.integers(0, 2**16))
def test_rope_depends_only_on_position(t, d, dtype, seed):
    table = kernels.rope_table(d, 10000.0, 512)
    x = _randn(seed, t, 3, d, dtype=dtype)
    pos = torch.randint(0, 512, (t,), generator=torch.Generator().manual_seed(seed))
    full = kernels.apply_rope(x, pos, table)
    assert torch.equal(kernels.apply_rope(x[-1:], pos[-1:], table)[0], full[-1])


ROPE_CASES = [(128, 1000000.0, 40960), (64, 10000.0, 4096), (16, 500000.0, 1 << 20)]


@pytest.mark.parametrize(("head_dim", "base", "positions"), ROPE_CASES)
def test_rope_table_is_its_statement_on_every_code_path(head_dim, base, positions):
    """cos / sin of the fp32 angle t * inv_freq, rounded once from float64 (inv_freq =
    1 / fp32(base ^ (2j / d))): the same bits on every ISA path this CPU runs, and within
    torch's own float error of torch's table (which loses bits at large angles)."""
    from parity import native

    cos, sin = kernels.rope_table(head_dim, base, positions)
    for isa in native.cpu_isas():
        c, s = native.ops().rope_table_on(head_dim, base, positions, isa)
        assert torch.equal(c, cos) and torch.equal(s, sin), isa
    exponent = torch.arange(0, head_dim, 2).float() / head_dim
    inv_freq = 1.0 / torch.tensor([base ** e for e in exponent.tolist()], dtype=torch.float32)
    angle = torch.outer(torch.arange(positions).float(), inv_freq).double()
    assert torch.equal(cos, angle.cos().float()) and torch.equal(sin, angle.sin().float())
    want_cos, want_sin = kernels._rope_table_reference(head_dim, base, positions)
    assert (cos - want_cos).abs().max() < 1e-4 and (sin - want_sin).abs().max() < 1e-4


def test_rope_table_refuses_bad_shapes():
    from parity import native

    with pytest.raises(RuntimeError, match="head_dim must be even"):
        native.ops().rope_table(7, 10000.0, 8)
    with pytest.raises(RuntimeError, match="max_positions must be in"):
        native.ops().rope_table(8, 10000.0, (1 << 24) + 1)


@settings(max_examples=20, deadline=None)
@given(
    length=st.integers(1, 200), hkv=st.sampled_from([1, 2]), group=st.sampled_from([1, 2, 3]),
    d=st.sampled_from([16, 32, 64]), dtype=DTYPES, seed=st.integers(0, 2**16),
    others=st.integers(0, 4),
)
def test_attention_decode_equals_whole_sequence(length, hkv, group, d, dtype, seed, others):
    hq = hkv * group
    q = _randn(seed, length, hq, d, dtype=dtype)
    k = _randn(seed + 1, 1, length, hkv, d, dtype=dtype)
    v = _randn(seed + 2, 1, length, hkv, d, dtype=dtype)
    scale = kernels.attention_scale(d)
    full = kernels.attention(q, k, v, torch.zeros(length, dtype=torch.long), torch.arange(length), scale)
    t = length - 1
    # decode: one query; the context is padded with garbage beyond t (a paged cache's slots)
    pad = 70
    kd = torch.cat([k, torch.full((1, pad, hkv, d), float("nan"), dtype=dtype)], dim=1)
    vd = torch.cat([v, torch.full((1, pad, hkv, d), float("inf"), dtype=dtype)], dim=1)
    one = kernels.attention(q[t:], kd, vd, torch.zeros(1, dtype=torch.long), torch.tensor([t]), scale)
    assert torch.equal(one[0], full[t])
    # the same query inside a batch of other sequences and positions
    if others:
        ko = _randn(seed + 3, others, length + pad, hkv, d, dtype=dtype)
        vo = _randn(seed + 4, others, length + pad, hkv, d, dtype=dtype)
        kb, vb = torch.cat([ko, kd]), torch.cat([vo, vd])
        qb = torch.cat([_randn(seed + 5, others, hq, d, dtype=dtype), q[t:]])
        seqs = torch.arange(others + 1)
        pos = torch.cat([torch.randint(0, length + pad, (others,)), torch.tensor([t])])
        assert torch.equal(kernels.attention(qb, kb, vb, seqs, pos, scale)[-1], full[t])


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
])
@settings(max_examples=20, deadline=None)
@given(
    lens=st.lists(st.integers(1, 200), min_size=1, max_size=4), hkv=st.sampled_from([1, 2, 3]),
    group=st.sampled_from([1, 2, 5]), d=st.sampled_from([8, 20, 40, 64]), dtype=DTYPES,
    seed=st.integers(0, 2**16),
)
def test_paged_attention_equals_contiguous(device, lens, hkv, group, d, dtype, seed):
    """The rollout's form (keys read block by block from a paged cache whose slots are
    scattered, garbage in every other slot) gives the training form's bits for every query,
    on the CPU kernel and on the CUDA one (there the rollout's call gathers, then attends)."""
    if device == "cuda":
        d = max(d, 16)  # the CUDA kernel's contract (parity.cuda.check_attention_shapes)
    r, length = len(lens), max(lens)
    k = _randn(seed, r, length, hkv, d, dtype=dtype)
    v = _randn(seed + 1, r, length, hkv, d, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    q_seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])
    q_pos = torch.cat([torch.arange(n) for n in lens])
    q = _randn(seed + 2, q_seq.numel(), hkv * group, d, dtype=dtype)
    num_slots = r * length + 50
    cache = torch.full((num_slots, 2, hkv, d), float("nan"), dtype=dtype)
    slots = torch.randperm(num_slots, generator=g)[: r * length].view(r, length)
    cache[slots.reshape(-1), 0] = k.reshape(-1, hkv, d)
    cache[slots.reshape(-1), 1] = v.reshape(-1, hkv, d)
    # as the metadata builder writes them: slot 0 past a sequence's end
    ctx_slots = torch.where(torch.arange(length) < torch.tensor(lens).unsqueeze(1), slots, 0)
    last = torch.tensor([n - 1 for n in lens])  # one decode query per sequence
    rows = torch.cumsum(torch.tensor(lens), 0) - 1
    q, k, v, q_seq, q_pos, cache, ctx_slots, last, rows = (
        t.to(device) for t in (q, k, v, q_seq, q_pos, cache, ctx_slots, last, rows)
    )
    scale = kernels.attention_scale(d)
    contiguous = kernels.attention(q, k, v, q_seq, q_pos, scale)
    assert torch.equal(kernels.paged_attention(q, cache, ctx_slots, q_seq, q_pos, scale), contiguous)
    decode = kernels.paged_attention(q[rows], cache, ctx_slots, torch.arange(r, device=device), last, scale)
    assert torch.equal(decode, contiguous[rows])


@settings(max_examples=25, deadline=None)
@given(
    lens=st.lists(st.integers(1, 200), min_size=1, max_size=4), hkv=st.sampled_from([1, 2, 3]),
    group=st.sampled_from([1, 2, 5]), d=st.integers(1, 80), dtype=DTYPES, seed=st.integers(0, 2**16),
    scale=st.sampled_from([None, 0.3, 1.0]),
)
def test_compiled_attention_walk_is_the_python_walk_on_every_path(lens, hkv, group, d, dtype, seed, scale):
    """parity/csrc/attention.cpp computes `_paged_attention_walk` operation for operation: the
    same bits on every code path this CPU has, whatever the garbage in unattended slots."""
    from parity import native

    r, length = len(lens), max(lens)
    g = torch.Generator().manual_seed(seed)
    num_slots = r * length + 30
    cache = _randn(seed, num_slots, 2, hkv, d, dtype=dtype) * 4
    cache[torch.randperm(num_slots, generator=g)[:30]] = float("nan")  # unused slots
    slots = torch.randperm(num_slots, generator=g)[: r * length].view(r, length)
    used = torch.zeros(num_slots, dtype=torch.bool)
    used[slots.reshape(-1)] = True
    cache[used] = _randn(seed + 1, int(used.sum()), 2, hkv, d, dtype=dtype) * 4
    ctx_slots = torch.where(torch.arange(length) < torch.tensor(lens).unsqueeze(1), slots, 0)
    nq = int(torch.randint(1, 40, (1,), generator=g))
    q_seq = torch.randint(0, r, (nq,), generator=g)
    q_pos = (torch.rand(nq, generator=g) * torch.tensor(lens)[q_seq]).long()
    q = _randn(seed + 2, nq, hkv * group, d, dtype=dtype) * 2
    scale = kernels.attention_scale(d) if scale is None else scale
    walk = kernels._paged_attention_walk(q, cache, ctx_slots, q_seq, q_pos, scale)
    for isa in native.ops().isas():
        out = native.ops().paged_attention_on(q, cache, ctx_slots, q_seq, q_pos, scale, isa).to(dtype)
        assert torch.equal(out, walk), isa


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (+0.0 and -0.0 apart, unlike torch.equal), NaNs at the same places."""
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[a.dtype]
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a.masked_fill(nan, 0).view(ints), b.masked_fill(nan, 0).view(ints))


@settings(max_examples=25, deadline=None)
@given(
    lens=st.lists(st.integers(1, 200), min_size=1, max_size=3), hkv=st.sampled_from([1, 3]),
    group=st.sampled_from([1, 3]), d=st.sampled_from([1, 17, 64, 80, 130]), dtype=DTYPES,
    seed=st.integers(0, 2**16), inf_values=st.booleans(),
)
def test_compiled_attention_walk_is_the_python_walk_for_prefill_runs(lens, hkv, group, d, dtype, seed, inf_values):
    """Queries in long runs of one sequence, as a prefill gives them (the compiled walk's tasks
    share each block's gather among a run's queries): a chunk of consecutive positions per
    sequence, some chunks shuffled, decode queries of other sequences between them. With an inf
    in a value a run's later queries see, the earlier ones must still read it as nothing (a
    zero p times inf is NaN): every query stays the Python walk's, bit for bit, on every path."""
    from parity import native

    r, length = len(lens), max(lens)
    g = torch.Generator().manual_seed(seed)
    num_slots = r * length + 30
    cache = torch.full((num_slots, 2, hkv, d), float("nan"), dtype=dtype)  # unused slots
    slots = torch.randperm(num_slots, generator=g)[: r * length].view(r, length)
    cache[slots.reshape(-1)] = _randn(seed + 1, r * length, 2, hkv, d, dtype=dtype) * 4
    ctx_slots = torch.where(torch.arange(length) < torch.tensor(lens).unsqueeze(1), slots, 0)
    seqs, positions, first_inf = [], [], {}
    for i in torch.randperm(r, generator=g).tolist():
        n = lens[i]
        start = int(torch.randint(0, n, (1,), generator=g)) // 2
        chunk = torch.arange(start, n)
        if len(chunk) > 1 and int(torch.randint(0, 3, (1,), generator=g)) == 0:
            chunk = chunk[torch.randperm(len(chunk), generator=g)]
        if inf_values and n - start > 1:  # inside the chunk's first run of 32
            at = start + 1 + int(torch.randint(0, min(31, n - start - 1), (1,), generator=g))
            cache[slots[i, at], 1, -1, d // 2] = float("inf")
            first_inf[i] = at
        seqs += [i] * len(chunk)
        positions += chunk.tolist()
        other = int(torch.randint(0, r, (1,), generator=g))  # a decode query between runs
        seqs.append(other)
        positions.append(int(torch.randint(0, lens[other], (1,), generator=g)))
    q_seq, q_pos = torch.tensor(seqs), torch.tensor(positions)
    q = _randn(seed + 2, len(seqs), hkv * group, d, dtype=dtype) * 2
    scale = kernels.attention_scale(d)
    walk = kernels._paged_attention_walk(q, cache, ctx_slots, q_seq, q_pos, scale)
    before = torch.tensor([p < first_inf.get(s, length) for s, p in zip(seqs, positions, strict=True)])
    assert walk[before].isfinite().all()
    for isa in native.ops().isas():
        out = native.ops().paged_attention_on(q, cache, ctx_slots, q_seq, q_pos, scale, isa).to(dtype)
        assert _same_bits(out, walk), isa


def test_compiled_attention_refuses_positions_outside_the_context():
    from parity import native

    cache = torch.zeros(8, 2, 1, 4)
    slots = torch.arange(8).view(2, 4)
    q = torch.zeros(1, 1, 4)
    with pytest.raises(RuntimeError, match="outside ctx_slots"):
        native.ops().paged_attention(q, cache, slots, torch.tensor([0]), torch.tensor([4]), 0.5)
    with pytest.raises(RuntimeError, match="outside the cache"):
        native.ops().paged_attention(q, cache, slots + 1, torch.tensor([1]), torch.tensor([3]), 0.5)


def test_attention_matches_dense_reference_and_has_gradients():
    q = _randn(0, 90, 4, 32).requires_grad_()
    k = _randn(1, 1, 90, 2, 32).requires_grad_()
    v = _randn(2, 1, 90, 2, 32).requires_grad_()
    seq, pos = torch.zeros(90, dtype=torch.long), torch.arange(90)
    out = kernels.attention(q, k, v, seq, pos, 0.2)
    ref = kernels._attention_reference(q, k, v, seq, pos, 0.2)
    assert (out - ref).abs().max() < 1e-5
    out.square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref.square().sum().backward()
    for g, t in zip(grads, (q, k, v), strict=True):
        assert (g - t.grad).abs().max() < 1e-4



def test_ordered_attention_gradients_do_not_depend_on_the_heads_beside():
    """Under ordered_backward a KV head's gradients (its query heads', its keys' and values') are
    those of the KV head alone: a tensor-parallel rank holding some of the heads computes the
    same bits as TP = 1. They are the plain backward's up to rounding."""
    from parity.autograd import ordered_backward

    hkv, g = 4, 3
    q = _randn(0, 40, hkv * g, 16).requires_grad_()
    k = _randn(1, 1, 40, hkv, 16).requires_grad_()
    v = _randn(2, 1, 40, hkv, 16).requires_grad_()
    seq, pos = torch.zeros(40, dtype=torch.long), torch.arange(40)
    weight = _randn(3, 40, hkv * g, 16)

    def grads(q, k, v, weight, ordered=True):
        with ordered_backward() if ordered else contextlib.nullcontext():
            out = kernels.attention(q, k, v, seq, pos, 0.25)
        return torch.autograd.grad((out * weight).sum(), (q, k, v))

    whole = grads(q, k, v, weight)
    for first, count in ((0, 1), (1, 2), (2, 2)):  # a rank's consecutive KV heads
        heads = slice(first * g, (first + count) * g)
        part = grads(q[:, heads].detach().requires_grad_(), k[:, :, first : first + count].detach().requires_grad_(),
                     v[:, :, first : first + count].detach().requires_grad_(), weight[:, heads])
        assert torch.equal(part[0], whole[0][:, heads])
        for got, want in zip(part[1:], whole[1:], strict=True):
            assert torch.equal(got, want[:, :, first : first + count])
    for got, want in zip(whole, grads(q, k, v, weight, ordered=False), strict=True):
        torch.testing.assert_close(got, want)


def test_ordered_weight_gradient_is_one_chain_over_the_tokens():
    """Under ordered_backward a linear's weight gradient is the compiled GEMM's order over the
    tokens (linear_reference: one fp32 FMA chain per element, k = token 0, 1, ...), whatever the
    batch's shape: the tokens of [3, 50] and of [150] give the same bits."""
    from parity.autograd import ordered_backward

    x, grad_out = _randn(0, 3, 50, 40), _randn(1, 3, 50, 24)
    w = _randn(2, 24, 40).requires_grad_()
    want = kernels.linear_reference(grad_out.reshape(150, 24).t().contiguous(), x.reshape(150, 40).t().contiguous())
    for shape in ((3, 50), (150,)):
        with ordered_backward():
            y = kernels.linear(x.reshape(*shape, 40), w)
        (got,) = torch.autograd.grad(y, w, grad_out.reshape(*shape, 24))
        assert torch.equal(got, want), shape


PACKED_LENGTHS = (7, 12, 1)


def _packed_attention_inputs():
    """(q, k, v, seq, pos): three ragged sequences' queries end to end, as packed training has them."""
    lengths = PACKED_LENGTHS
    q = _randn(3, sum(lengths), 4, 16).requires_grad_()
    k = _randn(4, 3, 12, 2, 16).requires_grad_()
    v = _randn(5, 3, 12, 2, 16).requires_grad_()
    seq = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    pos = torch.cat([torch.arange(n) for n in lengths])
    return q, k, v, seq, pos


def test_ordered_attention_gradients_take_packed_queries():
    """Ragged sequences' queries end to end (packed training): the ordered gradients are the
    reference's up to rounding."""
    from parity.autograd import ordered_backward

    q, k, v, seq, pos = _packed_attention_inputs()
    with ordered_backward():
        out = kernels.attention(q, k, v, seq, pos, 0.25)
    got = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref = kernels._attention_reference(q, k, v, seq, pos, 0.25)
    for g, want in zip(got, torch.autograd.grad(ref.square().sum(), (q, k, v)), strict=True):
        torch.testing.assert_close(g, want)


def test_attention_gradient_reference_takes_packed_queries():
    """Queries of ragged sequences given end to end (packed training): the reference computes
    each as the sequence alone does, gradients included (not bitwise: a plain-torch backward)."""
    q, k, v, seq, pos = _packed_attention_inputs()
    packed = kernels._attention_reference(q, k, v, seq, pos, 0.25)
    packed.square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    first = 0
    for r, n in enumerate(PACKED_LENGTHS):
        alone = kernels._attention_reference(q[first : first + n], k[r : r + 1, :n], v[r : r + 1, :n],
                                             torch.zeros(n, dtype=torch.long), torch.arange(n), 0.25)
        torch.testing.assert_close(packed[first : first + n], alone)
        alone.square().sum().backward()
        first += n
    for g, t in zip(grads, (q, k, v), strict=True):
        torch.testing.assert_close(g, t.grad)


@SETTINGS
@given(rows=st.integers(1, 40), vocab=st.sampled_from([512, 2048, 49152]), dtype=DTYPES,
       seed=st.integers(0, 2**16), pick=st.integers(0, 39))
def test_log_softmax_row_invariant(rows, vocab, dtype, seed, pick):
    logits = _randn(seed, rows, vocab, dtype=dtype)
    i = pick % rows
    assert torch.equal(kernels.log_softmax(logits[i : i + 1])[0], kernels.log_softmax(logits)[i])


def test_log_softmax_is_the_rollout_samplers_op():
    """The rollout's sampler computes its raw and prompt log-probs with this very op."""
    from rollout.sampler import ParitySampler

    logits = _randn(0, 7, 512, dtype=torch.bfloat16)
    assert torch.equal(ParitySampler.compute_logprobs(logits), kernels.log_softmax(logits))


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
])
@SETTINGS
@given(entries=st.integers(1, 3000), g=st.integers(1, 8), d=st.sampled_from([8, 20, 32, 64, 128, 130]),
       seed=st.integers(0, 2**16), pick=st.integers(0, 2999))
def test_attention_block_products_are_entry_invariant(device, entries, g, d, seed, pick):
    """The products of one entry (a (query, kv-head) block of attention or the indexer, a
    (token, head) step of the KDA recurrence) give the same bits alone as among any number of
    other entries, on the CPU's compiled bmm and on CUDA's product + row sum."""
    a = _randn(seed, entries, g, d).to(device)
    b = _randn(seed + 1, entries, d, kernels.KV_BLOCK).to(device)
    i = pick % entries
    full = kernels.bmm(a, b)
    assert torch.equal(kernels.bmm(a[i : i + 1], b[i : i + 1])[0], full[i])
    p = _randn(seed + 2, entries, g, kernels.KV_BLOCK).to(device)
    v = _randn(seed + 3, entries, kernels.KV_BLOCK, d).to(device)
    assert torch.equal(kernels.bmm(p[i:], v[i:])[0], kernels.bmm(p, v)[i])
    s, k = _randn(seed + 4, entries, 2, d, d).to(device), _randn(seed + 5, entries, 2, d, 1).to(device)
    assert torch.equal(kernels.bmm(s[i : i + 1], k[i : i + 1])[0], kernels.bmm(s, k)[i])


def test_linear_gradients_match_plain_autograd():
    x = _randn(0, 3, 37, 96).requires_grad_()
    w = _randn(1, 64, 96).requires_grad_()
    kernels.linear(x, w).square().sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    F.linear(x, w).square().sum().backward()
    assert (gx - x.grad).abs().max() < 1e-3 and (gw - w.grad).abs().max() < 1e-3


def test_rollout_weight_pack_is_made_once_and_dropped_by_every_write():
    """rollout.sync.PackedWeight: the GEMM pack (and a derived tensor's pack) is reused between
    writes (the same tensor), and a full-weight sync drops it, so the next forward computes with
    the new weights."""
    from torch import nn

    from parity.wire import pack_tensors
    from rollout.sync import PackedWeight, SyncedModel

    class Model(nn.Module, SyncedModel):
        def __init__(self) -> None:
            super().__init__()
            self.proj = PackedWeight(24, 40, dtype=torch.float32)

    model = Model()
    with torch.no_grad():
        model.proj.weight.copy_(_randn(0, 24, 40))
    x = _randn(1, 3, 40)
    first = model.proj.pack()
    assert model.proj.pack() is first
    assert torch.equal(kernels.linear(x, model.proj.weight, packed=first), kernels.linear(x, model.proj.weight))
    new = _randn(2, 24, 40)
    rows = model.proj.derived_pack(lambda w: w[:8])  # a TP rank's vocabulary rows of a tied head
    assert model.proj.derived_pack(lambda w: w[:8]) is rows
    model.update_params_packed(*pack_tensors({"proj.weight": new}))
    assert model.proj.pack() is not first
    assert torch.equal(kernels.linear(x, model.proj.weight, packed=model.proj.pack()), kernels.linear(x, new))
    weight, packed = model.proj.derived_pack(lambda w: w[:8])
    assert torch.equal(weight, new[:8]) and torch.equal(kernels.linear(x, weight, packed=packed), kernels.linear(x, new[:8]))
