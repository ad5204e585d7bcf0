"""Shared fixtures: tiny checkpoints built once per session, and the Megatron process state.

Tests live in two folders, each marked by its folder: `tests/unit` (no engine: kernels, math,
config, data; `pytest -m unit`, about a minute) and `tests/integration` (real vLLM, Megatron and
Ray; `pytest -m integration`)."""

from __future__ import annotations

import os

import pytest

_FOLDER_MARKS = ("unit", "integration")


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = item.path.parts
        for mark in _FOLDER_MARKS:
            if mark in parts:
                item.add_marker(getattr(pytest.mark, mark))

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """model_factory(arch, dtype, preset="tiny") -> path of a checkpoint built with seed 0."""
    from rl.models import init_model

    cache: dict[tuple, str] = {}

    def make(arch: str, dtype: str = "fp32", preset: str = "tiny") -> str:
        key = (arch, dtype, preset)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{arch}-{preset}-{dtype}") / "model"
            cache[key] = str(init_model(arch=arch, preset=preset, seed=0, out_dir=out, dtype=dtype))
        return cache[key]

    return make


@pytest.fixture(scope="session")
def megatron():
    """torch.distributed (gloo, world of one) and Megatron's parallel state, once per session."""
    from trainer.megatron.patches import init_megatron

    init_megatron()


def write_prompt_file(directory, lengths, seed: int = 0, vocab: int = 500):
    """A `--prompts` JSONL file of random token-id prompts of the given lengths."""
    import json
    import random

    rng = random.Random(seed)
    path = directory / "prompts.jsonl"
    rows = [{"prompt_ids": [rng.randrange(3, vocab) for _ in range(n)]} for n in lengths]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_random_adapter(model_dir: str, out_dir, rank: int = 4, alpha: float = 8.0, seed: int = 0):
    """A peft adapter on every LoRA target of a Kimi-architecture model (kimi-mini or
    kimi-linear) with nonzero A and B (a fresh adapter has B = 0 and would test nothing)."""
    import torch

    from parity import kimi
    from parity.model_spec import KimiSpec
    from trainer.checkpoint import peft_config, save_peft

    spec = KimiSpec.from_dir(model_dir)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for fan_in, parts in kimi.lora_linears(spec).values():
        for path, fan_out in parts:
            tensors[kimi.peft_name(path, "A")] = torch.randn(rank, fan_in, generator=gen) * 0.1
            tensors[kimi.peft_name(path, "B")] = torch.randn(fan_out, rank, generator=gen) * 0.1
    save_peft(out_dir, tensors, peft_config(rank, alpha, list(kimi.LORA_TARGETS), model_dir))
    return out_dir


def use_transformers_kimi_linear_config() -> None:
    """Point AutoConfig's "kimi_linear" at transformers' own KimiLinearConfig again. vLLM, when
    it loads a kimi_linear checkpoint in this process, registers its own config class under
    that name, and transformers' AutoModelForCausalLM has no model for vLLM's class."""
    from transformers import AutoConfig
    from transformers.models.kimi_linear import KimiLinearConfig

    AutoConfig.register("kimi_linear", KimiLinearConfig, exist_ok=True)


# An old kimi-mini directory (`KimiMiniForCausalLM`, written before kimi-mini became kimi-linear
# presets): its own config keys and tensor names, the tiny preset's shapes. Kept as test data:
# such directories must still load (parity/kimi_formats.py converts them).
OLD_KIMI_MINI_TINY = dict(
    hidden_size=128, layer_types=["kda", "kda", "kda", "mla"], kda_num_heads=4, kda_head_dim=32, kda_conv_size=4,
    num_attention_heads=4, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
    index_n_heads=4, index_head_dim=32, index_topk=16, n_routed_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=128, n_shared_experts=1, max_position_embeddings=2048, initializer_range=0.1,
)


def old_kimi_mini_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of an old kimi-mini checkpoint by name (tied: no lm_head)."""
    h, nh, d = c["hidden_size"], c["kda_num_heads"], c["kda_head_dim"]
    hm, qk = c["num_attention_heads"], c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,)}
    for i, kind in enumerate(c["layer_types"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
        if kind == "kda":
            out.update({a + n + ".weight": (nh * d, h) for n in ("q_proj", "k_proj", "v_proj", "g_proj")})
            out.update({
                a + "conv1d.weight": (3 * nh * d, c["kda_conv_size"]), a + "f_a_proj.weight": (d, h),
                a + "f_b_proj.weight": (nh * d, d), a + "dt_bias": (nh * d,), a + "A_log": (nh,),
                a + "b_proj.weight": (nh, h), a + "o_norm.weight": (d,), a + "o_proj.weight": (h, nh * d),
            })
        else:
            out.update({
                a + "q_proj.weight": (hm * qk, h),
                a + "kv_a_proj_with_mqa.weight": (c["kv_lora_rank"] + c["qk_rope_head_dim"], h),
                a + "kv_a_layernorm.weight": (c["kv_lora_rank"],),
                a + "kv_b_proj.weight": (hm * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"]),
                a + "o_proj.weight": (h, hm * c["v_head_dim"]),
                a + "indexer.wq.weight": (c["index_n_heads"] * c["index_head_dim"], h),
                a + "indexer.wk.weight": (c["index_head_dim"], h),
                a + "indexer.weights_proj.weight": (c["index_n_heads"], h),
            })
        out[p + "mlp.gate.weight"] = (c["n_routed_experts"], h)
        ffns = [(f"{p}mlp.experts.{e}.", c["moe_intermediate_size"]) for e in range(c["n_routed_experts"])]
        ffns.append((p + "mlp.shared_experts.", c["moe_intermediate_size"] * c["n_shared_experts"]))
        for prefix, inter in ffns:
            out.update({prefix + "gate_proj.weight": (inter, h), prefix + "up_proj.weight": (inter, h),
                        prefix + "down_proj.weight": (h, inter)})
    return out


def write_old_kimi_mini(out, dtype: str = "fp32", seed: int = 0, **shape):
    """An old-format kimi-mini directory (config.json, model.safetensors, tokenizer) at `out`."""
    import json
    import math
    from pathlib import Path

    import torch
    from safetensors.torch import save_file

    from parity.dtypes import dtype_string, torch_dtype
    from rl.models import build_tokenizer

    out = Path(out)
    out.mkdir(parents=True)
    tokenizer = build_tokenizer(512, 2048)
    config = dict(OLD_KIMI_MINI_TINY, **shape)
    config.update(
        architectures=["KimiMiniForCausalLM"], model_type="kimi_mini", vocab_size=512,
        num_hidden_layers=len(config["layer_types"]), rope_theta=10000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        dtype=dtype_string(dtype), torch_dtype=dtype_string(dtype),
    )
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, size in old_kimi_mini_shapes(config).items():
        if name.endswith("norm.weight"):
            t = torch.ones(size)
        elif name.endswith("A_log"):
            t = torch.empty(size).uniform_(1.0, 16.0, generator=gen).log()
        elif name.endswith("dt_bias"):
            dt = torch.empty(size).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()
            t = dt + torch.log(-torch.expm1(-dt))
        elif name.endswith("conv1d.weight"):
            t = torch.empty(size).normal_(0.0, 0.5, generator=gen)
        else:
            t = torch.empty(size).normal_(0.0, config["initializer_range"], generator=gen)
        weights[name] = t.to(torch_dtype(dtype)).contiguous()
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tokenizer.save_pretrained(out, save_jinja_files=False)
    return out


def write_converted_twin(old_dir, out):
    """The kimi-linear directory an old kimi-mini one converts to (parity/kimi_formats.py)."""
    import json
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    from parity import kimi_formats

    old_dir, out = Path(old_dir), Path(out)
    shutil.copytree(old_dir, out, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    config = json.loads((old_dir / "config.json").read_text())
    tensors = dict(kimi_formats.linear_tensors(config, load_file(str(old_dir / "model.safetensors")).items()))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(kimi_formats.linear_config(config), indent=2, sort_keys=True) + "\n")
    return out
