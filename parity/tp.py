"""Tensor parallelism shared by both engines: the shard layouts and the cross-rank sum.

Shards (rank r of `size`), the same on the rollout and the trainer (they are Megatron's):

- column-parallel QKV (grouped per KV head, parity.layouts): rows chunked in `size` equal
  pieces, i.e. whole KV groups ([q of the group; k; v]) per rank;
- column-parallel [gate; up]: [gate_r; up_r] (each half chunked, the rank's pieces stacked);
- row-parallel o_proj / down_proj: columns (dim 1) chunked;
- lm-head / output layer (tied or not): vocabulary rows, padded with zero rows up to a multiple
  of `size` (`padded_vocab`, as Megatron's make_vocab_size_divisible_by and vLLM's
  ParallelLMHead pad), then chunked; the logits of the shards are concatenated in rank order (an
  exact all-gather) and the padded columns are cut off before anything reads them, so a padded
  row is never sampled and never in a log-softmax's normaliser;
- the embedding lookup is exact whichever rank holds a row; norms are replicated.

The cross-rank sum of a row-parallel layer is `rank_ordered_sum`: every rank computes its
partial products in fp32 (`kernels.linear_partials`: its share of the layer's `row_splits`
K-slices, never rounded), all-gathers them (a copy, exact) and adds them in slice order, in
fp32, then casts to the model dtype. With TP = 1 the GEMM adds the same slices' partials in the
same order inside the kernel, so any two TP sizes give the same bits. A backend all-reduce (gloo ring, vLLM's shared-memory reduce) picks its order and
precision from the backend, the message size and the world: the same two partials could give
different bits on the two sides. This sum depends on the partials alone.

LoRA under TP: adapters are kept replicated (every rank holds the full A and B) and the delta
is computed on the full input exactly as with TP=1: a column-parallel layer's input is already
full (the delta's columns of the rank are then sliced in the shard layout), a row-parallel
layer's input shards are all-gathered (exact) first and its full delta is added once, after the
sum. The delta therefore has the bits of the TP=1 delta on both sides, whatever the rank count.

The trainer's ordered backward (deterministic_layout) uses the same construction backward: a
column-parallel layer's input gradient sums over its output features in `row_splits` slices
(partials in slice order across the ranks, `rank_ordered_sum`), and a column-parallel
adapter's output gradient is gathered whole (`unshard_delta_cols`), so every rank computes the
TP=1 gradients (trainer.megatron.layers).
"""

from __future__ import annotations

import math

import torch


def check_tp(spec, size: int) -> None:
    """ValueError unless `spec` (parity.model_spec.ModelSpec) shards evenly over `size` ranks."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if size > 1 and getattr(spec, "num_experts", 0):  # the experts have no shard layout
        raise ValueError(f"qwen3-moe runs without tensor parallelism: tensor_parallel_size must be 1, got {size}")
    for what, n in (
        ("num_attention_heads", spec.num_heads), ("num_key_value_heads", spec.num_kv_heads),
        ("intermediate_size", spec.intermediate_size),
    ):  # the vocabulary is padded instead (padded_vocab)
        if n % size:
            raise ValueError(f"{what}={n} is not divisible by tensor_parallel_size={size}")


# The fused linears (parity.lora.FUSED_PARTS) that are row-parallel under TP.
ROW_PARALLEL = ("o", "down")


def row_splits(num_heads: int, num_kv_heads: int, intermediate_size: int) -> int:
    """The K-slice count of the row-parallel layers (o_proj, down_proj): every TP size that
    check_tp accepts divides it, and it divides both layers' K (num_heads * head_dim and
    intermediate_size). Fixed by the model config alone, so a rank of any TP size holds whole
    slices, and TP = 1 and TP = N add the same fp32 partials in the same order: the trainer and
    the rollout may shard differently and still agree bit for bit."""
    return math.gcd(num_heads, num_kv_heads, intermediate_size)


def check_ordered_vocab(spec, size: int) -> None:
    """ValueError unless the trainer's ordered backward can run at `size` ranks: it sums the LM
    head's input gradient in row_splits slices of the vocabulary, so a rank's vocabulary rows
    must be whole slices."""
    splits = row_splits(spec.num_heads, spec.num_kv_heads, spec.intermediate_size)
    if size > 1 and spec.vocab_size % splits:
        raise ValueError(f"at trainer.tensor_parallel_size {size} needs the vocabulary ({spec.vocab_size}) "
                         f"divisible by the model's row_splits ({splits}); use trainer.tensor_parallel_size 1")


def fused_k_splits(spec, fused: str, size: int = 1) -> int:
    """The K-slices a rank of `size` computes for fused linear `fused` of `spec`
    (parity.model_spec.ModelSpec): its share of row_splits for a row-parallel layer, 1 (one
    chain over the whole K) for a column-parallel one."""
    if fused not in ROW_PARALLEL:
        return 1
    return row_splits(spec.num_heads, spec.num_kv_heads, spec.intermediate_size) // size


def shard_rows(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Column-parallel shard (QKV grouped per KV head, lm-head/embedding vocab rows)."""
    return t.chunk(size, dim=0)[rank].contiguous() if size > 1 else t


def padded_vocab(vocab: int, size: int) -> int:
    """The vocabulary rounded up to a multiple of `size` (the zero rows each side adds)."""
    return -(-vocab // size) * size


def shard_vocab(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s rows of a [vocab, ...] embedding / lm-head padded to padded_vocab rows: a
    view where the rank's rows all exist, zero rows appended on the rank that holds the end."""
    if size == 1:
        return t
    per = padded_vocab(t.shape[0], size) // size
    start, stop = rank * per, min((rank + 1) * per, t.shape[0])
    part = t[start:stop]
    if stop - start == per:
        return part
    return torch.cat([part, part.new_zeros(per - max(stop - start, 0), *t.shape[1:])])


def shard_cols(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Row-parallel shard (o_proj, down_proj): the input columns of the rank."""
    return t.chunk(size, dim=1)[rank].contiguous() if size > 1 else t


def shard_gate_up(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """[gate; up] -> [gate_r; up_r] (Megatron's GLU shard: the local output chunks in two)."""
    if size == 1:
        return t
    gate, up = t.chunk(2, dim=0)
    return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]]).contiguous()


def unshard_gate_up(shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of shard_gate_up over all ranks' shards, in rank order."""
    halves = [s.chunk(2, dim=0) for s in shards]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves]).contiguous()


def shard_delta_cols(delta: torch.Tensor, fused: str, rank: int, size: int) -> torch.Tensor:
    """The rank's columns of a full column-parallel output (a LoRA delta) in the shard layout."""
    if size == 1:
        return delta
    if fused == "gate_up":
        gate, up = delta.chunk(2, dim=-1)
        return torch.cat([gate.chunk(size, dim=-1)[rank], up.chunk(size, dim=-1)[rank]], dim=-1)
    return delta.chunk(size, dim=-1)[rank]


def unshard_delta_cols(shards: list[torch.Tensor], fused: str) -> torch.Tensor:
    """Inverse of shard_delta_cols over every rank's columns, in rank order."""
    if fused == "gate_up":
        halves = [s.chunk(2, dim=-1) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=-1)
    return torch.cat(shards, dim=-1)


def rank_ordered_sum(parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """parts [S, ...] (the all-gathered fp32 K-slice partials, in slice order = rank order)
    -> their sum.

    ((p0 + p1) + p2) + ... in fp32, rounded once to `dtype`. Element-wise adds only, so the
    bits depend on the partials and their order alone (not on shapes, threads or backend)."""
    acc = parts[0].float()
    for p in parts[1:]:
        acc = acc + p.float()
    return acc.to(dtype)
