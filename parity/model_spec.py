"""The architecture facts both engines read from an HF config.json, in one dataclass."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# The one architecture registry: the name users type (`--arch`) -> the HF architecture that
# config.json names. Everything else (the spec class, vLLM's parity model, the trainer's GPT
# build) is keyed by these.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "kimi-mini": "KimiMiniForCausalLM"}
KIMI_ARCHITECTURE = ARCHITECTURES["kimi-mini"]
# The dense architectures ModelSpec describes, HF name -> ModelSpec.arch.
SUPPORTED_ARCHITECTURES = {hf: name for name, hf in ARCHITECTURES.items() if hf != KIMI_ARCHITECTURE}


def parity_architecture(hf_architecture: str) -> str:
    """The name vLLM registers the parity implementation of an HF architecture under."""
    if hf_architecture not in ARCHITECTURES.values():
        raise ValueError(
            f"no parity model for architecture {hf_architecture!r} "
            f"(supported: {sorted(ARCHITECTURES.values())})"
        )
    return f"KimiRLParity{hf_architecture}"


@dataclass(frozen=True)
class ModelSpec:
    arch: str  # "llama" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool

    @property
    def qk_norm(self) -> bool:
        # Qwen3 normalises q and k per head before RoPE; Llama does not.
        return self.arch == "qwen3"

    @classmethod
    def from_hf_config(cls, config: dict) -> ModelSpec:
        arch_name = (config.get("architectures") or [""])[0]
        if arch_name not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch_name!r}")
        # transformers >= 5 keeps rope_theta under rope_parameters; older files keep it on top.
        rope = config.get("rope_parameters") or {}
        rope_theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        if rope.get("rope_type", "default") != "default" or config.get("rope_scaling"):
            raise ValueError("only plain RoPE (rope_type 'default') is supported")
        num_heads = config["num_attention_heads"]
        return cls(
            arch=SUPPORTED_ARCHITECTURES[arch_name],
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
            rms_norm_eps=float(config["rms_norm_eps"]),
            rope_theta=float(rope_theta),
            max_position_embeddings=config["max_position_embeddings"],
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelSpec:
        return cls.from_hf_config(json.loads((Path(model_dir) / "config.json").read_text()))


LAYER_TYPES = ("kda", "mla")


@dataclass(frozen=True)
class KimiSpec:
    """kimi-mini: a hybrid of KDA (gated delta-rule linear attention) and MLA layers whose keys a
    sparse indexer pre-selects, every layer with a MoE feed-forward (routed + shared experts).
    Field names follow the HF config.json keys (DeepSeek / Kimi-Linear spellings)."""

    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]  # per layer: "kda" | "mla"
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # KDA
    kda_num_heads: int
    kda_head_dim: int  # dk = dv
    kda_conv_size: int  # short causal depthwise conv over q, k, v
    # MLA
    num_attention_heads: int
    kv_lora_rank: int  # the cached latent c_kv
    qk_nope_head_dim: int
    qk_rope_head_dim: int  # the shared RoPE key k_pe, cached
    v_head_dim: int
    # sparse-attention indexer (one shared index key per token, cached)
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    # MoE
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int

    arch = "kimi_mini"

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_cache_width(self) -> int:
        """Values cached per token by an MLA layer: latent + RoPE key + index key."""
        return self.kv_lora_rank + self.qk_rope_head_dim + self.index_head_dim

    @property
    def kda_conv_channels(self) -> int:
        return 3 * self.kda_num_heads * self.kda_head_dim

    @classmethod
    def from_hf_config(cls, config: dict) -> KimiSpec:
        arch_name = (config.get("architectures") or [""])[0]
        if arch_name != KIMI_ARCHITECTURE:
            raise ValueError(f"not a kimi-mini config: architecture {arch_name!r}")
        layer_types = tuple(config["layer_types"])
        bad = [t for t in layer_types if t not in LAYER_TYPES]
        if bad or len(layer_types) != config["num_hidden_layers"]:
            raise ValueError(
                f"layer_types must list {config['num_hidden_layers']} of {LAYER_TYPES}, got {layer_types}"
            )
        fields = {f: config[f] for f in cls.__dataclass_fields__ if f not in ("layer_types",)}
        spec = cls(layer_types=layer_types, **fields)
        if not 0 < spec.num_experts_per_tok <= spec.n_routed_experts:
            raise ValueError("num_experts_per_tok must be in 1..n_routed_experts")
        if spec.index_topk < 1:
            raise ValueError("index_topk must be >= 1")
        if spec.qk_rope_head_dim % 2 or spec.v_head_dim > spec.qk_head_dim:
            raise ValueError("qk_rope_head_dim must be even and v_head_dim <= qk head dim")
        if spec.mla_cache_width % 2:  # the rollout splits an entry over a slot's key/value halves
            raise ValueError("kv_lora_rank + qk_rope_head_dim + index_head_dim must be even")
        return spec

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> KimiSpec:
        return cls.from_hf_config(json.loads((Path(model_dir) / "config.json").read_text()))


def hf_architecture(model_dir: str | Path) -> str:
    """The architecture a checkpoint's config.json names ("" if none)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return (config.get("architectures") or [""])[0]


def load_spec(model_dir: str | Path) -> ModelSpec | KimiSpec:
    """The spec of a model directory, dense (Llama / Qwen3) or kimi-mini."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    if (config.get("architectures") or [""])[0] == KIMI_ARCHITECTURE:
        return KimiSpec.from_hf_config(config)
    return ModelSpec.from_hf_config(config)
