#!/usr/bin/env bash
# Runs the GPU checks and kernel studies of one stage on a CUDA machine, each under its own time limit, writing
# JSON results and one log under OUT.  Usage: bash benchmarks/gpu_studies.sh STAGE OUT
#   rows    GPU kernel tests, then the 1-16 row MMA kernel, one-wave split and one-row GEMV anatomy studies
#   infllm  the block-selection anatomy and the decode-step study
set -u
stage=$1 out=$2
mkdir -p "$out"
log="$out/$stage.log"
step() {  # step SECONDS COMMAND...: runs one command under a limit, logging its output and exit status
  local limit=$1; shift
  echo "### $* (limit ${limit}s)" >>"$log"
  local t0=$SECONDS
  timeout "$limit" "$@" >>"$log" 2>&1
  echo "### exit $? after $((SECONDS - t0)) s" >>"$log"
}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >>"$log" 2>&1
case $stage in
  rows)
    step 150 python -m pytest tests -n 8 -p no:cacheprovider -k "gpu and (mma or w4a16 or nvfp4 or occupancy)"
    (cd benchmarks && step 270 python mma_rows.py --out "$out/mma_rows.json")
    (cd benchmarks && step 200 python rows_waves.py --out "$out/rows_waves.json")
    (cd benchmarks && step 150 python w4a16_gemv_anatomy.py --out "$out/gemv_anatomy.json")
    ;;
  infllm)
    step 120 python -m pytest tests -n 8 -p no:cacheprovider -k "gpu and infllm"
    (cd benchmarks && step 200 python infllm_select_anatomy.py --out "$out/select_anatomy.json")
    (cd benchmarks && step 200 python infllm_decode.py --out "$out/infllm_decode.json")
    ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
tail -c 11000 "$log"
