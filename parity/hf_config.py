"""Old kimi-mini directories' transformers config class. transformers does not know model_type
"kimi_mini"; every process that loads such a config through AutoConfig (vLLM's config loader, a
tokenizer, the CLI) calls `register_hf_config()` first. (kimi-mini now writes kimi-linear, which
transformers knows; parity/kimi_formats.py converts the old directories for the model.)"""

from __future__ import annotations

from transformers import AutoConfig, PretrainedConfig

MODEL_TYPE = "kimi_mini"
# The kimi-mini config.json keys, kept as attributes.
_KEYS = (
    "vocab_size", "hidden_size", "layer_types", "rms_norm_eps", "rope_theta", "max_position_embeddings",
    "tie_word_embeddings", "kda_num_heads", "kda_head_dim", "kda_conv_size", "num_attention_heads",
    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim",
    "index_topk", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
)


class KimiMiniConfig(PretrainedConfig):
    """transformers does not know model_type "kimi_mini"; vLLM loads configs through AutoConfig,
    so every process registers this class. It keeps every config.json key as an attribute and
    adds what vLLM sizes the attention cache pages from: one KV head of head_dim =
    mla_cache_width / 2 (an MLA layer's entry fills the key and the value half of a slot)."""

    model_type = MODEL_TYPE

    def __init__(self, **kwargs) -> None:
        known = {k: kwargs.pop(k) for k in list(kwargs) if k in _KEYS}
        super().__init__(tie_word_embeddings=known.pop("tie_word_embeddings", True), **kwargs)
        for key, value in known.items():
            setattr(self, key, value)
        if "kv_lora_rank" in known:
            width = known["kv_lora_rank"] + known["qk_rope_head_dim"] + known["index_head_dim"]
            if width % 2:
                raise ValueError(
                    f"kv_lora_rank + qk_rope_head_dim + index_head_dim = {width} must be even "
                    "(an MLA cache entry fills the key and value halves of a cache slot)"
                )
            self.head_dim = width // 2
            self.num_key_value_heads = 1


def register_hf_config() -> None:
    """Make AutoConfig (and so vLLM's config loader) build KimiMiniConfig for "kimi_mini"."""
    AutoConfig.register(MODEL_TYPE, KimiMiniConfig, exist_ok=True)
