"""The distribution a token is sampled from and the token itself, computed by one compiled
implementation on both sides (parity/csrc/sampling.cpp): temperature, top-k, top-p, the
log-softmax, and a counter-based draw.

The transform, vLLM's sampler's semantics with every order defined:

    x = logits.float() / temperature       (fp32, correctly rounded; 1 changes nothing)
    top-k (0 < k < vocab): keep every x not below the k-th largest (ties at the k-th all stay)
    top-p (p < 1): order the kept tokens by (x descending, token id ascending), probabilities
        q = our exp / fixed-tree sum over the kept row, and keep the shortest prefix of the
        order whose fp64 running sum (left to right) reaches p; the first token always stays
    processed log-probs = log_softmax(x with -inf outside the kept set)     (compiled)
    the token = Gumbel-max over those log-probs, the noise from Philox 4x32-10 keyed by the
        request's 64-bit key and counted by (vocabulary block, position)

So a sampled token is a pure function of (request key, position, logits): `request_key(seed,
step, prompt, sample)` names the request, position is the token's index in the completion (0 =
the first sampled token). The same seed samples the same tokens at any batch size, chunking,
schedule, TP size or thread count, run after run, and on every ISA code path (KIMI_RL_ISA:
parity/native.py). The rollout samples with this module (rollout/sampler.py, installed by
rollout/vllm_patches.py in place of vLLM's sampler); the trainer scores with `processed_logits`
and `parity.kernels.token_logprobs`: the same compiled ops on bitwise-equal rows.

Why it is batch invariant: every op works on one row on its own (rows are split between
threads, never a row), and within a row every order is fixed by the row's contents alone.

CUDA logits take the same compiled ops: a CUDA rollout's sampler copies its logits rows to the
host and the tokens back, and a CUDA trainer's `processed_logits` works on a host copy, so a
GPU run samples and scores with the bits a CPU run would. The division by the temperature is
on the host too: torch's CUDA division by a scalar multiplies by the reciprocal, which is not
correctly rounded (measured on an H100: 288 of 1536 log-probs off by up to 4.8e-7 when the
trainer divided on the device). KIMI_RL_INVARIANT_KERNELS=0 keeps torch's ops for the kept
set and log-softmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from parity import kernels, native

# vLLM treats a temperature below this as greedy (vllm.sampling_params._SAMPLING_EPS): the
# log-probs it then returns are those of the raw logits, not of the scaled ones.
MIN_TEMPERATURE = 1e-5
# Rows sorted per call: a sort needs the values and int64 indices of every row it holds, so the
# trainer's [batch x sequence] rows go through in pieces (the ops are row-wise: same bits).
_SORT_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class Sampling:
    """How tokens are sampled: vLLM's SamplingParams fields of the same names."""

    temperature: float = 1.0
    top_p: float = 1.0  # in (0, 1]; 1 = off
    top_k: int = 0  # 0 = off; on when 0 < top_k < vocabulary size

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= MIN_TEMPERATURE):
            raise ValueError(f"temperature must be >= {MIN_TEMPERATURE} (below it vLLM samples "
                             f"greedily), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")

    def k_for(self, vocab: int) -> int | None:
        """The top-k in effect over `vocab` logits (vLLM: on iff 0 < top_k < vocab)."""
        return self.top_k if 0 < self.top_k < vocab else None

    def p(self) -> float | None:
        return self.top_p if self.top_p < 1 else None

    def is_raw(self, vocab: int) -> bool:
        """True when the processed log-probs are the raw log-softmax (bitwise)."""
        return self.temperature == 1.0 and self.p() is None and self.k_for(vocab) is None


def _fp32(value: float) -> torch.Tensor:
    # vLLM holds temperatures and top-p values as float32 tensors: 0.7 is float32(0.7).
    return torch.tensor(value, dtype=torch.float32)


@torch.no_grad()
def _kept_rows(rows: torch.Tensor, k: int | None, p: float | None) -> torch.Tensor:
    """[n, V] fp32 scaled logits -> bool [n, V], True where vLLM leaves the logit in place."""
    vocab = rows.shape[-1]
    if p is None:  # apply_top_k_only: no sort, the k-th largest value is the threshold
        kth = rows.topk(k, dim=1).values[:, k - 1 : k]
        return ~(rows < kth)
    logits_sort, logits_idx = rows.sort(dim=-1, descending=False)
    dropped = torch.zeros_like(logits_sort, dtype=torch.bool)
    if k is not None:
        dropped = logits_sort < logits_sort[:, vocab - k : vocab - k + 1]
        logits_sort = logits_sort.masked_fill(dropped, float("-inf"))
    probs_sort = logits_sort.softmax(dim=-1)
    probs_sum = torch.cumsum(probs_sort, dim=-1, out=probs_sort)
    top_p_mask = probs_sum <= 1 - _fp32(p)
    top_p_mask[:, -1] = False  # at least one token survives
    dropped = dropped | top_p_mask
    return torch.empty_like(dropped).scatter_(-1, logits_idx, ~dropped)


def _kept(rows: torch.Tensor, k: int | None, p: float | None) -> torch.Tensor:
    """bool [n, V]: the kept set of each row of scaled fp32 logits under one (k, p)."""
    if not kernels.INVARIANT:  # torch's ops, a bounded number of rows a sort
        step = max(1, _SORT_ELEMENTS // rows.shape[-1])
        return torch.cat([_kept_rows(rows[i : i + step], k, p) for i in range(0, rows.shape[0], step)])
    n = rows.shape[0]
    top_k = torch.full((n,), k or 0, dtype=torch.int64)
    top_p = torch.full((n,), 1.0 if p is None else p, dtype=torch.float32)
    return native.ops().kept(rows.cpu(), top_k, top_p).to(rows.device)  # CUDA rows: on the host


def processed_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """fp32 logits [..., V] of the distribution the rollout samples from: divided by the
    temperature, -inf outside the top-k / top-p set. Differentiable through the kept logits."""
    # CUDA logits come to the host first: torch's CUDA division by a scalar multiplies by its
    # reciprocal (not correctly rounded), and the rollout's sampler divides on the host.
    x = logits.float().cpu()
    if sampling.temperature != 1.0:  # x / 1 is x, bitwise
        x = x / _fp32(sampling.temperature)
    vocab = x.shape[-1]
    k, p = sampling.k_for(vocab), sampling.p()
    if k is None and p is None:
        return x
    kept = _kept(x.detach().reshape(-1, vocab), k, p)
    return x.masked_fill(~kept.view(x.shape), float("-inf"))


def processed_logprobs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """fp32 log-probs [..., V] of the sampled distribution (-inf outside the kept set; the raw
    log-softmax when `sampling` changes nothing)."""
    return kernels.log_softmax(processed_logits(logits, sampling))


@torch.no_grad()
def processed_logprobs_rows(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """`processed_logprobs` with parameters per row (what a rollout batch holds): logits
    [N, V] on the CPU, temperature fp32 [N], top_k int [N] (off where not 0 < k < V) or None,
    top_p fp32 [N] (off where >= 1) or None. The same ops on each row as `processed_logprobs`
    with that row's Sampling, so the same bits."""
    x = logits.float() / temperature.float().unsqueeze(1)  # row-wise: the same division
    n, vocab = x.shape
    k = None if top_k is None else top_k.long()
    if k is not None and not ((k > 0) & (k < vocab)).any():
        k = None
    if top_p is not None and not (top_p < 1).any():
        top_p = None
    if k is not None or top_p is not None:
        kept = native.ops().kept(
            x, k if k is not None else torch.zeros(n, dtype=torch.int64),
            top_p.float().contiguous() if top_p is not None else torch.ones(n, dtype=torch.float32),
        )
        x = x.masked_fill(~kept, float("-inf"))
    return kernels.log_softmax(x)


_MASK32, _MASK64 = (1 << 32) - 1, (1 << 64) - 1


def philox4x32_10(counter: tuple[int, int, int, int], key: tuple[int, int]) -> list[int]:
    """One block of Philox 4x32-10 (Salmon et al., SC'11; Random123's constants), in Python:
    four 32-bit words. The compiled sampler draws its noise from the same function."""
    c = [w & _MASK32 for w in counter]
    k0, k1 = key[0] & _MASK32, key[1] & _MASK32
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [((p1 >> 32) ^ c[1] ^ k0) & _MASK32, p1 & _MASK32, ((p0 >> 32) ^ c[3] ^ k1) & _MASK32, p0 & _MASK32]
        k0, k1 = (k0 + 0x9E3779B9) & _MASK32, (k1 + 0xBB67AE85) & _MASK32
    return c


def request_key(seed: int, step: int, prompt: int, sample: int) -> int:
    """The 64-bit key of one sampled completion: Philox of (prompt, sample, step) under the run
    seed. `prompt` is the prompt's index in the step's list (its identity, not its place in a
    batch), `sample` the completion's index among that prompt's samples."""
    for name, value, bits in (("step", step, 64), ("prompt", prompt, 32), ("sample", sample, 32)):
        if not 0 <= value < 1 << bits:
            raise ValueError(f"request_key: {name} must be in [0, 2**{bits}), got {value}")
    seed &= _MASK64
    words = philox4x32_10((prompt, sample, step & _MASK32, step >> 32), (seed & _MASK32, seed >> 32))
    return words[0] | words[1] << 32


def _signed64(key: int) -> int:
    key &= _MASK64
    return key - (1 << 64) if key >= 1 << 63 else key


def sample_tokens(logprobs: torch.Tensor, keys: list[int], positions: list[int]) -> torch.Tensor:
    """The token of each row of log-probs [N, V] (CPU): Gumbel-max with Philox noise keyed by
    keys[i] (request_key) and counted by positions[i] (the token's index in its completion).
    int64 [N]; a pure function of its arguments (parity/csrc/sampling.cpp)."""
    keys_t = torch.tensor([_signed64(k) for k in keys], dtype=torch.int64)
    positions_t = torch.tensor(positions, dtype=torch.int64)
    return native.ops().sample(logprobs, keys_t, positions_t)
