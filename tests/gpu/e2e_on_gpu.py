"""The whole transition on a real GPU: every step of issue 15 through the real pyinfra CLI, one JSON.

Run by tests/gpu/run_e2e_on_gpu.sh (which installs the carried wheels and sshd first):

    python3 tests/gpu/e2e_on_gpu.py --results DIR [--simulated] [--budget-s 480] [--engine vllm]

It starts a lab (``gpugate lab up --gpus real``; ``--simulated``: the simulated GPUs, for rehearsing
here), starts a side process that polls the GPUs' used memory (NVML v2; the simulated ledger) every
few ms and records every change, and then runs, each step recorded and none stopping the next:

1. deploy (first start);  2. a flag change shown with --dry, then applied;  3. a converged re-run;
4. the seeds' kill chain on the lab's Proxmox host, as they typed it over SSH, with what it reached and
   what the GPU read after; then the same chain with patterns that do not match the shell (what the
   seeds meant); a deploy brings the desired state back after each;
5. memory held in another container (fault foreign-holder) -> the deploy refuses before the stop;
6. a start that crashes (the new environment hides the GPU) -> rollback;
7. the rollback runbook;  8. the status runbook.
With ``--live`` (issue 34) the run is instead: 1. a first start that declares LoRA adapter a (its launch
carries the adapter); 9. adapter b added live; 10. the checkpoint lab-model-v2 of the same model
applied live (update_weights_from_disk); 11. a flag change (a restart) of the same server for
comparison. A client in the container sends requests back to back during 9-11; each step records its
wall time, whether the main pid stayed, the GPUs' used memory and the client's failures.
With ``--engine vllm`` the lab serves vLLM (``gpugate lab up --engine vllm``) and step 4 is vLLM's own
hazard instead of the kill chains: the API server SIGKILLed (vLLM 0.33.0's EngineCore outlives it holding
the GPU, vllm#55510), then a deploy that sweeps it; step 6's crash is a ``--kv-cache-dtype`` that vLLM
refuses while it starts (its parser declares no choices).

Figures (from the journal's events, the audit log and the poller's samples, all on the machine's
clock): the physical release time after the server's exit, the gate's overhead over the moment NVML v2
showed the memory back, each restart split into drain, kill, gate, load and verify, and the tool's
overhead beyond drain and load. Everything goes to DIR/e2e_results.json, rewritten after every step
(a run cut short still leaves what it had); the commands' output to DIR/e2e.log.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

VMID = 129
HOST = "pve1"
# What differs per engine (--engine): its port, how its processes are told, its fp8 KV value, its
# tensor-parallel flag and memory share, another flag for step 5, the crash of step 6
PROFILES = {
    "sglang": {"port": 30000, "main": "sglang.launch_server", "names": ("sglang",), "fp8": "fp8_e4m3",
               "tp": "tp", "base": {"mem-fraction-static": 0.88}, "other": {"disable-radix-cache": True},
               "sim_env": {"SGLANG_STANDIN_LOAD_S": "0.5"}},
    "vllm": {"port": 8000, "main": "vllm.entrypoints", "names": ("vllm", "VLLM::"), "fp8": "fp8",
             "tp": "tensor-parallel-size", "base": {"gpu-memory-utilization": 0.88},
             "other": {"enable-prefix-caching": False}, "sim_env": {"VLLM_STANDIN_LOAD_S": "0.5"}},
}
ENGINE = "sglang"
P = PROFILES[ENGINE]
PORT = P["port"]
MAX_USED_MIB = 64
LAB_DIR = Path(os.environ.get("GPUGATE_E2E_LAB_DIR", "/tmp/gpugate-e2e-lab"))  # no "sglang" in it: pkill -f
SEEDS_CHAIN = "pkill -f sglang.launch_server; pkill -9 -f sglang; fuser -k /dev/nvidia*"
MEANT_CHAIN = "pkill -f '[s]glang.launch_server'; pkill -9 -f '[s]glang'; fuser -k /dev/nvidia*"
PHASES = ("drain", "kill", "sweep", "stop", "gate", "prepare", "start", "load", "verify", "commit", "rollback")

# Runs in the container (its /usr/bin/python3, stdlib): the server as /proc and /health show it.
CT_PROBE = r"""
import json, os, urllib.request
procs = []
for pid in os.listdir("/proc"):
    if not pid.isdigit():
        continue
    try:
        argv = open("/proc/%s/cmdline" % pid, "rb").read().split(b"\0")
    except OSError:
        continue
    argv = [a.decode(errors="replace") for a in argv if a]
    if argv and any(n in a for a in argv[:3] for n in @NAMES@) and int(pid) != os.getpid():
        procs.append({"pid": int(pid), "argv": argv})
main = [p for p in procs if "@MAIN@" in " ".join(p["argv"][:3]) and "--port" in p["argv"]
        and p["argv"][p["argv"].index("--port") + 1] == "@PORT@"]
try:
    health = urllib.request.urlopen("http://127.0.0.1:@PORT@/health", timeout=5).status
except Exception as exc:
    health = getattr(exc, "code", None) or type(exc).__name__
print(json.dumps({"main": main[0] if main else None, "sglang_procs": procs, "health": health}))
"""

# Runs on the lab host (its /usr/bin/python3): every process with its cgroup (the container) and cmdline.
HOST_PS = r"""
import json, os
out = []
for pid in os.listdir("/proc"):
    if not pid.isdigit() or int(pid) == os.getpid():
        continue
    try:
        argv = [a.decode(errors="replace") for a in open("/proc/%s/cmdline" % pid, "rb").read().split(b"\0") if a]
        cg = open("/proc/%s/cgroup" % pid).read().strip().split("::")[-1]
        comm = open("/proc/%s/comm" % pid).read().strip()
    except OSError:
        continue
    vmid = None
    if "/lxc/" in cg:
        vmid = cg.split("/lxc/")[1].split("/")[0]
    out.append({"pid": int(pid), "vmid": vmid, "comm": comm, "cmd": " ".join(argv)[:300]})
print(json.dumps(out))
"""

# The side process: GPU memory used (v2: reserved memory not counted), sampled every few ms.
POLLER = r"""
import json, sys, time
out_path, mode, arg = sys.argv[1], sys.argv[2], sys.argv[3]
interval = float(sys.argv[4])
if mode == "nvml":
    import pynvml
    pynvml.nvmlInit()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    def read():
        return [pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2).used >> 20 for h in handles]
else:
    sys.path.insert(0, arg.split("::")[0])
    from gpugate_lab.core import gpu_usage
    from pathlib import Path
    gdir = Path(arg.split("::")[1])
    def read():
        return [g["used_mib"] for g in gpu_usage(gdir)]
last, beat = None, 0.0
with open(out_path, "a", buffering=1) as out:
    while True:
        now = time.time()
        try:
            used = read()
        except Exception as exc:
            used = "error: %s" % exc
        if used != last or now - beat >= 1.0:
            out.write(json.dumps({"t": round(now, 4), "used": used}) + "\n")
            last, beat = used, now
        time.sleep(interval)
"""


class Run:
    """The results document and the helpers every step uses."""

    def __init__(self, results: Path, simulated: bool, budget_s: float, cpu_real: str | None = None):
        self.results = results
        self.simulated = simulated
        self.cpu_real = cpu_real  # a venv with CPU torch: the stand-in's real mode on the CPU, sim GPUs
        self.deadline = time.monotonic() + budget_s
        self.log_path = results / "e2e.log"
        mode = "cpu-real" if cpu_real else ("simulated" if simulated else "real")
        self.doc: dict = {"schema": 1, "mode": mode,
                          "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                          "steps": {}, "figures": {}, "transitions": {}, "errors": []}
        self.env = dict(os.environ)
        self.env.update({"GPUGATE_LAB_DIR": str(LAB_DIR), "GPUGATE_FLEET": str(LAB_DIR / "fleet.yaml"),
                         "GPUGATE_AUDIT_LOG": str(results / "audit.jsonl"), "GPUGATE_OPERATOR": "e2e@gpu"})
        self.poller: subprocess.Popen | None = None
        self.samples_path = results / "gpu_samples.jsonl"
        self.flags_base: dict = {}
        self.server_env: dict = {}

    # ------------------------------------------------------------ bookkeeping
    def log(self, text: str) -> None:
        with open(self.log_path, "a") as handle:
            handle.write(text if text.endswith("\n") else text + "\n")

    def save(self) -> None:
        self.doc["saved_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        tmp = self.results / ".e2e_results.json.tmp"
        tmp.write_text(json.dumps(self.doc, indent=1, default=str) + "\n")
        os.replace(tmp, self.results / "e2e_results.json")

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def step(self, name: str, fn, *args, min_left_s: float = 20.0) -> dict:
        """Run one step; whatever happens, its record is saved and the run goes on."""
        record: dict = {"began_at": round(time.time(), 3)}
        self.doc["steps"][name] = record
        if self.left_s() < min_left_s:
            record.update(outcome="skipped", reason=f"budget: {self.left_s():.0f} s left, needs {min_left_s:.0f} s")
            self.save()
            return record
        self.log(f"\n======== step {name} ({self.left_s():.0f} s of budget left)")
        started = time.monotonic()
        try:
            record.update(fn(*args) or {})
            record.setdefault("outcome", "done")
        except Exception as exc:  # noqa: BLE001 -- record and go on to the next step
            record.update(outcome="error", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:])
            self.doc["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
            self.log(traceback.format_exc())
        record["duration_s"] = round(time.monotonic() - started, 3)
        self.log(f"-------- step {name}: {record.get('outcome')} in {record['duration_s']} s")
        self.save()
        return record

    def sh(self, argv: list[str], timeout: float = 120, input: str | None = None, env: dict | None = None) -> dict:
        """Run a command, log all of it, return rc/out/err/wall (never raises for a failing command)."""
        timeout = max(5.0, min(timeout, self.left_s() - 5))
        self.log("$ " + " ".join(shlex.quote(a if len(a) < 300 else a[:120] + "...") for a in argv))
        began = time.time()
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                                  env=env or self.env, input=input, stdin=None if input is not None else subprocess.DEVNULL)
            rc, out, err = proc.returncode, proc.stdout, proc.stderr
        except OSError as exc:  # a missing tool is an outcome too
            rc, out, err = "not run", "", f"{type(exc).__name__}: {exc}"
        except subprocess.TimeoutExpired as exc:
            rc = "timeout"
            out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        ended = time.time()
        self.log(out + ("\n[stderr]\n" + err if err.strip() else "") + f"[rc={rc} in {ended - began:.2f} s]")
        return {"rc": rc, "out": out, "err": err, "began": round(began, 4), "ended": round(ended, 4),
                "wall_s": round(ended - began, 3)}

    # ------------------------------------------------------------ the lab, the container, the GPUs
    def host_exec(self) -> list[str]:
        from gpugate_lab import core

        return core.host_exec_argv(LAB_DIR, HOST)

    def ct_state(self) -> dict:
        res = self.sh(self.host_exec() + ["pct", "exec", str(VMID), "--", "/usr/bin/python3", "-c",
                                          CT_PROBE.replace("@PORT@", str(PORT)).replace("@MAIN@", P["main"])
                                          .replace("@NAMES@", repr(P["names"]))], timeout=30)
        try:
            return json.loads(res["out"].strip().splitlines()[-1])
        except (ValueError, IndexError):
            return {"error": (res["err"] or res["out"])[-500:], "rc": res["rc"]}

    def host_ps(self) -> list[dict]:
        res = self.sh(self.host_exec() + ["/usr/bin/python3", "-c", HOST_PS], timeout=30)
        try:
            return json.loads(res["out"])
        except ValueError:
            return []

    def gpu_now(self) -> list:
        """The GPUs' used MiB now, as the poller reads them (its last sample)."""
        samples = self.samples()
        return samples[-1]["used"] if samples else []

    def samples(self) -> list[dict]:
        try:
            return [json.loads(line) for line in self.samples_path.read_text().splitlines() if line.strip()]
        except (OSError, ValueError):
            return []

    def journal_since(self, since: float) -> list[dict]:
        """The container's transition journal events (every run file touched since ``since``)."""
        code = ("import glob, json, os, sys\nout = []\n"
                "for f in sorted(glob.glob('/var/lib/gpugate/runs/*.jsonl')):\n"
                "    if os.path.getmtime(f) + 1 < %f: continue\n"
                "    for line in open(f, errors='replace'):\n"
                "        try: e = json.loads(line)\n"
                "        except ValueError: continue\n"
                "        e['_run'] = os.path.basename(f)[:-6]; out.append(e)\n"
                "print(json.dumps(out))\n") % since
        res = self.sh(self.host_exec() + ["pct", "exec", str(VMID), "--", "/usr/bin/python3", "-c", code], timeout=30)
        try:
            return [e for e in json.loads(res["out"].strip().splitlines()[-1]) if float(e.get("t", 0)) >= since - 1]
        except (ValueError, IndexError):
            return []

    def audit_since(self, since: float) -> list[dict]:
        path = self.results / "audit.jsonl"
        events = []
        try:
            for line in path.read_text().splitlines():
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if float(event.get("t", 0)) >= since - 1:
                    events.append(event)
        except OSError:
            pass
        return events

    # ------------------------------------------------------------ pyinfra
    def pyinfra(self, target: str, flags: dict | None = None, env: dict | None = None, dry: bool = False,
                extra: tuple = (), timeout: float = 180) -> dict:
        argv = [sys.executable, "-m", "pyinfra"] + ([] if dry else ["-y"]) + ["inventory.py", target]
        argv += ["--data", f"sglang_flags={json.dumps(flags if flags is not None else self.flags_base)}",
                 "--data", f"sglang_env={json.dumps(self.server_env if env is None else env)}",
                 "--data", "start_timeout_s=240", "--data", "gpu_gate_timeout_s=60", "--data", "drain_timeout_s=30"]
        argv += list(extra) + (["--dry"] if dry else [])
        res = self.sh(argv, timeout=timeout)
        return res

    def transition(self, name: str, res: dict) -> dict:
        """The events of one pyinfra call, its phase split and figures; kept under transitions[name]."""
        journal = self.journal_since(res["began"])
        audit = self.audit_since(res["began"])
        figures = transition_figures(journal, audit, self.samples(), res)
        self.doc["transitions"][name] = {"figures": figures, "journal": compact(journal), "audit": compact(audit)}
        return figures


# ---------------------------------------------------------------- figures (pure)


def compact(events: list[dict]) -> list[dict]:
    """Events without bulky fields (kept: step, phase, t, target, outcome-ish and timing fields)."""
    keep = ("step", "phase", "t", "target", "outcome", "passed", "drained", "state", "ok", "duration_s",
            "elapsed_s", "used_mib", "polls", "killed", "pid", "exit_code", "reason", "message", "gpu_used_mib",
            "timings", "_run")
    return [{k: e[k] for k in keep if k in e} for e in events]


def phase_spans(events: list[dict]) -> list[dict]:
    """begin/end pairs per (step, target), in order: [{"step", "target", "begin", "end", "s"}].

    >>> phase_spans([{"step": "gate", "phase": "begin", "t": 1.0}, {"step": "gate", "phase": "end", "t": 1.25}])
    [{'step': 'gate', 'target': None, 'begin': 1.0, 'end': 1.25, 's': 0.25}]
    """
    open_: dict = {}
    spans = []
    for event in sorted(events, key=lambda e: float(e.get("t", 0))):
        key = (event.get("step"), event.get("target"), event.get("_run"))
        if event.get("phase") == "begin":
            open_[key] = float(event["t"])
        elif event.get("phase") == "end":
            begin = open_.pop(key, None)
            duration = event.get("duration_s")
            if begin is None and isinstance(duration, (int, float)):
                begin = float(event["t"]) - float(duration)
            if begin is not None:
                spans.append({"step": event.get("step"), "target": event.get("target"), "begin": round(begin, 4),
                              "end": round(float(event["t"]), 4), "s": round(float(event["t"]) - begin, 4)})
    return spans


def first_free_after(samples: list[dict], t0: float, max_used: int = MAX_USED_MIB) -> float | None:
    """The first poller sample at or after t0 in which every GPU reads <= max_used MiB.

    >>> first_free_after([{"t": 1, "used": [900]}, {"t": 2, "used": [10]}, {"t": 3, "used": [0]}], 1.5)
    2
    """
    for sample in samples:
        used = sample.get("used")
        if sample["t"] >= t0 and isinstance(used, list) and used and all(u <= max_used for u in used):
            return sample["t"]
    return None


def last_held_before(samples: list[dict], t1: float, max_used: int = MAX_USED_MIB) -> float | None:
    """The last sample before t1 in which some GPU still read above max_used (the poller's bracket)."""
    held = None
    for sample in samples:
        used = sample.get("used")
        if sample["t"] < t1 and isinstance(used, list) and any(u > max_used for u in used):
            held = sample["t"]
    return held


def transition_figures(journal: list[dict], audit: list[dict], samples: list[dict], res: dict) -> dict:
    """Phase split (desired target first), release and gate figures, overhead beyond drain and load."""
    spans = phase_spans(journal) or phase_spans(audit)
    source = "journal" if phase_spans(journal) else ("audit" if spans else None)
    first: dict = {}
    for span in spans:
        first.setdefault(span["step"], span)  # the first of each step: the desired server's transition
    figures: dict = {"source": source, "pyinfra_wall_s": res.get("wall_s"), "rc": res.get("rc"),
                     "phases_s": {k: first[k]["s"] for k in PHASES if k in first},
                     "spans": spans}
    drain = first.get("drain")
    kill = first.get("kill")
    # Only a transition that stopped a server has a release to measure (a first start has no drain).
    exit_t = max([s["end"] for s in (drain, kill) if s] or [0]) or None
    gate = first.get("gate")
    if exit_t and gate and samples:
        # The moment the memory came back: the first free reading after the last held one before the
        # gate passed (the poller writes a sample when the reading changes, so "the first free sample
        # after the exit" would miss a release that happened while the main process was still exiting).
        held = last_held_before(samples, gate["end"])
        freed = first_free_after(samples, held + 1e-6) if held is not None else None
        figures["server_exit_t"] = exit_t
        figures["memory_back_t"] = freed
        figures["last_held_t"] = held
        if freed is not None:
            # negative: the workers (which hold the memory) were gone before the main process was seen gone
            figures["release_after_exit_s"] = round(freed - exit_t, 4)
            figures["gate_pass_t"] = gate["end"]
            figures["gate_overhead_s"] = round(gate["end"] - freed, 4)
    load = first.get("load")
    drain_s = drain["s"] if drain else 0.0
    load_s = load["s"] if load else 0.0
    if isinstance(res.get("wall_s"), (int, float)) and (drain or load):
        figures["tool_overhead_beyond_drain_and_load_s"] = round(res["wall_s"] - drain_s - load_s, 3)
    if drain and first.get("verify"):
        figures["restart_in_container_s"] = round(first["verify"]["end"] - drain["begin"], 3)
    return figures


def summary_of(res: dict, n: int = 4000) -> dict:
    return {"rc": res["rc"], "wall_s": res["wall_s"], "out_tail": (res["out"] + res["err"])[-n:]}


# ---------------------------------------------------------------- the steps


def step_lab_up(run: Run) -> dict:
    from gpugate_lab import core

    if LAB_DIR.exists():  # a fresh lab: no history of an earlier run in the containers
        core.down(LAB_DIR)
        shutil.rmtree(LAB_DIR)
    argv = [sys.executable, "-m", "gpugate.cli", "lab", "--dir", str(LAB_DIR), "up", "--hosts", "1", "--engine", ENGINE]
    argv += ["--gpus", "1", "--gpu-mib", "143771"] if run.simulated else ["--gpus", "real"]
    if run.cpu_real:  # the real-mode stand-in (torch env, model, forward pass) on this CPU; GPUs simulated
        from gpugate_lab import realgpu

        binding = {"mode": "real", "device": "cpu", "devices": [], "binds": [], "links": [], "ld_dirs": [],
                   "nvidia_smi": None, "gpus": [], "torch_env": realgpu.find_torch_env(run.cpu_real)}
        began = time.time()
        core.up(LAB_DIR, hosts=1, gpus=1, gpu_mib=143771, gpu_binding=binding, engines=(ENGINE,))
        res = {"rc": 0, "out": json.dumps(binding), "err": "", "wall_s": round(time.time() - began, 3)}
    else:
        res = run.sh(argv, timeout=120)
    if res["rc"] != 0:
        raise RuntimeError("lab up failed: " + (res["err"] or res["out"])[-1000:])
    state = core.status(LAB_DIR)
    host = state["hosts"][0]
    gpus = len(host.get("gpus") or []) or 1
    fleet = (LAB_DIR / "fleet.yaml").read_text()
    run.flags_base = {P["tp"]: gpus, **P["base"]}
    run.server_env = dict(P["sim_env"]) if run.simulated and not run.cpu_real else {}
    nvidia = run.sh(run.host_exec() + ["pct", "exec", str(VMID), "--", "nvidia-smi"], timeout=60)
    return {"lab_up": summary_of(res, 2000), "gpu_mode": host.get("gpu_mode"), "gpus": host.get("gpus"),
            "fleet": fleet, "container_nvidia_smi": summary_of(nvidia, 3000)}


def start_poller(run: Run) -> dict:
    if run.simulated or run.cpu_real:
        mode, arg, interval = "sim", f"{REPO}::{LAB_DIR / 'hosts' / HOST / 'gpu'}", 0.005
    else:
        mode, arg, interval = "nvml", "-", 0.002
    run.poller = subprocess.Popen([sys.executable, "-c", POLLER, str(run.samples_path), mode, arg, str(interval)],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=open(run.results / "poller.err", "a"), start_new_session=True, env=run.env)
    time.sleep(1.5)
    samples = run.samples()
    if not samples:
        raise RuntimeError("the GPU poller wrote nothing: " + (run.results / "poller.err").read_text()[-500:])
    return {"poller": {"mode": mode, "interval_s": interval, "pid": run.poller.pid}, "first_sample": samples[0]}


def step_deploy(run: Run) -> dict:
    res = run.pyinfra("deploy.py")
    figures = run.transition("1_deploy", res)
    state = run.ct_state()
    return {"pyinfra": summary_of(res), "figures": figures, "server": state, "gpu_used_mib_after": run.gpu_now(),
            "outcome": "served" if res["rc"] == 0 and state.get("health") == 200 else "failed"}


def step_flag_change(run: Run) -> dict:
    changed = dict(run.flags_base, **{"kv-cache-dtype": P["fp8"]})
    before = run.ct_state()
    dry = run.pyinfra("deploy.py", flags=changed, dry=True, timeout=90)
    after_dry = run.ct_state()
    applied = run.pyinfra("deploy.py", flags=changed)
    figures = run.transition("2_flag_change", applied)
    after = run.ct_state()
    argv = (after.get("main") or {}).get("argv") or []
    text = dry["out"] + dry["err"]
    return {"dry": summary_of(dry), "dry_shows_the_diff": "--kv-cache-dtype" in text and P["fp8"] in text,
            "dry_touched_nothing": (before.get("main") or {}).get("pid") == (after_dry.get("main") or {}).get("pid"),
            "applied": summary_of(applied), "figures": figures, "server": after,
            "running_has_new_flag": P["fp8"] in argv,
            "kv_capacity_line": next((line.strip() for line in (applied["out"] + applied["err"]).splitlines()
                                      if "KV cache" in line and "->" in line), None),
            "outcome": "changed" if applied["rc"] == 0 and P["fp8"] in argv and after.get("health") == 200 else "failed"}


def step_converged(run: Run) -> dict:
    changed = dict(run.flags_base, **{"kv-cache-dtype": P["fp8"]})
    before = run.ct_state()
    res = run.pyinfra("deploy.py", flags=changed)
    after = run.ct_state()
    same = (before.get("main") or {}).get("pid") is not None and \
        (before.get("main") or {}).get("pid") == (after.get("main") or {}).get("pid")
    return {"pyinfra": summary_of(res), "server_pid_unchanged": same,
            "no_changes_said": bool(re.search(r"no changes", res["out"] + res["err"], re.I)),
            "outcome": "converged" if res["rc"] == 0 and same else "failed"}


def kill_chain(run: Run, chain: str) -> dict:
    """The chain over SSH on the lab host, as typed; what it reached and what the GPU read after."""
    from gpugate_lab import core

    before_ps = run.host_ps()
    state_before = run.ct_state()
    gpu_before = run.gpu_now()
    res = run.sh(core.ssh_argv(LAB_DIR, HOST) + [chain], timeout=60)
    time.sleep(2.0)
    after_ps = run.host_ps()
    alive_after = {p["pid"] for p in after_ps}
    reached = [p for p in before_ps if p["pid"] not in alive_after]
    survivors = [p for p in after_ps if "sglang" in p["cmd"] or p["comm"].startswith("sglang")]
    samples = run.samples()
    freed = first_free_after(samples, res["began"])
    smi = run.sh(run.host_exec() + ["nvidia-smi", "--query-gpu=index,memory.used,memory.total",
                                    "--format=csv,noheader,nounits"], timeout=30)
    state_after = run.ct_state()
    return {
        "chain": chain, "ssh": summary_of(res, 2000),
        "shell_killed_by_its_own_pattern": res["rc"] in (255, 143, 137, -9, -15),
        "reached": reached, "sglang_survivors": survivors,
        "server_before": state_before, "server_after": state_after,
        "gpu_used_mib_before": gpu_before, "gpu_used_mib_2s_after": run.gpu_now(),
        "nvidia_smi_after": smi["out"].strip(),
        "memory_back_after_chain_start_s": round(freed - res["began"], 4) if freed else None,
    }


def step_kill_chain(run: Run, chain: str, label: str) -> dict:
    result = kill_chain(run, chain)
    restore = run.pyinfra("deploy.py", flags=dict(run.flags_base, **{"kv-cache-dtype": P["fp8"]}))
    result["restore_deploy"] = summary_of(restore)
    result["restore_figures"] = run.transition(f"4_{label}_restore", restore)
    state = run.ct_state()
    result["server_restored"] = state
    result["outcome"] = "restored" if restore["rc"] == 0 and state.get("health") == 200 else "not restored"
    return result


def step_sigkill_api_server(run: Run) -> dict:
    """vLLM's own hazard: the API server SIGKILLed (an OOM kill, a `kill -9` by hand). 0.33.0's
    EngineCore watches no parent: it and its workers keep the GPU while the port is free. Then a
    deploy, which must sweep them (they are this server's own) and start it again."""
    before = run.ct_state()
    pid = (before.get("main") or {}).get("pid")
    gpu_before = run.gpu_now()
    kill = run.sh(run.host_exec() + ["pct", "exec", str(VMID), "--", "kill", "-9", str(pid)], timeout=30)
    time.sleep(2.0)
    left = run.ct_state()
    gpu_left = run.gpu_now()
    restore = run.pyinfra("deploy.py", flags=dict(run.flags_base, **{"kv-cache-dtype": P["fp8"]}))
    figures = run.transition("4_sigkill_restore", restore)
    after = run.ct_state()
    text = restore["out"] + restore["err"]
    orphans = [p for p in left.get("sglang_procs") or [] if p["argv"][0].startswith("VLLM::")]
    return {"killed_pid": pid, "kill": summary_of(kill, 500), "gpu_used_mib_before": gpu_before,
            "left_after_2s": left, "gpu_used_mib_2s_after": gpu_left, "orphans_holding": orphans,
            "restore_deploy": summary_of(restore, 6000), "restore_figures": figures, "server_restored": after,
            "swept_said": "swept" in text,
            "outcome": "swept and restored" if restore["rc"] == 0 and after.get("health") == 200 and "swept" in text
            else "not restored"}


def step_foreign(run: Run) -> dict:
    fault = run.sh([sys.executable, "-m", "gpugate.cli", "lab", "--dir", str(LAB_DIR), "fault", "--host", HOST,
                    "--vmid", str(VMID), "foreign-holder"], timeout=200)
    held = run.gpu_now()
    before = run.ct_state()
    desired = dict(run.flags_base, **{"kv-cache-dtype": P["fp8"]}, **P["other"])
    res = run.pyinfra("deploy.py", flags=desired, timeout=120)
    after = run.ct_state()
    same = (before.get("main") or {}).get("pid") is not None and \
        (before.get("main") or {}).get("pid") == (after.get("main") or {}).get("pid")
    clear = run.sh([sys.executable, "-m", "gpugate.cli", "lab", "--dir", str(LAB_DIR), "fault", "--host", HOST,
                    "--vmid", str(VMID), "--clear", "foreign-holder"], timeout=60)
    time.sleep(1.0)
    text = res["out"] + res["err"]
    return {"fault": summary_of(fault, 1500), "gpu_used_mib_with_holder": held, "pyinfra": summary_of(res),
            "refused": res["rc"] != 0, "server_pid_unchanged": same, "server_after": after,
            "message_names_outside_memory": bool(re.search(r"outside|another container|foreign|not this container",
                                                           text, re.I)),
            "clear": summary_of(clear, 1000), "gpu_used_mib_after_clear": run.gpu_now(),
            "outcome": "refused before the stop" if res["rc"] != 0 and same and after.get("health") == 200 else "unexpected"}


def step_crash_rollback(run: Run) -> dict:
    # The new server's main process fails right after its TP workers are ready (the stand-in cannot
    # parse its load time): on real GPUs that is after every worker created its CUDA context, loaded its
    # weights and took its KV pool, so the rollback's gate waits for real memory coming back. (A hidden
    # GPU, CUDA_VISIBLE_DEVICES=99, is refused by the plan before the stop; a memory fraction of 0.01
    # still fits the lab's tiny model on an H200, so it served: the first GPU run saw both.)
    changed = dict(run.flags_base, **{"kv-cache-dtype": P["fp8"]})
    crash_env = dict(run.server_env, SGLANG_STANDIN_LOAD_S="not-a-number")
    if ENGINE == "vllm":  # a value vLLM refuses while it starts: its parser declares no choices
        changed, crash_env = dict(run.flags_base, **{"kv-cache-dtype": "fp9"}), dict(run.server_env)
    before = run.ct_state()
    res = run.pyinfra("deploy.py", flags=changed, env=crash_env)
    figures = run.transition("6_crash_rollback", res)
    after = run.ct_state()
    text = res["out"] + res["err"]
    # compared as the product compares what runs: without the launch-only --gated-launch-port (the old
    # server was started gated; its rollback is an ordinary start of the same spec)
    from gpugate.engine.sglang.weight_cache import steady_argv  # noqa: PLC0415 -- vLLM's argv has no gate option

    argv_before = steady_argv((before.get("main") or {}).get("argv"))
    argv_after = steady_argv((after.get("main") or {}).get("argv"))
    return {"crash_env": {k: v for k, v in crash_env.items()}, "pyinfra": summary_of(res, 6000), "figures": figures,
            "server_before": before, "server_after": after, "same_argv_after": argv_before == argv_after,
            "rolled_back_said": bool(re.search(r"roll(ed)?[ _-]?back|previous server", text, re.I)),
            "crash_flags": changed,
            "outcome": "rolled back" if res["rc"] != 0 and after.get("health") == 200 and argv_before
            and argv_before == argv_after and re.search(r"ROLLED BACK|rolled back", text)
            and (after.get("main") or {}).get("pid") != (before.get("main") or {}).get("pid") else "unexpected"}


def step_rollback_runbook(run: Run) -> dict:
    before = run.ct_state()
    res = run.pyinfra("runbooks/rollback.py", flags=dict(run.flags_base, **{"kv-cache-dtype": P["fp8"]}),
                      extra=("--limit", f"@pct/{HOST}:{VMID}"))
    figures = run.transition("7_rollback_runbook", res)
    after = run.ct_state()
    argv = (after.get("main") or {}).get("argv") or []
    return {"pyinfra": summary_of(res), "figures": figures, "server_before": before, "server_after": after,
            "kv_cache_dtype_after": argv[argv.index("--kv-cache-dtype") + 1] if "--kv-cache-dtype" in argv else None,
            "outcome": "rolled back" if res["rc"] == 0 and after.get("health") == 200 else "failed"}


LORA_A, LORA_B = "/opt/models/lab-lora-a", "/opt/models/lab-lora-b"
MODEL_V1, MODEL_V2 = "/opt/models/lab-model", "/opt/models/lab-model-v2"
# a client of the server in the container: 1-token generations back to back, one line per answer
CT_CLIENT = r"""
import json, sys, time, urllib.request as u
end = time.time() + float(sys.argv[1])
while time.time() < end:
    began = time.time()
    try:
        r = u.urlopen(u.Request("http://127.0.0.1:@PORT@/generate", headers={"content-type": "application/json"},
                                data=json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 1}}).encode()), timeout=30)
        ok = r.status == 200 and bool(json.load(r).get("text"))
        print(json.dumps({"t": began, "s": round(time.time() - began, 4), "ok": ok}), flush=True)
    except Exception as error:
        print(json.dumps({"t": began, "s": round(time.time() - began, 4), "ok": False, "error": str(error)[:200]}), flush=True)
        time.sleep(0.05)
"""


def live_data(adapters: dict, model: str) -> tuple:
    return ("--data", f"sglang_lora_adapters={json.dumps(adapters)}", "--data", f"sglang_model_path={model}")


def with_client(run: Run, fn):
    """``fn()`` while a client in the container sends generations back to back; what it saw."""
    client = subprocess.Popen(run.host_exec() + ["pct", "exec", str(VMID), "--", "/usr/bin/python3", "-c",
                                                 CT_CLIENT.replace("@PORT@", str(PORT)), "300"],
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              start_new_session=True, env=run.env)
    time.sleep(1.0)
    try:
        result = fn()
    finally:
        time.sleep(0.5)
        os.killpg(client.pid, signal.SIGTERM)
        out, _ = client.communicate(timeout=30)
    answers = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    failed = [a for a in answers if not a["ok"]]
    longest = max((a["s"] for a in answers), default=None)
    # the longest time without an answer: between two successive successful answers' ends
    ends = sorted(a["t"] + a["s"] for a in answers if a["ok"])
    gap = max((b - a for a, b in zip(ends, ends[1:])), default=None)
    return result, {"requests": len(answers), "failed": len(failed), "longest_answer_s": longest,
                    "longest_gap_without_an_answer_s": round(gap, 3) if gap is not None else None,
                    "first_failures": failed[:3]}


def live_step(run: Run, name: str, adapters: dict, model: str, flags: dict | None = None) -> dict:
    extra = live_data(adapters, model)
    dry = run.pyinfra("deploy.py", flags=flags, dry=True, extra=extra, timeout=90)
    before = run.ct_state()
    memory_before = run.gpu_now()
    applied, client = with_client(run, lambda: run.pyinfra("deploy.py", flags=flags, extra=extra))
    figures = run.transition(name, applied)
    after = run.ct_state()
    text = dry["out"] + dry["err"]
    pid_kept = (before.get("main") or {}).get("pid") == (after.get("main") or {}).get("pid")
    return {"dry_path": next((line.strip() for line in text.splitlines() if "path:" in line), None),
            "dry_lines": [line.strip() for line in text.splitlines() if "live:" in line or "restart:" in line][:8],
            "applied": summary_of(applied), "figures": figures, "main_pid_kept": pid_kept,
            "gpu_used_mib_before": memory_before, "gpu_used_mib_after": run.gpu_now(), "client": client,
            "outcome": ("live" if pid_kept else "restarted") if applied["rc"] == 0 and after.get("health") == 200
            else "failed"}


def step_lora_deploy(run: Run) -> dict:
    res = run.pyinfra("deploy.py", extra=live_data({"a": LORA_A}, MODEL_V1))
    figures = run.transition("1_deploy_lora", res)
    state = run.ct_state()
    return {"pyinfra": summary_of(res), "figures": figures, "server": state, "gpu_used_mib_after": run.gpu_now(),
            "outcome": "served" if res["rc"] == 0 and state.get("health") == 200 else "failed"}


def step_status(run: Run) -> dict:
    res = run.pyinfra("runbooks/status.py", flags=dict(run.flags_base, **{"kv-cache-dtype": P["fp8"]}), timeout=90)
    # exit status 1 means: some row is not as desired (here: the rollback runbook left the fleet's flags)
    return {"pyinfra": summary_of(res, 6000), "table": res["out"][-4000:],
            "outcome": "shown" if res["rc"] in (0, 1) and res["out"].strip() else "failed"}


def checkout_commit() -> str:
    """This checkout's own commit: the file tests/gpu/pack_for_gpu.sh wrote before the copy travelled
    (without .git), else git where this checkout is its own repository's top, else says there is none
    (a `git log` in a copy inside another repository names that repository's commit)."""
    root = Path(__file__).resolve().parents[2]
    recorded = Path(os.environ.get("GPUGATE_CARRY") or root / ".gpu-carry") / "commit"
    if recorded.is_file():
        return recorded.read_text().strip()[:200]
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=root, capture_output=True, text=True)
    if top.returncode == 0 and Path(top.stdout.strip()).resolve() == root:
        head = subprocess.run(["git", "log", "-1", "--format=%h %s"], cwd=root, capture_output=True, text=True)
        return head.stdout.strip()[:200]
    return "no commit: this checkout has no .git of its own"


def machine_info(run: Run) -> dict:
    info: dict = {"python": sys.version.split()[0], "kernel": platform.release(), "repo_head": checkout_commit()}
    smi = run.sh(["nvidia-smi", "--query-gpu=index,name,driver_version,memory.total,memory.used",
                  "--format=csv,noheader"], timeout=30)
    info["nvidia_smi"] = smi["out"].strip() or ((smi["err"].strip().splitlines() or [""])[-1])[:300]
    torch = run.sh([sys.executable, "-c", "import torch; print(torch.__version__, torch.version.cuda, "
                                          "torch.cuda.is_available())"], timeout=60)
    info["torch"] = ((torch["out"] or torch["err"]).strip().splitlines() or [""])[-1][-300:]
    return info


def summarize(run: Run) -> None:
    """The figures the issue asks for, from the flag change (a full drain -> verify restart) and the others."""
    figures: dict = {}
    for name, transition in run.doc["transitions"].items():
        f = transition["figures"]
        figures[name] = {k: f.get(k) for k in ("pyinfra_wall_s", "rc", "phases_s", "release_after_exit_s",
                                               "gate_overhead_s", "restart_in_container_s",
                                               "tool_overhead_beyond_drain_and_load_s")}
    run.doc["figures"] = figures


def report(doc: dict) -> str:
    """A markdown summary of a results document (for docs/benchmarks.md and the issue's note)."""
    lines = [f"Run: engine {doc.get('engine', 'sglang')}, mode {doc.get('mode')}, {doc.get('started_at')} .. {doc.get('ended_at')}; "
             f"machine: {(doc.get('machine') or {}).get('nvidia_smi', '?')}; torch {(doc.get('machine') or {}).get('torch', '?')}",
             "", "| step | outcome | s |", "|---|---|---|"]
    for name, step in doc.get("steps", {}).items():
        lines.append(f"| {name} | {step.get('outcome')} | {step.get('duration_s')} |")
    lines += ["", "| transition | pyinfra wall s | drain | kill | gate | load | verify | release after exit s | "
              "gate overhead s | overhead beyond drain+load s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, f in doc.get("figures", {}).items():
        ph = f.get("phases_s") or {}
        lines.append("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            name, f.get("pyinfra_wall_s"), ph.get("drain"), ph.get("kill"), ph.get("gate"), ph.get("load"),
            ph.get("verify"), f.get("release_after_exit_s"), f.get("gate_overhead_s"),
            f.get("tool_overhead_beyond_drain_and_load_s")))
    live = [(n, s) for n, s in doc.get("steps", {}).items() if "client" in s]
    if live:
        lines += ["", "| live step | outcome | --dry | pid kept | pyinfra wall s | live apply s | live verify s | "
                      "GPU MiB before -> after | client requests | failed | longest gap without an answer s |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, step in live:
            c = step["client"]
            spans = {sp["step"]: sp["s"] for sp in (step.get("figures") or {}).get("spans") or []}
            dry = (step.get("dry_path") or "").split("path:")[-1].strip()
            lines.append(f"| {name} | {step.get('outcome')} | {dry} | {step.get('main_pid_kept')} | "
                         f"{(step.get('applied') or {}).get('wall_s')} | {spans.get('live_apply')} | "
                         f"{spans.get('live_verify')} | {step.get('gpu_used_mib_before')} -> "
                         f"{step.get('gpu_used_mib_after')} | {c['requests']} | {c['failed']} | "
                         f"{c.get('longest_gap_without_an_answer_s')} |")
    for name in ("4_seeds_kill_chain", "4b_meant_kill_chain"):
        step = doc.get("steps", {}).get(name) or {}
        if "chain" in step:
            reached = ", ".join(f"{p.get('cmd', '')[:40]} (ct {p.get('vmid')})" for p in step.get("reached") or [])
            lines += ["", f"{name}: `{step['chain']}`: ssh rc {step['ssh']['rc']}, shell killed by its own pattern: "
                          f"{step.get('shell_killed_by_its_own_pattern')}; reached: {reached or 'nothing'}; sglang "
                          f"survivors: {len(step.get('sglang_survivors') or [])}; GPU MiB before {step.get('gpu_used_mib_before')}"
                          f" -> 2 s after {step.get('gpu_used_mib_2s_after')}; memory back "
                          f"{step.get('memory_back_after_chain_start_s')} s after the chain began"]
    if doc.get("errors"):
        lines += ["", "Errors: " + "; ".join(doc["errors"])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--report":  # e2e_on_gpu.py --report RESULTS.json
        sys.stdout.write(report(json.loads(Path(sys.argv[2]).read_text())))
        return 0
    parser.add_argument("--results", type=Path, required=True)
    parser.add_argument("--simulated", action="store_true", help="rehearse on the simulated lab (no GPU)")
    parser.add_argument("--budget-s", type=float, default=float(os.environ.get("GPUGATE_E2E_BUDGET_S", "480")))
    parser.add_argument("--no-meant-chain", action="store_true", help="skip the second kill chain")
    parser.add_argument("--engine", choices=sorted(PROFILES), default="sglang", help="the engine the lab serves")
    parser.add_argument("--live", action="store_true", help="the live changes of issue 34 instead of steps 2-8")
    parser.add_argument("--cpu-real", metavar="VENV", help="rehearse the stand-in's real mode on the CPU "
                                                          "(VENV has torch); the GPUs stay simulated")
    args = parser.parse_args(argv)
    global ENGINE, P, PORT
    ENGINE, P = args.engine, PROFILES[args.engine]
    PORT = P["port"]
    args.results.mkdir(parents=True, exist_ok=True)
    run = Run(args.results, args.simulated or bool(args.cpu_real), args.budget_s, args.cpu_real)
    run.doc["engine"] = ENGINE
    run.save()
    try:
        try:
            run.doc["machine"] = machine_info(run)
        except Exception as exc:  # noqa: BLE001
            run.doc["machine"] = {"error": repr(exc)}
        lab = run.step("0_lab_up", step_lab_up, run, min_left_s=0)
        if lab.get("outcome") != "done":
            return 1
        run.step("0_poller", start_poller, run, min_left_s=0)
        if args.live:
            run.step("1_deploy_lora", step_lora_deploy, run)
            run.step("9_live_adapter_added", live_step, run, "9_live_adapter_added", {"a": LORA_A, "b": LORA_B}, MODEL_V1)
            run.step("10_live_weights", live_step, run, "10_live_weights", {"a": LORA_A, "b": LORA_B}, MODEL_V2)
            run.step("11_restart_for_comparison", live_step, run, "11_restart_for_comparison", {"a": LORA_A, "b": LORA_B},
                     MODEL_V2, dict(run.flags_base, **{"kv-cache-dtype": P["fp8"]}))
        else:
            run.step("1_deploy", step_deploy, run)
            run.step("2_flag_change", step_flag_change, run)
            run.step("3_converged", step_converged, run)
            if ENGINE == "vllm":
                run.step("4_sigkill_api_server", step_sigkill_api_server, run, min_left_s=90)
            else:
                run.step("4_seeds_kill_chain", step_kill_chain, run, SEEDS_CHAIN, "seeds", min_left_s=90)
            if not args.no_meant_chain and ENGINE != "vllm":
                run.step("4b_meant_kill_chain", step_kill_chain, run, MEANT_CHAIN, "meant", min_left_s=150)
            run.step("5_foreign_memory", step_foreign, run, min_left_s=60)
            run.step("6_crash_rollback", step_crash_rollback, run, min_left_s=60)
            run.step("7_rollback_runbook", step_rollback_runbook, run, min_left_s=45)
            run.step("8_status_runbook", step_status, run, min_left_s=10)
    finally:
        summarize(run)
        if run.poller:
            os.killpg(run.poller.pid, signal.SIGKILL)
        run.doc["samples"] = len(run.samples())
        run.doc["ended_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        run.save()
        if os.environ.get("GPUGATE_E2E_KEEP_LAB") != "1":
            from gpugate_lab import core

            try:
                core.down(LAB_DIR)
            except Exception as exc:  # noqa: BLE001
                run.log(f"lab down: {exc}")
    (args.results / "e2e_report.md").write_text(report(run.doc))
    print(report(run.doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
