#!/usr/bin/env bash
# The embedded default job: build a tiny random-init Llama (if absent) and run the quickstart
# GRPO + LoRA training (configs/quickstart.yaml) through Ray, vLLM and Megatron, with bitwise
# rollout/trainer parity checked at every step. Output under runs/quickstart-<time>/.
set -euo pipefail
cd "$(dirname "$0")/.."
K=.venv/bin/kimi-rl
[ -f models/tiny-llama/config.json ] || $K model init --arch llama --preset tiny --seed 0 models/tiny-llama
# A fresh run directory each time: a run never overwrites an earlier one.
$K train configs/quickstart.yaml "run_dir=runs/quickstart-$(date +%Y%m%d-%H%M%S)" "$@"
