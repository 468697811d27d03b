#!/bin/sh
# The real-GPU tests of the GPU fact and the gate, in one command, on a machine with an NVIDIA GPU,
# torch and python3 (e.g. the lent H200):
#
#     tests/gpu/run_on_gpu.sh [WHEELS_DIR]
#
# Nothing is downloaded. When pyinfra (or pytest, nvidia-ml-py...) is missing, they are installed
# offline from WHEELS_DIR (default: $GPUGATE_WHEELS, else ./wheels) into .venv-gpu, a venv that
# still sees the system's torch (--system-site-packages). gpugate itself runs from this checkout.
# Figures: printed as JSON, and written to $OUT/gpu_gate.json when $OUT is set (else ./gpu_gate.json).
# Knobs: GPUGATE_GPU_HOLD_GIB (20), GPUGATE_GPU_REPEATS (10).
set -eu
cd "$(dirname "$0")/../.."
WHEELS="${1:-${GPUGATE_WHEELS:-wheels}}"
PYTHON=python3
if ! $PYTHON -c 'import pyinfra, pytest, pynvml, yaml, jinja2, structlog' 2>/dev/null; then
    if [ ! -x .venv-gpu/bin/python ]; then
        $PYTHON -m venv --system-site-packages .venv-gpu
    fi
    .venv-gpu/bin/python -m pip install --quiet --no-index --find-links "$WHEELS" \
        'pyinfra>=3.10,<4' pytest nvidia-ml-py pyyaml jinja2 structlog
    PYTHON="$PWD/.venv-gpu/bin/python"
fi
# @local runs the probe with the `python3` on PATH: the same interpreter, so it finds pynvml.
BIN_DIR="$(dirname "$($PYTHON -c 'import sys; print(sys.executable)')")"
export PATH="$BIN_DIR:$PATH"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export GPUGATE_GPU_RESULTS="${OUT:-.}/gpu_gate.json"
$PYTHON -c 'import sys; print("python", sys.version.split()[0])'
nvidia-smi --query-gpu=index,name,memory.used,memory.total,driver_version --format=csv || true
exec $PYTHON -m pytest -m gpu tests/gpu -s -q -p no:cacheprovider
