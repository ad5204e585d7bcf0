"""`ParityLlamaForCausalLM`: a vLLM out-of-tree Llama whose every numerically relevant op is a
`parity.kernels` call, in exactly the order the Megatron trainer runs them.

The model owns plain `nn.Parameter`s in the fused layouts of `parity.layouts` (QKV grouped per
KV head, [gate; up]), so vLLM never repacks them (its CPU linear layers hand the weights to
oneDNN) and both engines multiply by the same tensors. Attention goes through vLLM's
`Attention` layer (it owns the paged KV cache and the forward context) with the parity backend
of `rollout.attention`. No `support_torch_compile`: the model always runs eager.

Per layer (the trainer does exactly the same sequence):

    h = rms_norm(x, input_layernorm)
    q, k, v = split_qkv(linear(h, qkv))
    [qwen3: q = rms_norm(q, q_norm); k = rms_norm(k, k_norm)]
    q, k = apply_rope(q), apply_rope(k)
    x = x + linear(attention(q, k, v), o_proj)
    h = rms_norm(x, post_attention_layernorm)
    x = x + linear(silu_and_mul(linear(h, gate_up)), down_proj)

then `rms_norm(x, norm)`; `compute_logits` is `linear(x, lm_head)` in the model dtype (vLLM's
sampler turns it into log-probs with `log_softmax(dtype=float32)`, i.e. `kernels.log_softmax`).

LoRA. Each fused linear can hold an adapter (`set_adapter`, peft-named tensors in the model
dtype); so can each qwen3-moe expert's [gate; up] and down, under the checkpoint's per-expert
names (`mlp.experts.{e}.gate_proj` ...). Its output is then `linear(x, W) +
parity.lora.fused_delta(...)`, the very ops the trainer's `_LoRAMixin` runs, so log-probs stay
bitwise equal to the trainer with the adapter on. Without an adapter a linear runs only
`linear(x, W)`, the base path.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator

import torch
from torch import nn

from parity import kernels, layouts, moe, tp, weights
from parity.lora import (
    FUSED_PARTS,
    TARGETS,
    AdapterLayout,
    Pair,
    adapter_shapes,
    fused_delta,
    layer_linears,
    part_shapes,
    peft_key,
)
from parity.model_spec import ModelSpec
from rollout.attention import ParityAttentionBackend
from rollout.sync import PackedWeight, SyncedModel


class _Weight(nn.Module):
    """A module holding one plain parameter as `.weight` (keeps vLLM-style parameter names)."""

    def __init__(self, *shape: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class _FusedLinear(PackedWeight):
    """A fused linear ("qkv" | "o" | "gate_up" | "down"; `expert`: a qwen3-moe expert's) that
    can hold a LoRA adapter.

    The adapter's pairs are a plain dict attribute, not registered parameters or buffers:
    vLLM's in-place weight reload and its weight checksums walk the registered tensors, and an
    adapter is not part of the checkpoint.
    """

    def __init__(
        self, fused: str, spec: ModelSpec, dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1,
        expert: bool = False,
    ) -> None:
        shapes = part_shapes(spec, expert)
        parts = FUSED_PARTS[fused]
        out, fan_in = sum(shapes[n][1] for n in parts), shapes[parts[0]][0]
        if fused in tp.ROW_PARALLEL:
            fan_in //= tp_size
        else:
            out //= tp_size
        super().__init__(out, fan_in, dtype=dtype)
        self.fused = fused
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.out_features = {n: shapes[n][1] for n in parts}
        self.num_kv_heads = spec.num_kv_heads
        # This rank's K-slices. An expert (qwen3-moe: TP 1) runs one chain over the whole K,
        # as the trainer's expert linear does; the dense row-parallel layers keep row_splits.
        self.k_splits = 1 if expert else tp.fused_k_splits(spec, fused, tp_size)
        self.pairs: dict[str, Pair] = {}  # HF target -> (A [r, in], B [out, r]), model dtype
        self.scaling = 0.0

    def hold(self, pairs: dict[str, Pair], scaling: float) -> None:
        """Hold copies of `pairs` (only this linear's parts, already validated). A pair whose
        shapes match the held one is copied into the held tensors, so repeated syncs of the
        same adapter do not allocate. Copies, never references: in-process, the caller's
        tensors may be the trainer's live parameters."""
        held = {}
        for name, (a, b) in pairs.items():
            old = self.pairs.get(name)
            if old is not None and old[0].shape == a.shape and old[1].shape == b.shape:
                old[0].copy_(a)
                old[1].copy_(b)
                held[name] = old
            else:
                # on the weight's device: a sync arrives on the host
                held[name] = tuple(
                    t.to(self.weight.device, copy=True, memory_format=torch.contiguous_format) for t in (a, b)
                )
        self.pairs = held
        self.scaling = scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1 and self.fused in tp.ROW_PARALLEL:
            # The trainer's sum (trainer.megatron.layers._rank_ordered_linear): all-gather the fp32
            # partials of the rank's K-slices, add them in slice order in fp32, round once.
            from vllm.distributed import tensor_model_parallel_all_gather

            parts = kernels.linear_partials(x, self.weight, self.k_splits, packed=self.pack())
            out = tp.rank_ordered_sum(tensor_model_parallel_all_gather(parts, dim=0), x.dtype)
        else:
            out = kernels.linear(x, self.weight, k_splits=self.k_splits, packed=self.pack())
        if not self.pairs:
            return out
        # The adapter is replicated and sees the full input (parity/tp.py): a row-parallel
        # input's shards are all-gathered (exact), a column-parallel delta is sliced.
        if self.tp_size > 1 and self.fused in tp.ROW_PARALLEL:
            from vllm.distributed import tensor_model_parallel_all_gather

            x = tensor_model_parallel_all_gather(x.contiguous(), dim=-1)
        # Non-empty pairs cover a part of this linear, so the delta is never None here.
        delta = fused_delta(self.fused, x, self.pairs, self.scaling, self.out_features, self.num_kv_heads)
        if self.fused not in tp.ROW_PARALLEL:
            delta = tp.shard_delta_cols(delta, self.fused, self.tp_rank, self.tp_size)
        return out + delta


class ParityAttention(nn.Module):
    def __init__(
        self, spec: ModelSpec, dtype: torch.dtype, cache_config, prefix: str,
        tp_rank: int = 0, tp_size: int = 1,
    ) -> None:
        from vllm.model_executor.layers.attention import Attention

        super().__init__()
        self.spec = spec
        # This rank's heads: whole KV groups (parity/tp.py).
        d, hq, hkv = spec.head_dim, spec.num_heads // tp_size, spec.num_kv_heads // tp_size
        self.num_heads, self.num_kv_heads = hq, hkv
        self.qkv_proj = _FusedLinear("qkv", spec, dtype, tp_rank, tp_size)
        self.o_proj = _FusedLinear("o", spec, dtype, tp_rank, tp_size)
        if spec.qk_norm:
            self.q_norm = _Weight(d, dtype=dtype)
            self.k_norm = _Weight(d, dtype=dtype)
        self.rope = kernels.rope_table(d, spec.rope_theta, spec.max_position_embeddings)
        self.attn = Attention(
            hq,
            d,
            kernels.attention_scale(d),
            num_kv_heads=hkv,
            cache_config=cache_config,
            prefix=f"{prefix}.attn",
            attn_backend=ParityAttentionBackend,
        )

    def forward(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        s = self.spec
        q, k, v = layouts.split_qkv(self.qkv_proj(h), self.num_heads, self.num_kv_heads, s.head_dim)
        if s.qk_norm:
            q = kernels.rms_norm(q, self.q_norm.weight, s.rms_norm_eps)
            k = kernels.rms_norm(k, self.k_norm.weight, s.rms_norm_eps)
        q = kernels.apply_rope(q, positions, self.rope)
        k = kernels.apply_rope(k, positions, self.rope)
        o = self.attn(q.contiguous(), k.contiguous(), v.contiguous())  # [T, Hq * D]
        return self.o_proj(o)


class ParityMLP(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.gate_up_proj = _FusedLinear("gate_up", spec, dtype, tp_rank, tp_size)
        self.down_proj = _FusedLinear("down", spec, dtype, tp_rank, tp_size)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(h)))


class _Expert(nn.Module):
    """One expert: [gate; up] and down, each able to hold the expert's own adapter pairs (no
    TP: qwen3-moe runs at TP 1)."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = _FusedLinear("gate_up", spec, dtype, expert=True)
        self.down_proj = _FusedLinear("down", spec, dtype, expert=True)


class ParitySparseMoe(nn.Module):
    """Qwen3-MoE's sparse block: `gate` (the router, never adapted) and `experts.{e}`, through
    parity/moe.py (the routing and expert dispatch the trainer runs too). An expert with an
    adapter adds its delta to the rows routed to it: the delta is row-wise (the same parity
    kernels as a dense linear's), so a token's bits still depend on its own row alone."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.spec = spec
        self.gate = _Weight(spec.num_experts, spec.hidden_size, dtype=dtype)
        self.experts = nn.ModuleList(_Expert(spec, dtype) for _ in range(spec.num_experts))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        s = self.spec
        experts, weights = moe.softmax_route(self.gate.weight, h, s.num_experts_per_tok, s.norm_topk_prob)
        return moe.dispatch(self.experts, s.num_experts, h, experts, weights)


class ParityDecoderLayer(nn.Module):
    def __init__(
        self, spec: ModelSpec, dtype: torch.dtype, cache_config, prefix: str,
        tp_rank: int = 0, tp_size: int = 1, index: int = 0,
    ) -> None:
        super().__init__()
        self.eps = spec.rms_norm_eps
        self.input_layernorm = _Weight(spec.hidden_size, dtype=dtype)
        self.self_attn = ParityAttention(
            spec, dtype, cache_config, f"{prefix}.self_attn", tp_rank, tp_size
        )
        self.post_attention_layernorm = _Weight(spec.hidden_size, dtype=dtype)
        self.mlp = ParitySparseMoe(spec, dtype) if spec.is_moe_layer(index) else ParityMLP(spec, dtype, tp_rank, tp_size)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = kernels.rms_norm(x, self.input_layernorm.weight, self.eps)
        x = x + self.self_attn(positions, h)
        h = kernels.rms_norm(x, self.post_attention_layernorm.weight, self.eps)
        return x + self.mlp(h)


class ParityModel(nn.Module):
    def __init__(
        self, spec: ModelSpec, dtype: torch.dtype, cache_config, prefix: str,
        tp_rank: int = 0, tp_size: int = 1,
    ) -> None:
        super().__init__()
        self.spec = spec
        # Replicated under TP: a lookup is exact whichever rank holds the row.
        self.embed_tokens = PackedWeight(spec.vocab_size, spec.hidden_size, dtype=dtype)  # tied: the head
        self.layers = nn.ModuleList(
            ParityDecoderLayer(spec, dtype, cache_config, f"{prefix}.layers.{i}", tp_rank, tp_size, i)
            for i in range(spec.num_layers)
        )
        self.norm = _Weight(spec.hidden_size, dtype=dtype)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return kernels.embedding(input_ids, self.embed_tokens.weight)

    def forward(
        self, input_ids: torch.Tensor | None, positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        for layer in self.layers:
            x = layer(positions, x)
        return kernels.rms_norm(x, self.norm.weight, self.spec.rms_norm_eps)


# peft's LoRA names (parity.lora.peft_key): layer, expert (qwen3-moe's sparse layers), target,
# "A" | "B".
_PEFT_RE = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.\w+\.(?:experts\.(\d+)\.)?(\w+)\.lora_([AB])\.weight$"
)

# An adapter's pairs: {(layer, expert or None, HF target): (A, B)}.
Pairs = dict[tuple[int, int | None, str], Pair]


def _where(layer: int, expert: int | None, target: str) -> str:
    return f"layer {layer} " + (f"expert {expert} " if expert is not None else "") + target


def adapter_pairs(spec: ModelSpec, dtype: torch.dtype, tensors: dict[str, torch.Tensor], scaling: float) -> Pairs:
    """Check a LoRA adapter for a model (peft names, the model dtype, rank-r shapes, finite
    scaling; ValueError otherwise) and pair its tensors: {(layer, expert, target): (A, B)},
    expert None except for the MLP targets of a qwen3-moe sparse layer (one pair per expert)."""
    if not tensors:
        raise ValueError("empty adapter (clear_adapter removes one)")
    spec.check_lora_targets({m[3] for m in map(_PEFT_RE.match, tensors) if m is not None})
    if not math.isfinite(scaling):
        raise ValueError(f"scaling must be finite, got {scaling}")
    found: dict[tuple[int, int | None, str], dict[str, torch.Tensor]] = {}
    adaptable: dict[int, set[tuple[str, int | None]]] = {}  # per layer, made once (many experts)
    for name, tensor in tensors.items():
        m = _PEFT_RE.match(name)
        expert = None if m is None or m[2] is None else int(m[2])
        if m is None or m[3] not in TARGETS or peft_key(int(m[1]), m[3], m[4], expert) != name:
            raise ValueError(f"not a peft LoRA tensor name: {name!r}")
        layer, target, which = int(m[1]), m[3], m[4]
        if layer >= spec.num_layers:
            raise ValueError(f"{name}: the model has {spec.num_layers} layers")
        if layer not in adaptable:
            adaptable[layer] = {(t, e) for fused, e in layer_linears(spec, layer) for t in FUSED_PARTS[fused]}
        if (target, expert) not in adaptable[layer]:
            raise ValueError(f"{name}: {_layer_kind(spec, layer)}")
        if tensor.dtype != dtype:
            # A silent cast here could round differently from the trainer's: the caller sends
            # the tensors the trainer computes with (trainer.megatron.lora.rollout_tensors).
            raise ValueError(f"{name}: dtype {tensor.dtype}, the model computes in {dtype}")
        found.setdefault((layer, expert, target), {})[which] = tensor.detach()
    pairs = {}
    for (layer, expert, target), ab in found.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{_where(layer, expert, target)}: needs lora_A and lora_B, got {sorted(ab)}")
        a, b = ab["A"], ab["B"]
        fan_in, fan_out = part_shapes(spec, expert is not None)[target]
        if not (
            a.dim() == 2 and b.dim() == 2 and a.shape[0] == b.shape[1] > 0
            and a.shape[1] == fan_in and b.shape[0] == fan_out
        ):
            raise ValueError(
                f"{_where(layer, expert, target)}: A {tuple(a.shape)} and B {tuple(b.shape)} are not"
                f" [r, {fan_in}] and [{fan_out}, r]"
            )
        pairs[(layer, expert, target)] = (a, b)
    return pairs


def _layer_kind(spec: ModelSpec, layer: int) -> str:
    """Why an MLP module name does not fit `layer`: what its MLP's modules are."""
    if spec.is_moe_layer(layer):
        return f"layer {layer} is sparse: its MLP targets are per expert (experts 0..{spec.num_experts - 1})"
    return f"layer {layer} is dense: its MLP has no experts"


class ParityLlamaForCausalLM(nn.Module, SyncedModel):
    """vLLM model class registered as `KimiRLParityLlamaForCausalLM`."""

    # The HF architecture this class computes (the config's `architectures` names the parity
    # class once hf_overrides selects it).
    hf_architecture = "LlamaForCausalLM"

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        from vllm.distributed import (
            get_pp_group,
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        super().__init__()
        if get_pp_group().world_size != 1:
            raise NotImplementedError("the parity models run without pipeline parallelism")
        # Tensor parallelism: this worker holds rank tp_rank's shards in the trainer's layouts
        # (parity/tp.py); the caller always sends and receives full (TP=1-layout) tensors.
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        model_config = vllm_config.model_config
        config = model_config.hf_config.to_dict()
        config["architectures"] = [self.hf_architecture]
        self.spec = ModelSpec.from_hf_config(config)
        self._check_spec(self.spec)
        tp.check_tp(self.spec, self.tp_size)
        self.dtype = model_config.dtype
        self.config = model_config.hf_config
        prefix = f"{prefix}.model" if prefix else "model"
        self.model = ParityModel(
            self.spec, self.dtype, vllm_config.cache_config, prefix, self.tp_rank, self.tp_size
        )
        if not self.spec.tie_word_embeddings:
            self.lm_head = PackedWeight(
                tp.padded_vocab(self.spec.vocab_size, self.tp_size) // self.tp_size,
                self.spec.hidden_size, dtype=self.dtype,
            )
        self._shard_kinds = weights.shard_kinds(self.spec, "rollout")
        # RolloutEngine(adapter_layout=...) asks, through hf_overrides, for an adapter reserved
        # now: before vLLM captures its CUDA graphs (rollout/sync.py, reserve_adapter).
        layout = getattr(model_config.hf_config, "kimi_rl_adapter", None)
        if layout is not None:
            self.reserve_adapter(AdapterLayout.from_dict(layout))

    def _check_spec(self, spec: ModelSpec) -> None:
        if spec.qk_norm:
            raise ValueError(f"{type(self).__name__} computes Llama; got a {spec.arch} config")

    # --- vLLM model interface -----------------------------------------------------------

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
        **_,
    ) -> torch.Tensor:
        assert intermediate_tensors is None, "pipeline parallelism is not supported"
        return self.model(input_ids, positions, inputs_embeds)

    def output_head(self) -> PackedWeight:
        """The module whose weight computes the logits: the embedding when tied."""
        return self.model.embed_tokens if self.spec.tie_word_embeddings else self.lm_head

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        head = self.output_head()
        weight = head.weight
        if self.tp_size == 1:
            return kernels.linear(hidden_states, weight, packed=head.pack())
        # The trainer's vocab-parallel output layer: this rank's vocabulary rows (of the
        # replicated tied embedding, or the held lm_head shard), padded to the trainer's padded
        # vocabulary; logits all-gathered in rank order, the padded columns cut off before the
        # sampler sees them.
        # The rank's rows and their pack are kept between steps (dropped with the weights).
        from vllm.distributed import tensor_model_parallel_all_gather

        if self.spec.tie_word_embeddings:
            weight, packed = head.derived_pack(lambda w: tp.shard_vocab(w, self.tp_rank, self.tp_size))
        else:
            packed = head.pack()
        logits = tensor_model_parallel_all_gather(kernels.linear(hidden_states, weight, packed=packed), dim=-1)
        return logits[..., : self.spec.vocab_size]

    # --- tensor parallelism: full tensors <-> this rank's shards ------------------------------

    def _shard_kind(self, name: str) -> weights.Shard:
        return self._shard_kinds.get(name) if self.tp_size > 1 else None

    def _local(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a full (TP=1-layout) parameter tensor."""
        return weights.shard_tensor(full, self._shard_kind(name), self.tp_rank, self.tp_size)

    def _full_shape(self, name: str, param: torch.Tensor) -> tuple[int, ...]:
        kind = self._shard_kind(name)
        shape = list(param.shape)
        if kind in ("rows", "gate_up"):
            shape[0] *= self.tp_size
        elif kind == "vocab":
            shape[0] = self.spec.vocab_size
        elif kind == "cols":
            shape[1] *= self.tp_size
        return tuple(shape)

    def _full(self, name: str, param: torch.Tensor) -> torch.Tensor:
        """The full tensor of a held parameter (an exact all-gather of the ranks' shards; a
        collective: every worker runs it, as collective_rpc calls every worker)."""
        kind = self._shard_kind(name)
        if kind is None:
            return param
        from vllm.distributed import tensor_model_parallel_all_gather

        parts = list(tensor_model_parallel_all_gather(param.detach().unsqueeze(0), dim=0))
        return weights.unshard_tensor(parts, kind, self.spec.vocab_size)

    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """named_parameters() with every shard gathered back to the full tensor."""
        for name, param in self.named_parameters():
            yield name, self._full(name, param)

    # --- LoRA (the sync itself: rollout/sync.py) --------------------------------------------

    def _fused_linears(self) -> Iterator[tuple[int, int | None, _FusedLinear]]:
        """(layer, expert, linear) in parity.lora.layer_linears order (expert None: not an expert's)."""
        for i, layer in enumerate(self.model.layers):
            yield i, None, layer.self_attn.qkv_proj
            yield i, None, layer.self_attn.o_proj
            if isinstance(layer.mlp, ParityMLP):
                yield i, None, layer.mlp.gate_up_proj
                yield i, None, layer.mlp.down_proj
                continue
            for e, expert in enumerate(layer.mlp.experts):
                yield i, e, expert.gate_up_proj
                yield i, e, expert.down_proj

    def _adapter_pairs(self, tensors: dict[str, torch.Tensor], scaling: float):
        return adapter_pairs(self.spec, self.dtype, tensors, scaling)

    def _adapter_shapes(self, layout: AdapterLayout) -> dict[str, tuple[int, ...]]:
        self.spec.check_lora_targets(layout.targets)
        return adapter_shapes(self.spec, layout)

    def _adapter_linears(self) -> Iterator[_FusedLinear]:
        return (linear for *_, linear in self._fused_linears())

    def _hold(self, pairs: Pairs, scaling: float, *, copy: bool) -> None:
        by_linear: dict[tuple[int, int | None], dict[str, Pair]] = {}
        for (layer, expert, target), pair in pairs.items():
            by_linear.setdefault((layer, expert), {})[target] = pair
        for i, e, linear in self._fused_linears():
            mine = {t: p for t, p in by_linear.get((i, e), {}).items() if t in linear.out_features}
            if copy:
                linear.hold(mine, scaling)
            else:
                linear.pairs, linear.scaling = mine, scaling

    def _held(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, e, linear in self._fused_linears():
            for target, pair in linear.pairs.items():
                for which, tensor in zip("AB", pair, strict=True):
                    yield peft_key(i, target, which, e), tensor
