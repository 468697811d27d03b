#!/bin/sh
# The real-GPU tests of the GPU fact and the gate, in one command, on a machine with an NVIDIA GPU,
# torch and python3 (e.g. the lent H200):
#
#     tests/gpu/run_on_gpu.sh [WHEELS_DIR]
#
# Nothing is downloaded. When pyinfra (or pytest, nvidia-ml-py...) is missing, they are installed
# offline from WHEELS_DIR (default: $GPUGATE_WHEELS, else ./wheels) into .gpu-site (a --target dir
# on PYTHONPATH, so the system's torch stays in view). gpugate itself runs from this checkout.
# Figures: printed as JSON, and written to $OUT/gpu_gate.json when $OUT is set (else ./gpu_gate.json).
# Knobs: GPUGATE_GPU_HOLD_GIB (20), GPUGATE_GPU_REPEATS (10).
set -eu
cd "$(dirname "$0")/../.."
WHEELS="${1:-${GPUGATE_WHEELS:-wheels}}"
PYTHON=python3
SITE=""
if ! $PYTHON -c 'import pyinfra, pytest, pynvml, yaml, jinja2, structlog' 2>/dev/null; then
    # A --target dir rather than a venv: the GPU machine's python3 may itself be a venv (torch lives
    # there), and a venv made from a venv does not see the first one's packages.
    SITE="$PWD/.gpu-site"
    $PYTHON -m pip install --quiet --no-index --find-links "$WHEELS" --target "$SITE" \
        'pyinfra>=3.10,<4' pytest nvidia-ml-py pyyaml jinja2 structlog
fi
# @local runs the probe with the `python3` on PATH: the same interpreter, so it finds pynvml.
BIN_DIR="$(dirname "$($PYTHON -c 'import sys; print(sys.executable)')")"
export PATH="$BIN_DIR:$PATH"
export PYTHONPATH="$PWD${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"
export GPUGATE_GPU_RESULTS="${OUT:-.}/gpu_gate.json"
$PYTHON -c 'import sys; print("python", sys.version.split()[0])'
nvidia-smi --query-gpu=index,name,memory.used,memory.total,driver_version --format=csv || true
exec $PYTHON -m pytest -m gpu tests/gpu -s -q -p no:cacheprovider
