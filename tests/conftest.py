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
