#!/usr/bin/env bash
# Build a separate virtual environment for the AutoRound peer (benchmarks/peers/autoround.py; CPU only).
#
#   bash benchmarks/peers/setup_autoround.sh VENV_DIR
#
# Installs, from the package registries only: the CPU build of torch first (so nothing pulls a CUDA
# build), then auto-round with a transformers it accepts, then salaquant itself (editable, without its
# dependency list) plus only what salaquant's model, loading and calibration code needs to import.
# auto-round needs Python >= 3.11. Re-running on an existing VENV_DIR reuses it and converges to the same state.
set -euo pipefail

TORCH_VERSION=2.13.0
AUTOROUND_VERSION=0.16.1
# auto-round 0.16.1 declares transformers>=4.38 with no upper bound: the one salaquant's own environment runs.
TRANSFORMERS_VERSION=5.25.0
# shellcheck source=benchmarks/peers/peer_venv.sh
source "$(dirname "${BASH_SOURCE[0]}")/peer_venv.sh" "$@"

# 2. auto-round (without its [cpu] extra: no prebuilt kernels are needed to quantize) and a transformers it accepts.
"${PIP[@]}" -c "$CONSTRAINTS" "auto-round==$AUTOROUND_VERSION" "transformers==$TRANSFORMERS_VERSION"

# 3. salaquant and what its runners' imports need; then the check.
install_salaquant
check_peer auto_round transformers auto-round accelerate datasets safetensors
