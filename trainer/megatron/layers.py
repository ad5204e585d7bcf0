"""Megatron-core modules whose arithmetic is the parity kernels.

Each class subclasses or mirrors the Megatron module it replaces and changes only the math:
the tensor-parallel plumbing (region copies, gathers, all-reduces) stays Megatron's, except
under parity.autograd.ordered_backward (the trainer's deterministic_layout), where the parity
linears build one autograd graph at every TP size and compute every input gradient in an order
fixed by the model (`row_splits` slices of the output features, partials added in slice order,
as the row-parallel forward does), so TP = 1 and TP = N train the same bits.
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
from parity.autograd import InvariantLinear, ordered


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

    _dgrad_pack: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def dgrad_operand(self, weight: torch.Tensor, arrange) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`arrange(weight)` (the weight laid out as the input gradient's product takes it,
        [K, N']) and its pack, for `kernels.linear(grad, operand, packed=pack)`. A frozen
        weight's are kept from its first backward on (it is never written again, as for
        `packed`): the operand is then a zero-stride stand-in, which the GEMM reads only for
        its shape and dtype, so only the pack is held. A trainable weight's are made per call."""
        held = self._dgrad_pack
        if held is not None and held[0] is weight and not weight.requires_grad:
            return held[1], held[2]
        arranged = arrange(weight.detach()).contiguous()
        packed = kernels.pack(arranged)
        if not weight.requires_grad and packed is not None:
            self._dgrad_pack = (weight, arranged.new_zeros(()).expand(arranged.shape), packed)
        return arranged, packed


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


def _ordered_here(x: torch.Tensor) -> bool:
    """A forward whose backward is ordered (parity.autograd.ordered_backward; the CPU kernels)."""
    return ordered() and torch.is_grad_enabled() and not x.is_cuda


def _ordered_product(
    x: torch.Tensor, weight: torch.Tensor, splits: int, group, packed: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ weight.T with K cut into `splits` equal slices (fixed by the model), each one fp32
    FMA chain, their partials added in slice order in fp32 and rounded once: inside the GEMM at
    TP = 1, across the ranks (each holding splits / N consecutive slices) by
    _rank_ordered_linear at TP = N. The same bits at every TP size."""
    if group.size() == 1:
        return kernels.linear(x, weight, k_splits=splits, packed=packed)
    return _rank_ordered_linear(x, weight, splits // group.size(), group, packed)


def _dgrad_columns(t: torch.Tensor, slices: int, glu: bool) -> torch.Tensor:
    """A column-parallel layer's local output features (t's last dim) in the order its input
    gradient sums them: `slices` equal slices, for [gate; up] slice j being gate chunk j then
    up chunk j (so a rank's [gate_r; up_r] holds whole slices of the TP = 1 order), zero-padded
    at the end to a multiple of `slices` (a vocabulary that does not split evenly: zero terms
    leave an FMA chain's sum as it is)."""
    if glu:
        t = t.unflatten(-1, (2, slices, -1)).transpose(-3, -2).flatten(-3)
    pad = -t.shape[-1] % slices
    return torch.nn.functional.pad(t, (0, pad)) if pad else t


class _ShardColumns(torch.autograd.Function):
    """A replicated adapter's full delta -> this rank's columns of it (tp.shard_delta_cols).
    Backward: every rank's column gradients all-gathered (a copy) into the full layout, so each
    rank holds the whole delta's gradient and computes the adapter's gradients and its input
    gradient whole, as TP = 1 does, instead of summing per-rank shares across ranks."""

    @staticmethod
    def forward(ctx, delta, fused, group):
        ctx.fused, ctx.group = fused, group
        if group.size() == 1:
            return delta.clone()
        return tp.shard_delta_cols(delta, fused, group.rank(), group.size())

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        if ctx.group.size() == 1:
            return grad, None, None
        grad = grad.contiguous()
        parts = [torch.empty_like(grad) for _ in range(ctx.group.size())]
        dist.all_gather(parts, grad, group=ctx.group)
        return tp.unshard_delta_cols(parts, ctx.fused), None, None


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
    glu = False  # output features [gate; up] (ParityGateUpLinear)

    def _forward_impl(self, input, weight, bias=None, *, allreduce_dgrad=False, tp_group=None, **kw):
        return _parity_linear(input, weight, bias, allreduce_dgrad, tp_group, packed=self.packed(weight))

    def forward(self, input_, *args, **kwargs):
        if _ordered_here(input_):
            return self._ordered_forward(input_, *args, **kwargs)
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

    def _ordered_forward(self, input_, weight=None, runtime_gather_output=None):
        """The forward's bits, in one graph at every TP size (no region copy, whose backward
        all-reduces): the base's input gradient from _ordered_dgrad, the adapter's delta on the
        full input with its gradient gathered whole on every rank (_ShardColumns)."""
        assert self.bias is None and not self.sequence_parallel
        weight = self.weight if weight is None else weight
        out = kernels.linear(input_, weight, packed=self.packed(weight), input_grad=self._ordered_dgrad)
        adapter = self.active_adapter()
        delta = adapter.delta(input_) if adapter is not None else None
        if delta is not None:
            out = out + _ShardColumns.apply(delta, adapter.fused, self.tp_group)
        if self.gather_output if runtime_gather_output is None else runtime_gather_output:
            out = gather_from_tensor_model_parallel_region(out, group=self.tp_group)
        return out, None

    def _ordered_dgrad(self, grad_out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """grad_out @ weight, a sum over the output features: in `row_splits` slices of the
        TP = 1 layout (_dgrad_columns), a rank's slices computed here, every slice's fp32
        partial added in slice order across the ranks (_ordered_product). Nothing in the order
        depends on the TP size."""
        splits = row_splits(self.config)
        local = splits // self.tp_group.size()
        operand, packed = self.dgrad_operand(weight, lambda w: _dgrad_columns(w.t(), local, self.glu))
        return _ordered_product(_dgrad_columns(grad_out, local, self.glu), operand, splits, self.tp_group, packed)


class ParityGateUpLinear(ParityColumnParallelLinear):
    """linear_fc1 of the MLP: output features [gate; up], a rank's [gate_r; up_r]."""

    glu = True


class ParityRowParallelLinear(_FrozenPack, _LoRAMixin, RowParallelLinear):
    def _forward_impl(self, input, weight, bias=None, *, allreduce_dgrad=False, tp_group=None, **kw):
        assert not allreduce_dgrad, "a row-parallel input is already sharded"
        return kernels.linear(input, weight, bias, k_splits=row_splits(self.config), packed=self.packed(weight))

    def forward(self, input_):
        if _ordered_here(input_):
            return self._ordered_forward(input_)
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

    def _ordered_forward(self, input_):
        """The forward's bits, in one graph at every TP size, with the input gradient of
        _ordered_dgrad; the adapter as in `forward`, its gradients whole on every rank (the
        output, hence its gradient, is replicated)."""
        assert self.input_is_parallel and not self.sequence_parallel and self.bias is None
        forward = functools.partial(_ordered_product, splits=row_splits(self.config), group=self.tp_group,
                                    packed=self.packed(self.weight))
        out = InvariantLinear.apply(input_, self.weight, forward, self._ordered_dgrad)
        adapter = self.active_adapter()
        if adapter is not None:
            delta = adapter.delta(gather_from_tensor_model_parallel_region(input_, group=self.tp_group))
            if delta is not None:
                out = out + delta
        return out, None

    def _ordered_dgrad(self, grad_out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """grad_out @ weight, a sum over the (replicated) output features: one FMA chain per
        element through the compiled GEMM, the same chain whatever input columns the rank
        holds."""
        operand, packed = self.dgrad_operand(weight, lambda w: w.t())
        return kernels.linear(grad_out, operand, packed=packed)


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
