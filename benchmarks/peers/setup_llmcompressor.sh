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
# shellcheck source=benchmarks/peers/peer_venv.sh
source "$(dirname "${BASH_SOURCE[0]}")/peer_venv.sh" "$@"

# 2. llm-compressor and a transformers it accepts.
"${PIP[@]}" -c "$CONSTRAINTS" "llmcompressor==$LLMCOMPRESSOR_VERSION" "transformers==$TRANSFORMERS_VERSION"

# 3. salaquant and what its runners' imports need; then the check.
install_salaquant
check_peer llmcompressor transformers llmcompressor compressed-tensors accelerate safetensors
