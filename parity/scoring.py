"""Teacher-forced scoring of token sequences, for any engine that maps token ids to logits."""

from __future__ import annotations

from collections.abc import Callable

import torch

from parity import kernels
from parity.sampling import Sampling, processed_logits


def batched_logprobs(
    logits_fn: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor], sequences: list[list[int]],
    starts: list[int], batch_size: int = 8, sampling: Sampling | None = None, packed: bool = False,
) -> list[torch.Tensor]:
    """For each sequence, log p(seq[i] | seq[:i]) for i in [start, len): float32 [len - start].

    p is the distribution `sampling` samples from (parity.sampling: temperature-scaled, top-k /
    top-p renormalised over the kept set; vLLM's processed log-probs), or the raw softmax when
    `sampling` is None. `logits_fn(ids, cu_seqlens) -> logits` runs one batch: right-padded
    ids [B, S] with cu_seqlens None, or with `packed` the batch's sequences end to end in one
    row ids [1, N], sequence j starting at cu_seqlens[j] (int32 [B + 1]). Sequences are
    batched by length (results come back in the given order); causal attention keeps padding
    out of the scored positions. With the parity kernels the grouping and the layout change
    the cost, never a bit of the result.
    """
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    out: list[torch.Tensor | None] = [None] * len(sequences)
    for i in range(0, len(order), batch_size):
        rows = order[i : i + batch_size]
        if packed:
            lengths = torch.tensor([len(sequences[r]) for r in rows])
            cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).int()])
            ids = torch.tensor([tok for r in rows for tok in sequences[r]]).unsqueeze(0)
            firsts = cu_seqlens[:-1].tolist()  # where each sequence's positions start in the row
        else:
            width = max(len(sequences[r]) for r in rows)
            cu_seqlens = None
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            for row, r in enumerate(rows):
                ids[row, : len(sequences[r])] = torch.tensor(sequences[r])
            firsts = [row * (width - 1) for row in range(len(rows))]
        logits = logits_fn(ids, cu_seqlens)[:, :-1]
        if sampling is not None:
            logits = processed_logits(logits, sampling)
        ids = ids.to(logits.device)
        logp = kernels.token_logprobs(logits, ids[:, 1:]).flatten()  # position j scores token j+1
        for first, r in zip(firsts, rows, strict=True):
            out[r] = logp[first + starts[r] - 1 : first + len(sequences[r]) - 1].float().cpu()
    return out  # type: ignore[return-value]
