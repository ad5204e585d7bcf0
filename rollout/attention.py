"""A vLLM attention backend whose math is `parity.kernels.paged_attention`, over vLLM's paged KV cache.

Only the parity models use it (they pass it as `attn_backend=` to vLLM's `Attention` layer);
stock models in the same process keep vLLM's own CPU attention.

KV cache. vLLM allocates each layer's cache as a contiguous tensor of logical shape
[num_blocks, num_kv_heads, block_size, 2 * head_size] (the CPU backend's spec, inherited).
This backend reads and writes it itself, in its own in-block layout: slot-major,
`cache.view(num_blocks * block_size, 2, num_kv_heads, head_size)`, where slot
`s = block * block_size + offset` holds the key at [s, 0] and the value at [s, 1]. vLLM only
ever touches the cache as whole blocks (zeroing new blocks), which keeps its meaning in this
layout. Keys and values are stored in the model dtype, unchanged.

Metadata. `ParityAttentionMetadataBuilder.build` runs once per step (shared by all layers) and
turns vLLM's common metadata (query_start_loc, seq_lens, block_table, slot_mapping) into what
the kernel needs: for each scheduled query token its request index `q_seq` and absolute
position `q_pos = seq_len - query_len + j`, and for each request the cache slots of its
positions 0..L-1 (L = the longest seq_len in the step). Every layer then calls
`kernels.paged_attention` once for the whole batch, which reads each 64-key block out of the
cache in place as its walk reaches it (no per-step copy of the contexts): prefill, decode,
chunked prefill (a later chunk reads the earlier chunks' keys from the cache) and mixed batches
are the same code path. Tokens beyond the scheduled ones (padding) are not attended and get a zero
output.

On CUDA the same math runs without any host work per layer or per step beyond one small copy:
`build` turns the host copy of query_start_loc into the kernel's tile list (request, first query;
`parity.cuda.paged_tile_plan`) and copies it into a persistent device buffer (unused rows
-1); the kernel finds each tile's rows, positions and keys itself from vLLM's persistent device
buffers (query_start_loc, seq_lens, block table) and reads the cache in place, and the KV cache
is written by a Triton store that skips padding slots. Every launch then reads only buffers whose
addresses never change, so vLLM can capture uniform decode steps as full CUDA graphs
(`_cudagraph_support`); replay computes what the eager step computes, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

from parity import kernels
from rollout.plugin import ATTENTION_BACKEND
from rollout.vllm_patches import register_attention_backend

# vLLM's Attention layer looks its backend up by enum member name (rollout/vllm_patches.py).
BACKEND_NAME = register_attention_backend(ATTENTION_BACKEND, "rollout.attention.ParityAttentionBackend")


@dataclass
class ParityAttentionMetadata:
    num_actual_tokens: int  # as vLLM reports it (may include padding)
    num_query_tokens: int  # scheduled tokens: query_start_loc[num_reqs]
    num_reqs: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] (CUDA: vLLM's device buffer)
    seq_lens: torch.Tensor  # [num_reqs] (CUDA: vLLM's device buffer)
    block_table: torch.Tensor  # [num_reqs, max_blocks]
    slot_mapping: torch.Tensor  # [num_tokens]
    block_size: int
    # CPU: the per-query view of the step
    q_seq: torch.Tensor | None = None  # [num_query_tokens] int64, request index of each query
    q_pos: torch.Tensor | None = None  # [num_query_tokens] int64, absolute position of each query
    ctx_slots: torch.Tensor | None = None  # [num_reqs, L] int64, slot of positions 0..L-1 (0 past the end)
    # CUDA: the kernel's tiles, a view of the builder's persistent buffer
    tiles: torch.Tensor | None = None  # [T, 2] int32 (request, first query), -1 rows unused


class ParityAttentionMetadataBuilder(AttentionMetadataBuilder[ParityAttentionMetadata]):
    reorder_batch_threshold: ClassVar[int | None] = None
    # CUDA: a uniform decode step's launches read persistent buffers only (see the module doc).
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size
        self.tiles = None
        if torch.device(device).type == "cuda":
            from parity import cuda

            self.block_q = cuda.attention_config(kv_cache_spec.head_size, kv_cache_spec.dtype).block_q
            sched = vllm_config.scheduler_config
            # Each request has at least one query: tiles <= requests + tokens / block_q.
            capacity = sched.max_num_seqs + -(-sched.max_num_batched_tokens // self.block_q) + 1
            self.tiles = torch.full((capacity, 2), -1, dtype=torch.int32, device=device)
            self.tiles_used = 0

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> ParityAttentionMetadata:
        cm = common_attn_metadata
        if self.tiles is not None:
            return self._build_cuda(cm)
        num_reqs = cm.num_reqs
        qsl = cm.query_start_loc_cpu[: num_reqs + 1].to(torch.int64)
        seq_lens = cm.seq_lens[:num_reqs].to(device="cpu", dtype=torch.int64)
        query_lens = qsl[1:] - qsl[:-1]
        num_query_tokens = int(qsl[-1]) if num_reqs else 0
        q_seq = torch.repeat_interleave(torch.arange(num_reqs), query_lens)
        # Query j of request r sits at position seq_len[r] - query_len[r] + j.
        q_pos = (seq_lens - query_lens)[q_seq] + (torch.arange(num_query_tokens) - qsl[:-1][q_seq])

        block_table = cm.block_table_tensor[:num_reqs]
        ctx_len = int(seq_lens.max()) if num_reqs else 0
        pos = torch.arange(ctx_len)
        bs = self.block_size
        blocks = block_table[:, pos // bs].to(device="cpu", dtype=torch.int64)
        slots = blocks * bs + pos % bs
        # Positions past a request's end point at slot 0: read, then masked by the kernel.
        ctx_slots = torch.where((pos.unsqueeze(0) < seq_lens.unsqueeze(1)).to(slots.device), slots, 0)

        return ParityAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            num_query_tokens=num_query_tokens,
            num_reqs=num_reqs,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_table=block_table,
            slot_mapping=cm.slot_mapping,
            block_size=bs,
            q_seq=q_seq,
            q_pos=q_pos,
            ctx_slots=ctx_slots,
        )

    def _build_cuda(self, cm: CommonAttentionMetadata) -> ParityAttentionMetadata:
        from parity import cuda

        num_reqs = cm.num_reqs
        qsl_host = cm.query_start_loc_cpu[: num_reqs + 1]
        plan = cuda.paged_tile_plan(qsl_host, self.block_q)
        used = plan.shape[0]
        # A fresh pinned copy per step: the host allocator keeps it until the copy has run.
        self.tiles[:used].copy_(plan.pin_memory(), non_blocking=True)
        if self.tiles_used > used:  # rows a larger step (or a graph's capture) left behind
            self.tiles[used : self.tiles_used].fill_(-1)
        self.tiles_used = used
        return ParityAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            num_query_tokens=int(qsl_host[-1]) if num_reqs else 0,
            num_reqs=num_reqs,
            query_start_loc=cm.query_start_loc,
            seq_lens=cm.seq_lens,
            block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping,
            block_size=self.block_size,
            tiles=self.tiles[:used],
        )


def _slot_view(kv_cache: torch.Tensor, num_kv_heads: int, head_size: int) -> torch.Tensor:
    if not kv_cache.is_contiguous():
        raise RuntimeError(
            "the parity attention backend needs a contiguous per-layer KV cache "
            f"(got strides {tuple(kv_cache.stride())} for shape {tuple(kv_cache.shape)})"
        )
    return kv_cache.view(-1, 2, num_kv_heads, head_size)


class ParityAttentionImpl(AttentionImpl[ParityAttentionMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **extra,
    ) -> None:
        unsupported = {
            "alibi_slopes": alibi_slopes,
            "sliding_window": sliding_window,
            "logits_soft_cap": logits_soft_cap,
            "kv_sharing_target_layer_name": kv_sharing_target_layer_name,
            **{k: v for k, v in extra.items() if v is not None},
        }
        unsupported = {k: v for k, v in unsupported.items() if v is not None}
        if unsupported:
            raise NotImplementedError(f"parity attention does not support {sorted(unsupported)}")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"parity attention supports decoder attention only, not {attn_type}")
        if kv_cache_dtype != "auto":
            raise NotImplementedError(f"parity attention keeps the KV cache in the model dtype, not {kv_cache_dtype}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale  # the model passes kernels.attention_scale(head_size); keep that float
        self.num_kv_heads = num_kv_heads if num_kv_heads is not None else num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.sliding_window = None
        self.kv_sharing_target_layer_name = None

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        if kv_cache.numel() == 0:
            return
        cache = _slot_view(kv_cache, self.num_kv_heads, self.head_size)
        if cache.is_cuda:
            from parity import cuda

            cuda.kv_cache_store(key, value, cache, slot_mapping)
            return
        n = min(slot_mapping.shape[0], key.shape[0])
        slots = slot_mapping[:n].to(torch.int64)
        keep = slots >= 0  # padding tokens carry slot -1
        slots = slots[keep]
        cache[slots, 0] = key[:n][keep].to(cache.dtype)
        cache[slots, 1] = value[:n][keep].to(cache.dtype)

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: ParityAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("parity attention does not fuse output quantization")
        if attn_metadata is None or kv_cache.numel() == 0:  # profiling / warm-up run
            output.zero_()
            return output
        if attn_metadata.tiles is not None:
            return self._forward_cuda(query, kv_cache, attn_metadata, output)
        n = attn_metadata.num_query_tokens
        output[n:].zero_()
        if n == 0:
            return output
        if kv_cache.shape[2] != attn_metadata.block_size:
            raise RuntimeError(
                f"KV cache block size {kv_cache.shape[2]} != metadata block size {attn_metadata.block_size}"
            )
        out = kernels.paged_attention(
            query[:n].view(n, self.num_heads, self.head_size),
            _slot_view(kv_cache, self.num_kv_heads, self.head_size),
            attn_metadata.ctx_slots,
            attn_metadata.q_seq,
            attn_metadata.q_pos,
            self.scale,
        )
        output[:n] = out.view(output[:n].shape)
        return output

    def _forward_cuda(
        self, query: torch.Tensor, kv_cache: torch.Tensor, md: ParityAttentionMetadata, output: torch.Tensor
    ) -> torch.Tensor:
        """The whole step in one launch over persistent buffers (capturable); rows of padding
        tokens are left as they are (no request reads them)."""
        from parity import cuda

        if kv_cache.shape[2] != md.block_size:
            raise RuntimeError(f"KV cache block size {kv_cache.shape[2]} != metadata block size {md.block_size}")
        n = query.shape[0]
        cuda.paged_attention_forward(
            query.view(n, self.num_heads, self.head_size),
            _slot_view(kv_cache, self.num_kv_heads, self.head_size),
            md.block_table, md.block_size, md.query_start_loc, md.seq_lens, md.tiles,
            self.scale, out=output.view(n, self.num_heads, self.head_size),
        )
        return output


class ParityAttentionBackend(CPUAttentionBackend):
    """CPU_ATTN's KV cache spec and dtypes; parity math, own cache layout and metadata."""

    forward_includes_kv_cache_update: bool = False
    supported_kv_cache_dtypes: ClassVar[list] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any

    @classmethod
    def supports_non_causal(cls) -> bool:
        return False

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @staticmethod
    def get_impl_cls() -> type[ParityAttentionImpl]:
        return ParityAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[ParityAttentionMetadataBuilder]:
        return ParityAttentionMetadataBuilder
