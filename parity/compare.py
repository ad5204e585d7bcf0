"""Compare rollout and trainer log-probs of the same sampled tokens.

Equality is `torch.equal` on the float32 tensors (per sequence) and `==` per token — never a
tolerance. KL estimators follow the usual RL convention for samples drawn from the rollout
policy: with log r = train_logprob - rollout_logprob, k1 = E[-log r], k3 = E[r - 1 - log r].
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import xxhash


@dataclass
class ParityStats:
    sequences: int
    sequences_equal: int  # sequences whose tensors are torch.equal
    tokens_compared: int
    tokens_equal: int
    bitwise_equal_fraction: float
    max_abs_diff: float
    mean_abs_diff: float
    kl_k1: float
    kl_k3: float

    @property
    def all_equal(self) -> bool:
        return self.sequences_equal == self.sequences

    def to_dict(self) -> dict:
        return asdict(self)


def compare_logprobs(
    rollout_logprobs: list[torch.Tensor], train_logprobs: list[torch.Tensor]
) -> ParityStats:
    if len(rollout_logprobs) != len(train_logprobs):
        raise ValueError("rollout and trainer scored a different number of sequences")
    seq_equal = 0
    for r, t in zip(rollout_logprobs, train_logprobs, strict=True):
        if r.shape != t.shape:
            raise ValueError(f"shape mismatch: rollout {tuple(r.shape)} vs trainer {tuple(t.shape)}")
        seq_equal += bool(torch.equal(r, t))
    if rollout_logprobs:
        r = torch.cat([x.float() for x in rollout_logprobs])
        t = torch.cat([x.float() for x in train_logprobs])
    else:
        r = t = torch.zeros(0)
    n = r.numel()
    diff = (r - t).abs()
    log_ratio = (t - r).double()
    return ParityStats(
        sequences=len(rollout_logprobs),
        sequences_equal=seq_equal,
        tokens_compared=n,
        tokens_equal=int((r == t).sum()),
        bitwise_equal_fraction=float((r == t).sum()) / n if n else 1.0,
        max_abs_diff=float(diff.max()) if n else 0.0,
        mean_abs_diff=float(diff.mean()) if n else 0.0,
        kl_k1=float((-log_ratio).mean()) if n else 0.0,
        kl_k3=float((log_ratio.exp() - 1 - log_ratio).mean()) if n else 0.0,
    )


def tensor_checksum(tensor: torch.Tensor) -> str:
    """XXH3-128 of a tensor's raw bytes in row-major order (any dtype, bf16 included): the
    trainer and every rollout worker compute it the same way, so equal digests mean equal bits.
    A sync is verified every step, so the hash must cost less than the copy it checks: XXH3
    reads ~20x faster than sha256 here (a 9 MB adapter: ~1.7 ms vs ~33 ms). It guards against
    corruption and stale buffers, not against an adversary (nobody untrusted writes the bytes)."""
    raw = tensor.detach().cpu().contiguous().view(-1).view(torch.uint8)
    return xxhash.xxh3_128_hexdigest(raw.numpy())
