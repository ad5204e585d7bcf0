"""parity.sampling: the same processed log-probs as vLLM's own CPU sampler, bitwise, and every
op it runs gives a row the same bits alone as in a batch. Equality is torch.equal."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parity import kernels
from parity.sampling import Sampling, processed_logprobs

SETTINGS = settings(max_examples=25, deadline=None)
# (temperature, top_p, top_k): each filter alone, both, and neither
CASES = [(1.0, 1.0, 0), (0.7, 1.0, 0), (0.7, 0.9, 0), (1.0, 1.0, 20), (0.7, 0.9, 20),
         (1.3, 0.5, 3), (0.7, 0.999, 0), (0.05, 0.9, 50)]


def _logits(seed: int, rows: int, vocab: int, dtype=torch.float32, scale: float = 3.0) -> torch.Tensor:
    # bf16-rounded logits (what a bf16 model gives) have many ties: the top-k / top-p boundary
    # then falls inside runs of equal values.
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=g) * scale).to(dtype)


def _vllm(logits: torch.Tensor, sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's sampler on these logits, as its Sampler.sample runs it for an all-random batch:
    (processed log-probs, sampled tokens)."""
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler
    from vllm.v1.sample.sampler import Sampler

    n, vocab = logits.shape
    x = logits.to(torch.float32).clone()
    x = Sampler.apply_temperature(x, torch.full((n,), sampling.temperature, dtype=torch.float32), True)
    # vLLM's input batch: top-k of `vocab` (off) unless 0 < k < vocab; top-p None unless < 1.
    top_k = sampling.k_for(vocab)
    k = None if top_k is None else torch.full((n,), top_k, dtype=torch.int32)
    p = torch.full((n,), sampling.top_p, dtype=torch.float32) if sampling.p() else None
    sampler = TopKTopPSampler("processed_logprobs")
    assert sampler.forward.__name__ == "forward_cpu"  # the path the rollout engine runs
    tokens, logprobs = sampler(x, {}, k, p)
    return logprobs, tokens


@pytest.mark.parametrize(("temperature", "top_p", "top_k"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [512, 49152])
def test_processed_logprobs_are_vllms(temperature, top_p, top_k, dtype, vocab):
    sampling = Sampling(temperature, top_p, top_k)
    logits = _logits(vocab + top_k, 9, vocab, dtype)
    want, tokens = _vllm(logits, sampling)
    got = processed_logprobs(logits, sampling)
    assert torch.equal(got, want)
    # The sampled tokens are inside the kept set: their log-probs are finite.
    assert torch.isfinite(got.gather(1, tokens.view(-1, 1))).all()
    kept = torch.isfinite(got).sum(1)
    if sampling.is_raw(vocab):
        assert torch.equal(got, kernels.log_softmax(logits))
        assert (kept == vocab).all()
    elif sampling.k_for(vocab):
        assert (kept <= vocab).all() and (kept >= 1).all()
        if sampling.p() is None:
            assert (kept >= top_k).all()  # ties at the k-th value all stay
    if sampling.p() is not None or sampling.k_for(vocab):
        assert (kept < vocab).all()  # the filters really drop tokens on these logits


def test_filters_change_the_logprobs():
    """Processed log-probs are not the raw ones: temperature rescales, the filters renormalise
    over the kept set (each kept token's log-prob goes up)."""
    logits = _logits(0, 4, 512)
    raw = kernels.log_softmax(logits)
    scaled = processed_logprobs(logits, Sampling(temperature=0.7))
    assert not torch.equal(scaled, raw)
    both = processed_logprobs(logits, Sampling(temperature=0.7, top_p=0.9, top_k=20))
    kept = torch.isfinite(both)
    assert (both[kept] > scaled[kept]).all()
    assert torch.allclose(both.exp().sum(-1), torch.ones(4), atol=1e-5)


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


@SETTINGS
@given(rows=st.integers(2, 40), vocab=st.sampled_from([512, 49152, 151936]), seed=st.integers(0, 2**16),
       pick=st.integers(0, 39))
def test_sort_softmax_cumsum_row_invariant(rows, vocab, seed, pick):
    """The ops under the top-p cut, one by one (bf16-rounded rows: many ties, so the sort's
    tie order is exercised): a row's sorted values, indices, softmax and cumsum alone equal
    its row in the batch."""
    x = _logits(seed, rows, vocab, torch.bfloat16).float() / 0.7
    i = pick % rows
    values, idx = x.sort(dim=-1)
    one_values, one_idx = x[i : i + 1].sort(dim=-1)
    assert torch.equal(one_values[0], values[i]) and torch.equal(one_idx[0], idx[i])
    probs = values.softmax(dim=-1)
    assert torch.equal(values[i : i + 1].softmax(dim=-1)[0], probs[i])
    assert torch.equal(torch.cumsum(probs[i : i + 1], dim=-1)[0], torch.cumsum(probs, dim=-1)[i])


def test_cumsum_runs_left_to_right_in_float64():
    """What makes cumsum row-invariant: a sequential float64 running sum, rounded per entry."""
    p = _logits(3, 1, 4096).softmax(-1)[0]
    acc, running = 0.0, []
    for v in p.tolist():  # Python floats are float64
        acc += v
        running.append(acc)
    assert torch.equal(torch.cumsum(p, 0), torch.tensor(running, dtype=torch.float64).float())


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
