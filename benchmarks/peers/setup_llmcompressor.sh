#!/usr/bin/env bash
# Build a separate virtual environment for the llm-compressor GPTQ peer (CPU only).
#
#   bash benchmarks/peers/setup_llmcompressor.sh VENV_DIR
#
# Installs, from the package registries only: the CPU build of torch first (so nothing pulls a CUDA
# build), then llm-compressor with the newest transformers it accepts, then salaquant itself
# (editable, without its dependency list) plus only what salaquant's model, loading and calibration
# code needs to import. Re-running on an existing VENV_DIR reuses it and converges to the same state.
set -euo pipefail

TORCH_VERSION=2.13.0
LLMCOMPRESSOR_VERSION=0.14.0.1
# llm-compressor 0.14.0.1 declares transformers>=5.15.0,<=5.17.0: take the newest it accepts.
TRANSFORMERS_VERSION=5.17.0
# shellcheck source=benchmarks/peers/cpu_torch_venv.sh
source "$(dirname "${BASH_SOURCE[0]}")/cpu_torch_venv.sh" "$@"

# Pin torch for every later step so no resolver replaces the CPU build.
CONSTRAINTS="$VENV/peer-constraints.txt"
printf 'torch==%s\n' "$TORCH_VERSION" >"$CONSTRAINTS"

# 2. llm-compressor and a transformers it accepts.
"${PIP[@]}" -c "$CONSTRAINTS" "llmcompressor==$LLMCOMPRESSOR_VERSION" "transformers==$TRANSFORMERS_VERSION"

# 3. salaquant without its dependency list, plus what salaquant.model.{hf,loading} and
#    salaquant.calibration.calib_data import (torch and transformers are already there; no nvidia-modelopt).
"${PIP[@]}" -c "$CONSTRAINTS" "safetensors>=0.4" "tokenizers>=0.20" "numpy>=1.26" "pyyaml>=6.0" "rich>=13.0"
"${PIP[@]}" --no-deps -e "$REPO"

"$PY" - <<'PY'
import importlib.metadata as md

import torch

import salaquant.calibration.calib_data  # noqa: F401
import salaquant.model.hf  # noqa: F401
import salaquant.model.loading  # noqa: F401

for name in ("torch", "transformers", "llmcompressor", "compressed-tensors", "accelerate", "safetensors", "salaquant"):
    print(f"{name:20s} {md.version(name)}")
print(f"{'torch cuda':20s} {torch.version.cuda}")
PY
