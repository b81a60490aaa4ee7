#!/usr/bin/env bash
# Create a virtual environment for the GPTQModel peer runner (benchmarks/peers/gptqmodel_gptq.py).
#
#   bash benchmarks/peers/setup_gptqmodel.sh VENV_DIR
#
# Installs from the package registries only, in this order:
#   1. torch==2.13.0, the CPU build (the same torch as the project's main environment), so that nothing later
#      pulls a CUDA build;
#   2. gptqmodel==7.7.0 (an sdist). Its setup.py compiles nothing: its C++/CUDA kernels are built lazily at run
#      time (JIT, gptqmodel/extension.py), so no CUDA toolkit or switch is needed to install it on a CPU-only
#      machine. Its metadata asks for torch>=2.14.1, which would replace the CPU torch pinned above, so it is
#      installed with --no-deps and its declared requirements (all but torch) are installed explicitly below;
#   3. salaquant itself (--no-deps, editable) plus the few packages its model, loading and calibration modules
#      import (nvidia-modelopt is not needed for these and is not installed).
# Running it again on an existing VENV_DIR reinstalls nothing that is already satisfied.
set -euo pipefail

GPTQMODEL_VERSION=${GPTQMODEL_VERSION:-7.7.0}
TORCH_VERSION=2.13.0
# shellcheck source=benchmarks/peers/peer_venv.sh
source "$(dirname "${BASH_SOURCE[0]}")/peer_venv.sh" "$@"

# 2. GPTQModel and its declared requirements (torch excluded, see above). No extension is built at install
# time; the CPU quantization path (GPTQ on torch) needs none of its CUDA kernels.
"${PIP[@]}" \
    "accelerate>=1.15.0" \
    "numpy>=2.4.6" \
    "safetensors>=0.8.0" \
    "filelock>=4.2.4" \
    "transformers>=5.20.2" \
    "threadpoolctl>=3.7.0" \
    "packaging>=26.3" \
    "device-smi>=0.5.7" \
    "protobuf>=7.36.2" \
    "pillow>=13.0.0" \
    "requests>=2.34.2" \
    "pypcre>=0.6.4" \
    "tokenicer>=0.0.14" \
    "logbar>=0.4.15" \
    "jinja2>=3.1.6" \
    "ninja>=1.13.2" \
    "maturin>=1.15.0" \
    "datasets>=5.1.0" \
    "pyarrow>=26.0.0" \
    "dill>=0.4.1" \
    "torchao>=0.18.0" \
    "defuser>=0.0.28" \
    "torch==${TORCH_VERSION}"
"${PIP[@]}" --no-deps --no-build-isolation "setuptools>=84.2.1,<85" wheel
"${PIP[@]}" --no-deps --no-build-isolation "gptqmodel==${GPTQMODEL_VERSION}"

# 3. salaquant (editable, no dependencies) and what salaquant.model / .model.loading / .calibration import.
"${PIP[@]}" "tokenizers>=0.20" "pyyaml>=6.0" "pydantic>=2.6" "rich>=13.0" "typer>=0.12" "torch==${TORCH_VERSION}"
"${PIP[@]}" --no-deps --no-build-isolation -e "$REPO"

"$PY" - <<'EOF'
import importlib.metadata as md
import sys

import torch

print(f"python {sys.version.split()[0]}")
print(f"torch {torch.__version__} (cuda: {torch.version.cuda})")
for name in ("gptqmodel", "transformers", "accelerate", "safetensors", "datasets", "torchao", "defuser", "salaquant"):
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name} not installed")
import gptqmodel  # noqa: E402,F401  (fails loudly here if the install is unusable)
import salaquant.calibration.calib_data  # noqa: E402,F401
import salaquant.model.hf  # noqa: E402,F401
import salaquant.model.loading  # noqa: E402,F401

print("imports ok: gptqmodel, salaquant.model.hf, salaquant.model.loading, salaquant.calibration.calib_data")
EOF
