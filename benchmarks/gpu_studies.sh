#!/usr/bin/env bash
# Runs the GPU checks and kernel studies of one stage on a CUDA machine, each under its own time limit, writing
# JSON results and one log under OUT.  Usage: bash benchmarks/gpu_studies.sh STAGE OUT
#   rows    GPU kernel tests, then the 1-16 row MMA kernel, one-wave split and one-row GEMV anatomy studies
#   infllm  the block-selection anatomy and the decode-step study
#   matrix  GPU tests of the 1-16-row 4-bit matrix kernels, then their tables at 1, 2 and 16 rows (each with the
#           launch timed with programmatic dependent launch beside it)
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
  matrix)
    step 240 python -m pytest -n 8 -p no:cacheprovider -k gpu tests/test_kernels_pdl.py tests/test_kernels_mma_rows.py \
      tests/test_kernels_w4a16_paired.py tests/test_kernels_nvfp4_paired.py
    (cd benchmarks && step 170 python kernels_w4a16.py --out "$out/kernels_w4a16.json" --m 1 16 --rep 100)
    (cd benchmarks && step 170 python kernels_nvfp4.py --out "$out/kernels_nvfp4.json" --ms 1,2,16)
    ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
tail -c 11000 "$log"
