#!/usr/bin/env bash
# The whole GPU path in one go, on a CUDA machine whose python3 already has torch + triton
# (see docs/gpu.md): install the carried wheels, run the CUDA kernel tests, the benchmark,
# the trainer's tests on CUDA, and `kimi-rl parity check` with vLLM's CUDA build.
#
#   scripts/gpu_check.sh [OUT_DIR] [WHEEL_DIR]      (defaults: bench_results/gpu .gpu/wheels)
#
# WHEEL_DIR holds megatron-core, vLLM's wheel (or a slimmed zip of it) and the vLLM
# dependencies the machine lacks (docs/gpu.md says how they were made). Each stage has its own
# time limit and log; a failing stage does not stop the next. STAGES=tests,bench,trainer,vllm,check
# picks stages (vllm: the import, check: the parity check); DEADLINE=SECONDS caps the whole run;
# C_PIECES="a b" names the pieces of vLLM's core extension; TRAIN_DIRS="a b" the two parts of
# what `kimi-rl train` adds (scripts/gpu_bundle.sh: train_a, train_b). PIECES=DIR instead: the
# bundle's pieces (scripts/gpu_bundle.sh: p1/piece.0, p2/piece.1, ...) gathered in DIR, unpacked
# to /tmp/kimi-bundle, which then gives all three (and the SmolLM2 GGUF).
set -u
OUT_DIR=${1:-bench_results/gpu}
WHEELS=${2:-.gpu/wheels}
if [ -n "${PIECES:-}" ]; then
    bundle=/tmp/kimi-bundle
    [ -d "$bundle/wheels" ] || { mkdir -p "$bundle" && cat "$PIECES"/piece.* | tar xf - -C "$bundle"; } || exit 1
    WHEELS=$bundle/wheels C_PIECES="$bundle/cpart_a/C.so.gz.aa $bundle/cpart_b/C.so.gz.ab"
    TRAIN_DIRS="$bundle/train_a $bundle/train_b"
fi
STAGES=${STAGES:-tests,bench,trainer,vllm,check}
SITE=${SITE:-/tmp/kimi-site}
mkdir -p "$OUT_DIR" "$SITE"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# FlashInfer is not carried: vLLM's sampler must not probe it
export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
has() { [[ ",$STAGES," == *",$1,"* ]]; }
stage() {  # stage NAME SECONDS CMD...
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    if [ -n "${DEADLINE:-}" ]; then  # seconds since the start that the whole script may take
        local left=$((DEADLINE - SECONDS))
        [ "$left" -lt "$limit" ] && limit=$left
        [ "$limit" -lt 10 ] && { echo "== $name: skipped (deadline)"; return; }
    fi
    timeout "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc=$rc in $((SECONDS - t0)) s (limit $limit)"
    tail -n "${TAIL:-15}" "$OUT_DIR/$name.log"
}

t0=$SECONDS
if [ ! -f "$SITE/.installed" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
        "$WHEELS"/megatron_core-*.whl "$WHEELS"/vdeps/*.whl >"$OUT_DIR/install.log" 2>&1 \
        && installed=1 || { echo "pip install failed"; tail "$OUT_DIR/install.log"; }
    for z in "$WHEELS"/vllm-*.zip "$WHEELS"/vllm-*.whl; do
        [ -f "$z" ] && $PY -m zipfile -e "$z" "$SITE"
    done
    # kimi-rl's vLLM plugin entry point, so vLLM's engine processes register the parity models
    cp -r "$WHEELS"/kimi_rl-*.dist-info "$SITE"/ 2>/dev/null
    [ -n "${installed:-}" ] && touch "$SITE/.installed"  # a failed install is retried next call
fi
if [ -n "${C_PIECES:-}" ] && [ ! -f "$SITE/vllm/_C_stable_libtorch.abi3.so" ]; then
    # vLLM's core CUDA extension, carried in pieces (scripts/gpu_bundle.sh); it replaces the
    # stand-in module of the slim zip
    cat $C_PIECES | gunzip >"$SITE/vllm/_C_stable_libtorch.abi3.so" && rm -f "$SITE/vllm/_C_stable_libtorch.py"
fi
if [ -n "${TRAIN_DIRS:-}" ] && [ ! -f "$SITE/.train-installed" ]; then
    # What `kimi-rl train` adds (scripts/gpu_bundle.sh): Ray's wheel in halves, the rest whole.
    parts=$(find $TRAIN_DIRS -name 'ray-*.whl.part*' | awk -F.part '{print $NF, $0}' | sort -n | cut -d' ' -f2-)
    ray="/tmp/$(basename "$(echo "$parts" | head -1)" .part0)"
    cat $parts >"$ray"
    # the sdists are needs with compiled code and no cp312 wheel on the index (pycosat)
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --no-build-isolation --target "$SITE" \
        "$ray" $(find $TRAIN_DIRS -name '*.whl' -o -name '*.tar.gz') >"$OUT_DIR/install-train.log" 2>&1 \
        && touch "$SITE/.train-installed" || { echo "pip install (train) failed"; tail "$OUT_DIR/install-train.log"; }
fi
echo "== install: $((SECONDS - t0)) s"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
$PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'

if has tests; then
    stage tests 150 $PY -m pytest -q -p no:cacheprovider tests/unit/test_cuda_kernels.py
fi
if has bench; then
    stage bench 170 $PY scripts/bench_gpu.py --skip-trainer --out "$OUT_DIR/bench_gpu.json"
fi
if has trainer; then
    stage trainer 100 $PY scripts/bench_gpu.py --only trainer --out "$OUT_DIR/trainer_gpu.json"
    stage trainer_tests 70 $PY -m pytest -q -p no:cacheprovider tests/integration/test_trainer.py tests/integration/test_megatron_patches.py
fi
if has vllm; then
    MODEL=${MODEL:-/tmp/kimi-models/tiny-llama}
    [ -d "$MODEL" ] || $PY -m rl.cli model init --arch llama --preset tiny --seed 0 "$MODEL" >"$OUT_DIR/model_init.log" 2>&1
    stage vllm_import 45 $PY -c 'import vllm, vllm.entrypoints.llm; print("vllm", vllm.__version__)'
    has check && stage parity_check 300 $PY -m rl.cli parity check --model "$MODEL" --dtype "${DTYPE:-bf16}" \
        --batch-sizes "${BATCH_SIZES:-1,8,32}" --num-prompts 8 --max-tokens 32 --report "$OUT_DIR/report"
fi
echo "== total $SECONDS s"
if [ -n "${PACK:-}" ]; then  # one archive of all logs and reports
    tar czf "$PACK" -C "$(dirname "$OUT_DIR")" "$(basename "$OUT_DIR")"
fi
