"""Each megatron-core 0.16.1 CPU shim is still needed (the bug is still there) and still
applies (with it, the code path runs). When megatron-core fixes a bug, the 'needed' test
fails: delete the shim."""

from __future__ import annotations

import pytest
import torch

from trainer.megatron.patches import cpu_current_device

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only shims")


def _stock_forward(model):
    ids = torch.randint(0, 400, (1, 8))
    mask = torch.triu(torch.ones(1, 1, 8, 8, dtype=torch.bool), diagonal=1)
    return model(ids, torch.arange(8).unsqueeze(0), mask)


def test_current_device_shim_needed_and_applies(model_factory, megatron):
    from trainer.megatron.model import load_model

    model = load_model(model_factory("llama"), "fp32", parity=False).eval()
    with torch.no_grad():
        # RotaryEmbedding.get_emb calls torch.cuda.current_device() unconditionally.
        with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
            _stock_forward(model)
        with cpu_current_device():
            assert _stock_forward(model).shape[:2] == (1, 8)
    assert torch.cuda.current_device is not None  # the real function is restored
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()


def test_rng_tracker_shim_needed(megatron):
    """Megatron's default (CUDA) RNG tracker still needs CUDA to seed; the inference tracker
    that init_megatron installs on the CPU does not."""
    from megatron.core.tensor_parallel import random as mrandom

    try:
        mrandom.initialize_rng_tracker(force_reset=True)  # the stock CUDA tracker
        with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
            mrandom.model_parallel_cuda_manual_seed(0)
        mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        mrandom.model_parallel_cuda_manual_seed(0)  # the shim applies: seeding works
        with mrandom.get_cuda_rng_tracker().fork():
            pass
    finally:
        mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def test_router_gemm_shim_needed_and_applies(model_factory, megatron):
    """Without Transformer Engine, megatron-core leaves moe_utils.te_general_gemm unbound (a
    fresh process shows it); with the shim, stock Megatron's MoE (qwen3-moe, parity off) runs."""
    import subprocess
    import sys

    from trainer.megatron.model import load_model

    probe = "import megatron.core.transformer.moe.moe_utils as m; print(hasattr(m, 'te_general_gemm'))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"  # still needed
    model = load_model(model_factory("qwen3-moe"), "fp32", parity=False).eval()  # binds it
    with torch.no_grad(), cpu_current_device():
        assert _stock_forward(model).shape[:2] == (1, 8)
