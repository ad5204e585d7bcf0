#!/usr/bin/env bash
# `kimi-rl parity check` on a CUDA machine, eager and with CUDA graphs asked for, parity on and
# off, then stock-vs-parity rollout tokens/s (docs/gpu.md). Run after scripts/gpu_check.sh has
# installed vLLM (STAGES=vllm), in the repository root:
#
#   scripts/gpu_parity.sh OUT_DIR
#
# Runs in priority order under DEADLINE (seconds for the whole script, default 540): CUDA
# graphs first (sampled at temperature 0.7 / top-p / top-k, with a LoRA adapter too), then the rollout speed of tiny and mid Llama, then eager and stock; one log
# and one report directory per run; prints each run's table; PACK=file.tgz archives OUT_DIR.
set -u
OUT_DIR=${1:?usage: gpu_parity.sh OUT_DIR}
SITE=${SITE:-/tmp/kimi-site}
MODELS=${MODELS:-/tmp/kimi-models}
DEADLINE=${DEADLINE:-540}
PY=${PY:-python3}
mkdir -p "$OUT_DIR" "$MODELS"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false VLLM_USE_FLASHINFER_SAMPLER=0
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
for arch in llama qwen3; do
    [ -d "$MODELS/tiny-$arch" ] || $PY -m rl.cli model init --arch $arch --preset tiny --seed 0 \
        --dtype bf16 "$MODELS/tiny-$arch" >"$OUT_DIR/init-$arch.log" 2>&1
done
# mid-llama: 137M parameters (hidden 1024, 12 layers, 16 / 4 heads, MLP 2816; o_proj and
# down_proj in 4 row-parallel K-slices), where the GEMMs and attention, not launches, dominate
[ -d "$MODELS/mid-llama" ] || $PY -c "from rl.models import init_model; init_model('llama', 'small', 0, \
    '$MODELS/mid-llama', 'bf16', overrides=dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=16, \
    num_key_value_heads=4, head_dim=64, intermediate_size=2816))" >"$OUT_DIR/init-mid.log" 2>&1
run() {  # run NAME SECONDS CMD...: one log per run, its last lines printed
    local name=$1 limit=$2 left=$((DEADLINE - SECONDS)); shift 2
    [ "$left" -lt "$limit" ] && limit=$left
    [ "$limit" -lt 30 ] && { echo "== $name: skipped (deadline)"; return; }
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1
    echo "== $name: rc=$? in $((SECONDS - t0)) s"
    grep -E "┃|│|MISMATCH|PASS|bitwise|Error|error:|captur|CUDA graph|cudagraph|rollout_speed" \
        "$OUT_DIR/$name.log" | grep -v "^\s*$" | tail -n "${TAIL:-14}"
}
check() {  # check NAME MODEL EXTRA_ARGS...: stock models on Triton attention (no FA carried)
    local name=$1 model=$2; shift 2
    run "$name" 150 $PY scripts/gpu_stock_triton.py rl.cli parity check --model "$MODELS/$model" --dtype bf16 \
        --batch-sizes 1,8,32 --num-prompts 8 --max-tokens 32 --report "$OUT_DIR/$name" "$@"
}
[ -d "$MODELS/tiny-llama-adapter" ] || $PY scripts/random_adapter.py "$MODELS/tiny-llama" \
    "$MODELS/tiny-llama-adapter" >"$OUT_DIR/init-adapter.log" 2>&1
check llama-graphs tiny-llama --cuda-graphs on
check llama-sampled tiny-llama --cuda-graphs on --temperature 0.7 --top-p 0.9 --top-k 20
check llama-lora-graphs tiny-llama --cuda-graphs on --adapter "$MODELS/tiny-llama-adapter"
check llama-lora-eager tiny-llama --adapter "$MODELS/tiny-llama-adapter"
check mid-graphs mid-llama --cuda-graphs on
run rollout-speed 230 $PY scripts/gpu_stock_triton.py scripts/bench_gpu.py --only rollout_speed \
    --models "$MODELS/tiny-llama,$MODELS/mid-llama" --out "$OUT_DIR/rollout_speed.json"
check qwen3-graphs tiny-qwen3 --cuda-graphs on
check llama-eager tiny-llama
check qwen3-eager tiny-qwen3
check llama-off-graphs tiny-llama --parity off --cuda-graphs on
echo "== total $SECONDS s"
if [ -n "${PACK:-}" ]; then
    tar czf "$PACK" -C "$(dirname "$OUT_DIR")" "$(basename "$OUT_DIR")"
fi
