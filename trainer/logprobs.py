"""Score token sequences with the Megatron model: per-token log-probs of given tokens."""

from __future__ import annotations

import torch
from megatron.core.models.gpt import GPTModel

from parity import kernels
from trainer.megatron_patches import cpu_current_device


def forward_logits(model: GPTModel, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits [B, S, V] for right-padded input_ids [B, S]."""
    b, s = input_ids.shape
    position_ids = torch.arange(s).unsqueeze(0).expand(b, s)
    # Stock Megatron builds its causal mask on "cuda" when given None; pass one (True = masked).
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    with cpu_current_device():
        return model(input_ids, position_ids, mask)


def sequence_logprobs(
    model: GPTModel, sequences: list[list[int]], starts: list[int], batch_size: int = 8
) -> list[torch.Tensor]:
    """For each sequence, log p(seq[i] | seq[:i]) for i in [start, len): float32 [len - start].

    Sequences are right-padded into batches; causal attention keeps padding out of the
    scored positions.
    """
    out: list[torch.Tensor] = []
    for i in range(0, len(sequences), batch_size):
        batch, batch_starts = sequences[i : i + batch_size], starts[i : i + batch_size]
        width = max(len(s) for s in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        for row, seq in enumerate(batch):
            ids[row, : len(seq)] = torch.tensor(seq)
        logits = forward_logits(model, ids)
        logp = kernels.token_logprobs(logits[:, :-1], ids[:, 1:])  # position j scores token j+1
        for row, (seq, start) in enumerate(zip(batch, batch_starts, strict=True)):
            out.append(logp[row, start - 1 : len(seq) - 1].float())
    return out
