"""The architecture facts both engines read from an HF config.json, in one dataclass."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from parity import fp8, kimi_formats
from parity.kimi_formats import KIMI_LINEAR_ARCHITECTURE, KIMI_MINI_ARCHITECTURE

# The one architecture registry: the name users type (`--arch`) -> the HF architecture that
# config.json names. Everything else (the spec class, vLLM's parity model, the trainer's GPT
# build) is keyed by these. kimi-mini is a set of kimi-linear presets: it writes kimi-linear.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "kimi-mini": KIMI_LINEAR_ARCHITECTURE,
    "kimi-linear": KIMI_LINEAR_ARCHITECTURE, "qwen3-moe": "Qwen3MoeForCausalLM",
}
# The HF architectures KimiSpec reads: kimi-linear, and old kimi-mini directories (converted on
# load, parity/kimi_formats.py).
KIMI_FORMATS = (KIMI_LINEAR_ARCHITECTURE, KIMI_MINI_ARCHITECTURE)
# The dense architectures ModelSpec describes, HF name -> ModelSpec.arch.
SUPPORTED_ARCHITECTURES = {hf: name for name, hf in ARCHITECTURES.items() if hf not in KIMI_FORMATS}
# The cache formats a run can ask for (rollout.kv_cache_dtype, --kv-cache-dtype): "auto" keeps
# the model dtype, "fp8" keeps the Kimi MLA entries in e4m3 (parity/fp8.py). Both engines read
# the choice from this config key (the rollout's through vLLM's hf_overrides; the trainer's
# load_model sets it on the spec).
KV_CACHE_DTYPES = ("auto", "fp8")
KV_CACHE_DTYPE_KEY = "kimi_rl_kv_cache_dtype"


def parity_architecture(hf_architecture: str) -> str:
    """The name vLLM registers the parity implementation of an HF architecture under."""
    known = {*ARCHITECTURES.values(), *KIMI_FORMATS}
    if hf_architecture not in known:
        raise ValueError(f"no parity model for architecture {hf_architecture!r} (supported: {sorted(known)})")
    return f"KimiRLParity{hf_architecture}"


@dataclass(frozen=True)
class ModelSpec:
    arch: str  # "llama" | "qwen3" | "qwen3-moe"
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
    # Qwen3-MoE: a sparse MoE feed-forward (softmax router, top num_experts_per_tok experts of
    # moe_intermediate_size, no shared expert) in every decoder_sparse_step-th layer not in
    # mlp_only_layers; the other layers keep the dense MLP of intermediate_size. 0 experts: dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @property
    def qk_norm(self) -> bool:
        # Qwen3 (and Qwen3-MoE) normalise q and k per head before RoPE; Llama does not.
        return self.arch in ("qwen3", "qwen3-moe")

    def check_lora_targets(self, targets: Iterable[str]) -> None:
        """ValueError if `targets` name the qwen3-moe router (`gate`): LoRA adapts the attention
        projections, the dense MLPs and every expert's gate_proj / up_proj / down_proj, never
        the router (it routes in fp32 from its checkpoint weight alone: no adapter path is built)."""
        if self.num_experts and "gate" in targets:
            raise ValueError("qwen3-moe: the MoE router (mlp.gate) takes no LoRA adapter; the experts' "
                             "gate_proj, up_proj and down_proj do")

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i has the sparse MoE block (transformers' Qwen3MoeDecoderLayer rule)."""
        return self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

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
        arch = SUPPORTED_ARCHITECTURES[arch_name]
        return cls(
            arch=arch,
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
            **(_qwen3_moe_fields(config) if arch == "qwen3-moe" else {}),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelSpec:
        return cls.from_hf_config(json.loads((Path(model_dir) / "config.json").read_text()))


def _qwen3_moe_fields(config: dict) -> dict:
    """The MoE fields of a Qwen3MoeForCausalLM config.json (published checkpoints say
    num_experts; transformers 5 writes num_local_experts), or ValueError naming the field."""
    n = config["num_hidden_layers"]
    fields = dict(
        num_experts=config.get("num_experts", config.get("num_local_experts", 0)),
        num_experts_per_tok=config["num_experts_per_tok"],
        moe_intermediate_size=config["moe_intermediate_size"],
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        decoder_sparse_step=config.get("decoder_sparse_step", 1),
        mlp_only_layers=tuple(config.get("mlp_only_layers") or ()),
    )
    if fields["num_experts"] < 1:
        raise ValueError("num_experts must be >= 1")
    if not 0 < fields["num_experts_per_tok"] <= fields["num_experts"]:
        raise ValueError("num_experts_per_tok must be in 1..num_experts")
    if fields["decoder_sparse_step"] < 1:
        raise ValueError("decoder_sparse_step must be >= 1")
    if any(not 0 <= i < n for i in fields["mlp_only_layers"]):
        raise ValueError(f"mlp_only_layers must name layers in 0..{n - 1}")
    return fields


LAYER_TYPES = ("kda", "mla")


INDEX_QUERY_SOURCES = ("latent", "hidden")


@dataclass(frozen=True)
class KimiSpec:
    """Kimi Linear (`KimiLinearForCausalLM`, transformers' KimiLinearConfig keys): a hybrid of
    KDA (gated delta-rule linear attention, a low-rank output gate g_a_proj -> g_b_proj) and MLA
    layers, MoE feed-forwards (routed + shared experts) with DeepSeek-V3 routing
    (e_score_correction_bias for selection only, grouped top-k, routed_scaling_factor), the
    first `first_k_dense_replace` layers dense. MLA attends without RoPE with `mla_use_nope`,
    over every earlier key (index_topk 0) or, with DeepSeek-V3.2's `index_n_heads` /
    `index_head_dim` / `index_topk`, over that model's indexer's top-k (DeepseekV32Indexer: wq_b
    on the query latent, so q_lora_rank is required; wk + LayerNorm k_norm; weights_proj; RoPE
    on the first qk_rope_head_dim index dims).

    kimi-mini is a set of its presets (rl/models.py). Old kimi-mini directories are read through
    parity/kimi_formats.py, which sets the two options only it produces: `kda_gate_rank` (its
    full-rank gate as g_a_proj with an identity g_b_proj) and `index_query_source` "hidden"."""

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
    mla_use_nope: bool = False  # True: no RoPE anywhere in MLA (the rope dims attend as they are)
    kv_norm_eps: float = 0.0  # kv_a_layernorm's (and q_a_layernorm's) eps (0: rms_norm_eps)
    first_k_dense_replace: int = 0  # the first k layers have a dense SwiGLU MLP, not a MoE
    intermediate_size: int = 0  # the dense MLP's width
    routed_scaling_factor: float = 1.0
    moe_renormalize: bool = True
    num_expert_group: int = 1  # grouped top-k: keep the topk_group best groups (top-2 sums)
    topk_group: int = 1
    # A low-rank query (q_a_proj -> q_a_layernorm -> q_b_proj) instead of q_proj; 0: none.
    q_lora_rank: int = 0
    # The KDA output gate's rank: g_a_proj [rank, hidden], g_b_proj [H * D, rank] (0: the
    # published kda_head_dim; an old kimi-mini's full-rank g_proj converts to H * D).
    kda_gate_rank: int = 0
    # What the indexer's queries read: "latent" DeepSeek-V3.2's wq_b on the query latent (RoPE,
    # LayerNorm'd key), or "hidden" old kimi-mini's wq on the hidden state (no RoPE, no norm).
    index_query_source: str = "latent"
    # kimi-linear's mla_use_output_gate (Kimi K3): o_proj(attn * sigmoid(g_proj(h))), g_proj
    # [Hm * v_head_dim, hidden] on the MLA layer's input.
    mla_output_gate: bool = False
    # Not a checkpoint field: the run's MLA cache format ("auto": the model dtype; "fp8": e4m3
    # with a per-token scale per entry part, parity/fp8.py), set from KV_CACHE_DTYPE_KEY.
    kv_cache_dtype: str = "auto"

    @property
    def gate_rank(self) -> int:
        """The KDA output gate's rank (g_a_proj's rows)."""
        return self.kda_gate_rank or self.kda_head_dim

    @property
    def has_indexer(self) -> bool:
        return self.index_topk > 0

    @property
    def kv_layernorm_eps(self) -> float:
        return self.kv_norm_eps or self.rms_norm_eps

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace

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
    def mla_cache_parts(self) -> tuple[int, ...]:
        """The widths of an MLA cache entry's parts, one FP8 scale each: latent + RoPE key, and
        the index key."""
        first = self.kv_lora_rank + self.qk_rope_head_dim
        return (first, self.index_head_dim) if self.has_indexer else (first,)

    def mla_slot_width(self, itemsize: int) -> int:
        """Elements of the model dtype (`itemsize` bytes) one token's cache slot holds: the
        entry itself, or its packed FP8 bytes rounded up to a multiple of 4 elements (the
        rollout splits a slot into key / value halves, and vLLM wants their width even)."""
        if self.kv_cache_dtype != "fp8":
            return self.mla_cache_width
        return 4 * math.ceil(fp8.packed_bytes(self.mla_cache_parts) / (4 * itemsize))

    @property
    def kda_conv_channels(self) -> int:
        return 3 * self.kda_num_heads * self.kda_head_dim

    @classmethod
    def from_hf_config(cls, config: dict) -> KimiSpec:
        """The spec of a kimi-linear config.json dict, or of an old kimi-mini one (converted:
        parity/kimi_formats.py)."""
        arch_name = (config.get("architectures") or [""])[0]
        if arch_name not in KIMI_FORMATS:
            raise ValueError(f"not a Kimi config: architecture {arch_name!r}")
        if kimi_formats.is_kimi_mini(config):
            return cls._from_kimi_linear(kimi_formats.linear_config(config))
        spec = cls._from_kimi_linear(config)
        if (spec.hidden_size // spec.num_attention_heads) % 2:
            # KimiLinearConfig has no head_dim: transformers' RoPE check (run by vLLM's config
            # loader) takes hidden_size // num_attention_heads as the rotary width.
            raise ValueError(f"hidden_size // num_attention_heads must be even (transformers reads it as the "
                             f"rotary head_dim), got {spec.hidden_size} // {spec.num_attention_heads}")
        return spec

    @classmethod
    def _from_kimi_linear(cls, config: dict) -> KimiSpec:
        """The published Kimi Linear config.json (transformers' KimiLinearConfig keys)."""
        lac = config.get("linear_attn_config") or {}
        n = config["num_hidden_layers"]
        kda = [i - 1 for i in lac.get("kda_layers", [])]
        full = [i - 1 for i in lac.get("full_attn_layers", [])]
        if sorted(kda + full) != list(range(n)):
            raise ValueError(
                f"linear_attn_config: kda_layers + full_attn_layers must number the {n} layers 1..{n} once each"
            )
        refused = {
            "moe_layer_freq": (config.get("moe_layer_freq", 1), 1),
            "moe_router_activation_func": (config.get("moe_router_activation_func", "sigmoid"), "sigmoid"),
            "num_nextn_predict_layers": (config.get("num_nextn_predict_layers", 0), 0),
            # Kimi K3's attention residuals (vLLM's kimi_k3 KimiDecoderLayer attn_res): not built
            "attn_res_block_size": (config.get("attn_res_block_size"), None),
        }
        for key, (value, wanted) in refused.items():
            if value != wanted:
                raise ValueError(f"{key}: {value!r} is not supported (only {wanted!r})")
        if config.get("num_key_value_heads", config["num_attention_heads"]) != config["num_attention_heads"]:
            raise ValueError("num_key_value_heads must equal num_attention_heads (MLA expands every head)")
        rope = config.get("rope_parameters") or {}
        index_topk = config.get("index_topk") or 0
        index = {key: (config.get(key) or 0) if index_topk else 0 for key in ("index_n_heads", "index_head_dim")}
        for key, value in index.items():
            if index_topk and value < 1:
                raise ValueError(f"{key} must be >= 1 when index_topk is set")
        q_lora_rank = config.get("q_lora_rank") or 0
        source = config.get("index_query_source", "latent")
        if source not in INDEX_QUERY_SOURCES:
            raise ValueError(f"index_query_source must be one of {', '.join(INDEX_QUERY_SOURCES)}, got {source!r}")
        latent = index_topk and source == "latent"
        if latent and not q_lora_rank:
            # DeepSeek-V3.2's indexer projects its queries from the query latent (wq_b)
            raise ValueError("q_lora_rank must be set when index_topk is (the indexer's wq_b reads the query latent)")
        if latent and index["index_head_dim"] < config["qk_rope_head_dim"]:
            raise ValueError("index_head_dim must be >= qk_rope_head_dim (RoPE rotates the first qk_rope_head_dim)")
        spec = cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            layer_types=tuple("kda" if i in kda else "mla" for i in range(n)),
            rms_norm_eps=float(config["rms_norm_eps"]),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            max_position_embeddings=config.get("model_max_length") or config["max_position_embeddings"],
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            kda_num_heads=lac["num_heads"],
            kda_head_dim=lac["head_dim"],
            kda_conv_size=lac["short_conv_kernel_size"],
            num_attention_heads=config["num_attention_heads"],
            kv_lora_rank=config["kv_lora_rank"],
            qk_nope_head_dim=config["qk_nope_head_dim"],
            qk_rope_head_dim=config["qk_rope_head_dim"],
            v_head_dim=config["v_head_dim"],
            index_n_heads=index["index_n_heads"], index_head_dim=index["index_head_dim"], index_topk=index_topk,
            q_lora_rank=q_lora_rank,
            kda_gate_rank=config.get("kda_gate_rank") or 0,
            index_query_source=source,
            mla_output_gate=bool(config.get("mla_use_output_gate", False)),
            n_routed_experts=config["num_experts"],
            num_experts_per_tok=config["num_experts_per_token"],
            moe_intermediate_size=config["moe_intermediate_size"],
            n_shared_experts=config.get("num_shared_experts", 0),
            mla_use_nope=bool(config.get("mla_use_nope", False)),
            # transformers' KimiLinearAttention builds kv_a_layernorm with RMSNorm's default eps
            # (an old kimi-mini's used rms_norm_eps: its conversion says so)
            kv_norm_eps=config.get("kv_layernorm_eps", KV_A_LAYERNORM_EPS),
            first_k_dense_replace=config.get("first_k_dense_replace", 0),
            intermediate_size=config.get("intermediate_size", 0),
            routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
            moe_renormalize=bool(config.get("moe_renormalize", True)),
            num_expert_group=config.get("num_expert_group", 1),
            topk_group=config.get("topk_group", 1),
            kv_cache_dtype=config.get(KV_CACHE_DTYPE_KEY, "auto"),
        )
        if spec.first_k_dense_replace and spec.intermediate_size < 1:
            raise ValueError("intermediate_size must be >= 1 when first_k_dense_replace > 0")
        groups = spec.num_expert_group
        if groups < 1 or spec.n_routed_experts % groups or (groups > 1 and spec.n_routed_experts // groups < 2):
            # a group is ranked by the sum of its two best scores
            raise ValueError("num_expert_group must split num_experts into groups of >= 2 experts")
        if not 0 < spec.topk_group <= groups:
            raise ValueError("topk_group must be in 1..num_expert_group")
        return spec.validated()

    def validated(self) -> KimiSpec:
        """self, or ValueError naming the field that cannot hold."""
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"{KV_CACHE_DTYPE_KEY} must be one of {', '.join(KV_CACHE_DTYPES)}")
        if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
            raise ValueError("num_experts_per_tok must be in 1..n_routed_experts")
        if self.index_topk < 0:
            raise ValueError("index_topk must be >= 0")
        if self.qk_rope_head_dim % 2 or self.v_head_dim > self.qk_head_dim:
            raise ValueError("qk_rope_head_dim must be even and v_head_dim <= qk head dim")
        if self.mla_cache_width % 2:  # the rollout splits an entry over a slot's key/value halves
            raise ValueError("kv_lora_rank + qk_rope_head_dim + index_head_dim must be even")
        return self

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> KimiSpec:
        return cls.from_hf_config(json.loads((Path(model_dir) / "config.json").read_text()))


KV_A_LAYERNORM_EPS = 1e-6


def check_kv_cache_dtype(name: str, architecture: str | None) -> None:
    """ValueError unless `name` is a cache format the model of HF `architecture` (None: parity
    off) can keep: FP8 entries exist for the Kimi architectures' MLA caches, in the parity
    model only."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    if name == "fp8" and architecture not in KIMI_FORMATS:
        what = "stock vLLM (parity off)" if architecture is None else f"{architecture}'s attention cache"
        raise ValueError(f"kv_cache_dtype fp8: only the Kimi architectures' MLA caches keep FP8 entries "
                         f"(with the parity model); {what} stays in the model dtype")


def hf_architecture(model_dir: str | Path) -> str:
    """The architecture a checkpoint's config.json names ("" if none)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return (config.get("architectures") or [""])[0]


def load_spec(model_dir: str | Path) -> ModelSpec | KimiSpec:
    """The spec of a model directory, dense (Llama / Qwen3 / Qwen3-MoE) or a KDA/MLA hybrid
    (kimi-linear; an old kimi-mini directory converted)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    if (config.get("architectures") or [""])[0] in KIMI_FORMATS:
        return KimiSpec.from_hf_config(config)
    return ModelSpec.from_hf_config(config)
