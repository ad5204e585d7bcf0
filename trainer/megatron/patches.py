"""CPU shims for megatron-core 0.16.1 (the newest release for Python 3.11).

Megatron assumes CUDA in a few places that the parity trainer reaches on a CPU-only torch.
Each shim names the version and the bug; tests/integration/test_megatron_patches.py fails when a shim
stops applying (the target moved) or stops being needed (the bug was fixed).
"""

from __future__ import annotations

import contextlib
import os

import torch

from trainer.distributed import free_port


def needs_cuda_shim() -> bool:
    return not torch.cuda.is_available()


@contextlib.contextmanager
def cpu_current_device():
    """megatron-core 0.16.1 calls `torch.cuda.current_device()` unconditionally in forward
    paths (rotary_pos_embedding.py RotaryEmbedding.get_emb, utils.py GlobalMemoryBuffer);
    on a CPU-only torch that raises "Torch not compiled with CUDA enabled". While Megatron
    runs, map it to "cpu". Scoped to a context so other libraries keep the real function."""
    if not needs_cuda_shim():
        yield
        return
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = original


def bind_router_gemm_without_te() -> None:
    """megatron-core 0.16.1 `moe/moe_utils.py` router GEMM (`RouterGatingLinearFunction`) reads
    the module global `te_general_gemm`, which is bound only when Transformer Engine imports:
    without TE a stock MoE forward raises NameError. Bind it to None (the code's own "no TE"
    value: torch's matmul)."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def init_megatron(tp_size: int = 1, seed: int = 0) -> None:
    """Initialise torch.distributed (gloo on CPU, world of one unless launched otherwise)
    and Megatron's parallel state.

    megatron-core 0.16.1: `tensor_parallel.model_parallel_cuda_manual_seed` asserts on
    `torch.cuda.get_rng_state` without CUDA. The trainer uses no dropout, so Megatron's
    inference RNG tracker (a no-op fork) replaces the CUDA tracker on the CPU."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(
            backend,
            rank=int(os.environ.get("RANK", 0)),
            world_size=int(os.environ.get("WORLD_SIZE", 1)),
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size)
    if needs_cuda_shim():
        mrandom.initialize_rng_tracker(inference_rng_tracker=True)
    else:
        mrandom.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
