"""The lab's ``nvidia-smi``: the query forms real tools use, over the simulated driver (gpusim).

Stdlib only (installed in lab containers as /usr/bin/nvidia-smi). Behaviour copied from the real tool:

- ``--query-gpu=FIELDS`` / ``--query-compute-apps=FIELDS`` with ``--format=csv[,noheader][,nounits]``;
  headers carry units (``memory.used [MiB]``) even with nounits, values carry `` MiB`` unless nounits;
  an unknown field aborts the whole query (``Field "x" is not a valid field to query.``, exit 2).
- no compute apps: empty output. ``memory.used`` is v2 used (0 on an idle GPU).
- ``-i 0,1`` / ``-i GPU-uuid``, ``-L``, the table when run bare (approximate).
- driver absent: exit 9, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver...".

Example: ``nvidia-smi --query-gpu=index,memory.used --format=csv,noheader`` -> ``0, 0 MiB`` per GPU.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

try:
    from gpugate_lab import gpusim
except ImportError:  # inside a lab container: the stdlib-only copy
    import gpugate_gpusim as gpusim  # type: ignore[no-redef]

DRIVER_FAILED = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running.\n"
)
EXIT_DRIVER_NOT_LOADED = 9
EXIT_BAD_ARGS = 2
EXIT_NOT_FOUND = 6

NA = "[N/A]"

# field name -> (header unit, getter(gpu dict) -> (value, unit or None))
GpuRow = Dict[str, object]


def _mib(key: str) -> Callable[[GpuRow], Tuple[object, Optional[str]]]:
    return lambda g: (g[key], "MiB")


GPU_FIELDS: Dict[str, Tuple[Optional[str], Callable[[GpuRow], Tuple[object, Optional[str]]]]] = {
    "index": (None, lambda g: (g["index"], None)),
    "uuid": (None, lambda g: (g["uuid"], None)),
    "gpu_uuid": (None, lambda g: (g["uuid"], None)),
    "name": (None, lambda g: (g["name"], None)),
    "gpu_name": (None, lambda g: (g["name"], None)),
    "count": (None, lambda g: (g["count"], None)),
    "driver_version": (None, lambda g: (g["driver_version"], None)),
    "pci.bus_id": (None, lambda g: (g["bus_id"], None)),
    "gpu_bus_id": (None, lambda g: (g["bus_id"], None)),
    "memory.total": ("MiB", _mib("total")),
    "memory.used": ("MiB", _mib("used")),
    "memory.free": ("MiB", _mib("free")),
    "memory.reserved": ("MiB", _mib("reserved")),
    "utilization.gpu": ("%", lambda g: (100 if g["used"] else 0, "%")),
    "utilization.memory": ("%", lambda g: (0, "%")),
    "temperature.gpu": (None, lambda g: (33 if not g["used"] else 45, None)),
    "power.draw": ("W", lambda g: ("%.2f" % (65.0 if not g["used"] else 180.0), "W")),
    "persistence_mode": (None, lambda g: ("Enabled", None)),
    "compute_mode": (None, lambda g: ("Default", None)),
    "compute_cap": (None, lambda g: (g["compute_cap"], None)),
    "mig.mode.current": (None, lambda g: (NA, None)),
    "pstate": (None, lambda g: ("P0" if g["used"] else "P8", None)),
    "serial": (None, lambda g: (NA, None)),
    "vbios_version": (None, lambda g: ("98.02.3A.00.01", None)),
    "timestamp": (None, lambda g: (time.strftime("%Y/%m/%d %H:%M:%S.000"), None)),
}

APP_FIELDS: Dict[str, Tuple[str, Optional[str], Callable[[dict], Tuple[object, Optional[str]]]]] = {
    # field -> (header name, header unit, getter)
    "pid": ("pid", None, lambda p: (p["pid"], None)),
    "process_name": ("process_name", None, lambda p: (p["name"], None)),
    "name": ("process_name", None, lambda p: (p["name"], None)),
    "gpu_uuid": ("gpu_uuid", None, lambda p: (p["gpu_uuid"], None)),
    "gpu_name": ("gpu_name", None, lambda p: (p["gpu_name"], None)),
    "gpu_bus_id": ("gpu_bus_id", None, lambda p: (p["gpu_bus_id"], None)),
    "used_memory": ("used_gpu_memory", "MiB", lambda p: (p["used_mib"], "MiB")),
    "used_gpu_memory": ("used_gpu_memory", "MiB", lambda p: (p["used_mib"], "MiB")),
    "timestamp": ("timestamp", None, lambda p: (time.strftime("%Y/%m/%d %H:%M:%S.000"), None)),
}


class UsageError(Exception):
    def __init__(self, message: str, code: int = EXIT_BAD_ARGS):
        super().__init__(message)
        self.code = code


def gpu_rows(gpu_dir=None) -> List[GpuRow]:
    """Every simulated GPU as nvidia-smi would report it (MiB)."""
    config = gpusim.load_config(gpu_dir)
    rows = []
    for i in range(int(config["count"])):
        mem = gpusim.memory_info(i, gpu_dir)
        rows.append({
            "index": i, "uuid": config["uuids"][i], "name": config["name"], "count": int(config["count"]),
            "driver_version": config.get("driver_version", gpusim.DEFAULT_DRIVER_VERSION),
            "cuda_version": config.get("cuda_version", gpusim.DEFAULT_CUDA_VERSION),
            "bus_id": "00000000:%02X:00.0" % (0x18 + 0x10 * i),
            "compute_cap": gpusim.compute_capability(config),
            "total": mem.total_mib, "used": mem.used_mib, "free": mem.free_mib, "reserved": mem.reserved_mib,
        })
    return rows


def select_gpus(rows: List[GpuRow], ids: Optional[str]) -> List[GpuRow]:
    """Apply ``-i``: comma-separated indices or UUIDs."""
    if ids is None:
        return rows
    chosen = []
    for token in ids.split(","):
        token = token.strip()
        match = [r for r in rows if str(r["index"]) == token or r["uuid"] == token]
        if not match:
            raise UsageError("No devices were found", EXIT_NOT_FOUND)
        chosen.extend(m for m in match if m not in chosen)
    return chosen


def _format_value(value: object, unit: Optional[str], nounits: bool) -> str:
    text = str(value)
    if unit is None or nounits or text.startswith("["):
        return text
    return f"{text} {unit}" if unit != "%" else f"{text} %"


def _split_fields(spec: str) -> List[str]:
    return [f.strip() for f in spec.split(",") if f.strip()]


def query_gpu(rows: List[GpuRow], spec: str, fmt: set) -> str:
    """CSV for ``--query-gpu=spec``. Example: ``query_gpu(rows, "index,memory.used", {"noheader"})``."""
    fields = _split_fields(spec)
    for f in fields:
        if f not in GPU_FIELDS:
            raise UsageError(f'Field "{f}" is not a valid field to query.\n')
    nounits = "nounits" in fmt
    lines = []
    if "noheader" not in fmt:
        lines.append(", ".join(f if GPU_FIELDS[f][0] is None else f"{f} [{GPU_FIELDS[f][0]}]" for f in fields))
    for g in rows:
        lines.append(", ".join(_format_value(*GPU_FIELDS[f][1](g), nounits) for f in fields))
    return "".join(line + "\n" for line in lines)


def compute_apps(rows: List[GpuRow], gpu_dir=None) -> List[dict]:
    """Processes visible from here (own PID namespace, or mapped from descendants), per GPU."""
    apps = []
    for g in rows:
        for p in gpusim.list_processes(int(g["index"]), gpu_dir=gpu_dir):
            apps.append({"pid": p["pid"], "name": p["name"], "used_mib": p["used_mib"], "gpu_index": g["index"],
                         "gpu_uuid": g["uuid"], "gpu_name": g["name"], "gpu_bus_id": g["bus_id"]})
    return apps


def query_compute_apps(rows: List[GpuRow], spec: str, fmt: set, gpu_dir=None) -> str:
    """CSV for ``--query-compute-apps=spec``; nothing at all (not even a header) when no process runs."""
    fields = _split_fields(spec)
    for f in fields:
        if f not in APP_FIELDS:
            raise UsageError(f'Field "{f}" is not a valid field to query.\n')
    apps = compute_apps(rows, gpu_dir)
    if not apps:
        return ""
    nounits = "nounits" in fmt
    lines = []
    if "noheader" not in fmt:
        lines.append(", ".join(
            APP_FIELDS[f][0] if APP_FIELDS[f][1] is None else f"{APP_FIELDS[f][0]} [{APP_FIELDS[f][1]}]"
            for f in fields))
    for p in apps:
        lines.append(", ".join(_format_value(*APP_FIELDS[f][2](p), nounits) for f in fields))
    return "".join(line + "\n" for line in lines)


def list_gpus(rows: List[GpuRow]) -> str:
    """``-L``: ``GPU 0: NAME (UUID: GPU-...)``."""
    return "".join(f"GPU {g['index']}: {g['name']} (UUID: {g['uuid']})\n" for g in rows)


def table(rows: List[GpuRow], gpu_dir=None) -> str:
    """The summary table nvidia-smi prints when run bare (approximate layout)."""
    first = rows[0] if rows else {"driver_version": gpusim.DEFAULT_DRIVER_VERSION,
                                  "cuda_version": gpusim.DEFAULT_CUDA_VERSION}
    bar = "+-----------------------------------------------------------------------------------------+"
    out = [time.strftime("%a %b %d %H:%M:%S %Y"), bar,
           "| NVIDIA-SMI %-12s           Driver Version: %-14s CUDA Version: %-8s|" % (
               first["driver_version"], first["driver_version"], first["cuda_version"]),
           "|-----------------------------------------+------------------------+----------------------+",
           "| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |",
           "| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |",
           "|=========================================+========================+======================|"]
    for g in rows:
        name = str(g["name"])[:20]
        out.append("| %3d  %-20s           On  | %-16s Off |                    0 |" % (
            g["index"], name, g["bus_id"]))
        mem = "%dMiB / %dMiB" % (g["used"], g["total"])
        out.append("| N/A   %2dC    %-4s %12s |  %21s | %7s      Default |" % (
            33 if not g["used"] else 45, "P0" if g["used"] else "P8",
            "%dW /  600W" % (65 if not g["used"] else 180), mem, "%d%%" % (100 if g["used"] else 0)))
        out.append("+-----------------------------------------+------------------------+----------------------+")
    out += ["", bar,
            "| Processes:                                                                              |",
            "|  GPU   GI   CI              PID   Type   Process name                        GPU Memory |",
            "|        ID   ID                                                               Usage      |",
            "|=========================================================================================|"]
    apps = compute_apps(rows, gpu_dir)
    if not apps:
        out.append("|  No running processes found                                                             |")
    for p in apps:
        out.append("|  %3d   N/A  N/A  %15d      C   %-35s %7dMiB |" % (
            p["gpu_index"], p["pid"], str(p["name"])[-35:], p["used_mib"]))
    out.append(bar)
    return "\n".join(out) + "\n"


def _parse_args(argv: List[str]) -> dict:
    """A small parser that accepts nvidia-smi's spellings (``--opt=value``, ``--opt value``, ``-i 0``)."""
    opts: dict = {"format": None, "query_gpu": None, "query_apps": None, "ids": None, "list": False}
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")

        def take() -> str:
            nonlocal i
            if eq:
                return value
            i += 1
            if i >= len(argv):
                raise UsageError(f'Option "{name}" requires a value.\n')
            return argv[i]

        if name in ("--query-gpu",):
            opts["query_gpu"] = take()
        elif name in ("--query-compute-apps",):
            opts["query_apps"] = take()
        elif name in ("--format",):
            opts["format"] = take()
        elif name in ("-i", "--id"):
            opts["ids"] = take()
        elif name in ("-L", "--list-gpus"):
            opts["list"] = True
        elif name in ("-h", "--help"):
            opts["help"] = True
        else:
            raise UsageError('Invalid combination of input arguments. Please run "nvidia-smi -h" for help.\n')
        i += 1
    return opts


def run(argv: List[str], gpu_dir=None) -> Tuple[int, str]:
    """Run nvidia-smi; returns (exit code, stdout text). Pure enough to test without a subprocess."""
    try:
        opts = _parse_args(argv)
        if opts.get("help"):
            return 0, "NVIDIA System Management Interface -- lab simulation\n"
        try:
            rows = gpu_rows(gpu_dir)
        except gpusim.DriverUnavailable:
            return EXIT_DRIVER_NOT_LOADED, DRIVER_FAILED
        rows = select_gpus(rows, opts["ids"])
        if opts["list"]:
            return 0, list_gpus(rows)
        if opts["query_gpu"] is not None or opts["query_apps"] is not None:
            fmt_spec = opts["format"]
            if fmt_spec is None:
                raise UsageError('"--format" must be specified when using a query option.\n')
            fmt = set(_split_fields(fmt_spec))
            if "csv" not in fmt or not fmt <= {"csv", "noheader", "nounits"}:
                raise UsageError(f'"{fmt_spec}" is not a valid format.\n')
            if opts["query_gpu"] is not None:
                return 0, query_gpu(rows, opts["query_gpu"], fmt)
            return 0, query_compute_apps(rows, opts["query_apps"], fmt, gpu_dir)
        return 0, table(rows, gpu_dir)
    except UsageError as exc:
        return exc.code, str(exc)


def main(argv: Optional[List[str]] = None) -> int:
    code, text = run(sys.argv[1:] if argv is None else argv)
    sys.stdout.write(text)
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
