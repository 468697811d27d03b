"""Lab faults: the failures real SGLang servers show, injected into one lab container.

A container's faults live in ``$LAB/hosts/<host>/ct/<vmid>/labctl/faults.json`` (read-only inside the
container as /run/gpugate-lab/faults.json); the stand-in, its workers and the simulated driver read it
when the behaviour matters, so a fault applies to a server that is already running:

- ``ignore-sigterm``: SIGTERM starts a drain that never ends (only SIGKILL stops the server).
- ``orphan-worker``: scheduler workers survive a SIGKILL of their parent and keep their memory.
- ``stuck-memory``: the memory of the processes holding GPU memory in the container when it is set
  (the running server's schedulers) is never released, even after they die, until the fault is
  cleared (clearing releases those whose holder is gone); what those processes allocate later sticks
  too. It names them (faults.json: ``{"holders": [...], "set_at": ...}``): a process started later (a
  gated engine started before the stop, the next server) allocates and frees as usual, as on real
  hardware, where the memory a driver keeps is the memory of the processes it was stuck for.
- ``foreign-holder``: a process in the lab host (outside the container) holds memory on every GPU;
  clearing kills it. Nothing inside the container can see or kill it.
- ``crash-on-start``: the stand-in exits 1 with a traceback while loading.
- ``never-healthy``: /health stays 503.
- ``slow-start=SECONDS``: loading takes that long; read again while loading, so clearing it ends a load
  in progress (tests hold a server in its load this way: tests/conftest.py ``Lab.load_held``).
- ``slow-weight-update=SECONDS``: a live weight update (``/update_weights_from_disk``) loads that long
  instead of ``$SGLANG_STANDIN_WEIGHT_UPDATE_S``, read when the update begins (tests act while the
  weights load: tests/e2e/test_live_changes_lab.py kills the engine there).
- ``weights-load-fails[=MODEL_PATH]``: a live weight update (SGLang's ``/update_weights_from_disk``) of
  that checkpoint (of any, without a path) fails before a weight is written, as an unreadable checkpoint
  does: the engine answers its failure and keeps serving the weights it had.
- ``weights-cannot-generate[=MODEL_PATH]``: that checkpoint (any, without a path) loads in a live update,
  but its weights are NaN: every generation after it ends at once, as the engine ends a NaN sample
  (SGLang: empty text, ``finish_reason`` ``{"type": "stop", "matched": "NaN happened"}``) until other
  weights are loaded. With a path, loading the previous checkpoint back undoes it.
- ``slow-decode=FACTOR`` (FACTOR > 0): every decoded token takes FACTOR x as long, the first too (time to
  first token and inter-token latency both FACTOR x); simulated GPUs only.
- ``error-rate=P`` (0 < P <= 1): a share P of the generation requests fail as the engine fails an
  internal error (500, counted in its own error/abort metrics); /health stays 200. Evenly spread: the
  first request passes for P < 1, P = 0.5 fails every second one.

  Both apply to the NEXT server started in the container only (faults.json keeps ``{"value", "set_at"}``):
  the first started after the fault was set claims it; a server already running and a later start (a
  rollback to the old spec) are healthy. That is how a test says "the new spec is slower". Clearing ends
  it in the server that has it too.

Example: ``apply_fault(Path("/tmp/gpugate-lab"), "pve1", 129, "slow-start=30")``
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from gpugate_lab import gpusim

FAULT_NAMES = ("ignore-sigterm", "orphan-worker", "stuck-memory", "foreign-holder", "crash-on-start",
               "never-healthy", "slow-start=SECONDS", "slow-weight-update=SECONDS", "weights-load-fails", "weights-cannot-generate",
               "slow-decode=FACTOR", "error-rate=P")
# faults of ONE server, the next started in the container: {fault: (what its value is, its check)}
SERVER_FAULTS = {"slow-decode": ("a factor greater than 0 (slow-decode=FACTOR, e.g. slow-decode=3)",
                                 lambda v: v > 0),
                 "error-rate": ("a share of the requests greater than 0 and at most 1 (error-rate=P, e.g. "
                                "error-rate=0.5)", lambda v: 0 < v <= 1)}
# faults of a live weight update: bare, every checkpoint; =MODEL_PATH, that one only
CHECKPOINT_FAULTS = ("weights-load-fails", "weights-cannot-generate")
FOREIGN_HOLDER_MIB = 4096
NEIGHBOUR_VMID = 990  # real-GPU lab: the container of "another tenant" that holds memory (foreign-holder)
REAL_HOLDER = r'''
import signal, sys, torch
mib, device = int(sys.argv[1]), sys.argv[2]
devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())] if device == "cuda" else [torch.device("cpu")]
held = [torch.empty(mib << 20, dtype=torch.uint8, device=d) for d in devices]
if device == "cuda":
    torch.cuda.synchronize()
print("holding %d MiB on %d GPU(s) from another container, pid %d" % (mib, len(held), __import__("os").getpid()), flush=True)
while True:
    signal.pause()
'''


class FaultUnavailable(ValueError):
    """A fault this lab cannot show (e.g. stuck-memory on real GPUs); str() says why."""


def _real_binding(lab_dir: Path, host: str) -> Optional[dict]:
    from gpugate_lab import realgpu  # noqa: PLC0415

    return realgpu.read_binding(Path(lab_dir) / "hosts" / host)


def ct_dir(lab_dir: Path, host: str, vmid: int) -> Path:
    return Path(lab_dir) / "hosts" / host / "ct" / str(vmid)


def faults_path(lab_dir: Path, host: str, vmid: int) -> Path:
    return ct_dir(lab_dir, host, vmid) / "labctl" / "faults.json"


def fault_names() -> str:
    """The faults as ``gpugate lab fault`` takes them, in one line (its help and its refusal).

    >>> fault_names().split(", ")[-1]
    'error-rate=P'
    """
    return ", ".join(f"{n}[=MODEL_PATH]" if n in CHECKPOINT_FAULTS else n for n in FAULT_NAMES)


def parse_fault(name: str, clear: bool = False) -> Tuple[str, object]:
    """``"slow-start=5"`` -> ``("slow-start", 5.0)``; ``"ignore-sigterm"`` -> ``("ignore-sigterm", True)``;
    ``"weights-load-fails=/opt/models/lab-model-v2"`` -> ``("weights-load-fails", "/opt/models/lab-model-v2")``;
    ``"slow-decode=3"`` -> ``("slow-decode", 3.0)`` (apply_fault adds when it was set).

    Raises ValueError naming the valid faults. When clearing, ``slow-start``, ``slow-decode`` and
    ``error-rate`` need no value and ``all`` clears every fault.

    >>> parse_fault("error-rate=0.25"), parse_fault("slow-decode", clear=True)
    (('error-rate', 0.25), ('slow-decode', None))
    >>> parse_fault("error-rate=1.5")
    Traceback (most recent call last):
    ValueError: fault error-rate takes a share of the requests greater than 0 and at most 1 (error-rate=P, e.g. error-rate=0.5), got 'error-rate=1.5'
    """
    key, eq, value = name.strip().partition("=")
    valid = "valid faults: " + fault_names()
    if clear and key == "all" and not eq:
        return "all", None
    if key in CHECKPOINT_FAULTS:
        if clear or not eq:
            return key, None if clear else True
        if not value.startswith("/"):
            raise ValueError(f"fault {key} takes the absolute path of a model directory ({key}=MODEL_PATH), "
                             f"got {name!r}")
        return key, value.rstrip("/") or "/"
    if key in SERVER_FAULTS:
        if clear:
            return key, None
        what, valid_value = SERVER_FAULTS[key]
        try:
            number = float(value) if eq else float("nan")
        except ValueError:
            number = float("nan")
        if not valid_value(number):  # NaN fails every check
            raise ValueError(f"fault {key} takes {what}, got {name!r}")
        return key, number
    if key in ("slow-start", "slow-weight-update"):
        if clear:
            return key, None
        try:
            seconds = float(value)
        except ValueError:
            raise ValueError(f"fault {key} needs seconds ({key}=SECONDS), got {name!r}; {valid}") from None
        if not seconds >= 0:
            raise ValueError(f"fault {key} needs a non-negative number of seconds, got {name!r}")
        return key, seconds
    if key in FAULT_NAMES and not eq:
        return key, True
    raise ValueError(f"unknown fault {name!r}; {valid}")


def read_faults(lab_dir: Path, host: str, vmid: int) -> Dict[str, object]:
    """The container's active faults, {} when none."""
    return gpusim.read_faults(faults_path(lab_dir, host, vmid).parent)


def _write_faults(lab_dir: Path, host: str, vmid: int, faults: Dict[str, object]) -> None:
    path = faults_path(lab_dir, host, vmid)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".faults.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(faults, indent=1, sort_keys=True) + "\n")
    tmp.chmod(0o644)
    os.replace(tmp, path)


def _host_exec_argv(lab_dir: Path, host: str) -> List[str]:
    """nsenter prefix into the lab host (lab core); tests replace this to run without namespaces."""
    from gpugate_lab.core import host_exec_argv  # noqa: PLC0415 -- core imports much; only needed here

    return host_exec_argv(lab_dir, host)


def _gpu_dir(lab_dir: Path, host: str) -> Path:
    return Path(lab_dir) / "hosts" / host / "gpu"


def _foreign_tag(host: str, vmid: int) -> str:
    return f"foreign-holder:{host}:{vmid}"


def _start_foreign_holder(lab_dir: Path, host: str, vmid: int, mib: int) -> str:
    pgid_file = ct_dir(lab_dir, host, vmid) / "foreign-holder.pgid"
    if _foreign_holder_alive(pgid_file):
        return "already running"
    argv = _host_exec_argv(lab_dir, host) + [
        sys.executable, "-m", "gpugate_lab.gpusim", "hold", "--gpu", "all", "--mib", str(mib),
        "--sim-dir", str(_gpu_dir(lab_dir, host)), "--tag", _foreign_tag(host, vmid)]
    # Own session: clear can kill nsenter and the holder it forked as one process group.
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    line = proc.stdout.readline().decode(errors="replace").strip() if proc.stdout else ""
    if not line.startswith("holding"):
        proc.kill()
        err = proc.stderr.read().decode(errors="replace").strip() if proc.stderr else ""
        raise RuntimeError(f"foreign holder did not start: {err or line or 'no output'}")
    pgid_file.write_text(f"{proc.pid}\n")
    return line


def _start_real_foreign_holder(lab_dir: Path, host: str, vmid: int, binding: dict,
                               mib: int = FOREIGN_HOLDER_MIB, timeout_s: float = 180.0) -> str:
    """Real-GPU lab: a torch process in the neighbour container (vmid 990, made on demand) holds
    ``mib`` MiB of real device memory on every GPU until the fault is cleared. Seen from ``vmid`` it is
    memory without a holder, exactly as another tenant's would be."""
    import select  # noqa: PLC0415

    from gpugate_lab import core  # noqa: PLC0415

    pgid_file = ct_dir(lab_dir, host, vmid) / "foreign-holder.pgid"
    if _foreign_holder_alive(pgid_file):
        return "already running"
    neighbour = NEIGHBOUR_VMID if vmid != NEIGHBOUR_VMID else NEIGHBOUR_VMID + 1
    if not ct_dir(lab_dir, host, neighbour).is_dir():
        core.add_container(lab_dir, host, neighbour)
    python = (binding.get("torch_env") or {}).get("python") or "/usr/bin/python3"
    argv = _host_exec_argv(lab_dir, host) + [
        "pct", "exec", str(neighbour), "--", python, "-c", REAL_HOLDER, str(mib), binding.get("device", "cuda")]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    line = ""
    if proc.stdout and select.select([proc.stdout], [], [], timeout_s)[0]:
        line = proc.stdout.readline().decode(errors="replace").strip()
    if not line.startswith("holding"):
        os.killpg(proc.pid, signal.SIGKILL)
        err = proc.stderr.read().decode(errors="replace").strip()[-2000:] if proc.stderr else ""
        raise RuntimeError(f"foreign holder did not start in container {neighbour}: {err or line or 'no output'}")
    pgid_file.write_text(f"{proc.pid}\n")
    return f"{line}: container {neighbour}"


def _foreign_holder_alive(pgid_file: Path) -> Optional[int]:
    try:
        pgid = int(pgid_file.read_text())
    except (OSError, ValueError):
        return None
    try:
        os.killpg(pgid, 0)
    except OSError:
        return None
    return pgid


def _stop_foreign_holder(lab_dir: Path, host: str, vmid: int) -> bool:
    pgid_file = ct_dir(lab_dir, host, vmid) / "foreign-holder.pgid"
    pgid = _foreign_holder_alive(pgid_file)
    if pgid is not None:
        os.killpg(pgid, signal.SIGKILL)
    pgid_file.unlink(missing_ok=True)
    return pgid is not None


def _ctl_selector(lab_dir: Path, host: str, vmid: int) -> Optional[str]:
    return gpusim.ctl_id_of(faults_path(lab_dir, host, vmid).parent)


def apply_fault(lab_dir: Path, host: str, vmid: int, name: str, clear: bool = False) -> str:
    """Inject (or with clear=True remove) one fault into a lab container; returns what was done.

    Example: ``apply_fault(lab, "pve1", 129, "orphan-worker")`` ->
    ``"pve1/129: fault orphan-worker set"``; an unknown name raises ValueError listing the valid ones.
    """
    key, value = parse_fault(name, clear)
    lab_dir = Path(lab_dir)
    if not ct_dir(lab_dir, host, vmid).is_dir():
        raise ValueError(f"no lab container {vmid} on host {host} (in {lab_dir})")
    faults = read_faults(lab_dir, host, vmid)
    where = f"{host}/{vmid}"
    (faults_path(lab_dir, host, vmid).parent).mkdir(parents=True, exist_ok=True)
    ctl = _ctl_selector(lab_dir, host, vmid)
    gpu_dir = _gpu_dir(lab_dir, host)

    if clear:
        keys = list(faults) if key == "all" else [key]
        notes = []
        for k in keys:
            faults.pop(k, None)
        _write_faults(lab_dir, host, vmid, faults)
        if "stuck-memory" in keys and ctl and gpu_dir.is_dir():
            n = len(gpusim.set_stuck(gpu_dir, False, ctl=ctl))
            notes.append(f"{n} stuck allocation(s) released to the driver")
        if "foreign-holder" in keys or key == "all":
            if _stop_foreign_holder(lab_dir, host, vmid):
                notes.append("foreign holder killed")
        what = "all faults" if key == "all" else f"fault {key}"
        return f"{where}: {what} cleared" + (f" ({'; '.join(notes)})" if notes else "")

    real = _real_binding(lab_dir, host)
    if real and key == "slow-decode":
        raise FaultUnavailable(
            "slow-decode is unavailable in a real-GPU lab (lab up --gpus real): it stretches the simulated "
            "decode time, and a real model decodes at its own speed")
    if real and key == "stuck-memory":
        raise FaultUnavailable(
            "stuck-memory is unavailable in a real-GPU lab (lab up --gpus real): it needs the lab's simulated "
            "driver, and the NVIDIA driver frees a dead process's memory; orphan-worker shows memory that "
            "outlives the server")
    if key == "stuck-memory":
        # the processes it applies to: those holding memory in the container now (issue 32 item 14)
        held = [a for a in gpusim.list_allocations(gpu_dir) if a.get("ctl") == ctl] if ctl and gpu_dir.is_dir() else []
        value = {"holders": sorted({gpusim.holder_key(a.get("pidns"), a.get("pid")) for a in held}),
                 "set_at": time.time()}
    if key in SERVER_FAULTS:  # the next server started in the container claims it (gpugate_standin)
        value = {"value": value, "set_at": time.time()}
    faults[key] = value
    _write_faults(lab_dir, host, vmid, faults)
    note = ""
    if key in SERVER_FAULTS:
        return (f"{where}: fault {key}={value['value']:g} set (for the next server started in the container "
                f"only; the one running now and any later start are healthy)")
    if key == "foreign-holder" and real:
        return f"{where}: fault foreign-holder set ({_start_real_foreign_holder(lab_dir, host, vmid, real)})"
    if key == "stuck-memory" and ctl and gpu_dir.is_dir():
        n, holders = len(gpusim.set_stuck(gpu_dir, True, ctl=ctl)), faults[key]["holders"]
        note = (f" ({n} current allocation(s) now stuck, of {len(holders)} process(es): it applies to them only)"
                if holders else " (no process holds GPU memory in the container: it names none; set it while "
                                "the server runs)")
    if key == "foreign-holder":
        note = f" ({_start_foreign_holder(lab_dir, host, vmid, FOREIGN_HOLDER_MIB)}, outside the container)"
    shown = f"{key}={value:g}" if key == "slow-start" else f"{key}={value}" if isinstance(value, str) else key
    return f"{where}: fault {shown} set{note}"


def wait_released(gpu_dir: Path, timeout_s: float = 5.0) -> bool:
    """Poll until no allocation is left on the host (a test helper for the lab)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not gpusim.list_allocations(gpu_dir):
            return True
        time.sleep(0.02)
    return False
