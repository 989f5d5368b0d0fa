#!/usr/bin/env bash
# On a bare CUDA machine, from the checkout's root (after loadtests/gpu/prepare.sh, carrying .gpu/):
# the native kernel tests, HF parity with graphs on and off, the offline speed table against HF and
# the bandwidth bound, a decode profile, then `pdserve up --device cuda` under load against the
# offline engine. Results under $OUT (raw JSON lines, pytest output, served-load tables).
#   KERNEL_TESTS=1 STAGES="env parity speed-smol speed-1b7 profile" SERVE=1 bash loadtests/gpu/run.sh
# Each part has its own time limit (T_TESTS, T_BENCH, T_SERVE seconds), so that one hung part
# cannot take the others' results with it; the limit comes as SIGINT, so that a part cut short
# still reports what it has (pytest its failures, bench_serve stops its clusters). The kernel
# tests took 144 s of their 150 on an H100 on 2026-11-26 (157 tests, 8 workers); now 273 tests,
# one worker per core up to 16, 180 s. DEADLINE (seconds from the start) gives the served
# load what is left of it; SERVE_MODES picks bench_serve's modes (default colocated,grpc; add
# grpc-bytes for the gRPC push of bytes beside the same-host shared-memory one, local for the
# router with a decode worker that prefills every prompt itself: the engine out of the router's
# process, against colocated's one GIL for both; ~70 s more per mode).
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/gpu_out} MODELS_DIR=${MODELS_DIR:-/tmp/pdserve-models}
export PDSERVE_TESTS_ALLOW_NO_DEFAULT_MODEL=1
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 3
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
start=$(date +%s)
elapsed() { echo "elapsed $(( $(date +%s) - start )) s"; }
if [ "${KERNEL_TESTS:-1}" = 1 ]; then
  # one xdist worker per core, up to 16: the kernel tests' time is mostly Triton compiling
  workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n $(( $(nproc) < 16 ? $(nproc) : 16 ))")
  # SIGINT first: pytest stops and still prints what failed and why
  timeout -s INT -k 30 "${T_TESTS:-180}" python3 -m pytest -q -p no:cacheprovider $workers --durations=10 -rs \
    ${TESTS:-tests/kernels tests/unit/test_cuda_graphs.py tests/unit/test_gpu_memory.py tests/unit/test_async_scheduling.py tests/unit/test_kv_ingest.py} \
    -k "not cpu_ and not calibration" > "$OUT/pytest.txt" 2>&1
  echo "pytest rc=$?" >> "$OUT/pytest.txt"
  tail -25 "$OUT/pytest.txt"; elapsed
fi
if [ -n "${STAGES-env parity speed-smol speed-1b7}" ]; then
  timeout -s INT -k 30 "${T_BENCH:-300}" python3 -m loadtests.bench_gpu ${STAGES-env parity speed-smol speed-1b7} \
    --tokenizer-dir .gpu/model --out "$OUT" 2>&1 | grep -v "Loading weights\|Writing model" | tee "$OUT/bench_gpu.txt"
  elapsed
fi
serve_s=${T_SERVE:-240}
if [ -n "${DEADLINE:-}" ]; then serve_s=$(( DEADLINE - $(date +%s) + start )); fi
if [ "${SERVE:-1}" = 1 ] && [ "$serve_s" -ge 90 ]; then
  # a machine that went cold since the speed stages has no models: build them (seconds)
  [ -d "$MODELS_DIR"/smol1b7-bfloat16 ] || python3 -m loadtests.bench_gpu models --tokenizer-dir .gpu/model --out "$OUT"
  model=$(ls -d "$MODELS_DIR"/smol1b7-bfloat16 2>/dev/null || ls -d "$MODELS_DIR"/smol135m-bfloat16)
  # SIGINT, so that bench_serve stops its clusters (each in a session of its own) on the way out
  timeout -s INT -k 30 "$serve_s" python3 -m loadtests.bench_serve --model "$model" --device cuda --modes "${SERVE_MODES:-colocated,grpc}" \
    --load-concurrency 1,64 --load-requests 128 --load-prompt-len 128 --load-max-tokens 128 \
    --up-args "--kvstore-gib 0 --cpu-offload-gb 0" 2>&1 | tee "$OUT/bench_serve.txt"; elapsed
  pkill -f "services.cli up" 2>/dev/null  # any cluster left all the same holds GPU memory
  # each service's log (the engines' "engine: N steps ..." lines: steps/s and rows per step)
  for dir in /tmp/pdserve-up-*; do
    [ -d "$dir" ] && mkdir -p "$OUT/serve_logs/${dir##*/}" \
      && find "$dir" -maxdepth 1 -name '*.log' -size -2M -exec cp {} "$OUT/serve_logs/${dir##*/}/" \;
  done
fi
