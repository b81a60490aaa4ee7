# What the peer setup scripts share, sourced by them with their arguments:
#
#   TORCH_VERSION=2.13.0
#   source "$(dirname "${BASH_SOURCE[0]}")/peer_venv.sh" "$@"
#
# Takes one argument, VENV_DIR (anything else: the caller's usage line, exit 2). Makes the virtual environment
# there with $PYTHON (default python3) unless it holds a python already, then installs torch==$TORCH_VERSION, the
# CPU build, before anything else, so that no later install pulls a CUDA build; stops if a CUDA build came.
# Sets VENV (the folder), REPO (this repository), PY (the environment's python), PIP (its pip install command, an
# array) and CONSTRAINTS (a pip constraints file pinning that torch) for the rest of the caller, and defines
# install_salaquant and check_peer (below) for its last steps.

if [[ $# -ne 1 ]]; then
    echo "usage: $0 VENV_DIR" >&2
    exit 2
fi
VENV=$1
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PYTHON=${PYTHON:-python3}

if [[ ! -x "$VENV/bin/python" ]]; then
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip install --disable-pip-version-check)

# 1. torch, CPU build, first.
"${PIP[@]}" "torch==${TORCH_VERSION}"
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.version.cuda is None else 1)'; then
    echo "error: a CUDA build of torch was installed in $VENV; install the CPU build of torch ${TORCH_VERSION}" >&2
    exit 1
fi

# Pin torch for every later step so no resolver replaces the CPU build.
CONSTRAINTS="$VENV/peer-constraints.txt"
printf 'torch==%s\n' "$TORCH_VERSION" >"$CONSTRAINTS"

# The last install step: salaquant without its dependency list (editable), plus what salaquant.model.{hf,loading}
# and salaquant.calibration.calib_data import beyond torch and transformers (no nvidia-modelopt).
install_salaquant() {
    "${PIP[@]}" -c "$CONSTRAINTS" "safetensors>=0.4" "tokenizers>=0.20" "numpy>=1.26" "pyyaml>=6.0" "rich>=13.0"
    "${PIP[@]}" --no-deps -e "$REPO"
}

# check_peer MODULE DIST...: import the peer's MODULE and salaquant's modules the runners use (failing loudly if the
# install is unusable), then print the version of each distribution named.
check_peer() {
    "$PY" - "$@" <<'PY'
import importlib
import importlib.metadata as md
import sys

import torch

for module in (sys.argv[1], "salaquant.calibration.calib_data", "salaquant.model.hf", "salaquant.model.loading"):
    importlib.import_module(module)
for name in ("torch", *sys.argv[2:], "salaquant"):
    print(f"{name:20s} {md.version(name)}")
print(f"{'torch cuda':20s} {torch.version.cuda}")
PY
}
