"""Shared fixtures: tiny checkpoints built once per session, and the Megatron process state."""

from __future__ import annotations

import os

import pytest

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
    from trainer.megatron_patches import init_megatron

    init_megatron()
