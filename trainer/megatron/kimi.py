"""Kimi Linear (and so kimi-mini, a set of its presets) on Megatron-core: a GPTModel whose layer
spec plugs in KDA / MLA mixers and a MoE (or, in the first first_k_dense_replace layers, a dense
SwiGLU) feed-forward that compute through parity/kimi.py, the functions the vLLM rollout calls too.

Every layer is a stock `TransformerLayer` (norms, residual adds and the embedding / final norm /
tied output layer are Megatron's, with the parity norm and linear as in trainer/model.py); only
the attention and MLP slots are ours. They take Megatron's [s, b, h], flatten it batch-major to
the rollout's token layout (each sequence whole, from position 0), call the shared function and
return `(out, None)`. Right padding only appends tokens after a sequence's own, and every piece
of the math is causal and row-wise invariant, so padding never changes a real token's bits.

Parameters carry Megatron-style names (`linear_q_proj`, `linear_kv_down_proj`, `mlp.router`,
`mlp.experts.local_experts.{e}.linear_fc1` ...); read-only properties expose them under the
names parity/kimi.py expects (`q_proj`, `kv_a_proj_with_mqa`, `gate`, `experts[e].gate_up_proj`
...), so both hold without a second registration of any parameter.

LoRA: each linear knows its HF module path and its parts (`parity.kimi.lora_linears`); an
adapter slot holds fp32 A/B per covered part, and the forward is `parity.kimi.adapted_linear`
with the pairs cast to the model dtype, exactly the rollout's call. Tensor parallelism: TP=1 only.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from megatron.core import parallel_state
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from parity import kimi
from parity.model_spec import KimiSpec
from trainer.megatron.layers import (
    ParityColumnParallelLinear,
    ParityRMSNorm,
    _FrozenPack,
    _LoRAMixin,
    common_config,
)
from trainer.megatron.patches import cpu_current_device

Parts = tuple[tuple[str, int], ...]


@dataclass
class KimiTransformerConfig(TransformerConfig):
    """TransformerConfig plus the Kimi spec, which every mixer / MoE module reads (as
    MLATransformerConfig carries MLA's extra fields)."""

    kimi_spec: KimiSpec | None = None


def kimi_transformer_config(spec: KimiSpec, dtype: torch.dtype) -> KimiTransformerConfig:
    return KimiTransformerConfig(
        kimi_spec=spec,
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.moe_intermediate_size,
        num_attention_heads=spec.num_attention_heads,
        layernorm_epsilon=spec.rms_norm_eps,
        tensor_model_parallel_size=1,
        **common_config(dtype),
    )


# --- building blocks ------------------------------------------------------------------------------


class KimiLinear(_FrozenPack, _LoRAMixin, torch.nn.Module):
    """A bias-free linear whose forward is `parity.kimi.adapted_linear`, plus adapter slots
    (trainer.megatron.layers._LoRAMixin semantics: `lora` ModuleDict, `lora_active` slot name).

    `hf_path` is the HF module path (fused expert linears: `...gate_up_proj`) and `parts` the
    (HF module path, out size) row blocks of the weight, as `parity.kimi.lora_linears` gives them.
    """

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype):
        super().__init__()
        # Zeros: every weight is overwritten by the checkpoint (load_model checks it strictly).
        self.weight = torch.nn.Parameter(torch.zeros(out_features, in_features, dtype=dtype))
        self.hf_path = ""
        self.parts: Parts = ()

    def set_path(self, hf_path: str, parts: Parts | None = None) -> None:
        self.hf_path = hf_path
        self.parts = parts if parts is not None else ((hf_path, self.weight.shape[0]),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        adapter = self.active_adapter()
        packed = self.packed(self.weight)
        if adapter is None:
            return kimi.adapted_linear(x, self.weight, self.parts, {}, 0.0, packed)
        return kimi.adapted_linear(x, self.weight, self.parts, adapter.pairs(self.weight.dtype), adapter.scaling,
                                   packed)


class _Weight(torch.nn.Module):
    """A bare `.weight` holder (norm weights, the depthwise conv, the router)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, fill: float = 0.0):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full(shape, fill, dtype=dtype))


def _spec(config: TransformerConfig) -> KimiSpec:
    spec = getattr(config, "kimi_spec", None)
    if spec is None:
        raise ValueError("Kimi modules need a KimiTransformerConfig (kimi_transformer_config)")
    return spec


def _flat(hidden_states: torch.Tensor) -> torch.Tensor:
    """[s, b, h] -> [b * s, h]: tokens grouped per sequence, batch-major (the rollout's layout)."""
    s, b, h = hidden_states.shape
    return hidden_states.transpose(0, 1).reshape(b * s, h)


def _unflat(out: torch.Tensor, s: int, b: int) -> torch.Tensor:
    return out.view(b, s, -1).transpose(0, 1)


@functools.lru_cache(maxsize=8)
def _lora_parts(spec: KimiSpec) -> dict[str, tuple[int, Parts]]:
    # Every layer's modules look their parts up here: build the table once per spec.
    return kimi.lora_linears(spec)


# --- mixers ---------------------------------------------------------------------------------------


class KimiKDA(MegatronModule):
    """KDA (gated delta-rule linear attention) in the self_attention slot."""

    def __init__(self, config: TransformerConfig, layer_number: int, **_):
        super().__init__(config=config)
        spec = self.spec = _spec(config)
        h, nh, d, dt = spec.hidden_size, spec.kda_num_heads, spec.kda_head_dim, config.params_dtype
        self.layer_index = layer_number - 1
        self.linear_q_proj = KimiLinear(h, nh * d, dt)
        self.linear_k_proj = KimiLinear(h, nh * d, dt)
        self.linear_v_proj = KimiLinear(h, nh * d, dt)
        self.linear_f_a_proj = KimiLinear(h, d, dt)
        self.linear_f_b_proj = KimiLinear(d, nh * d, dt)
        self.linear_b_proj = KimiLinear(h, nh, dt)
        self.linear_g_a_proj = KimiLinear(h, spec.gate_rank, dt)  # the low-rank output gate
        self.linear_g_b_proj = KimiLinear(spec.gate_rank, nh * d, dt)
        self.linear_proj = KimiLinear(nh * d, h, dt)
        self.conv1d = _Weight((spec.kda_conv_channels, spec.kda_conv_size), dt)
        self.dt_bias = torch.nn.Parameter(torch.zeros(nh * d, dtype=dt))
        self.A_log = torch.nn.Parameter(torch.zeros((1, 1, nh, 1), dtype=dt))
        self.o_norm = _Weight((d,), dt, 1.0)
        prefix, parts = f"model.layers.{self.layer_index}.self_attn.", _lora_parts(spec)
        for name, hf in _KDA_LINEARS.items():
            path = prefix + hf
            getattr(self, name).set_path(path, parts[path][1] if path in parts else None)

    # parity/kimi.py's names for the same modules
    q_proj = property(lambda self: self.linear_q_proj)
    k_proj = property(lambda self: self.linear_k_proj)
    v_proj = property(lambda self: self.linear_v_proj)
    f_a_proj = property(lambda self: self.linear_f_a_proj)
    f_b_proj = property(lambda self: self.linear_f_b_proj)
    b_proj = property(lambda self: self.linear_b_proj)
    g_a_proj = property(lambda self: self.linear_g_a_proj)
    g_b_proj = property(lambda self: self.linear_g_b_proj)
    o_proj = property(lambda self: self.linear_proj)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, **_) -> tuple[torch.Tensor, None]:
        spec, (s, b, _h) = self.spec, hidden_states.shape
        # Every sequence starts from position 0: zero conv window and zero recurrent state.
        conv_state = torch.zeros(b, spec.kda_conv_size - 1, spec.kda_conv_channels, device=hidden_states.device)
        state = torch.zeros(b, spec.kda_num_heads, spec.kda_head_dim, spec.kda_head_dim,
                            device=hidden_states.device)
        out, _, _ = kimi.kda_mixer(self, spec, _flat(hidden_states), [s] * b, conv_state, state)
        return _unflat(out, s, b), None


_KDA_LINEARS = {
    "linear_q_proj": "q_proj", "linear_k_proj": "k_proj", "linear_v_proj": "v_proj",
    "linear_f_a_proj": "f_a_proj", "linear_f_b_proj": "f_b_proj", "linear_b_proj": "b_proj",
    "linear_g_a_proj": "g_a_proj", "linear_g_b_proj": "g_b_proj", "linear_proj": "o_proj",
}


class KimiIndexer(torch.nn.Module):
    """The sparse-attention indexer's projections (index queries, the shared index key, head
    weights): DeepSeek-V3.2's, queries from the query latent (wq_b) and a LayerNorm (weight +
    bias) on the index key; with index_query_source "hidden" old kimi-mini's (wq on h)."""

    def __init__(self, spec: KimiSpec, dtype: torch.dtype):
        super().__init__()
        h, width = spec.hidden_size, spec.index_n_heads * spec.index_head_dim
        if spec.index_query_source == "latent":
            self.linear_wq_b = KimiLinear(spec.q_lora_rank, width, dtype)
            self.k_norm = _Weight((spec.index_head_dim,), dtype, 1.0)
            self.k_norm.bias = torch.nn.Parameter(torch.zeros(spec.index_head_dim, dtype=dtype))
        else:
            self.linear_wq = KimiLinear(h, width, dtype)
        self.linear_wk = KimiLinear(h, spec.index_head_dim, dtype)
        self.linear_weights_proj = KimiLinear(h, spec.index_n_heads, dtype)

    wq = property(lambda self: self.linear_wq)
    wq_b = property(lambda self: self.linear_wq_b)
    wk = property(lambda self: self.linear_wk)
    weights_proj = property(lambda self: self.linear_weights_proj)


class KimiMLA(MegatronModule):
    """MLA (non-absorbed) over the keys the indexer selects, in the self_attention slot."""

    def __init__(self, config: TransformerConfig, layer_number: int, **_):
        super().__init__(config=config)
        spec = self.spec = _spec(config)
        h, hm, dt = spec.hidden_size, spec.num_attention_heads, config.params_dtype
        self.layer_index = layer_number - 1
        if spec.q_lora_rank:
            self.linear_q_down_proj = KimiLinear(h, spec.q_lora_rank, dt)
            self.q_layernorm = _Weight((spec.q_lora_rank,), dt, 1.0)
            self.linear_q_up_proj = KimiLinear(spec.q_lora_rank, hm * spec.qk_head_dim, dt)
        else:
            self.linear_q_proj = KimiLinear(h, hm * spec.qk_head_dim, dt)
        self.linear_kv_down_proj = KimiLinear(h, spec.kv_lora_rank + spec.qk_rope_head_dim, dt)
        self.kv_layernorm = _Weight((spec.kv_lora_rank,), dt, 1.0)
        self.linear_kv_up_proj = KimiLinear(spec.kv_lora_rank, hm * (spec.qk_nope_head_dim + spec.v_head_dim), dt)
        self.linear_proj = KimiLinear(hm * spec.v_head_dim, h, dt)
        if spec.mla_output_gate:
            self.linear_g_proj = KimiLinear(h, hm * spec.v_head_dim, dt)
        if spec.has_indexer:
            self.indexer = KimiIndexer(spec, dt)
        prefix, parts = f"model.layers.{self.layer_index}.self_attn.", _lora_parts(spec)
        for name, hf in _MLA_LINEARS.items():
            try:
                module = self.get_submodule(name)
            except AttributeError:  # a linear this format does not have
                continue
            path = prefix + hf
            module.set_path(path, parts[path][1] if path in parts else None)
        self.trace: dict[str, torch.Tensor] | None = None  # see routing_trace

    q_proj = property(lambda self: self.linear_q_proj)
    q_a_proj = property(lambda self: self.linear_q_down_proj)
    q_a_layernorm = property(lambda self: self.q_layernorm)
    q_b_proj = property(lambda self: self.linear_q_up_proj)
    g_proj = property(lambda self: self.linear_g_proj)
    kv_a_proj_with_mqa = property(lambda self: self.linear_kv_down_proj)
    kv_a_layernorm = property(lambda self: self.kv_layernorm)
    kv_b_proj = property(lambda self: self.linear_kv_up_proj)
    o_proj = property(lambda self: self.linear_proj)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, **_) -> tuple[torch.Tensor, None]:
        spec, (s, b, _h) = self.spec, hidden_states.shape
        device = hidden_states.device
        positions = torch.arange(s, device=device).repeat(b)
        q_seq = torch.arange(b, device=device).repeat_interleave(s)
        h = _flat(hidden_states)
        q, entry, index_q, index_w = kimi.mla_entries(self, spec, h, positions)
        ctx, gate = entry.view(b, s, -1), kimi.mla_gate(self, spec, h)
        if not spec.has_indexer:  # every earlier key
            return _unflat(kimi.mla_attend_full(self, spec, q, ctx, q_seq, positions, gate), s, b), None
        # Top-k is discrete: no gradient reaches the indexer through it, so skip its graph.
        with torch.no_grad():
            selected, count = kimi.indexer_topk(
                spec, index_q, index_w, ctx[..., -spec.index_head_dim :], q_seq, positions
            )
        if self.trace is not None:
            self.trace["selected"] = selected
        out = kimi.mla_attend(self, spec, q, ctx, q_seq, selected, count, gate)
        return _unflat(out, s, b), None


_MLA_LINEARS = {
    "linear_q_proj": "q_proj", "linear_kv_down_proj": "kv_a_proj_with_mqa",
    "linear_q_down_proj": "q_a_proj", "linear_q_up_proj": "q_b_proj", "linear_g_proj": "g_proj",
    "linear_kv_up_proj": "kv_b_proj", "linear_proj": "o_proj",
    "indexer.linear_wq": "indexer.wq", "indexer.linear_wq_b": "indexer.wq_b", "indexer.linear_wk": "indexer.wk",
    "indexer.linear_weights_proj": "indexer.weights_proj",
}


# --- MoE ------------------------------------------------------------------------------------------


class KimiExpert(torch.nn.Module):
    """One SwiGLU expert: linear_fc1 = [gate; up] fused, linear_fc2 = down."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype):
        super().__init__()
        self.linear_fc1 = KimiLinear(hidden, 2 * inter, dtype)
        self.linear_fc2 = KimiLinear(inter, hidden, dtype)

    gate_up_proj = property(lambda self: self.linear_fc1)
    down_proj = property(lambda self: self.linear_fc2)

    def set_paths(self, prefix: str, parts: dict[str, tuple[int, Parts]], down: str = "down_proj") -> None:
        _set_swiglu_paths(self, prefix, parts, down)


def _set_swiglu_paths(module, prefix: str, parts: dict[str, tuple[int, Parts]], down: str = "down_proj") -> None:
    """HF module paths of a SwiGLU's linear_fc1 / linear_fc2: `{prefix}gate_up_proj` (fused) and
    `{prefix}{down}` (routed experts: w2)."""
    module.linear_fc1.set_path(prefix + "gate_up_proj", parts[prefix + "gate_up_proj"][1])
    module.linear_fc2.set_path(prefix + down, parts[prefix + down][1])


class KimiExperts(torch.nn.Module):
    """The routed experts, `local_experts.{e}` as Megatron's SequentialMLP names them;
    indexable (`experts[e]`) as parity.kimi.moe reads them."""

    def __init__(self, spec: KimiSpec, dtype: torch.dtype):
        super().__init__()
        self.local_experts = torch.nn.ModuleList(
            KimiExpert(spec.hidden_size, spec.moe_intermediate_size, dtype) for _ in range(spec.n_routed_experts)
        )

    def __getitem__(self, e: int) -> KimiExpert:
        return self.local_experts[e]


class KimiMoE(MegatronModule):
    """Router + routed experts + shared expert, in the mlp slot, through parity.kimi.moe."""

    def __init__(self, config: TransformerConfig, **_):
        super().__init__(config=config)
        spec = self.spec = _spec(config)
        dt = config.params_dtype
        self.router = _Weight((spec.n_routed_experts, spec.hidden_size), dt)
        # added to the router's scores for the choice of experts only
        self.router.e_score_correction_bias = torch.nn.Parameter(torch.zeros(spec.n_routed_experts, dtype=dt))
        self.experts = KimiExperts(spec, dt)
        if spec.n_shared_experts:
            self.shared_experts = KimiExpert(spec.hidden_size, spec.shared_intermediate_size, dt)
        self.layer_index = -1
        self.trace: dict[str, torch.Tensor] | None = None  # see routing_trace

    gate = property(lambda self: self.router)

    def set_layer_number(self, layer_number: int) -> None:
        """TransformerLayer calls this right after building the mlp slot (which gets no layer
        number): the HF paths of the expert linears name their layer."""
        self.layer_index = layer_number - 1
        prefix, parts = f"model.layers.{self.layer_index}.block_sparse_moe.", _lora_parts(self.spec)
        for e, expert in enumerate(self.experts.local_experts):
            expert.set_paths(f"{prefix}experts.{e}.", parts, "w2")
        if self.spec.n_shared_experts:
            self.shared_experts.set_paths(f"{prefix}shared_experts.", parts)

    def forward(self, hidden_states: torch.Tensor, **_) -> tuple[torch.Tensor, None]:
        s, b, _h = hidden_states.shape
        out, experts = kimi.moe(self, self.spec, _flat(hidden_states))
        if self.trace is not None:
            self.trace["experts"] = experts
        return _unflat(out, s, b), None


class KimiDenseMLP(MegatronModule):
    """A dense SwiGLU MLP in the mlp slot (the first first_k_dense_replace layers)."""

    def __init__(self, config: TransformerConfig, **_):
        super().__init__(config=config)
        spec = self.spec = _spec(config)
        dt = config.params_dtype
        self.linear_fc1 = KimiLinear(spec.hidden_size, 2 * spec.intermediate_size, dt)
        self.linear_fc2 = KimiLinear(spec.intermediate_size, spec.hidden_size, dt)

    gate_up_proj = property(lambda self: self.linear_fc1)
    down_proj = property(lambda self: self.linear_fc2)

    def set_layer_number(self, layer_number: int) -> None:
        """As KimiMoE.set_layer_number: the HF paths name the layer."""
        prefix = f"model.layers.{layer_number - 1}.mlp."
        _set_swiglu_paths(self, prefix, _lora_parts(self.spec))

    def forward(self, hidden_states: torch.Tensor, **_) -> tuple[torch.Tensor, None]:
        s, b, _h = hidden_states.shape
        return _unflat(kimi.dense_mlp(self, _flat(hidden_states)), s, b), None


# --- the model ------------------------------------------------------------------------------------


def kimi_block_spec(spec: KimiSpec) -> TransformerBlockSubmodules:
    """Per-layer TransformerLayer specs: KDA or MLA mixer by `spec.layer_types`, MoE (or in the
    first first_k_dense_replace layers a dense MLP)."""
    mixers = {"kda": KimiKDA, "mla": KimiMLA}
    layers = [
        ModuleSpec(
            module=TransformerLayer,
            submodules=TransformerLayerSubmodules(
                input_layernorm=ParityRMSNorm,
                self_attention=mixers[kind],
                self_attn_bda=get_bias_dropout_add,
                pre_mlp_layernorm=ParityRMSNorm,
                # A bare class, not a ModuleSpec: TransformerLayer then passes only the config
                # (the spec comes through it) and logs no "unknown MLP type" warning.
                mlp=KimiMoE if spec.is_moe_layer(i) else KimiDenseMLP,
                mlp_bda=get_bias_dropout_add,
            ),
        )
        for i, kind in enumerate(spec.layer_types)
    ]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=ParityRMSNorm)


def build_kimi_gpt(spec: KimiSpec, dtype: torch.dtype, tp_size: int = 1) -> GPTModel:
    """The Kimi GPTModel (parity kernels only); weights are placeholders until loaded."""
    if tp_size != 1 or (
        parallel_state.model_parallel_is_initialized()
        and parallel_state.get_tensor_model_parallel_world_size() != 1
    ):
        raise ValueError("the Kimi architectures support tensor parallel size 1 only on the trainer")
    config = kimi_transformer_config(spec, dtype)
    with cpu_current_device():
        model = GPTModel(
            config=config, transformer_layer_spec=kimi_block_spec(spec), vocab_size=spec.vocab_size,
            max_sequence_length=spec.max_position_embeddings, position_embedding_type="none",
            share_embeddings_and_output_weights=spec.tie_word_embeddings, parallel_output=False,
        )
    # As in trainer.megatron.model.build_gpt: the hard-coded output layer computes through kernels.linear.
    model.output_layer.__class__ = ParityColumnParallelLinear
    model.kimi_spec = spec
    return model


def is_kimi(model: torch.nn.Module) -> bool:
    return isinstance(getattr(model, "kimi_spec", None), KimiSpec)


# --- LoRA -----------------------------------------------------------------------------------------


class KimiLoRAAdapter(torch.nn.Module):
    """fp32 A [r, in] / B [out, r] per part of one KimiLinear that `targets` cover, keyed by
    the part's target name (q_proj, gate_proj, ...); `paths` maps those to HF module paths."""

    def __init__(self, linear: KimiLinear, targets: list[str], rank: int, alpha: float):
        super().__init__()
        self.scaling = alpha / rank
        fan_in = linear.weight.shape[1]
        self.paths = {p.rsplit(".", 1)[-1]: p for p, _ in linear.parts if p.rsplit(".", 1)[-1] in targets}
        self.names = list(self.paths)
        sizes = dict(linear.parts)
        self.lora_A = torch.nn.ParameterDict()
        self.lora_B = torch.nn.ParameterDict()
        for name, path in self.paths.items():
            a = torch.empty(rank, fan_in)
            torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # peft's default init
            self.lora_A[name] = torch.nn.Parameter(a)
            self.lora_B[name] = torch.nn.Parameter(torch.zeros(sizes[path], rank))

    def pairs(self, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """{HF part path: (A, B)} cast to the model dtype, as parity.kimi.adapted_linear takes them."""
        return {self.paths[n]: (self.lora_A[n].to(dtype), self.lora_B[n].to(dtype)) for n in self.names}

    def peft_key(self, name: str, which: str) -> str:
        return kimi.peft_name(self.paths[name], which)


def adaptable_linears(model: GPTModel, targets: list[str]) -> Iterator[tuple[int, KimiLinear]]:
    """(layer index, linear) for every linear with a part among `targets`, in module order."""
    unknown = sorted(set(targets) - set(kimi.LORA_TARGETS))
    if unknown:
        raise ValueError(f"Kimi LoRA targets must be among {kimi.LORA_TARGETS}, got {unknown}")
    adaptable = kimi.lora_linears(model.kimi_spec)
    for i, layer in enumerate(model.decoder.layers):
        for module in layer.modules():
            if isinstance(module, KimiLinear) and module.hf_path in adaptable:
                if any(p.rsplit(".", 1)[-1] in targets for p, _ in module.parts):
                    yield i, module


def lora_linears_of(model: GPTModel) -> Iterator[tuple[int, KimiLinear]]:
    """(layer index, linear) for every KimiLinear with adapters attached."""
    for i, layer in enumerate(model.decoder.layers):
        for module in layer.modules():
            if isinstance(module, KimiLinear) and getattr(module, "lora", None) is not None:
                yield i, module


# --- tracing --------------------------------------------------------------------------------------


@contextlib.contextmanager
def _tracing(model: GPTModel) -> Iterator[list[tuple[int, str, torch.nn.Module]]]:
    modules = []
    for i, layer in enumerate(model.decoder.layers):
        if isinstance(layer.self_attention, KimiMLA) and layer.self_attention.spec.has_indexer:
            modules.append((i, "self_attn.selected", layer.self_attention))
        if isinstance(layer.mlp, KimiMoE):
            modules.append((i, "mlp.experts", layer.mlp))
    for _, _, m in modules:
        m.trace = {}
    try:
        yield modules
    finally:
        for _, _, m in modules:
            m.trace = None


@torch.no_grad()
def routing_trace(model: GPTModel, input_ids: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """The discrete choices of a forward over right-padded input_ids [B, S], per sequence:
    {"layers.{i}.mlp.experts": int64 [S, k] (score order), "layers.{i}.self_attn.selected":
    int64 [S, topk] (as indexer_topk returns them: ascending, unused ranks 0)}. Rows past a
    sequence's end belong to padding; callers slice them off."""
    from trainer.megatron.logprobs import forward_logits

    b, s = input_ids.shape
    with _tracing(model) as modules:
        forward_logits(model, input_ids)
        out: list[dict[str, torch.Tensor]] = [{} for _ in range(b)]
        for i, name, m in modules:
            key = "experts" if name == "mlp.experts" else "selected"
            rows = m.trace[key].view(b, s, -1).cpu()
            for r in range(b):
                out[r][f"layers.{i}.{name}"] = rows[r].clone()
    return out
