"""The GPU probe: runs INSIDE a container (or on a Proxmox host), stdlib only.

It is never installed: ``gpugate.remote.build_probe_command({"gpu": {}})`` inlines this file into one
``python3 -c`` command. ``collect()`` returns one JSON-able document (shape: docs/architecture.md,
"Probe documents") and never raises: every failure is data in ``errors`` or in a GPU's ``error``.

Where the numbers come from, in order:

1. NVML through nvidia-ml-py (``import pynvml``), memory through the v2 call
   (``version=pynvml.nvmlMemory_v2``): v2 ``used`` excludes the driver's reserved memory, so an idle
   H200 reads 0 MiB (v1 reads ~615 MiB). Old drivers without the v2 call fall back to v1; v1 ``used``
   counts reserved memory in, so ``used_mib`` is reported as unknown (null) and the raw figure kept
   as ``used_v1_mib``, with ``memory_api: "v1"``.
2. ``nvidia-smi`` CSV when nvidia-ml-py is missing or NVML fails (except DriverNotLoaded /
   LibRmVersionMismatch: nvidia-smi fails the same way). ``[N/A]``-style values read as null.
3. Always: a scan of ``/proc/*/fd`` for processes holding ``/dev/nvidia*`` (the "holders",
   gpugate.agent.gpu_holders), with their state from ``/proc/PID/stat`` (D: stuck in the kernel, SIGKILL will not end it; Z: exited).

Bounded in time: NVML runs in a worker thread with a deadline (an NVML call can hang in D state) and
nvidia-smi runs under a timeout and is abandoned, not waited for, if it hangs.

Example (skipped by the suite: it reads a real GPU)::

    >>> doc = collect()  # doctest: +SKIP
    >>> doc["source"], [g["used_mib"] for g in doc["gpus"]], [h["pid"] for h in doc["holders"]]  # doctest: +SKIP
    ('nvml', [0, 0], [])
"""

from __future__ import annotations

import os
import threading
import time

# the holder scan's names that the probe's callers use as the probe's own
from gpugate.agent.gpu_holders import ancestors, merge_listed_processes, scan_holders, vmid_from_cgroup  # noqa: F401
from gpugate.rules import procfs
from gpugate.rules.procfs import PROBE_MARKER  # noqa: F401 - the probe's marker, as its callers know it

# typing and subprocess are not imported at run time: the probe runs in every agent command (the
# converged re-run's only one), and neither is needed there (subprocess: only the nvidia-smi fallback,
# imported in run_command; the typing names only in annotations, which are never evaluated).
TYPE_CHECKING = False
if TYPE_CHECKING:  # mypy treats this name as true
    from typing import Any, Callable, Dict, Iterable, List, Tuple

    Runner = Callable[[list, float], tuple]  # run_command: (argv, timeout) -> (code, stdout, stderr)

SCHEMA = 1
NVML_TIMEOUT_S = 8.0
SMI_TIMEOUT_S = 8.0
MIB = 1024 * 1024
# nvidia-smi would fail the same way after these NVML errors: report them instead of trying it.
NVML_ERRORS_SHARED_WITH_SMI = ("DriverNotLoaded", "LibRmVersionMismatch")
# nvidia-smi's documented exit codes (man nvidia-smi).
SMI_EXIT_KINDS = {
    2: "InvalidArgument",
    3: "NotSupported",
    4: "NoPermission",
    6: "NotFound",
    8: "InsufficientPower",
    9: "DriverNotLoaded",
    10: "InterruptIssue",
    12: "LibraryNotFound",
    13: "FunctionNotFound",
    14: "CorruptedInfoROM",
    15: "GpuIsLost",
    255: "Unknown",
}
SMI_SEARCH_PATH = "/usr/bin:/usr/sbin:/bin:/sbin:/usr/local/bin:/usr/local/nvidia/bin"


class ProbeTimeout(Exception):
    """A GPU read did not answer within its deadline (likely a driver call stuck in D state)."""


# --------------------------------------------------------------------------------------------------
# Small helpers


def error_entry(source: str, kind: str, message: object) -> dict:
    return {"source": source, "kind": kind, "message": str(message)[:500]}


def nvml_error_kind(exc: BaseException) -> str:
    """``NVMLError_DriverNotLoaded`` -> ``DriverNotLoaded``; other exceptions: their class name."""
    name = type(exc).__name__
    if name.startswith("NVMLError_"):
        return name[len("NVMLError_"):]
    if name == "NVMLError":
        value = getattr(exc, "value", None)
        return "NVMLError%s" % ("" if value is None else "(%s)" % value)
    return name


def as_text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def bytes_to_mib(value: Any) -> int | None:
    # NVML reports "not available" as None (nvidia-ml-py) or as the all-ones sentinel.
    if value is None or value < 0 or value >= (1 << 63):
        return None
    return int(value) // MIB


def call_with_deadline(function: Callable[[], Any], timeout_s: float) -> Any:
    """Run ``function()`` in a daemon thread; raise ProbeTimeout if it has not returned in time.

    A hung thread is abandoned (a thread stuck in a driver call cannot be interrupted).
    """
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = function()
        except BaseException as exc:  # noqa: BLE001 - carried to the caller
            box["error"] = exc

    worker = threading.Thread(target=run, name="gpugate-nvml", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise ProbeTimeout("no answer within %.1f s" % timeout_s)
    if "error" in box:
        raise box["error"]
    return box.get("value")


def run_command(argv: list, timeout_s: float) -> tuple:
    """Run a command; return (exit code or None on timeout/missing, stdout, stderr).

    Unlike subprocess.run, a command that does not end after SIGKILL (D state) is not waited for.
    """
    import subprocess

    try:
        child = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
    except OSError as exc:
        return None, "", "cannot run %s: %s" % (argv[0], exc)
    try:
        out, err = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            child.kill()
        except OSError:
            pass
        return None, "", "timeout after %.1f s" % timeout_s
    return child.returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")


def find_nvidia_smi() -> str | None:
    path = os.environ.get("PATH", "") + ":" + SMI_SEARCH_PATH
    for directory in path.split(":"):
        if directory:
            candidate = os.path.join(directory, "nvidia-smi")
            if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
                return candidate
    return None


# --------------------------------------------------------------------------------------------------
# NVML


def empty_gpu(index: int) -> dict:
    return {
        "index": index,
        "uuid": None,
        "name": None,
        "total_mib": None,
        "used_mib": None,
        "reserved_mib": None,
        "error": None,
        "processes": [],
    }


def read_nvml_memory(nvml: Any, handle: Any) -> tuple:
    """(memory struct, "v2" | "v1"). v2 where the binding and the driver have it."""
    v2_version = getattr(nvml, "nvmlMemory_v2", None)
    if v2_version is not None:
        try:
            return nvml.nvmlDeviceGetMemoryInfo(handle, version=v2_version), "v2"
        except TypeError:
            pass  # an old binding without the version argument
        except Exception as exc:  # noqa: BLE001
            if nvml_error_kind(exc) != "FunctionNotFound":
                raise
    return nvml.nvmlDeviceGetMemoryInfo(handle), "v1"


def read_nvml_processes(nvml: Any, handle: Any) -> list:
    by_pid: dict = {}
    for function_name in (
        "nvmlDeviceGetComputeRunningProcesses",
        "nvmlDeviceGetGraphicsRunningProcesses",
    ):
        function = getattr(nvml, function_name, None)
        if function is None:
            continue
        for info in function(handle) or []:
            pid = int(info.pid)
            used = bytes_to_mib(getattr(info, "usedGpuMemory", None))
            if pid in by_pid:
                previous = by_pid[pid]["used_mib"]
                if previous is not None and used is not None:
                    by_pid[pid]["used_mib"] = max(previous, used)
            else:
                by_pid[pid] = {"pid": pid, "used_mib": used}
    return [by_pid[pid] for pid in sorted(by_pid)]


def read_nvml_gpu(nvml: Any, index: int) -> tuple:
    """One GPU; errors of this GPU (GpuIsLost...) stay in its ``error``. -> (gpu, memory api)."""
    gpu = empty_gpu(index)
    api = None
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        gpu["uuid"] = as_text(nvml.nvmlDeviceGetUUID(handle))
        gpu["name"] = as_text(nvml.nvmlDeviceGetName(handle))
        memory, api = read_nvml_memory(nvml, handle)
        gpu["total_mib"] = bytes_to_mib(memory.total)
        if api == "v2":
            gpu["used_mib"] = bytes_to_mib(memory.used)
            gpu["reserved_mib"] = bytes_to_mib(getattr(memory, "reserved", None))
        else:
            # v1 "used" counts the driver's reserved memory in: not comparable with a threshold.
            gpu["used_v1_mib"] = bytes_to_mib(memory.used)
    except Exception as exc:  # noqa: BLE001
        gpu["error"] = "%s: %s" % (nvml_error_kind(exc), exc)
        return gpu, api
    try:
        gpu["processes"] = read_nvml_processes(nvml, handle)
    except Exception as exc:  # noqa: BLE001 - e.g. NotSupported on MIG: memory still counts
        gpu["processes_error"] = "%s: %s" % (nvml_error_kind(exc), exc)
    return gpu, api


class NvmlSession:
    """NVML kept initialised between reads (a poll loop must not pay nvmlInit every time)."""

    def __init__(self, loader: Callable[[], Any] | None = None, keep_open: bool = False) -> None:
        self.loader = loader or load_pynvml
        self.keep_open = keep_open
        self.module: Any = None
        self.initialised = False
        self.hung = False

    def read(self) -> dict:
        nvml = self.module
        if nvml is None:
            nvml = self.module = self.loader()
        if not self.initialised:
            nvml.nvmlInit()
            self.initialised = True
        try:
            driver = None
            try:
                driver = as_text(nvml.nvmlSystemGetDriverVersion())
            except Exception:  # noqa: BLE001 - informational only
                pass
            gpus = []
            apis = set()
            for index in range(int(nvml.nvmlDeviceGetCount())):
                gpu, api = read_nvml_gpu(nvml, index)
                gpus.append(gpu)
                if api:
                    apis.add(api)
            memory_api = "v1" if "v1" in apis else ("v2" if apis else None)
            return {"driver": driver, "gpus": gpus, "memory_api": memory_api}
        finally:
            if not self.keep_open:
                self.close()

    def close(self) -> None:
        if self.initialised and not self.hung:
            self.initialised = False
            try:
                self.module.nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass


def load_pynvml() -> Any:
    import pynvml  # noqa: PLC0415 - optional in the container

    return pynvml


# --------------------------------------------------------------------------------------------------
# nvidia-smi


def smi_value(text: str) -> str | None:
    """A CSV field: ``[N/A]``, ``[Not Supported]``, ``[Unknown Error]``... -> None."""
    text = text.strip()
    if not text or (text.startswith("[") and text.endswith("]")) or text == "N/A":
        return None
    return text


def smi_int(text: str) -> int | None:
    value = smi_value(text)
    if value is None:
        return None
    try:
        return int(float(value))
    except ValueError:
        return None


def parse_smi_rows(text: str) -> list:
    return [
        [field.strip() for field in line.split(",")]
        for line in text.splitlines()
        if line.strip()
    ]


def parse_smi_gpus(text: str) -> list:
    """``index, uuid, name, memory.used, memory.total`` rows (noheader, nounits) -> gpus."""
    gpus: List[Dict[str, Any]] = []
    for row in parse_smi_rows(text):
        if len(row) < 5:
            continue
        # A name may contain commas: the fields around it are fixed.
        index, uuid, used, total = row[0], row[1], row[-2], row[-1]
        name = ",".join(row[2:-2]).strip()
        number = smi_int(index)
        gpu = empty_gpu(number if number is not None else len(gpus))
        gpu["uuid"] = smi_value(uuid)
        gpu["name"] = smi_value(name)
        gpu["total_mib"] = smi_int(total)
        gpu["used_mib"] = smi_int(used)
        if gpu["used_mib"] is None:
            gpu["error"] = "nvidia-smi: memory.used is %s" % (used.strip() or "empty")
        gpus.append(gpu)
    return gpus


def read_nvidia_smi(run: Runner = run_command, smi_path: str | None = None,
                    timeout_s: float = SMI_TIMEOUT_S) -> Tuple[dict | None, list]:
    """-> (part dict or None, errors). memory.reserved is asked separately: nvidia-smi before R510
    does not know it and an unknown field aborts the whole query. Where it is unknown, memory.used
    is taken to count reserved memory in (memory_api v1)."""
    smi = smi_path or find_nvidia_smi()
    if smi is None:
        return None, [error_entry("nvidia-smi", "NotFound", "nvidia-smi not found on PATH")]
    csv = "--format=csv,noheader,nounits"
    code, out, err = run(
        [smi, "--query-gpu=index,uuid,name,memory.used,memory.total", csv], timeout_s
    )
    if code != 0:
        kind = "Timeout" if code is None else SMI_EXIT_KINDS.get(code, "Exit%d" % code)
        message = (err.strip() or out.strip() or "exit %s" % code).splitlines()
        return None, [error_entry("nvidia-smi", kind, " | ".join(message[:3]))]
    gpus = parse_smi_gpus(out)
    memory_api = "v1"
    code, out, _err = run([smi, "--query-gpu=index,memory.reserved", csv], timeout_s)
    if code == 0:
        memory_api = "v2"
        reserved = {smi_int(row[0]): smi_int(row[1]) for row in parse_smi_rows(out) if len(row) >= 2}
        for gpu in gpus:
            gpu["reserved_mib"] = reserved.get(gpu["index"])
    else:
        for gpu in gpus:
            gpu["used_v1_mib"], gpu["used_mib"] = gpu["used_mib"], None
    code, out, _err = run([smi, "--query-compute-apps=pid,gpu_uuid,used_memory", csv], timeout_s)
    by_uuid = {gpu["uuid"]: gpu for gpu in gpus if gpu["uuid"]}
    if code == 0:
        for row in parse_smi_rows(out):
            if len(row) >= 3 and row[1] in by_uuid and smi_int(row[0]) is not None:
                by_uuid[row[1]]["processes"].append({"pid": smi_int(row[0]), "used_mib": smi_int(row[2])})
    else:
        for gpu in gpus:
            gpu["processes_error"] = "nvidia-smi --query-compute-apps exit %s" % code
    driver = None
    code, out, _err = run([smi, "--query-gpu=driver_version", csv], timeout_s)
    if code == 0 and out.strip():
        driver = smi_value(out.splitlines()[0])
    return {"driver": driver, "gpus": gpus, "memory_api": memory_api}, []


# --------------------------------------------------------------------------------------------------
# The document


def read_gpus(session: NvmlSession, run: Runner = run_command, smi_path: str | None = None,
              nvml_timeout_s: float = NVML_TIMEOUT_S, smi_timeout_s: float = SMI_TIMEOUT_S) -> Tuple[str, dict | None, list]:
    """-> (source, part or None, errors): NVML first, then nvidia-smi."""
    errors = []
    if session.hung:
        errors.append(error_entry("nvml", "Timeout", "an earlier NVML call never returned"))
    else:
        try:
            part = call_with_deadline(session.read, nvml_timeout_s)
            return "nvml", part, errors
        except ProbeTimeout as exc:
            session.hung = True
            errors.append(error_entry("nvml", "Timeout", exc))
        except ImportError as exc:
            errors.append(error_entry("nvml", "ModuleNotFound", exc))
        except Exception as exc:  # noqa: BLE001
            kind = nvml_error_kind(exc)
            errors.append(error_entry("nvml", kind, exc))
            session.close()
            if kind in NVML_ERRORS_SHARED_WITH_SMI:
                return "none", None, errors
    part, smi_errors = read_nvidia_smi(run, smi_path, smi_timeout_s)
    errors.extend(smi_errors)
    return ("nvidia-smi" if part is not None else "none"), part, errors


_default_session = None


def collect(exclude_pids: Iterable[int] = (), scope: str = "container", keep_nvml_open: bool = False, *,
            session: NvmlSession | None = None, nvml_loader: Callable[[], Any] | None = None, run: Runner = run_command,
            smi_path: str | None = None, proc_root: str = "/proc",
            nvml_timeout_s: float = NVML_TIMEOUT_S, smi_timeout_s: float = SMI_TIMEOUT_S) -> dict:
    """Read every GPU and every holder of /dev/nvidia*; never raises.

    + exclude_pids: pids that are not holders (the caller's own processes); the probe, its
      ancestors, other gpugate probes and nvidia-smi are always left out
    + scope: "container" or "host" (host: each holder also gets the ``vmid`` of its container
      from /proc/PID/cgroup, None for the host's own processes)
    + keep_nvml_open: keep NVML initialised for the next call (poll loops)
    + session, nvml_loader, run, smi_path, proc_root, *_timeout_s: for tests

    Example::

        collect(scope="host")["holders"][0]  # {"pid": 4242, "vmid": 129, "state": "S", ...}
    """
    global _default_session
    started = time.monotonic()
    if session is None:
        if nvml_loader is not None or _default_session is None or not keep_nvml_open:
            session = NvmlSession(nvml_loader, keep_open=keep_nvml_open)
            if keep_nvml_open and nvml_loader is None:
                _default_session = session
        else:
            session = _default_session
    doc: Dict[str, Any] = {
        "schema": SCHEMA,
        "source": "none",
        "memory_api": None,
        "driver": None,
        "errors": [],
        "gpus": [],
        "holders": [],
        "scope": scope,
        "probe_pid": os.getpid(),
        "read_at": None,
        "elapsed_ms": None,
    }
    with_vmid = scope == "host"
    exclude = set(int(pid) for pid in exclude_pids) | ancestors(proc_root, os.getpid())
    try:
        source, part, errors = read_gpus(session, run, smi_path, nvml_timeout_s, smi_timeout_s)
        doc["source"] = source
        doc["errors"].extend(errors)
        if part is not None:
            doc.update(part)
    except Exception as exc:  # noqa: BLE001 - a bug here must still give a document
        doc["errors"].append(error_entry("probe", type(exc).__name__, exc))
    doc["read_at"] = time.time()
    try:
        doc["holders"] = scan_holders(proc_root, exclude, with_vmid)
        merge_listed_processes(doc, proc_root, exclude, with_vmid)
    except Exception as exc:  # noqa: BLE001
        doc["errors"].append(error_entry("proc", type(exc).__name__, exc))
    doc["elapsed_ms"] = round((time.monotonic() - started) * 1000, 1)
    return doc


# --------------------------------------------------------------------------------------------------
# Ending the holders (gpu.idle(kill=True)): only what this pid namespace can see


def end_holders(grace_s: float = 10.0, ignore_pids: Iterable[int] = (), proc_root: str = "/proc",
                poll_s: float = 0.02, settle_s: float = 5.0, send: Callable[[int, int], None] = os.kill) -> dict:
    """SIGTERM every holder, SIGKILL those still running after ``grace_s`` (gpugate.rules.procfs.
    end_processes); never pid 1, the probe or its ancestors. Run inside the container, so no pid
    outside it can be reached.

    -> {"terminated": [pids gone after SIGTERM], "killed": [gone after SIGKILL],
        "survivors": [{"pid", "state", "cmdline"}], "elapsed_s"}
    """
    started = time.monotonic()
    exclude = set(int(pid) for pid in ignore_pids) | ancestors(proc_root, os.getpid()) | {1}
    targets = [holder["pid"] for holder in scan_holders(proc_root, exclude)]
    ended = procfs.end_processes(dict((pid, None) for pid in targets), grace_s, poll_s, settle_s, send, proc_root)
    report: Dict[str, Any] = {"targets": targets, "terminated": ended["terminated"], "errors": ended["errors"],
                              "killed": [pid for pid in ended["killed"] if pid not in ended["survivors"]],
                              "survivors": []}
    for pid in ended["survivors"]:
        stat = procfs.read_stat(pid, proc_root)
        report["survivors"].append({
            "pid": pid,
            "state": stat[1] if stat else None,
            "cmdline": procfs.read_cmdline(pid, proc_root),
        })
    report["elapsed_s"] = round(time.monotonic() - started, 3)
    return report
