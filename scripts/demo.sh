#!/usr/bin/env bash
# The embedded default job: build a tiny random-init Llama (if absent), sample in vLLM,
# re-score in Megatron, and prove the log-probs bit-identical. Report under reports/demo/.
set -euo pipefail
cd "$(dirname "$0")/.."
K=.venv/bin/kimi-rl
[ -f models/tiny-llama/config.json ] || $K model init --arch llama --preset tiny --seed 0 models/tiny-llama
$K parity check --model models/tiny-llama --dtype bf16 --batch-sizes 1,8,32 \
    --num-prompts 8 --max-tokens 32 --report reports/demo
