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
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from parity import kernels, layouts
from parity.model_spec import ModelSpec
from rollout.attention import ParityAttentionBackend


class _Weight(nn.Module):
    """A module holding one plain parameter as `.weight` (keeps vLLM-style parameter names)."""

    def __init__(self, *shape: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class ParityAttention(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, cache_config, prefix: str) -> None:
        from vllm.model_executor.layers.attention import Attention

        super().__init__()
        self.spec = spec
        d, hq, hkv = spec.head_dim, spec.num_heads, spec.num_kv_heads
        self.qkv_proj = _Weight((hq + 2 * hkv) * d, spec.hidden_size, dtype=dtype)
        self.o_proj = _Weight(spec.hidden_size, hq * d, dtype=dtype)
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
        q, k, v = layouts.split_qkv(
            kernels.linear(h, self.qkv_proj.weight), s.num_heads, s.num_kv_heads, s.head_dim
        )
        if s.qk_norm:
            q = kernels.rms_norm(q, self.q_norm.weight, s.rms_norm_eps)
            k = kernels.rms_norm(k, self.k_norm.weight, s.rms_norm_eps)
        q = kernels.apply_rope(q, positions, self.rope)
        k = kernels.apply_rope(k, positions, self.rope)
        o = self.attn(q.contiguous(), k.contiguous(), v.contiguous())  # [T, Hq * D]
        return kernels.linear(o, self.o_proj.weight)


class ParityMLP(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = _Weight(2 * spec.intermediate_size, spec.hidden_size, dtype=dtype)
        self.down_proj = _Weight(spec.hidden_size, spec.intermediate_size, dtype=dtype)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return kernels.linear(
            kernels.silu_and_mul(kernels.linear(h, self.gate_up_proj.weight)), self.down_proj.weight
        )


class ParityDecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, cache_config, prefix: str) -> None:
        super().__init__()
        self.eps = spec.rms_norm_eps
        self.input_layernorm = _Weight(spec.hidden_size, dtype=dtype)
        self.self_attn = ParityAttention(spec, dtype, cache_config, f"{prefix}.self_attn")
        self.post_attention_layernorm = _Weight(spec.hidden_size, dtype=dtype)
        self.mlp = ParityMLP(spec, dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = kernels.rms_norm(x, self.input_layernorm.weight, self.eps)
        x = x + self.self_attn(positions, h)
        h = kernels.rms_norm(x, self.post_attention_layernorm.weight, self.eps)
        return x + self.mlp(h)


class ParityModel(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, cache_config, prefix: str) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = _Weight(spec.vocab_size, spec.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            ParityDecoderLayer(spec, dtype, cache_config, f"{prefix}.layers.{i}")
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


# HF checkpoint names -> (kind, layer index, part).
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_DIRECT = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "self_attn.o_proj.weight": "self_attn.o_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
    "self_attn.q_norm.weight": "self_attn.q_norm.weight",
    "self_attn.k_norm.weight": "self_attn.k_norm.weight",
}
_QKV = {"self_attn.q_proj.weight": "q", "self_attn.k_proj.weight": "k", "self_attn.v_proj.weight": "v"}
_GATE_UP = {"mlp.gate_proj.weight": "gate", "mlp.up_proj.weight": "up"}
_IGNORED = re.compile(r"rotary_emb\.inv_freq$|rotary_emb\.(cos|sin)_cached$")


class ParityLlamaForCausalLM(nn.Module):
    """vLLM model class registered as `KimiRLParityLlamaForCausalLM`."""

    # The HF architecture this class computes (the config's `architectures` names the parity
    # class once hf_overrides selects it).
    hf_architecture = "LlamaForCausalLM"

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        from vllm.distributed import get_pp_group, get_tensor_model_parallel_world_size

        super().__init__()
        if get_tensor_model_parallel_world_size() != 1 or get_pp_group().world_size != 1:
            raise NotImplementedError("the parity models run without tensor/pipeline parallelism")
        model_config = vllm_config.model_config
        config = model_config.hf_config.to_dict()
        config["architectures"] = [self.hf_architecture]
        self.spec = ModelSpec.from_hf_config(config)
        self._check_spec(self.spec)
        self.dtype = model_config.dtype
        self.config = model_config.hf_config
        prefix = f"{prefix}.model" if prefix else "model"
        self.model = ParityModel(self.spec, self.dtype, vllm_config.cache_config, prefix)
        if not self.spec.tie_word_embeddings:
            self.lm_head = _Weight(self.spec.vocab_size, self.spec.hidden_size, dtype=self.dtype)
        self._pending: dict[tuple[int, str], dict[str, torch.Tensor]] = {}

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

    def lm_head_weight(self) -> torch.Tensor:
        if self.spec.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return kernels.linear(hidden_states, self.lm_head_weight())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named checkpoint tensors into the fused parameters (in place, so it also
        serves vLLM's reload_weights). q/k/v and gate/up are packed once all parts of a layer
        have arrived. Returns the names of the parameters written."""
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def put(name: str, tensor: torch.Tensor) -> None:
            param = params[name]
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}")
            # Through the parameter's weight_loader when vLLM installed one: its in-place reload
            # (reload_weights) swaps parameters for meta tensors and copies what the wrapped
            # loaders receive back into the live storage. Otherwise a plain copy.
            loader = getattr(param, "weight_loader", default_weight_loader)
            with torch.no_grad():
                loader(param, tensor)
            loaded.add(name)

        s = self.spec
        for name, tensor in weights:
            if _IGNORED.search(name):
                continue
            if name == "model.embed_tokens.weight":
                put("model.embed_tokens.weight", tensor)
            elif name == "model.norm.weight":
                put("model.norm.weight", tensor)
            elif name == "lm_head.weight":
                if not s.tie_word_embeddings:
                    put("lm_head.weight", tensor)
            elif m := _LAYER_RE.match(name):
                i, rest = int(m.group(1)), m.group(2)
                base = f"model.layers.{i}."
                if rest in _DIRECT and base + _DIRECT[rest] in params:
                    put(base + _DIRECT[rest], tensor)
                elif rest in _QKV:
                    parts = self._pending.setdefault((i, "qkv"), {})
                    parts[_QKV[rest]] = tensor
                    if len(parts) == 3:
                        del self._pending[(i, "qkv")]
                        put(
                            base + "self_attn.qkv_proj.weight",
                            layouts.pack_qkv(parts["q"], parts["k"], parts["v"], s.num_kv_heads),
                        )
                elif rest in _GATE_UP:
                    parts = self._pending.setdefault((i, "gate_up"), {})
                    parts[_GATE_UP[rest]] = tensor
                    if len(parts) == 2:
                        del self._pending[(i, "gate_up")]
                        put(base + "mlp.gate_up_proj.weight", layouts.pack_gate_up(parts["gate"], parts["up"]))
                else:
                    raise ValueError(f"unexpected checkpoint tensor {name!r}")
            else:
                raise ValueError(f"unexpected checkpoint tensor {name!r}")
        if self._pending:
            incomplete = {f"layer {i} {kind}: has {sorted(p)}" for (i, kind), p in self._pending.items()}
            self._pending.clear()
            raise ValueError(f"incomplete fused weights in checkpoint: {sorted(incomplete)}")
        return loaded
