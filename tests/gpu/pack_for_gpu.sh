#!/usr/bin/env bash
# Packs what tests/gpu/run_e2e_on_gpu.sh needs on the GPU machine, which reaches no network:
#
#     tests/gpu/pack_for_gpu.sh [--cpu-venv]
#
# into .gpu-carry/ (git-ignored), to be passed with the device tool's `carry: [".gpu-carry"]`:
#   .gpu-carry/wheels/  pyinfra and its dependencies, pyyaml, jinja2, structlog, nvidia-ml-py, for the
#                       GPU machine's Python (3.12, x86_64 manylinux; $GPU_PYTHON_VERSION overrides)
#   .gpu-carry/debs/    openssh-server/-client/-sftp-server and their libraries (the lab's sshd, per
#                       shared/reference/gpu-machine-recipe.md), procps and psmisc (pkill, fuser: the
#                       seeds' kill chain), from this Debian machine's apt
# and prints the total size (the carry limit is 64 MiB). --cpu-venv also makes .venv-gpu here: a venv
# of /usr/bin/python3 with CPU torch and transformers, for tests/gpu/test_real_lab.py and the rehearsal.
set -euo pipefail
cd "$(dirname "$0")/../.."
CARRY=.gpu-carry
PYVER="${GPU_PYTHON_VERSION:-3.12}"
ABI="cp${PYVER/./}"
mkdir -p "$CARRY/wheels" "$CARRY/debs"

# --- wheels for the GPU machine's interpreter (binary wheels only: nothing is built there)
python3 -m pip download --quiet --disable-pip-version-check --dest "$CARRY/wheels" \
    --only-binary=:all: --python-version "$PYVER" --implementation cp --abi "$ABI" --abi abi3 --abi none \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any \
    'pyinfra>=3.10,<4' 'pyyaml>=6' 'jinja2>=3.1' 'structlog>=24.1' 'nvidia-ml-py>=12.535'

# --- Debian packages, unpacked there with dpkg -x (never installed into /)
(
    cd "$CARRY/debs"
    if ! apt-get download openssh-server openssh-sftp-server openssh-client libwrap0 libnsl2 libtirpc3 \
            procps libproc2-0 psmisc >/dev/null 2>&1; then
        apt-get update -qq
        apt-get download openssh-server openssh-sftp-server openssh-client libwrap0 libnsl2 libtirpc3 \
            procps libproc2-0 psmisc >/dev/null
    fi
)

if [ "${1:-}" = "--cpu-venv" ] && [ ! -x .venv-gpu/bin/python3 ]; then
    /usr/bin/python3 -m venv .venv-gpu
    .venv-gpu/bin/pip install --quiet torch==2.13.0   # the CPU wheel on this machine's disk
    .venv-gpu/bin/pip install --quiet transformers nvidia-ml-py
fi

# --- the checkout's own commit: the copy on the GPU machine travels without .git, and a `git log` there
# would climb to whatever repository encloses it (tests/gpu/e2e_on_gpu.py reads this file instead)
if git rev-parse --show-toplevel >/dev/null 2>&1 && [ "$(git rev-parse --show-toplevel)" = "$PWD" ]; then
    { git log -1 --format='%h %s'; git status --porcelain --untracked-files=no | grep -q . && echo "(with uncommitted changes)"; } \
        > "$CARRY/commit" || true
else
    echo "no commit: this checkout has no .git of its own" > "$CARRY/commit"
fi

ls "$CARRY/wheels" "$CARRY/debs"
size=$(du -sb "$CARRY" | cut -f1)
echo "$CARRY: $((size / 1024)) KiB ($(find "$CARRY" -type f | wc -l) files); carry limit 65536 KiB"
if [ "$size" -gt $((60 * 1024 * 1024)) ]; then
    echo "too large for the device tool's carry (64 MiB with the rest)" >&2
    exit 1
fi
