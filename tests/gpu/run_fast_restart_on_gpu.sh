#!/usr/bin/env bash
# The downtime of the fp8 KV change three ways on the real GPU machine, in one call (issue 22, item 6):
#
#     tests/gpu/run_fast_restart_on_gpu.sh RESULTS_DIR [--simulated] [bench/fast_restart.py options]
#
# On the GPU machine (no network; the lead carries .gpu-carry/ made by tests/gpu/pack_for_gpu.sh):
#   1-2. sshd and the tools from the carried .debs, pyinfra and the rest from the carried wheels
#        (tests/gpu/setup_on_gpu.sh, as tests/gpu/run_e2e_on_gpu.sh does);
#   3. the weight set: a file of $GPUGATE_FR_WEIGHTS_GIB (default 32) GiB of random-ish data written
#      to the machine's local disk, in a directory a lab container sees (the machine's own /, not
#      /tmp, /root, /opt, /home or /srv, which a container replaces), fsync'd: on disk, and in the
#      page cache after the write (the results say how much of it was, before every deploy);
#   4. bench/fast_restart.py --gpus real --profile h200: `gpugate lab up --gpus real`, tp 1, the
#      stand-in's real mode (the weight set read from the file into CUDA memory, or mapped from the
#      daemon by CUDA IPC), the three ways and their changes through the real pyinfra CLI, a client
#      in the container, NVML v2 and per-process memory sampled every few ms; then (a) once more with
#      the page cache dropped before each read, if the budget allows.
# Writes RESULTS_DIR/fast_restart.json (rewritten after every deploy), fast_restart.log (every command
# and its output), gpu_samples.jsonl (the poller), audit.jsonl, setup.log, fast_restart.stdout.
# --simulated: the same on the simulated lab (profile h200-sim: a rehearsal on a machine without a GPU).
# Never pipe this into tail/grep: the lab's daemons would hold the pipe open (the recipe's pitfall).
set -uo pipefail
cd "$(dirname "$0")/../.."
RESULTS="${1:?usage: tests/gpu/run_fast_restart_on_gpu.sh RESULTS_DIR [--simulated] [options]}"
shift
SIMULATED=0
if [ "${1:-}" = "--simulated" ]; then SIMULATED=1; shift; fi
mkdir -p "$RESULTS"
RESULTS="$(cd "$RESULTS" && pwd)"
CARRY="${GPUGATE_CARRY:-$PWD/.gpu-carry}"
SETUP_LOG="$RESULTS/setup.log"
TOTAL_BUDGET_S="${GPUGATE_FR_TOTAL_S:-540}"   # the device call's limit is 600 s
WEIGHTS_GIB="${GPUGATE_FR_WEIGHTS_GIB:-32}"
started=$(date +%s)
say() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$SETUP_LOG"; }

# ---- 1. and 2.
. tests/gpu/setup_on_gpu.sh

# ---- 3. where the weight set goes: the most free space among directories a container sees as the machine's
args=()
if [ "$SIMULATED" = 1 ]; then
    args+=(--profile h200-sim)
else
    need_kib=$(( (WEIGHTS_GIB + 2) * 1024 * 1024 ))
    best=""; best_kib=0
    candidates=(/ /mnt /data /scratch /var/tmp)
    case "$PWD" in /tmp*|/root*|/opt*|/home*|/srv*|/run*|/dev*) ;; *) candidates+=("$(dirname "$PWD")") ;; esac
    for dir in "${candidates[@]}"; do
        [ -d "$dir" ] || continue
        kib=$(df -Pk "$dir" 2>/dev/null | awk 'NR==2 {print $4}')
        say "free in $dir: $((${kib:-0} / 1024 / 1024)) GiB ($(df -P "$dir" | awk 'NR==2 {print $1 " on " $6}'))"
        if [ "${kib:-0}" -gt "$best_kib" ]; then best="$dir"; best_kib="$kib"; fi
    done
    if [ "$best_kib" -lt "$need_kib" ]; then
        say "no directory has $((WEIGHTS_GIB + 2)) GiB free: the weight set would not fit"
        exit 2
    fi
    WEIGHTS="${best%/}/gpugate-fast-restart-weights/weights.bin"
    say "weight set: $WEIGHTS ($WEIGHTS_GIB GiB)"
    free -g >> "$SETUP_LOG" 2>&1
    args+=(--gpus real --profile h200 --weights-file "$WEIGHTS" --weights-gib "$WEIGHTS_GIB" --disk-variant)
fi

# ---- 4. the run
left=$((TOTAL_BUDGET_S - ($(date +%s) - started)))
budget=$((left - 30))
say "running bench/fast_restart.py (budget ${budget}s) ${args[*]} $*"
timeout --kill-after=10 "$((left - 10))" $PY bench/fast_restart.py --results "$RESULTS" --budget-s "$budget" \
    "${args[@]}" "$@" > "$RESULTS/fast_restart.stdout" 2>&1 < /dev/null
rc=$?
say "fast_restart.py exit $rc after $(( $(date +%s) - started )) s"
if [ "$SIMULATED" = 0 ] && [ -n "${WEIGHTS:-}" ]; then rm -rf "$(dirname "$WEIGHTS")"; fi
cat "$RESULTS/fast_restart.stdout"
exit $rc
