"""Downtime of the seeds' fp8 KV change, three ways side by side in one run (issue 22, item 6):

- (a) cold: ``weight_cache: false``, ``gated_launch: false`` -- the new engine loads its weights;
- (b) weight cache: ``weight_cache: true``, ``gated_launch: false`` -- the daemons keep the weights on
  the GPUs, the new engine maps them (an engine-only restart);
- (c) weight cache and gated launch: both true -- the new engine also imports and initialises its
  distributed environment while the old one drains, and is activated once the GPUs are free.

    python3 bench/fast_restart.py                 # the lab, SGLang's own phase times (~35 min, mostly sleep)
    python3 bench/fast_restart.py --quick         # the same at 1/20 of the times, a smoke run (< 2 min)
    python3 bench/fast_restart.py --gpus real --profile h200 --weights-file F --results DIR --budget-s 480
                                                  # the H200 (tests/gpu/run_fast_restart_on_gpu.sh)

Each way: deploy the base spec (tp from the profile, no fp8), then the change to
``kv-cache-dtype: fp8_e4m3`` (and, with ``--reps`` > 1, back and forth: every change is the same
restart) through the real pyinfra CLI (``python -m pyinfra -y inventory.py deploy.py`` with a fleet
file), while a client in the container sends ``POST /generate`` (1 token, 1 s timeout) every 5 ms to
the server's port. Downtime = the last request answered by the old server -> the first answered by
the new one (the longest gap between two answered requests during the deploy). Beside it: gpugate's
phases from the container's journal (/var/lib/gpugate/runs), the stand-in's own figures from the
server log (weights read or mapped, gate wait), and the GPUs' memory sampled every few ms (NVML v2
and per process on real GPUs, the simulated ledger per allocation otherwise), from which it reads
whether the old engine's memory was gone before the new engine's KV pool was allocated.

It builds its own lab in a fresh temporary directory (never ``$GPUGATE_LAB_DIR``'s) and takes it
down at the end. Results: ``--out`` (default bench/results/fast_restart[-quick].json), rewritten after
every deploy, so a run cut short keeps what it had; ``--results DIR`` puts the JSON, the commands'
log and the GPU samples in DIR instead.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import yaml  # noqa: E402

HOST, VMID, PORT = "pve1", 129, 30000
MODEL_PATH = "/opt/models/lab-model"
H200_MIB = 143771  # an H200's memory as NVML reports it (shared/reference/gpu-machine-recipe.md)
GIB = 1 << 30

# ---------------------------------------------------------------- the stand-in's phase times, with their sources
BLOG = ("SGLang's own profile of a Qwen3-235B FP8 start, single node (lmsys blog 'Fast Engine Recovery', "
        "2026-08-21, roadmap table: lm-sys/lm-sys.github.io blog/2026-08-21-sglang-fast-recovery.md)")
IMPORT_SOURCE = ("`import sglang.srt.server_args` of 0.5.23 timed on the H200 machine: 10.4, 10.7, 11.5, 13.5 s "
                 "(docs/results/h200_server_args_import.json)")
MECHANICS = {  # SGLang's loop intervals and drain (sglang/_timing.py, launch_server.py), the same in every profile
    "SGLANG_STANDIN_DRAIN_TICK_S": ("5", "sigterm_watchdog looks every 5 s (0.5.23 tokenizer_manager.py; "
                                         "shared/reference/gateway-and-fast-restart.md 1b)"),
    "SGLANG_STANDIN_SCHEDULER_EXIT_S": ("1", "assumed: SGLang waits up to _SCHEDULER_EXIT_TIMEOUT_SECS = 15 s for the "
                                             "schedulers after the drain; their real exit time is not measured here"),
    "SGLANG_STANDIN_GATE_POLL_S": ("1", "gated_launch.py POLL_INTERVAL_SECONDS = 1"),
    "SGLANG_STANDIN_DAEMON_CHECK_S": ("2", "weight_cache/daemon.py check_interval = 2"),
    "SGLANG_STANDIN_DAEMON_MONITOR_S": ("1", "weight_cache/daemon.py monitor loop time.sleep(1)"),
    "SGLANG_STANDIN_DAEMON_LIVENESS_S": ("5", "ipc_loader.py _DAEMON_LIVENESS_POLL_INTERVAL = 5"),
    "SGLANG_STANDIN_LOAD_S": ("0", "no extra load: the phases are the load"),
}
PROFILES: dict = {
    "lab": {
        "what": "Qwen3-235B FP8 at tp 4 on 4 simulated H200s (the RFC's case, sgl-project/sglang#27052)",
        "tp": 4, "gpus": 4,
        "env": {
            "SGLANG_STANDIN_IMPORT_S": ("11", IMPORT_SOURCE),
            "SGLANG_STANDIN_DIST_INIT_S": ("22", "scheduler spawn -> end of the distributed init: 'Server init & "
                                                 "Tokenizer ~17.3 s' + 'Init torch distributed ~4.7 s', " + BLOG),
            "SGLANG_STANDIN_WEIGHT_LOAD_S": ("306", "'Load weight ~306-327 s' (disk), " + BLOG +
                                                    "; also sgl-project/sglang#33522"),
            "SGLANG_STANDIN_IPC_MAP_S": ("1", "'IPC Zero-copy <1 s' for Qwen3-235B FP8 (the blog's table; ~0.63 s "
                                             "for Ling-2.6-1T)"),
            "SGLANG_STANDIN_KV_ALLOC_S": ("0.5", "'KV Cache allocation ~0.5 s', " + BLOG),
            "SGLANG_STANDIN_GRAPH_CAPTURE_S": ("58", "'Capture CUDA graph ~34.9 s' + 'DeepGEMM JIT warmup ~23.1 s', "
                                                     + BLOG + " (both after the weights: no cache or gate hides them)"),
            "SGLANG_STANDIN_WEIGHT_MIB": ("56028", "~235 GB of Qwen3-235B FP8 weights over tp 4 (the blog's table)"),
        },
    },
    "h200": {
        "what": ("a dense model of 32 GiB of weights (e.g. 16B parameters in bf16) at tp 1 on the one H200: "
                 "the weights read from a real file into real CUDA memory, mapped by CUDA IPC"),
        "tp": 1, "gpus": 1,
        "env": {
            "SGLANG_STANDIN_IMPORT_S": ("11", IMPORT_SOURCE),
            "SGLANG_STANDIN_DIST_INIT_S": ("2", "on top of the stand-in's own real torch import and CUDA context "
                                                "(~1.9 s on the H200): ~4 s from a scheduler's spawn to the end of "
                                                "its distributed init, as single-GPU SGLang logs show (3 s in "
                                                "sgl-project/sglang#15426's Llama-3.1-8B log, 5 s in #14422's)"),
            "SGLANG_STANDIN_WEIGHT_LOAD_S": ("0", "real: the weight set is read from the file"),
            "SGLANG_STANDIN_IPC_MAP_S": ("0", "real: torch's CUDA IPC handles opened"),
            "SGLANG_STANDIN_KV_ALLOC_S": ("0.5", "'KV Cache allocation ~0.5 s', " + BLOG +
                                                 " (the pool itself is a real torch.empty)"),
            "SGLANG_STANDIN_GRAPH_CAPTURE_S": ("12", "'Capture cuda graph end. Time elapsed: 12.11 s' of a main "
                                                     "model's capture (sgl-project/sglang#10088)"),
        },
    },
}
# the rehearsal of the H200 run on simulated GPUs: the real read of 32 GiB stands as ~10 s
PROFILES["h200-sim"] = dict(PROFILES["h200"], what=PROFILES["h200"]["what"] + " (simulated: the read is 10 s, "
                            "the map 0.1 s)",
                            env=dict(PROFILES["h200"]["env"],
                                     SGLANG_STANDIN_WEIGHT_LOAD_S=("10", "rehearsal: ~32 GiB at ~3.4 GB/s"),
                                     SGLANG_STANDIN_IPC_MAP_S=("0.1", "rehearsal: a map of a few hundred ms at most"),
                                     SGLANG_STANDIN_WEIGHT_MIB=("32768", "32 GiB, the H200 run's weight set")))
QUICK_SCALE = 20.0


def quick(profile: dict) -> dict:
    """The profile at 1/QUICK_SCALE of every time (phases and SGLang's intervals), tp 2."""
    env = {}
    for key, (value, source) in dict(MECHANICS, **profile["env"]).items():
        if key.endswith("_S") and key != "SGLANG_STANDIN_LOAD_S":
            value = "%g" % (float(value) / QUICK_SCALE)
        env[key] = (value, source + " [--quick: /%g]" % QUICK_SCALE if key.endswith("_S") else source)
    return dict(profile, what=profile["what"] + ", times /%g" % QUICK_SCALE, tp=2, gpus=2, env=env)


def profile_env(profile: dict) -> dict:
    return {key: value for key, (value, _) in dict(MECHANICS, **profile["env"]).items()}


WAYS = {
    "a": {"label": "(a) cold", "weight_cache": False, "gated_launch": False},
    "b": {"label": "(b) weight cache", "weight_cache": True, "gated_launch": False},
    "c": {"label": "(c) weight cache + gated launch", "weight_cache": True, "gated_launch": True},
}

# ---------------------------------------------------------------- processes run elsewhere

# In the container (its /usr/bin/python3, stdlib): POST /generate every INTERVAL s until stdin closes;
# prints "serving" at the first answer, and at the end one JSON line: counts and every gap > GAP s
# between two answered requests (the downtime is the longest).
CLIENT = r"""
import json, sys, threading, time, urllib.error, urllib.request
url, interval, timeout, max_s = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
GAP = 0.1
stop = threading.Event()
def watch():
    sys.stdin.read()
    stop.set()
threading.Thread(target=watch, daemon=True).start()
ok = fail = 0
errors, cur_errors, gaps, lat = {}, {}, [], []
first_ok = last_ok = None
began = time.time()
n = 0
while not stop.is_set() and time.time() - began < max_s:
    n += 1
    body = json.dumps({"text": "fast restart probe %d" % n, "sampling_params": {"max_new_tokens": 1}}).encode()
    t0 = time.time()
    error = None
    try:
        req = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            resp.read()
            if resp.status != 200:
                error = "HTTP %d" % resp.status
    except urllib.error.HTTPError as exc:
        error = "HTTP %d" % exc.code
    except Exception as exc:
        error = type(exc).__name__
    t1 = time.time()
    if error is None:
        ok += 1
        lat.append(t1 - t0)
        if last_ok is not None and t1 - last_ok > GAP:
            gaps.append({"from": round(last_ok, 4), "to": round(t1, 4), "s": round(t1 - last_ok, 4),
                         "failed": sum(cur_errors.values()), "errors": cur_errors})
        if first_ok is None:
            first_ok = t1
            print("serving", flush=True)
        last_ok, cur_errors = t1, {}
    else:
        fail += 1
        errors[error] = errors.get(error, 0) + 1
        cur_errors[error] = cur_errors.get(error, 0) + 1
    time.sleep(interval)
lat.sort()
print(json.dumps({"sent": ok + fail, "ok": ok, "failed": fail, "errors": errors, "gaps": gaps,
                  "first_ok": first_ok, "last_ok": last_ok, "began": began, "ended": time.time(),
                  "p50_ms": round(lat[len(lat) // 2] * 1000, 2) if lat else None,
                  "max_ms": round(lat[-1] * 1000, 2) if lat else None}), flush=True)
"""

# On this machine: the GPUs' memory every INTERVAL s, a JSON line on every change (and a heartbeat with
# the poll count each second): "used" per GPU (NVML v2 used: reserved not counted; the simulated
# ledger), "procs" MiB per process (NVML's compute processes; the ledger's allocations by pid), and a
# "cmd" line the first time a process is seen.
POLLER = r"""
import json, os, sys, time
out_path, mode, arg, interval = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
cmds = {}
if mode == "nvml":
    import pynvml
    pynvml.nvmlInit()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    def cmd_of(pid):
        try:
            with open("/proc/%d/cmdline" % pid, "rb") as f:
                return f.read().replace(b"\0", b" ").decode(errors="replace")[:160]
        except OSError:
            return "?"
    proc_errors = []
    def read():
        used = [pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2).used >> 20 for h in handles]
        procs = {}
        try:
            for h in handles:
                for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                    mib = (p.usedGpuMemory or 0) >> 20
                    procs[str(p.pid)] = procs.get(str(p.pid), 0) + mib
                    if p.pid not in cmds:
                        cmds[p.pid] = cmd_of(p.pid)
                        new.append((p.pid, cmds[p.pid]))
        except Exception as exc:  # the totals still count
            if not proc_errors:
                proc_errors.append(str(exc))
                new.append(("error", "per-process memory: %s" % exc))
            procs = None
        return used, procs
else:
    gdir = arg
    def read():
        cfg = json.load(open(os.path.join(gdir, "config.json")))
        used = [0] * int(cfg.get("count", 0))
        procs = {}
        adir = os.path.join(gdir, "alloc")
        for name in os.listdir(adir):
            if not name.endswith(".json"):
                continue
            try:
                rec = json.load(open(os.path.join(adir, name)))
            except (OSError, ValueError):
                continue
            used[int(rec["gpu"])] += int(rec["mib"])
            key = "%s:%s" % (rec.get("pidns"), rec.get("pid"))
            procs[key] = procs.get(key, 0) + int(rec["mib"])
            if key not in cmds:
                cmds[key] = str(rec.get("cmd"))[:160]
                new.append((key, cmds[key]))
        return used, procs
last, beat, polls = None, 0.0, 0
with open(out_path, "a", buffering=1) as out:
    while True:
        new = []
        now = time.time()
        try:
            used, procs = read()
        except Exception as exc:
            used, procs = "error: %s" % exc, {}
        polls += 1
        for pid, cmd in new:
            out.write(json.dumps({"t": round(now, 4), "pid": pid, "cmd": cmd}) + "\n")
        if (used, procs) != last or now - beat >= 1.0:
            out.write(json.dumps({"t": round(now, 4), "used": used, "procs": procs, "polls": polls}) + "\n")
            last, beat = (used, procs), now
        time.sleep(interval)
"""

# In the container: the journal events of every run file touched since T.
JOURNAL = r"""
import glob, json, os, sys
since = float(sys.argv[1])
out = []
for f in sorted(glob.glob('/var/lib/gpugate/runs/*.jsonl')):
    if os.path.getmtime(f) + 1 < since:
        continue
    for line in open(f, errors='replace'):
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if float(e.get('t', 0)) >= since - 1:
            e['_run'] = os.path.basename(f)[:-6]
            out.append(e)
print(json.dumps(out))
"""

LOG_MARKERS = ("Weight set:", "Weights read:", "Gated launch", "IpcModelLoader] Zero-copy", "IpcModelLoader] Loaded",
               "Daemon socket not found", "KV Cache is allocated", "Capture decode CUDA graph end", "fired up",
               "Error", "error", "Traceback")


# ---------------------------------------------------------------- pure helpers


def median(values: list) -> float | None:
    values = [v for v in values if isinstance(v, (int, float))]
    return round(statistics.median(values), 3) if values else None


def phase_spans(events: list[dict]) -> dict:
    """The first begin/end pair of each step (desired target first): {step: {"begin", "end", "s"}};
    steps with an end only (cache, activate) get their end.

    >>> phase_spans([{"step": "gate", "phase": "begin", "t": 1.0}, {"step": "gate", "phase": "end", "t": 1.25}])
    {'gate': {'begin': 1.0, 'end': 1.25, 's': 0.25}}
    """
    spans: dict = {}
    opened: dict = {}
    for event in sorted(events, key=lambda e: float(e.get("t", 0))):
        step, phase, t = event.get("step"), event.get("phase"), float(event.get("t", 0))
        if not step or step in spans:
            continue
        if phase == "begin":
            opened.setdefault(step, t)
        elif phase == "end":
            begin = opened.get(step)
            spans[step] = {"begin": begin, "end": t, "s": round(t - begin, 3) if begin is not None else None}
    return spans


def own_runs(events: list[dict], began: float) -> list[dict]:
    """The events of the runs that began at or after ``began`` (a run file touched a moment earlier
    holds the previous deploy's tail).

    >>> own_runs([{"_run": "r1", "step": "run", "phase": "begin", "t": 1.0}, {"_run": "r1", "t": 9.0},
    ...           {"_run": "r2", "step": "run", "phase": "begin", "t": 10.0}], 9.5)
    [{'_run': 'r2', 'step': 'run', 'phase': 'begin', 't': 10.0}]
    """
    runs = {e.get("_run") for e in events if e.get("step") == "run" and e.get("phase") == "begin"
            and float(e.get("t", 0)) >= began - 0.5}
    return [e for e in events if e.get("_run") in runs]


def downtime_of(client: dict) -> dict:
    """The longest gap between two answered requests: from the old server's last answer to the new one's first.

    >>> downtime_of({"gaps": [{"from": 1.0, "to": 1.2, "s": 0.2}, {"from": 5.0, "to": 9.5, "s": 4.5}]})["s"]
    4.5
    """
    gaps = sorted(client.get("gaps") or [], key=lambda g: g["s"])
    if not gaps:
        return {"s": None, "other_gaps_s": []}
    worst = gaps[-1]
    return {"s": worst["s"], "last_old_ok": worst["from"], "first_new_ok": worst["to"],
            "failed_in_gap": worst.get("failed"), "errors_in_gap": worst.get("errors"),
            "other_gaps_s": [g["s"] for g in gaps[:-1]][-5:]}


def memory_order(samples: list[dict], began: float, ended: float) -> dict:
    """From the GPU samples of one deploy: which processes held memory before and after (old engine,
    new engine, kept: the daemons), the moment the old engine's memory was all gone, the moment the
    new engine's KV pool was there (its memory within 1 GiB of what it holds at the end), and the
    peak of the GPUs' total use during the deploy.

    >>> s = [{"t": 0, "used": [100], "procs": {"d": 40, "o": 60}}, {"t": 2, "used": [40], "procs": {"d": 40}},
    ...      {"t": 3, "used": [41], "procs": {"d": 40, "n": 1}}, {"t": 4, "used": [2100], "procs": {"d": 40, "n": 2060}}]
    >>> r = memory_order(s, 1, 5); (r["old_gone_t"], r["new_kv_t"], r["old_gone_before_new_kv"])
    (2, 4, True)
    """
    rows = [s for s in samples if isinstance(s.get("used"), list)]
    before = [s for s in rows if s["t"] <= began]
    during = [s for s in rows if began < s["t"] <= ended]
    if not before or not during:
        return {"error": "no samples around the deploy"}
    totals = total_order(before[-1], during)
    if not all(isinstance(s.get("procs"), dict) for s in [before[-1]] + during):
        return dict(totals, per_process=False)
    first, last = before[-1], during[-1]
    held_before = {p for p, m in first["procs"].items() if m > 0}
    held_after = {p for p, m in last["procs"].items() if m > 0}
    kept, old, new = held_before & held_after, held_before - held_after, held_after - held_before
    old_gone = None
    for s in during:
        if any(s["procs"].get(p, 0) > 0 for p in old):
            old_gone = None
        elif old_gone is None:
            old_gone = s["t"]
    new_final = sum(last["procs"].get(p, 0) for p in new)
    new_kv = next((s["t"] for s in during if new and new_final > 2048
                   and sum(s["procs"].get(p, 0) for p in new) >= new_final - 1024), None)
    first_new = next((s["t"] for s in during if any(s["procs"].get(p, 0) > 0 for p in new)), None)
    mib = lambda s, ps: sum(s["procs"].get(p, 0) for p in ps)  # noqa: E731
    return {"kept_mib": mib(last, kept), "old_mib": mib(first, old), "new_mib": new_final,
            "old_gone_t": old_gone, "new_first_t": first_new, "new_kv_t": new_kv,
            "old_gone_before_new_kv": (old_gone is not None and new_kv is not None and old_gone < new_kv) if old else None,
            "gap_s": round(new_kv - old_gone, 3) if old_gone is not None and new_kv is not None else None,
            "peak_used_mib": max(sum(s["used"]) for s in during), "used_before_mib": sum(first["used"]),
            "used_after_mib": sum(last["used"]), "samples": len(during),
            "procs": {"kept": sorted(kept), "old": sorted(old), "new": sorted(new)}, "totals": totals}


def total_order(first: dict, during: list[dict]) -> dict:
    """The same question from the GPUs' totals alone: the lowest total during the deploy (the old
    engine gone, the new one's pool not yet there), when it was first reached, and when the total
    came back to within 1 GiB of its end value (the new pool).

    >>> r = total_order({"t": 0, "used": [100]}, [{"t": 2, "used": [40]}, {"t": 3, "used": [41]}, {"t": 4, "used": [2100]}])
    >>> (r["low_mib"], r["low_t"], r["high_again_t"])
    (40, 2, 4)
    """
    totals = [(s["t"], sum(s["used"])) for s in during]
    low = min(v for _, v in totals)
    low_t = next(t for t, v in totals if v <= low + 1024)
    end = totals[-1][1]
    high_t = next((t for t, v in totals if t > low_t and v >= end - 1024), None)
    return {"before_mib": sum(first["used"]), "low_mib": low, "low_t": low_t, "end_mib": end, "high_again_t": high_t,
            "peak_mib": max(v for _, v in totals)}


def page_cache_fraction(path: str) -> float | None:
    """The fraction of ``path``'s pages in the page cache now (mincore(2) on a read-only mapping)."""
    import ctypes

    try:
        size = os.path.getsize(path)
        if not size:
            return None
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        page = os.sysconf("SC_PAGE_SIZE")
        with open(path, "rb") as handle:
            addr = libc.mmap(None, size, 1, 1, handle.fileno(), 0)  # PROT_READ, MAP_SHARED
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                pages = (size + page - 1) // page
                vec = (ctypes.c_ubyte * pages)()
                if libc.mincore(addr, size, vec) != 0:
                    return None
                raw = bytes(vec)
                return round((pages - raw.count(0)) / pages, 4)
            finally:
                libc.munmap(addr, size)
    except (OSError, AttributeError, ValueError):
        return None


def make_weights(path: Path, size: int, log, fsync: bool = False) -> dict:
    """A file of ``size`` bytes of random-ish data (a 64 MiB random block, each copy stamped with its
    index), in the page cache after the write; the kernel writes it back to the disk meanwhile
    (``fsync``: wait for that here; the disk variant syncs before it drops the pages)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    block = bytearray(os.urandom(64 << 20))
    tic = time.monotonic()
    with open(path, "wb", buffering=0) as handle:
        done, index = 0, 0
        while done < size:
            block[:8] = index.to_bytes(8, "little")
            n = min(len(block), size - done)
            handle.write(memoryview(block)[:n])
            done, index = done + n, index + 1
        write_s = time.monotonic() - tic
        if fsync:
            os.fsync(handle.fileno())
    total_s = time.monotonic() - tic
    figures = {"path": str(path), "bytes": size, "write_s": round(write_s, 2), "fsync": fsync,
               "total_s": round(total_s, 2), "gbps": round(size / total_s / 1e9, 3),
               "in_page_cache_after_write": page_cache_fraction(str(path)), "disk": disk_of(path)}
    log("weights file: %s" % json.dumps(figures))
    return figures


def container_of(doc: dict) -> dict:
    """Container VMID of HOST in a fleet document (its key an int or a string)."""
    containers = doc["hosts"][HOST]["containers"]
    return containers[VMID] if VMID in containers else containers[str(VMID)]


def disk_of(path: Path) -> str:
    """``df`` of the file's filesystem (device, size, mount point)."""
    res = subprocess.run(["df", "-Ph", str(path)], capture_output=True, text=True)
    return " ".join(res.stdout.split("\n")[1].split()) if res.returncode == 0 and "\n" in res.stdout else res.stderr[-200:]


def dirty_kib() -> int | None:
    """The page cache's dirty and writeback KiB now (/proc/meminfo)."""
    try:
        fields = dict(line.split(":", 1) for line in open("/proc/meminfo").read().splitlines() if ":" in line)
        return int(fields["Dirty"].split()[0]) + int(fields["Writeback"].split()[0])
    except (OSError, KeyError, ValueError):
        return None


# ---------------------------------------------------------------- the run


class Bench:
    def __init__(self, args, profile: dict):
        self.args = args
        self.profile = profile
        self.real = args.gpus == "real"
        self.results = Path(args.results) if args.results else None
        self.out = Path(args.out) if args.out else (self.results / "fast_restart.json" if self.results else
                                                    REPO_ROOT / "bench" / "results" / ("fast_restart-quick.json" if args.quick else "fast_restart.json"))
        work = Path(tempfile.mkdtemp(prefix="gpugate-bench-fr-"))  # no "sglang" in it (pkill -f patterns)
        self.work = work
        self.lab_dir = work / "lab"
        self.logdir = self.results or work
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.logdir / "fast_restart.log"
        self.samples_path = self.logdir / "gpu_samples.jsonl"
        self.deadline = time.monotonic() + float(args.budget_s)
        self.env = dict(os.environ, GPUGATE_LAB_DIR=str(self.lab_dir), GPUGATE_FLEET=str(self.lab_dir / "fleet.yaml"),
                        GPUGATE_AUDIT_LOG=str(self.logdir / "audit.jsonl"), GPUGATE_OPERATOR="bench@fast-restart")
        self.poller = None
        self.serving = False  # a deploy of ours succeeded: a server answers on PORT
        self.server_env = profile_env(profile)
        if args.weights_file:
            self.server_env["SGLANG_STANDIN_WEIGHTS_FILE"] = str(args.weights_file)
        self.doc: dict = {
            "schema": 1, "what": "downtime of the fp8 KV change: (a) cold, (b) weight cache, (c) weight cache + "
                                 "gated launch (issue 22 item 6)",
            "mode": "real GPUs" if self.real else "simulated GPUs", "profile": args.profile + (" --quick" if args.quick else ""),
            "model": profile["what"], "tp": profile["tp"], "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": " ".join(shlex.quote(a) for a in sys.argv),
            "phase_times": {k: {"value_s": v, "source": s} for k, (v, s) in dict(MECHANICS, **profile["env"]).items()},
            "server_env": self.server_env, "ways": {}, "summary": {}, "errors": []}

    # ------------------------------------------------------------ bookkeeping
    def log(self, text: str) -> None:
        with open(self.log_path, "a") as handle:
            handle.write(text if text.endswith("\n") else text + "\n")

    def say(self, text: str) -> None:
        line = "[%s] %s" % (time.strftime("%H:%M:%S"), text)
        print(line, flush=True)
        self.log(line)

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        self.doc["saved_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.doc["summary"] = summarize(self.doc)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_name("." + self.out.name + ".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1, default=str) + "\n")
        os.replace(tmp, self.out)

    def sh(self, argv: list, timeout: float = 120, stdin=None) -> dict:
        timeout = max(5.0, min(timeout, self.left_s() + 5))
        self.log("$ " + " ".join(shlex.quote(str(a)) if len(str(a)) < 200 else "'%s...'" % str(a)[:60] for a in argv))
        began = time.time()
        try:
            proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT,
                                  env=self.env, stdin=subprocess.DEVNULL)
            rc, out, err = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc = "timeout"
            out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        ended = time.time()
        self.log(out + ("\n[stderr]\n" + err if err.strip() else "") + "[rc=%s in %.2f s]" % (rc, ended - began))
        return {"rc": rc, "out": out, "err": err, "began": round(began, 4), "ended": round(ended, 4),
                "wall_s": round(ended - began, 3)}

    def host_exec(self) -> list:
        from gpugate_lab import core

        return core.host_exec_argv(self.lab_dir, HOST)

    def in_ct(self, *argv: str, timeout: float = 60) -> dict:
        return self.sh(self.host_exec() + ["pct", "exec", str(VMID), "--", *argv], timeout=timeout)

    # ------------------------------------------------------------ the lab, the poller
    def lab_up(self) -> None:
        argv = [sys.executable, "-m", "gpugate.cli", "lab", "--dir", str(self.lab_dir), "up", "--hosts", "1"]
        argv += ["--gpus", "real"] if self.real else ["--gpus", str(self.profile["gpus"]), "--gpu-mib", str(H200_MIB)]
        res = self.sh(argv, timeout=180)
        if res["rc"] != 0:
            raise RuntimeError("lab up failed: " + (res["err"] or res["out"])[-1500:])
        self.fleet_doc = yaml.safe_load((self.lab_dir / "fleet.yaml").read_text())
        server = container_of(self.fleet_doc)["sglang"]
        self.python = server.get("python")  # real GPUs: the torch environment's interpreter
        smi = self.in_ct("nvidia-smi", "--query-gpu=index,name,memory.total,memory.used", "--format=csv,noheader")
        self.doc["lab"] = {"up_s": res["wall_s"], "container_nvidia_smi": smi["out"].strip()[-600:],
                           "server_python": self.python}

    def start_poller(self) -> None:
        if self.real:
            mode, arg, interval = "nvml", "-", float(self.args.sample_ms) / 1000
        else:
            mode, arg, interval = "sim", str(self.lab_dir / "hosts" / HOST / "gpu"), max(0.01, float(self.args.sample_ms) / 1000)
        self.poller = subprocess.Popen([sys.executable, "-c", POLLER, str(self.samples_path), mode, arg, str(interval)],
                                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                       stderr=open(self.logdir / "poller.err", "a"), start_new_session=True, env=self.env)
        time.sleep(1.2)
        if not self.samples():
            raise RuntimeError("the GPU poller wrote nothing: " + (self.logdir / "poller.err").read_text()[-800:])
        self.doc["poller"] = {"mode": mode, "interval_s": interval, "what": (
            "NVML v2 used per GPU and nvmlDeviceGetComputeRunningProcesses per process" if self.real else
            "the simulated driver's ledger: used per GPU and per allocating process")}

    def stop_poller(self) -> None:
        if self.poller is not None:
            try:
                os.killpg(self.poller.pid, signal.SIGKILL)
            except OSError:
                pass
            self.poller.wait(timeout=10)
            self.poller = None

    def samples(self, began: float | None = None, ended: float | None = None) -> list[dict]:
        out = []
        try:
            with open(self.samples_path) as handle:
                for line in handle:
                    try:
                        row = json.loads(line)
                    except ValueError:
                        continue
                    if began is not None and row["t"] < began:
                        continue
                    if ended is not None and row["t"] > ended:
                        break
                    out.append(row)
        except OSError:
            pass
        return out

    def poll_rate(self, began: float, ended: float) -> dict:
        """Polls per second over a window, from the heartbeat's running count."""
        rows = [r for r in self.samples(began, ended) if "polls" in r]
        if len(rows) < 2 or rows[-1]["t"] <= rows[0]["t"]:
            return {}
        rate = (rows[-1]["polls"] - rows[0]["polls"]) / (rows[-1]["t"] - rows[0]["t"])
        return {"polls_per_s": round(rate, 1), "mean_interval_ms": round(1000 / rate, 2) if rate else None}

    # ------------------------------------------------------------ fleet, pyinfra, client, journal, log
    def fleet(self, way: str, flags: dict, extra_env: dict | None = None) -> Path:
        doc = json.loads(json.dumps(self.fleet_doc))
        container = container_of(doc)
        server = container["sglang"]
        server.update({"model_path": MODEL_PATH, "port": PORT, "flags": flags,
                       "env": dict(self.server_env, **(extra_env or {})),
                       "weight_cache": WAYS[way]["weight_cache"], "gated_launch": WAYS[way]["gated_launch"]})
        container.setdefault("data", {}).update({"drain_timeout_s": 120, "gpu_gate_timeout_s": 120,
                                                 "start_timeout_s": 1800})
        path = self.lab_dir / ("fleet.%s.yaml" % way)
        path.write_text(yaml.safe_dump(doc))
        return path

    def pyinfra(self, fleet: Path, timeout: float = 1800) -> dict:
        self.env["GPUGATE_FLEET"] = str(fleet)
        return self.sh([sys.executable, "-m", "pyinfra", "-y", "inventory.py", "deploy.py"], timeout=timeout)

    def journal_since(self, since: float) -> list[dict]:
        res = self.in_ct("/usr/bin/python3", "-c", JOURNAL, str(since), timeout=60)
        try:
            return json.loads(res["out"].strip().splitlines()[-1])
        except (ValueError, IndexError):
            return []

    def log_section(self) -> list[str]:
        """The key lines of the server log's last start (gpugate writes a '=== gpugate start' header)."""
        res = self.in_ct("sh", "-c", "tail -c 400000 /var/log/gpugate/sglang-%d.log 2>/dev/null" % PORT, timeout=60)
        section = res["out"].split("=== gpugate start")[-1]
        return [line[:400] for line in section.splitlines() if any(m in line for m in LOG_MARKERS)][-30:]

    def client(self) -> subprocess.Popen:
        argv = self.host_exec() + ["pct", "exec", str(VMID), "--", "/usr/bin/python3", "-u", "-c", CLIENT,
                                   "http://127.0.0.1:%d/generate" % PORT, str(self.args.interval_ms / 1000.0), "1.0",
                                   str(max(60.0, self.left_s() + 60))]
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=self.env, start_new_session=True)
        import select

        ready, _, _ = select.select([proc.stdout], [], [], 30)
        line = proc.stdout.readline().strip() if ready else ""
        if line != "serving":
            self.end_client(proc)
            raise RuntimeError("the client saw no answer from the server before the deploy: %r" % line)
        return proc

    def end_client(self, proc: subprocess.Popen) -> dict:
        try:
            out, err = proc.communicate(input="", timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        lines = [line for line in (out or "").splitlines() if line.startswith("{")]
        try:
            return json.loads(lines[-1])
        except (ValueError, IndexError):
            return {"error": (err or out or "")[-800:]}

    # ------------------------------------------------------------ one deploy
    def deploy(self, way: str, flags: dict, measured: bool, extra_env: dict | None = None) -> dict:
        fleet = self.fleet(way, flags, extra_env)
        record: dict = {"way": way, "flags": flags, "measured": measured, "extra_env": extra_env or None}
        weights = self.server_env.get("SGLANG_STANDIN_WEIGHTS_FILE")
        if weights:
            record["weights_in_page_cache_before"] = page_cache_fraction(weights)
            record["dirty_kib_before"] = dirty_kib()
        proc = self.client() if measured else None
        began = time.time()
        res = self.pyinfra(fleet)
        ended = time.time()
        if proc is not None:
            time.sleep(0.5)
            record["client"] = self.end_client(proc)
            record["downtime"] = downtime_of(record["client"])
        record.update(rc=res["rc"], wall_s=res["wall_s"], began=res["began"], ended=res["ended"],
                      pyinfra_tail=(res["out"] + res["err"])[-2500:])
        journal = own_runs(self.journal_since(began), began)
        record["journal_spans"] = phase_spans([e for e in journal if e.get("target") in (None, "desired")])
        record["journal_events"] = [{k: e.get(k) for k in ("step", "phase", "t", "target", "mode", "why", "passed",
                                                             "elapsed_s", "drained", "reached", "state", "pid")
                                     if e.get(k) is not None} for e in journal if e.get("phase") != "progress"]
        record["outcome"] = next((e.get("outcome") for e in reversed(journal) if e.get("outcome")), None)
        record["server_log"] = self.log_section()
        record["memory"] = memory_order(self.samples(began - 2, ended + 1), began, ended)
        record["sampling"] = self.poll_rate(began, ended)
        if weights:
            record["weights_in_page_cache_after"] = page_cache_fraction(weights)
        record["figures"] = figures(record)
        self.serving = res["rc"] == 0
        return record


# journal span -> the moment its end marks, measured from the old server's last answer
SPAN_MARKS = (("drain", "old_exited"), ("kill", "old_killed"), ("gate", "gate_passed"), ("gated", "new_at_its_gate"),
              ("activate", "activated"), ("start", "started"), ("load", "ready"))


def figures(record: dict) -> dict:
    """Downtime and where it went, each on the machine's clock (client, journal, samples)."""
    down = record.get("downtime") or {}
    spans = record.get("journal_spans") or {}
    out: dict = {"downtime_s": down.get("s"), "pyinfra_wall_s": record.get("wall_s"),
                 "journal_s": {k: v.get("s") for k, v in spans.items() if v.get("s") is not None}}
    last_old, first_new = down.get("last_old_ok"), down.get("first_new_ok")
    if last_old is None:
        return out
    marks = {mark: spans[step]["end"] for step, mark in SPAN_MARKS if spans.get(step)}
    marks["first_new_ok"] = first_new
    out["after_last_old_answer_s"] = {k: round(v - last_old, 3) for k, v in sorted(marks.items(), key=lambda kv: kv[1])
                                      if isinstance(v, (int, float))}
    mem = record.get("memory") or {}
    for key in ("old_gone_t", "new_kv_t"):
        if isinstance(mem.get(key), (int, float)):
            out["after_last_old_answer_s"]["memory_" + key[:-2]] = round(mem[key] - last_old, 3)
    if spans.get("drain"):
        out["drain_s"] = spans["drain"]["s"]
    sets = weight_sets(record.get("server_log") or [])
    if sets:
        out["weight_set"] = sets[0]
    return out


def weight_sets(lines: list[str]) -> list[dict]:
    """The stand-in's "Weight set: {...}" figures (real mode: bytes, read_s or map_s, how).

    >>> weight_sets(['[x TP0] Weight set: {"bytes": 8, "read_s": 1.5, "weights": "disk"}'])[0]["read_s"]
    1.5
    """
    out = []
    for line in lines:
        if "Weight set: {" in line:
            try:
                out.append(json.loads(line.split("Weight set: ", 1)[1]))
            except ValueError:
                pass
    return out


def summarize(doc: dict) -> dict:
    out: dict = {}
    for way, data in doc.get("ways", {}).items():
        samples = [s for s in data.get("samples", []) if s.get("rc") == 0]
        down = [s["figures"]["downtime_s"] for s in samples]
        to_fp8 = [s["figures"]["downtime_s"] for s in samples if "kv-cache-dtype" in s["flags"]]
        mem = [s["memory"].get("old_gone_before_new_kv") for s in samples if s.get("memory")]
        out[way] = {"label": data.get("label") or WAYS.get(way, {}).get("label", way), "n": len(down), "downtime_s": down,
                    "median_s": median(down), "min_s": min(down) if down else None, "max_s": max(down) if down else None,
                    "to_fp8_s": to_fp8, "median_to_fp8_s": median(to_fp8),
                    "median_pyinfra_wall_s": median([s["wall_s"] for s in samples]),
                    "median_drain_s": median([s["figures"].get("drain_s") for s in samples]),
                    "old_memory_gone_before_new_kv": mem,
                    "failed_deploys": len(data.get("samples", [])) - len(samples)}
        marks: dict = {}
        for sample in samples:
            for key, value in (sample["figures"].get("after_last_old_answer_s") or {}).items():
                marks.setdefault(key, []).append(value)
        out[way]["median_after_last_old_answer_s"] = dict(sorted(((k, median(v)) for k, v in marks.items()),
                                                                 key=lambda kv: kv[1] if kv[1] is not None else 0))
        reads = [(s["figures"].get("weight_set") or {}) for s in samples]
        if any(reads):
            out[way]["weight_set"] = [{k: r.get(k) for k in ("weights", "bytes", "read_s", "gbps", "map_s",
                                                             "dropped_cache") if k in r} for r in reads]
    a, c = (out.get("a") or {}).get("median_s"), (out.get("c") or {}).get("median_s")
    if a and c:
        out["c_over_a"] = round(c / a, 3)
        out["target_c_at_most_a_over_5"] = c <= a / 5
    b = (out.get("b") or {}).get("median_s")
    if a and b:
        out["b_over_a"] = round(b / a, 3)
    return out


def report(doc: dict) -> str:
    s = doc.get("summary") or {}
    lines = ["| way | n | downtime median | min-max | each (s) | pyinfra wall median | drain median | old memory gone before new KV pool |",
             "|---|---|---|---|---|---|---|---|"]
    for way in ("a", "b", "c", "a_disk"):
        w = s.get(way)
        if not w:
            continue
        lines.append("| %s | %s | %s s | %s-%s s | %s | %s s | %s s | %s |" % (
            w["label"], w["n"], w["median_s"], w["min_s"], w["max_s"], ", ".join("%g" % x for x in w["downtime_s"] if x is not None),
            w["median_pyinfra_wall_s"], w["median_drain_s"], ", ".join(str(x) for x in w["old_memory_gone_before_new_kv"])))
    lines += ["", "Where the downtime went (median seconds after the old server's last answer):", ""]
    for way in ("a", "b", "c", "a_disk"):
        w = s.get(way)
        if w and w.get("median_after_last_old_answer_s"):
            lines.append("- %s: %s" % (w["label"], ", ".join("%s %s" % (k, v) for k, v in
                                                           w["median_after_last_old_answer_s"].items())))
    if "c_over_a" in s:
        lines.append("")
        lines.append("(c)/(a) = %s (target <= 0.2: %s); (b)/(a) = %s" % (
            s["c_over_a"], "met" if s["target_c_at_most_a_over_5"] else "missed", s.get("b_over_a")))
    return "\n".join(lines) + "\n"


def machine_info() -> dict:
    info = {"python": sys.version.split()[0], "kernel": platform.release(), "cpus": os.cpu_count()}
    try:
        with open("/proc/meminfo") as handle:
            info["mem_total_gib"] = round(int(handle.readline().split()[1]) / (1 << 20), 1)
    except (OSError, ValueError, IndexError):
        pass
    try:
        info["loadavg"] = open("/proc/loadavg").read().split()[:3]
    except OSError:
        pass
    commit = REPO_ROOT / ".gpu-carry" / "commit"
    if commit.is_file():
        info["commit"] = commit.read_text().strip()[:200]
    else:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=REPO_ROOT, capture_output=True, text=True)
        if top.returncode == 0 and Path(top.stdout.strip()).resolve() == REPO_ROOT:
            info["commit"] = subprocess.run(["git", "log", "-1", "--format=%h %s"], cwd=REPO_ROOT, capture_output=True,
                                            text=True).stdout.strip()[:200]
        else:
            info["commit"] = "no commit: this checkout has no .git of its own"
    smi = shutil.which("nvidia-smi")
    if smi:
        res = subprocess.run([smi, "--query-gpu=index,name,driver_version,memory.total,memory.used", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60)
        info["nvidia_smi"] = res.stdout.strip()
    return info


def run(bench: Bench, ways: list[str], reps: int) -> None:
    tp = bench.profile["tp"]
    base, fp8 = {"tp": tp}, {"tp": tp, "kv-cache-dtype": "fp8_e4m3"}
    bench.doc["flags"] = {"base": base, "change": fp8}
    estimate: dict = {}
    previous = None
    for way in ways:
        data = bench.doc["ways"].setdefault(way, {"label": WAYS[way]["label"], "setup": None, "samples": []})
        # a way that keeps the weight cache's setting of the one before restarts the engine at most (from
        # (b) to (c) it converges: only gated_launch differs); one that changes it starts or stops daemons
        same_cache = previous is not None and WAYS[previous]["weight_cache"] == WAYS[way]["weight_cache"]
        need = estimate.get(previous, 30.0) if same_cache else estimate.get("setup", 60.0)
        previous = way
        if bench.left_s() < need:
            data["skipped"] = "budget: %.0f s left" % bench.left_s()
            bench.save()
            continue
        bench.say("%s: deploy the base spec %s" % (WAYS[way]["label"], base))
        try:
            data["setup"] = bench.deploy(way, base, measured=False)
        except Exception as exc:  # noqa: BLE001 -- record, go on
            bench.doc["errors"].append("%s setup: %s" % (way, exc))
            bench.log(traceback.format_exc())
            bench.save()
            continue
        bench.say("  setup rc %s in %.1f s" % (data["setup"]["rc"], data["setup"]["wall_s"]))
        bench.save()
        if data["setup"]["rc"] != 0:
            bench.doc["errors"].append("%s setup: pyinfra rc %s" % (way, data["setup"]["rc"]))
            continue
        for i in range(reps):
            flags = fp8 if i % 2 == 0 else base
            need = estimate.get(way, 30.0) * 1.2 + 10
            if bench.left_s() < need:
                data["skipped_reps"] = reps - i
                bench.say("  budget: %.0f s left, a change needs ~%.0f s: %d reps skipped" % (bench.left_s(), need, reps - i))
                break
            try:
                record = bench.deploy(way, flags, measured=True)
            except Exception as exc:  # noqa: BLE001
                bench.doc["errors"].append("%s rep %d: %s" % (way, i, exc))
                bench.log(traceback.format_exc())
                bench.save()
                break
            data["samples"].append(record)
            estimate[way] = max(estimate.get(way, 0), record["wall_s"])
            bench.say("  %s -> %s: rc %s, downtime %s s, pyinfra %.1f s, old memory gone before new KV: %s" % (
                "base" if flags is fp8 else "fp8", "fp8" if flags is fp8 else "base", record["rc"],
                record["figures"]["downtime_s"], record["wall_s"], record["memory"].get("old_gone_before_new_kv")))
            bench.save()
        estimate["setup"] = max(estimate.get("setup", 0), data["setup"]["wall_s"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="every time /%g, tp 2: a smoke run" % QUICK_SCALE)
    parser.add_argument("--profile", default=None, choices=sorted(PROFILES), help="default: lab (h200 with --gpus real)")
    parser.add_argument("--gpus", default="sim", choices=("sim", "real"))
    parser.add_argument("--reps", type=int, default=None, help="measured changes per way (default 2; --quick 1)")
    parser.add_argument("--ways", default="a,b,c")
    parser.add_argument("--out", default=None)
    parser.add_argument("--results", default=None, help="a directory for the JSON, the log and the GPU samples")
    parser.add_argument("--budget-s", type=float, default=7200.0)
    parser.add_argument("--weights-file", default=None, help="real GPUs: the weight set's file (made if missing)")
    parser.add_argument("--weights-gib", type=float, default=32.0)
    parser.add_argument("--disk-variant", action="store_true",
                        help="real GPUs: at the end, (a) once more with the page cache dropped before each read")
    parser.add_argument("--interval-ms", type=float, default=5.0, help="the client's pause between requests")
    parser.add_argument("--sample-ms", type=float, default=3.0, help="the GPU poller's interval")
    parser.add_argument("--keep", action="store_true", help="leave the lab up")
    parser.add_argument("--report", metavar="JSON", help="recompute the figures and the summary of a results "
                                                          "file (in place) and print its tables")
    args = parser.parse_args(argv)
    if args.report:
        doc = json.loads(Path(args.report).read_text())
        for data in doc.get("ways", {}).values():
            for record in [data.get("setup")] + data.get("samples", []):
                if record:
                    record["figures"] = figures(record)
        doc["summary"] = summarize(doc)
        Path(args.report).write_text(json.dumps(doc, indent=1, default=str) + "\n")
        print(report(doc))
        return 0
    args.profile = args.profile or ("h200" if args.gpus == "real" else "lab")
    profile = PROFILES[args.profile]
    if args.quick:
        profile = quick(profile)
    reps = args.reps if args.reps is not None else (1 if args.quick else 2)
    bench = Bench(args, profile)
    bench.doc["machine"] = machine_info()
    bench.doc["reps"] = reps
    from gpugate_lab import core

    try:
        if args.weights_file:
            path = Path(args.weights_file)
            size = int(args.weights_gib * GIB)
            if not path.is_file() or path.stat().st_size != size:
                bench.say("writing the weight set: %s (%d bytes)" % (path, size))
                bench.doc["weights"] = make_weights(path, size, bench.log)
            else:
                bench.doc["weights"] = {"path": str(path), "bytes": size, "reused": True,
                                        "in_page_cache": page_cache_fraction(str(path))}
            bench.say("weights: %s" % json.dumps(bench.doc["weights"]))
        bench.say("lab up in %s (%s GPUs)" % (bench.lab_dir, args.gpus))
        bench.lab_up()
        bench.start_poller()
        bench.save()
        run(bench, [w.strip() for w in args.ways.split(",") if w.strip()], reps)
        if args.disk_variant and args.weights_file and bench.left_s() > 120:
            # (a) again, each read after posix_fadvise(DONTNEED) of the file's pages: from the disk
            data = bench.doc["ways"].setdefault("a_disk", {"label": "(a) cold, page cache dropped", "setup": None,
                                                           "samples": []})
            drop = {"SGLANG_STANDIN_WEIGHTS_DROP_CACHE": "1"}
            tic, dirty = time.monotonic(), dirty_kib()
            os.sync()  # posix_fadvise(DONTNEED) drops clean pages only
            data["sync"] = {"dirty_kib_before": dirty, "sync_s": round(time.monotonic() - tic, 2)}
            tp = profile["tp"]
            bench.say("(a) with the page cache dropped: setup (from (c): the daemons stop, the engine reads from disk)")
            data["setup"] = bench.deploy("a", {"tp": tp}, measured=bench.serving, extra_env=drop)
            bench.say("  setup rc %s, downtime %s s" % (data["setup"]["rc"], data["setup"]["figures"]["downtime_s"]))
            bench.save()
            if data["setup"]["rc"] == 0 and bench.left_s() > data["setup"]["wall_s"] * 1.2 + 10:
                record = bench.deploy("a", {"tp": tp, "kv-cache-dtype": "fp8_e4m3"}, measured=True, extra_env=drop)
                data["samples"].append(record)
                bench.say("  downtime %s s" % record["figures"]["downtime_s"])
            bench.save()
    except Exception as exc:  # noqa: BLE001 -- whatever happened is in the results
        bench.doc["errors"].append("%s: %s" % (type(exc).__name__, exc))
        bench.log(traceback.format_exc())
        bench.say("error: %s" % exc)
    finally:
        bench.stop_poller()
        bench.doc["ended_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        bench.doc["machine"]["loadavg_end"] = open("/proc/loadavg").read().split()[:3]
        bench.save()
        if not args.keep:
            try:
                core.down(bench.lab_dir)
            except Exception as exc:  # noqa: BLE001
                bench.log("lab down: %s" % exc)
            shutil.rmtree(bench.work, ignore_errors=True)
    text = report(bench.doc)
    print(text)
    print("results: %s" % bench.out)
    return 0 if not bench.doc["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
