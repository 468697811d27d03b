#!/usr/bin/env bash
# The whole transition on the real GPU machine, in one call (issue 15):
#
#     tests/gpu/run_e2e_on_gpu.sh RESULTS_DIR [--simulated] [e2e_on_gpu.py options]
#
# On the GPU machine (no network; the lead carries .gpu-carry/ made by tests/gpu/pack_for_gpu.sh):
#   1. sshd, ssh, ssh-keygen from the carried Debian packages (unpacked into /opt/ssh, never into /),
#      and pkill/pgrep/ps/fuser the same way where the machine lacks them
#      (shared/reference/gpu-machine-recipe.md);
#   2. pyinfra and the rest from the carried wheels into .gpu-site (a --target dir on PYTHONPATH, so
#      the machine's torch env stays in view), and the `pct` connector's entry point registered for
#      this checkout (a dist-info beside them: nothing is built there);
#   3. tests/gpu/e2e_on_gpu.py: `gpugate lab up --gpus real` and the eight steps through the real
#      pyinfra CLI, each recorded, none stopping the next, within a budget.
# Writes RESULTS_DIR/e2e_results.json (every figure and outcome), RESULTS_DIR/e2e.log (every command
# and its output), audit.jsonl, gpu_samples.jsonl (the NVML v2 poller), setup.log. Prints a summary.
# --simulated: the same on the simulated lab (a rehearsal on a machine without a GPU).
# Never pipe this into tail/grep: the lab's daemons would hold the pipe open (the recipe's pitfall).
set -uo pipefail
cd "$(dirname "$0")/../.."
RESULTS="${1:?usage: tests/gpu/run_e2e_on_gpu.sh RESULTS_DIR [--simulated]}"
shift
mkdir -p "$RESULTS"
RESULTS="$(cd "$RESULTS" && pwd)"
CARRY="${GPUGATE_CARRY:-$PWD/.gpu-carry}"
SETUP_LOG="$RESULTS/setup.log"
TOTAL_BUDGET_S="${GPUGATE_E2E_TOTAL_S:-540}"   # the device call's limit is 600 s
started=$(date +%s)
say() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$SETUP_LOG"; }

# ---- 1. and 2.: sshd and the tools from the carried .debs, the Python packages from the carried wheels
. tests/gpu/setup_on_gpu.sh

# ---- 3. the run
left=$((TOTAL_BUDGET_S - ($(date +%s) - started)))
budget=$((left - 40))
say "running tests/gpu/e2e_on_gpu.py (budget ${budget}s) $*"
timeout --kill-after=10 "$((left - 10))" $PY tests/gpu/e2e_on_gpu.py --results "$RESULTS" --budget-s "$budget" "$@" \
    > "$RESULTS/e2e.stdout" 2>&1 < /dev/null
rc=$?
say "e2e_on_gpu.py exit $rc after $(( $(date +%s) - started )) s"
cat "$RESULTS/e2e.stdout"
exit $rc
