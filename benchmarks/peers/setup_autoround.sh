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
# shellcheck source=benchmarks/peers/cpu_torch_venv.sh
source "$(dirname "${BASH_SOURCE[0]}")/cpu_torch_venv.sh" "$@"

# Pin torch for every later step so no resolver replaces the CPU build.
CONSTRAINTS="$VENV/peer-constraints.txt"
printf 'torch==%s\n' "$TORCH_VERSION" >"$CONSTRAINTS"

# 2. auto-round (without its [cpu] extra: no prebuilt kernels are needed to quantize) and a transformers it accepts.
"${PIP[@]}" -c "$CONSTRAINTS" "auto-round==$AUTOROUND_VERSION" "transformers==$TRANSFORMERS_VERSION"

# 3. salaquant without its dependency list, plus what salaquant.model.{hf,loading} and
#    salaquant.calibration.calib_data import (torch, transformers and datasets are already there).
"${PIP[@]}" -c "$CONSTRAINTS" "safetensors>=0.4" "tokenizers>=0.20" "numpy>=1.26" "pyyaml>=6.0" "rich>=13.0"
"${PIP[@]}" --no-deps -e "$REPO"

"$PY" - <<'PY'
import importlib.metadata as md

import torch

import auto_round  # noqa: F401  (fails loudly here if the install is unusable)
import salaquant.calibration.calib_data  # noqa: F401
import salaquant.model.hf  # noqa: F401
import salaquant.model.loading  # noqa: F401

for name in ("torch", "transformers", "auto-round", "accelerate", "datasets", "safetensors", "salaquant"):
    print(f"{name:20s} {md.version(name)}")
print(f"{'torch cuda':20s} {torch.version.cuda}")
PY
