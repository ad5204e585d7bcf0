"""Build a Megatron-core GPTModel from an HF checkpoint directory.

`parity=True` plugs the parity kernels in through the layer spec (linears, norms, core
attention with RoPE, SwiGLU activation) and re-classes GPTModel's hard-coded output layer;
`parity=False` is stock Megatron (local spec, Megatron's RoPE and attention) on the same
weights, the baseline the parity layer is measured against.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
)
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from safetensors.torch import load_file

from parity import kernels, kimi_formats, moe
from parity.dtypes import torch_dtype
from parity.model_spec import KimiSpec, ModelSpec, check_kv_cache_dtype, hf_architecture, load_spec
from parity.tp import check_tp, padded_vocab
from trainer.megatron.convert import hf_to_megatron, shard_megatron_state
from trainer.megatron.layers import (
    ParityColumnParallelLinear,
    ParityCoreAttention,
    ParityGateUpLinear,
    ParityRMSNorm,
    ParityRowParallelLinear,
    _FrozenPack,
    _LoRAMixin,
    common_config,
)
from trainer.megatron.patches import bind_router_gemm_without_te, cpu_current_device


def transformer_config(spec: ModelSpec, dtype: torch.dtype, parity: bool, tp_size: int = 1) -> TransformerConfig:
    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.intermediate_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=kernels.silu if parity else torch.nn.functional.silu,
        qk_layernorm=spec.qk_norm,
        tensor_model_parallel_size=tp_size,
        **common_config(dtype),
    )


class _Router(torch.nn.Module):
    def __init__(self, num_experts: int, hidden: int, dtype: torch.dtype):
        super().__init__()
        # Zeros: overwritten by the checkpoint (load_hf_weights loads strictly).
        self.weight = torch.nn.Parameter(torch.zeros(num_experts, hidden, dtype=dtype))


class ExpertLinear(_FrozenPack, _LoRAMixin, torch.nn.Module):
    """One expert's linear_fc1 ([gate; up]) or linear_fc2 (down): `kernels.linear` over the
    whole K (the rollout expert's single chain), plus the active adapter slot's delta
    (trainer.megatron.lora.LoRAAdapter: parity.lora.fused_delta, the rollout's call)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype):
        super().__init__()
        # Zeros: overwritten by the checkpoint (load_hf_weights loads strictly).
        self.weight = torch.nn.Parameter(torch.zeros(out_features, in_features, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = kernels.linear(x, self.weight, packed=self.packed(self.weight))
        adapter = self.active_adapter()
        delta = adapter.delta(x) if adapter is not None else None
        return out if delta is None else out + delta


class Expert(torch.nn.Module):
    """One SwiGLU expert: linear_fc1 = [gate; up] fused, linear_fc2 = down (Megatron's names);
    gate_up_proj / down_proj as parity/moe.py reads them."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype):
        super().__init__()
        self.linear_fc1 = ExpertLinear(hidden, 2 * inter, dtype)
        self.linear_fc2 = ExpertLinear(inter, hidden, dtype)

    gate_up_proj = property(lambda self: self.linear_fc1)
    down_proj = property(lambda self: self.linear_fc2)


class SparseMoE(MegatronModule):
    """Qwen3-MoE's sparse block in the mlp slot: `router` and `experts.local_experts.{e}`
    (Megatron's MoE names; each expert's linear_fc1 = [gate; up]), computed by parity/moe.py,
    the very routing and dispatch the rollout model runs. Replicated: qwen3-moe runs at TP 1.
    LoRA adapts the experts (trainer.megatron.lora), never the router.
    The layer spec names a subclass per model (`for_spec`): Megatron's TransformerLayer warns
    about a ModuleSpec of a module it does not know, and this one needs no kwargs from it."""

    spec: ModelSpec

    @classmethod
    def for_spec(cls, spec: ModelSpec) -> type[SparseMoE]:
        return type(cls.__name__, (cls,), {"spec": spec})

    def __init__(self, config: TransformerConfig, **_):
        super().__init__(config=config)
        spec = self.spec
        dt = config.params_dtype
        self.router = _Router(spec.num_experts, spec.hidden_size, dt)
        self.experts = torch.nn.Module()
        self.experts.local_experts = torch.nn.ModuleList(
            Expert(spec.hidden_size, spec.moe_intermediate_size, dt) for _ in range(spec.num_experts)
        )

    def forward(self, hidden_states: torch.Tensor, **_) -> tuple[torch.Tensor, None]:
        s = self.spec
        h = hidden_states.reshape(-1, s.hidden_size)  # routing and experts are per row
        experts, weights = moe.softmax_route(self.router.weight, h, s.num_experts_per_tok, s.norm_topk_prob)
        out = moe.dispatch(self.experts.local_experts, s.num_experts, h, experts, weights)
        return out.view_as(hidden_states), None


def parity_block_spec(spec: ModelSpec) -> TransformerBlockSubmodules:
    norm = ParityRMSNorm
    layer = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ParityColumnParallelLinear,
                    core_attention=ModuleSpec(
                        module=ParityCoreAttention,
                        params={
                            "rope_theta": spec.rope_theta,
                            "max_positions": spec.max_position_embeddings,
                        },
                    ),
                    linear_proj=ParityRowParallelLinear,
                    q_layernorm=norm if spec.qk_norm else IdentityOp,
                    k_layernorm=norm if spec.qk_norm else IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=ModuleSpec(
                module=MLP,
                submodules=MLPSubmodules(
                    linear_fc1=ParityGateUpLinear, linear_fc2=ParityRowParallelLinear
                ),
            ),
            mlp_bda=get_bias_dropout_add,
        ),
    )
    sparse = dataclasses.replace(
        layer, submodules=dataclasses.replace(
            layer.submodules, mlp=SparseMoE.for_spec(spec)
        ),
    )
    return TransformerBlockSubmodules(
        layer_specs=[sparse if spec.is_moe_layer(i) else layer for i in range(spec.num_layers)], layer_norm=norm
    )


def _stock_moe_config(config: TransformerConfig, spec: ModelSpec) -> TransformerConfig:
    """Stock Megatron's MoE for a qwen3-moe baseline (parity off): SequentialMLP experts under
    the names the parity model uses, Qwen3's routing (softmax then top-k; top-k then softmax
    is the renormalised form), no load-balancing loss (scoring only)."""
    bind_router_gemm_without_te()
    return dataclasses.replace(
        config, num_moe_experts=spec.num_experts, moe_router_topk=spec.num_experts_per_tok,
        moe_ffn_hidden_size=spec.moe_intermediate_size, moe_router_pre_softmax=not spec.norm_topk_prob,
        moe_layer_freq=[int(spec.is_moe_layer(i)) for i in range(spec.num_layers)],
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="allgather",
    )


def build_gpt(spec: ModelSpec, dtype: torch.dtype, parity: bool, tp_size: int = 1) -> GPTModel:
    if spec.num_experts:
        check_tp(spec, tp_size)  # qwen3-moe: TP 1 only
    config = transformer_config(spec, dtype, parity, tp_size)
    if spec.num_experts and not parity:
        config = _stock_moe_config(config, spec)
    common = dict(
        config=config,
        # Under TP the vocabulary is padded with zero rows to split evenly (parity/tp.py);
        # forward_logits cuts the padded columns off again.
        vocab_size=padded_vocab(spec.vocab_size, tp_size),
        max_sequence_length=spec.max_position_embeddings,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        parallel_output=False,
    )
    with cpu_current_device():
        if parity:
            model = GPTModel(
                transformer_layer_spec=parity_block_spec(spec), position_embedding_type="none",
                **common,
            )
            # GPTModel hard-codes tensor_parallel.ColumnParallelLinear as its output layer.
            # ParityColumnParallelLinear only overrides the GEMM, so re-classing the built
            # module keeps its parameters, TP group and hooks.
            model.output_layer.__class__ = ParityColumnParallelLinear
        else:
            model = GPTModel(
                transformer_layer_spec=get_gpt_decoder_block_spec(
                    config, use_transformer_engine=False, normalization="RMSNorm"
                ) if spec.num_experts else get_gpt_layer_local_spec(
                    normalization="RMSNorm", qk_layernorm=spec.qk_norm
                ),
                position_embedding_type="rope",
                rotary_base=int(spec.rope_theta),
                **common,
            )
    return model


def load_hf_weights(model: GPTModel, model_dir: str | Path, spec: ModelSpec | KimiSpec) -> None:
    hf = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        hf.update(load_file(str(path)))
    # An old kimi-mini checkpoint's tensors under kimi-linear's names (the spec already is).
    hf = dict(kimi_formats.linear_tensors(json.loads((Path(model_dir) / "config.json").read_text()), hf.items()))
    dtype = next(model.parameters()).dtype
    state = {k: v.to(dtype) for k, v in hf_to_megatron(hf, spec).items()}
    tp_size = model.config.tensor_model_parallel_size
    if tp_size > 1:  # this rank's shards (parity/tp.py layouts)
        from megatron.core import parallel_state

        state = shard_megatron_state(state, spec, parallel_state.get_tensor_model_parallel_rank(), tp_size)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"weight mapping mismatch: missing={missing} unexpected={unexpected}")


def load_model(
    model_dir: str | Path, dtype: str = "fp32", parity: bool = True, tp_size: int = 1, kv_cache_dtype: str = "auto",
) -> GPTModel:
    """Megatron GPTModel with the checkpoint's weights (call trainer.megatron.patches.init_megatron first,
    with the same tp_size; with tp_size > 1 each rank holds its shards, parity/tp.py).

    The Kimi architectures (trainer/megatron/kimi.py) exist only as the parity model: their
    mixers have no stock Megatron counterpart to serve as a baseline, so parity=False is refused. `kv_cache_dtype`
    "fp8" (the Kimi architectures) rounds each MLA cache entry as the rollout's FP8 cache keeps
    it (parity.kimi.mla_entries)."""
    spec = load_spec(model_dir)
    check_kv_cache_dtype(kv_cache_dtype, hf_architecture(model_dir) if parity else None)
    if isinstance(spec, KimiSpec):
        spec = dataclasses.replace(spec, kv_cache_dtype=kv_cache_dtype)
        if not parity:
            raise ValueError("the Kimi architectures have no stock Megatron model: use parity=True")
        from trainer.megatron.kimi import build_kimi_gpt

        model = build_kimi_gpt(spec, torch_dtype(dtype), tp_size)  # raises unless tp_size == 1
    else:
        model = build_gpt(spec, torch_dtype(dtype), parity, tp_size)
    model.hf_vocab_size = spec.vocab_size  # the logits' width once TP padding is cut off
    if torch.cuda.is_available():  # the parity kernels dispatch on the tensors' device
        model = model.cuda()
    load_hf_weights(model, model_dir, spec)
    return model
