"""Teacher-forced scoring of token sequences, for any engine that maps token ids to logits."""

from __future__ import annotations

from collections.abc import Callable

import torch

from parity import kernels
from parity.sampling import Sampling, processed_logits


def batched_logprobs(
    logits_fn: Callable[[torch.Tensor], torch.Tensor], sequences: list[list[int]], starts: list[int],
    batch_size: int = 8, sampling: Sampling | None = None,
) -> list[torch.Tensor]:
    """For each sequence, log p(seq[i] | seq[:i]) for i in [start, len): float32 [len - start].

    p is the distribution `sampling` samples from (parity.sampling: vLLM's processed
    log-probs), or the raw softmax when `sampling` is None.

    `logits_fn(ids [B, S]) -> logits [B, S, V]` runs one right-padded batch. Sequences are
    batched by length (results come back in the given order); causal attention keeps padding
    out of the scored positions. With the parity kernels the grouping changes the cost, never a
    bit of the result.
    """
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    out: list[torch.Tensor | None] = [None] * len(sequences)
    for i in range(0, len(order), batch_size):
        rows = order[i : i + batch_size]
        width = max(len(sequences[r]) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        for row, r in enumerate(rows):
            ids[row, : len(sequences[r])] = torch.tensor(sequences[r])
        logits = logits_fn(ids)[:, :-1]
        if sampling is not None:
            logits = processed_logits(logits, sampling)
        ids = ids.to(logits.device)
        logp = kernels.token_logprobs(logits, ids[:, 1:])  # position j scores token j+1
        for row, r in enumerate(rows):
            out[r] = logp[row, starts[r] - 1 : len(sequences[r]) - 1].float().cpu()
    return out  # type: ignore[return-value]
