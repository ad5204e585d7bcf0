"""The architecture facts both engines read from an HF config.json, in one dataclass."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}


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
