"""Megatron-core modules whose arithmetic is the parity kernels.

Each class subclasses or mirrors the Megatron module it replaces and changes only the math:
the tensor-parallel plumbing (region copies, gathers, all-reduces) stays Megatron's.
"""

from __future__ import annotations

import functools

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from parity import kernels, tp
from parity.autograd import InvariantLinear


def _parity_linear(input, weight, bias, allreduce_dgrad, tp_group, packed=None, **_):
    # Megatron's own GEMM function also all-reduces the input gradient across TP ranks when
    # allreduce_dgrad is set; copy_to_tensor_model_parallel_region does exactly that backward.
    if allreduce_dgrad:
        input = copy_to_tensor_model_parallel_region(input, group=tp_group)
    return kernels.linear(input, weight, bias, packed=packed)


class _FrozenPack:
    """Keeps the compiled GEMM's pack (parity.kernels.pack) of a frozen weight, made once by
    `pack_frozen_weights` after the weights are loaded and frozen: the LoRA base, or a full
    fine-tune's frozen reference copy, which nothing writes again. It is used only for the very
    tensor it was made from, and only while that tensor is still frozen; a trainable weight
    (it changes every step) is packed per call."""

    _frozen_pack: tuple[torch.Tensor, torch.Tensor] | None = None

    def pack_if_frozen(self) -> None:
        weight = getattr(self, "weight", None)
        if isinstance(weight, torch.nn.Parameter) and not weight.requires_grad:
            packed = kernels.pack(weight)
            self._frozen_pack = None if packed is None else (weight, packed)

    def packed(self, weight: torch.Tensor) -> torch.Tensor | None:
        held = self._frozen_pack
        if held is None or held[0] is not weight or weight.requires_grad:
            return None
        return held[1]


def pack_frozen_weights(model: torch.nn.Module) -> int:
    """Pack every frozen parity linear weight of `model` once; returns how many were packed."""
    layers = [m for m in model.modules() if isinstance(m, _FrozenPack)]
    for m in layers:
        m.pack_if_frozen()
    return sum(m._frozen_pack is not None for m in layers)


# The adapter slot a parity linear uses unless switched: the policy, the one the rollout mirrors.
POLICY_ADAPTER = "policy"


class _LoRAMixin:
    """Named adapters (trainer.megatron.lora.LoRAAdapter), at most one active; its delta is added.

    `lora` is a ModuleDict of slot name -> adapter, registered once an adapter is attached;
    `lora_active` names the slot in use (None: the base alone). Several slots let the policy
    and the critic share one frozen base, each through its own adapter.
    """

    lora_active: str | None = POLICY_ADAPTER

    def active_adapter(self):
        slots = getattr(self, "lora", None)
        if slots is None or self.lora_active not in slots:
            return None
        return slots[self.lora_active]

    def forward(self, input_, *args, **kwargs):
        out, bias = super().forward(input_, *args, **kwargs)
        adapter = self.active_adapter()
        delta = adapter.delta(input_) if adapter is not None else None
        return (out if delta is None else out + delta), bias


class LoRAColumnParallelLinear(_LoRAMixin, ColumnParallelLinear):
    """Megatron's own GEMM plus the adapter hook: LoRA on the stock (parity=False) model."""


class LoRARowParallelLinear(_LoRAMixin, RowParallelLinear):
    """Megatron's own GEMM plus the adapter hook: LoRA on the stock (parity=False) model."""


def with_lora_hook(linear: torch.nn.Module) -> torch.nn.Module:
    """Give a stock Megatron linear the adapter hook by re-classing it in place (it keeps its
    parameters, TP group and hooks); parity linears already have it."""
    if not isinstance(linear, _LoRAMixin):
        hooked = {ColumnParallelLinear: LoRAColumnParallelLinear, RowParallelLinear: LoRARowParallelLinear}
        linear.__class__ = hooked[type(linear)]
    return linear


def row_splits(config: TransformerConfig) -> int:
    """parity.tp.row_splits of the model this config builds (o_proj and down_proj's K-order)."""
    return tp.row_splits(config.num_attention_heads, config.num_query_groups or config.num_attention_heads,
                         config.ffn_hidden_size)


def _rank_ordered_linear(
    x: torch.Tensor, weight: torch.Tensor, k_splits: int, group, packed: torch.Tensor | None = None
) -> torch.Tensor:
    """The row-parallel product of parity.tp.rank_ordered_sum: the rank's fp32 K-slice partials,
    all-gathered, added in slice order in fp32, rounded once (the rollout's exact sum)."""
    import torch.distributed as dist

    partials = kernels.linear_partials(x, weight, k_splits, packed=packed).contiguous()
    parts = [torch.empty_like(partials) for _ in range(group.size())]
    dist.all_gather(parts, partials, group=group)
    return tp.rank_ordered_sum(torch.cat(parts), x.dtype)


class ParityColumnParallelLinear(_FrozenPack, _LoRAMixin, ColumnParallelLinear):
    def _forward_impl(self, input, weight, bias=None, *, allreduce_dgrad=False, tp_group=None, **kw):
        return _parity_linear(input, weight, bias, allreduce_dgrad, tp_group, packed=self.packed(weight))

    def forward(self, input_, *args, **kwargs):
        adapter = self.active_adapter()
        if self.tp_group.size() == 1 or adapter is None:
            return super().forward(input_, *args, **kwargs)
        # TP with an adapter: the replicated adapter's full delta on the (full) input, then the
        # rank's columns in the shard layout (parity.tp): the TP=1 delta's bits.
        out, bias = ColumnParallelLinear.forward(self, input_, *args, **kwargs)
        delta = adapter.delta(copy_to_tensor_model_parallel_region(input_, group=self.tp_group))
        if delta is None:
            return out, bias
        rank, size = self.tp_group.rank(), self.tp_group.size()
        return out + tp.shard_delta_cols(delta, adapter.fused, rank, size), bias


class ParityRowParallelLinear(_FrozenPack, _LoRAMixin, RowParallelLinear):
    def _forward_impl(self, input, weight, bias=None, *, allreduce_dgrad=False, tp_group=None, **kw):
        assert not allreduce_dgrad, "a row-parallel input is already sharded"
        return kernels.linear(input, weight, bias, k_splits=row_splits(self.config), packed=self.packed(weight))

    def forward(self, input_):
        if self.tp_group.size() == 1:
            return super().forward(input_)
        # TP: the rank's partial product, then the deterministic rank-ordered sum in place of
        # Megatron's backend all-reduce (parity.tp explains why).
        assert self.input_is_parallel and not self.sequence_parallel and self.bias is None
        # Backward is the local plain linear's, as for Megatron's all-reduce (identity): the
        # output is replicated, so is its gradient.
        forward = functools.partial(
            _rank_ordered_linear, k_splits=row_splits(self.config) // self.tp_group.size(), group=self.tp_group,
            packed=self.packed(self.weight),
        )
        out = InvariantLinear.apply(input_, self.weight, forward)
        adapter = self.active_adapter()
        if adapter is not None:
            # Replicated adapter on the full input (exact all-gather of the shards), added once.
            full = gather_from_tensor_model_parallel_region(input_, group=self.tp_group)
            delta = adapter.delta(full)
            if delta is not None:
                out = out + delta
        return out, None


class ParityRMSNorm(torch.nn.Module):
    """RMSNorm through parity.kernels.rms_norm; built as `cls(config=, hidden_size=, eps=)`."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)


class ParityCoreAttention(MegatronModule):
    """Core attention slot: RoPE plus causal GQA attention, both from parity.kernels.

    RoPE lives here (the model is built with position_embedding_type='none') so that the
    trainer applies the very same table and formula as the rollout model, after q/k norm.
    Megatron passes q [sq, b, np, d], k/v [sk, b, ng, d]; we return [sq, b, np * d].
    """

    def __init__(
        self, config: TransformerConfig, layer_number: int, attn_mask_type, attention_type: str,
        *, rope_theta: float, max_positions: int, **_,
    ):
        super().__init__(config=config)
        self.head_dim = config.kv_channels
        self.rope = kernels.rope_table(self.head_dim, rope_theta, max_positions)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params.cu_seqlens_q)
        # Sequences are right-padded (never left): causal attention keeps padding out of the
        # positions that are scored, so attention_mask is not needed.
        sq, b, nh, d = query.shape
        ng = key.shape[2]
        positions = torch.arange(sq).repeat(b)
        q = query.transpose(0, 1).reshape(b * sq, nh, d)
        k = key.transpose(0, 1).reshape(b * sq, ng, d)
        q = kernels.apply_rope(q, positions, self.rope)
        k = kernels.apply_rope(k, positions, self.rope).view(b, sq, ng, d)
        v = value.transpose(0, 1)
        seq = torch.arange(b).repeat_interleave(sq)
        out = kernels.attention(q, k, v, seq, positions, kernels.attention_scale(d))
        return out.view(b, sq, nh * d).transpose(0, 1)

    def _packed(self, query, key, value, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """THD: Megatron passes q [t, np, d], k/v [t, ng, d] of sequences packed end to end and
        takes [t, np * d] back. Each sequence's keys and values are laid out as its own row of
        kernels.attention's [R, L, ng, d] context: a query's arithmetic is the padded
        forward's (its own sequence's keys, blocks in order), so the bits are too."""
        t, nh, d = query.shape
        seq, positions = packed_positions(cu_seqlens.to(query.device))
        q = kernels.apply_rope(query, positions, self.rope)
        k = kernels.apply_rope(key, positions, self.rope)
        longest = int(cu_seqlens.diff().max())
        context = (cu_seqlens.numel() - 1, longest, *key.shape[1:])
        k_rows = k.new_zeros(context).index_put((seq, positions), k)
        v_rows = value.new_zeros(context).index_put((seq, positions), value)
        out = kernels.attention(q, k_rows, v_rows, seq, positions, kernels.attention_scale(d))
        return out.view(t, nh * d)


def packed_positions(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence index [N], position in its own sequence [N]) of each token of a packed row
    whose sequences start at cu_seqlens[:-1]."""
    counts = cu_seqlens.diff().long()
    seq = torch.repeat_interleave(torch.arange(counts.numel(), device=cu_seqlens.device), counts)
    return seq, torch.arange(int(cu_seqlens[-1]), device=cu_seqlens.device) - cu_seqlens[:-1].long()[seq]


def common_config(dtype: torch.dtype) -> dict:
    """TransformerConfig fields every kimi-rl model sets the same way (dense and kimi-mini)."""
    return dict(
        normalization="RMSNorm",
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=not torch.cuda.is_available(),
        # Fused CUDA paths do not exist on the CPU and would change numerics on the GPU.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )
