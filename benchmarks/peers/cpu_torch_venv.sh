# The start both peer setup scripts share, sourced by them with their arguments:
#
#   TORCH_VERSION=2.13.0
#   source "$(dirname "${BASH_SOURCE[0]}")/cpu_torch_venv.sh" "$@"
#
# Takes one argument, VENV_DIR (anything else: the caller's usage line, exit 2). Makes the virtual environment
# there with $PYTHON (default python3) unless it holds a python already, then installs torch==$TORCH_VERSION, the
# CPU build, before anything else, so that no later install pulls a CUDA build; stops if a CUDA build came.
# Sets VENV (the folder), REPO (this repository), PY (the environment's python) and PIP (its pip install command,
# an array) for the rest of the caller.

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
