#!/usr/bin/env bash
# The figures of docs/performance.md, measured on the machine this runs on: fused_training,
# sample_throughput and slices on tinsmith/small and on SmolLM2-135M's shape, and prefill_burst's
# chunked long prompt on SmolLM2-135M's shape, each on the device the
# engines resolve (TINSMITH_DEVICE, auto: the GPU where there is one). Each benchmark's output
# goes to OUT_DIR/<name>.txt; one that fails or runs past its limit does not stop the others.
#
#   bench/gpu_figures.sh [OUT_DIR]      (default: gpu-figures)
#
# PYTHON: the interpreter (default .venv/bin/python). SMOL_LIKE: where SmolLM2-135M's config
# and tokenizer come from (default its built-in name, which needs its GGUF installed; on a
# machine without it, a copy made by `bench.random_weights DIR --like <name> --no-weights`).
# LIMIT_S: each benchmark's time limit (default 300 s).
set -uo pipefail

out=${1:-gpu-figures}
python=${PYTHON:-.venv/bin/python}
limit=${LIMIT_S:-300}
mkdir -p "$out"

models_dir=$(mktemp -d)
trap 'rm -rf "$models_dir"' EXIT
export TINSMITH_MODEL_DIRS=$models_dir
smol=$models_dir/smollm2-135m-random
"$python" -m bench.random_weights "$smol" --like "${SMOL_LIKE:-HuggingFaceTB/SmolLM2-135M-Instruct}"

run() {
    local name=$1
    shift
    echo "== $name: $*"
    timeout --signal=TERM --kill-after=20 "$limit" "$python" -m "$@" 2>&1 | tee "$out/$name.txt"
    echo "== $name: exit ${PIPESTATUS[0]}"
}

sizes=(--sizes 1 4 16 64 256)
held=(--batch 8 --prompt 32 --tokens 32 --rounds 3 --held 1 8 64)
run fused-smollm2 bench.fused_training --model "$smol" "${sizes[@]}"
run sample-smollm2 bench.sample_throughput --model "$smol" "${held[@]}"
run fused-small bench.fused_training --model tinsmith/small "${sizes[@]}"
run sample-small bench.sample_throughput --model tinsmith/small "${held[@]}"
run slices-smollm2 bench.slices --model "$smol" --shapes 16x1024 32x2048
run slices-small bench.slices --model tinsmith/small --shapes 16x1024 32x2048
run prefill-chunks-smollm2 bench.prefill_burst --model "$smol" --burst 1 --prompt 8000 --bound 2048
