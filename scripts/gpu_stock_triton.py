"""Run a kimi-rl command or script with vLLM's stock models on its Triton attention backend:

    python scripts/gpu_stock_triton.py rl.cli parity check ... --parity off
    python scripts/gpu_stock_triton.py scripts/bench_gpu.py --only rollout_speed --models DIR

Why: the GPU machine gets vLLM 0.24.0 without its FlashAttention extensions (190 + 153 MB, over
the transfer limit; docs/gpu.md), and vLLM 0.24's attention selector still picks FLASH_ATTN on
Hopper, then fails at start ("FlashAttention version not detected"). The parity models name
their own backend and are left alone (engines created with `hf_overrides`). Only this process
is patched: vLLM builds the engine config here and sends it to its EngineCore.
"""

from __future__ import annotations

import runpy
import sys

import vllm.engine.arg_utils as arg_utils

_create_engine_config = arg_utils.EngineArgs.create_engine_config


def _with_triton_attention(self, *args, **kwargs):
    if not self.hf_overrides and self.attention_backend is None:
        self.attention_backend = "TRITON_ATTN"
    return _create_engine_config(self, *args, **kwargs)


if __name__ == "__main__":
    arg_utils.EngineArgs.create_engine_config = _with_triton_attention
    target, sys.argv = sys.argv[1], sys.argv[1:]
    if target.endswith(".py"):
        runpy.run_path(target, run_name="__main__")
    else:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
