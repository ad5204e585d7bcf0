"""Score token sequences with the Megatron model: per-token log-probs of given tokens."""

from __future__ import annotations

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams

from parity.sampling import Sampling
from parity.scoring import batched_logprobs
from trainer.megatron.layers import packed_positions
from trainer.megatron.patches import cpu_current_device


def forward_output(model: GPTModel, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """GPTModel's output for right-padded input_ids [B, S], or for one packed row [1, N] of
    sequences starting at `cu_seqlens` (Megatron's THD layout): logits [B, S, V_padded], or
    the decoder's hidden states [S, B, H] with post_process off."""
    b, s = input_ids.shape
    device = next(model.parameters()).device  # cpu, or cuda when load_model put it there
    input_ids = input_ids.to(device)
    if cu_seqlens is None:
        position_ids = torch.arange(s, device=device).unsqueeze(0).expand(b, s)
        # Stock Megatron builds its causal mask on "cuda" when given None; pass one (True = masked).
        mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool, device=device), diagonal=1)
        with cpu_current_device():
            return model(input_ids, position_ids, mask)
    position_ids = packed_positions(cu_seqlens)[1].unsqueeze(0).to(device)
    longest = int(cu_seqlens.diff().max())
    cu = cu_seqlens.to(device)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=longest, max_seqlen_kv=longest)
    with cpu_current_device():
        return model(input_ids, position_ids, None, packed_seq_params=params)


def forward_logits(model: GPTModel, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [B, S, V] of `forward_output`'s input. Under TP the output layer's
    vocabulary is padded (parity/tp.py): the padded columns are cut off before any softmax
    sees them, as the rollout does."""
    return forward_output(model, input_ids, cu_seqlens)[..., : model.hf_vocab_size]


def sequence_logprobs(
    model: GPTModel, sequences: list[list[int]], starts: list[int], batch_size: int = 8,
    sampling: Sampling | None = None, packed: bool = False,
) -> list[torch.Tensor]:
    """For each sequence, log p(seq[i] | seq[:i]) for i in [start, len): float32 [len - start],
    scored by the Megatron model (parity.scoring.batched_logprobs says which p and how);
    `packed`: each batch's sequences end to end in one row."""
    return batched_logprobs(lambda ids, cu: forward_logits(model, ids, cu), sequences, starts, batch_size,
                            sampling, packed)
