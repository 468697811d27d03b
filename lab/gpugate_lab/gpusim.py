"""The lab's simulated GPU driver: a memory ledger of files, locks and PID namespaces.

Stdlib only: this file also runs inside lab containers (installed there as ``gpugate_gpusim``).

Model (docs/architecture.md, "The simulated GPU driver"):

- ``GPU_DIR/config.json``: ``{"count", "total_mib", "reserved_mib", "name", "release_delay_s", "uuids",
  "driver_version", "cuda_version"}``.
- ``GPU_DIR/alloc/<id>.json``: one allocation ``{"id", "gpu", "mib", "pid", "pidns", "cmd", "created",
  "stuck", "ctl"}``. The holder keeps an fd on it with ``flock(LOCK_SH)``; like a device fd, the fd is
  inherited by forks and closed by the kernel when the last holder exits, however it exits.
- The driver daemon (``python -m gpugate_lab.gpusim driver GPU_DIR``) frees an allocation whose lock is
  free (holder gone) after ``release_delay_s`` and appends ``{"id","gpu","mib","freed_at"}`` to
  ``GPU_DIR/released.jsonl``. ``stuck`` allocations are never freed.
- v2 used = sum of allocations; reserved = reserved_mib; v1 used = v2 used + reserved.
- Process lists follow the real driver since 535.113: a reader sees allocations of processes visible in
  its own PID namespace, under the PIDs it knows them by; the rest are silently dropped.

Example::

    setup_host(Path("/tmp/g"), count=2, total_mib=97887)
    holding = allocate(1, 4096, gpu_dir=Path("/tmp/g"))
    memory_info(1, gpu_dir=Path("/tmp/g")).used_mib   # -> 4096
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sys
import time

# Imported where used (argparse, uuid, pathlib): every NVML read of the lab's pynvml imports this module,
# and the read path (load_config, memory_info, list_processes) runs on os.path strings only, so an
# `import pynvml` in a container costs what the real binding's import does, not ~40 ms of stdlib.
# Annotations stay strings (``from __future__ import annotations``): Path, Iterable, List and Optional
# name the types, none is needed at run time.

DEFAULT_SIM_DIR = "/run/gpugate-sim"
DEFAULT_LAB_CTL = "/run/gpugate-lab"
DEFAULT_NAME = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
DEFAULT_DRIVER_VERSION = "580.159.04"
DEFAULT_CUDA_VERSION = "13.0"


# Compute capability by GPU name (NVIDIA's CUDA GPU table), for nvidia-smi's compute_cap, NVML's
# nvmlDeviceGetCudaComputeCapability and the SGLang stand-in's weight-cache key; a config's own
# "compute_capability" wins. The default GPU here is a Blackwell RTX PRO 6000 (12.0), the GPU machine's an H200.
COMPUTE_CAPABILITY_BY_NAME = {
    "NVIDIA H200": "9.0", "NVIDIA H100 80GB HBM3": "9.0", "NVIDIA H100": "9.0", "NVIDIA H20": "9.0",
    "NVIDIA A100-SXM4-80GB": "8.0", "NVIDIA A100-SXM4-40GB": "8.0", "NVIDIA L40S": "8.9",
    "NVIDIA B200": "10.0", "NVIDIA RTX PRO 6000 Blackwell Server Edition": "12.0",
}
DEFAULT_COMPUTE_CAPABILITY = "9.0"


def compute_capability(config: dict) -> str:
    """``major.minor`` of the simulated GPUs.

    Example: ``compute_capability({"name": "NVIDIA H200"})`` -> ``"9.0"``
    """
    return str(config.get("compute_capability")
               or COMPUTE_CAPABILITY_BY_NAME.get(str(config.get("name")), DEFAULT_COMPUTE_CAPABILITY))


class DriverUnavailable(Exception):
    """The simulated driver is absent (no GPU_DIR/config.json): NVML's DriverNotLoaded."""


class NotEnoughMemory(Exception):
    """An allocation that required free memory did not find enough."""


# ---------------------------------------------------------------------------------------------- paths


def sim_dir() -> Path:
    """The simulated driver's directory: $GPUGATE_SIM_DIR, else /run/gpugate-sim (bound into containers)."""
    from pathlib import Path

    return Path(_sim_dir_text())


def _sim_dir_text(gpu_dir: "Path | str | None" = None) -> str:
    """``gpu_dir`` (Path or str) or the default sim dir, as a string (the read path needs no pathlib)."""
    return os.fspath(gpu_dir) if gpu_dir else (os.environ.get("GPUGATE_SIM_DIR") or DEFAULT_SIM_DIR)


def lab_ctl_dir() -> Path:
    """The container's lab control dir (faults.json): $GPUGATE_LAB_CTL, else /run/gpugate-lab."""
    from pathlib import Path

    return Path(os.environ.get("GPUGATE_LAB_CTL") or DEFAULT_LAB_CTL)


def read_faults(ctl_dir: Optional[Path] = None) -> dict:
    """Faults injected into this container ({} when none or unreadable).

    Example: ``read_faults()`` -> ``{"ignore-sigterm": True, "slow-start": 5.0}``
    """
    path = os.path.join(os.fspath(ctl_dir) if ctl_dir else (os.environ.get("GPUGATE_LAB_CTL") or DEFAULT_LAB_CTL),
                        "faults.json")
    try:
        with open(path) as handle:
            data = json.loads(handle.read())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def holder_key(pidns: str, pid: int) -> str:
    """How a fault names a process: its PID namespace and its pid there (an allocation's own fields).

    >>> holder_key("pid:[4026532290]", 17)
    'pid:[4026532290]:17'
    """
    return f"{pidns}:{pid}"


def named_by_fault(fault: str, started: float, faults: Optional[dict] = None) -> bool:
    """Does ``fault`` (a fault that names its processes: ``{"holders": [holder_key...], "set_at":
    epoch}``, e.g. stuck-memory) name this process? ``started``: when this process began
    (``time.time()``): one that began after the fault was set is never named, a reused pid included.
    As on real hardware, memory that a driver never gives back is the memory of the processes it was
    stuck for, not of the next server's (issue 32 item 14).

    >>> named_by_fault("stuck-memory", 0.0, {"stuck-memory": {"holders": [], "set_at": 1.0}})
    False
    """
    value = (read_faults() if faults is None else faults).get(fault)
    if not isinstance(value, dict) or started > float(value.get("set_at") or 0):
        return False
    return holder_key(own_pidns(), os.getpid()) in (value.get("holders") or ())


def _ctl_id() -> Optional[str]:
    """dev:inode of this container's lab control dir; stable across container restarts, and the same
    seen from inside (bind mount) and from the lab (its real path): tags allocations with their container."""
    try:
        st = os.stat(os.environ.get("GPUGATE_LAB_CTL") or DEFAULT_LAB_CTL)
    except OSError:
        return None
    return f"{st.st_dev}:{st.st_ino}"


def ctl_id_of(path: Path) -> Optional[str]:
    """dev:inode of a container's control dir seen from the lab (see ``_ctl_id``)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return f"{st.st_dev}:{st.st_ino}"


# --------------------------------------------------------------------------------------------- config


def setup_host(
    gpu_dir: Path,
    count: int,
    total_mib: int,
    reserved_mib: int = 615,
    release_delay_s: float = 0.15,
    name: str = DEFAULT_NAME,
) -> None:
    """Create a host's simulated driver: config.json (uuids stable across calls), alloc/, dev/ nodes.

    Example: ``setup_host(Path("/tmp/lab/hosts/pve1/gpu"), count=8, total_mib=97887)``
    """
    import uuid as uuid_module
    from pathlib import Path

    gpu_dir = Path(gpu_dir)
    (gpu_dir / "alloc").mkdir(parents=True, exist_ok=True)
    (gpu_dir / "dev").mkdir(parents=True, exist_ok=True)
    config_path = gpu_dir / "config.json"
    old_uuids: List[str] = []
    if config_path.exists():
        try:
            old_uuids = list(json.loads(config_path.read_text()).get("uuids") or [])
        except ValueError:
            old_uuids = []
    uuids = old_uuids[:count]
    while len(uuids) < count:
        uuids.append(f"GPU-{uuid_module.uuid4()}")
    config = {
        "count": count,
        "total_mib": total_mib,
        "reserved_mib": reserved_mib,
        "name": name,
        "release_delay_s": release_delay_s,
        "uuids": uuids,
        "driver_version": DEFAULT_DRIVER_VERSION,
        "cuda_version": DEFAULT_CUDA_VERSION,
    }
    _write_atomic(config_path, json.dumps(config, indent=1) + "\n")
    for node in [f"nvidia{i}" for i in range(count)] + ["nvidiactl", "nvidia-uvm"]:
        (gpu_dir / "dev" / node).touch()
    (gpu_dir / "released.jsonl").touch()


def load_config(gpu_dir: Optional[Path] = None) -> dict:
    """The driver's config; raises DriverUnavailable when the sim dir is absent."""
    path = os.path.join(_sim_dir_text(gpu_dir), "config.json")
    try:
        with open(path) as handle:
            return json.loads(handle.read())
    except (OSError, ValueError) as exc:
        raise DriverUnavailable(str(path)) from exc


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------- pid namespaces


def own_pidns() -> str:
    """This process's PID namespace, e.g. ``pid:[4026531836]``."""
    return os.readlink("/proc/self/ns/pid")


def _read_nspid(pid: str) -> Optional[List[int]]:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return [int(x) for x in line.split()[1:]]
    except OSError:
        return None
    return None


def visible_pid_map(pidns_wanted: Iterable[str]) -> dict:
    """{(pidns, pid in that ns): pid as this reader's /proc names it} for processes of the given
    (descendant) namespaces. One /proc scan; only what the reader can see (ancestors see descendants)."""
    wanted = set(pidns_wanted)
    mapping: dict = {}
    if not wanted:
        return mapping
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ns = os.readlink(f"/proc/{entry}/ns/pid")
        except OSError:
            continue
        if ns not in wanted:
            continue
        nspid = _read_nspid(entry)
        if nspid:
            mapping[(ns, nspid[-1])] = int(entry)
    return mapping


# ----------------------------------------------------------------------------------------- allocations


class MemoryInfo:
    """One GPU's memory in MiB. ``used_mib`` is v2 used (allocations only); v1 used adds reserved.

    A plain class with what ``@dataclass`` would generate (init, repr, eq): the dataclasses import
    (inspect, ast, ...) was most of the cost of every ``import pynvml`` in a lab container.
    """

    __slots__ = ("total_mib", "reserved_mib", "used_mib")

    def __init__(self, total_mib: int, reserved_mib: int, used_mib: int) -> None:
        self.total_mib = total_mib
        self.reserved_mib = reserved_mib
        self.used_mib = used_mib

    def __repr__(self) -> str:
        return f"MemoryInfo(total_mib={self.total_mib!r}, reserved_mib={self.reserved_mib!r}, used_mib={self.used_mib!r})"

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return (self.total_mib, self.reserved_mib, self.used_mib) == (other.total_mib, other.reserved_mib, other.used_mib)  # type: ignore[attr-defined]

    __hash__ = None  # type: ignore[assignment]  # as a dataclass with eq and without frozen

    @property
    def free_mib(self) -> int:
        return max(0, self.total_mib - self.reserved_mib - self.used_mib)

    @property
    def v1_used_mib(self) -> int:
        return self.used_mib + self.reserved_mib


def list_allocations(gpu_dir: Optional[Path] = None) -> List[dict]:
    """Every allocation on the host (no namespace filtering), sorted by creation time."""
    alloc_dir = os.path.join(_sim_dir_text(gpu_dir), "alloc")
    allocs = []
    try:
        names = os.listdir(alloc_dir)
    except OSError:
        return []
    for name in names:
        if name.startswith(".") or not name.endswith(".json"):
            continue
        record = _read_alloc(os.path.join(alloc_dir, name))
        if record is not None:
            allocs.append(record)
    allocs.sort(key=lambda a: (a.get("created", 0), a.get("id", "")))
    return allocs


def _read_alloc(path: Path | str) -> Optional[dict]:
    for _ in range(3):  # an in-place rewrite (mark_stuck) may be caught half-way; retry
        try:
            with open(path) as handle:
                data = json.loads(handle.read())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            time.sleep(0.001)
            continue
        data.setdefault("id", os.path.splitext(os.path.basename(path))[0])  # the file's stem
        return data
    return None


def memory_info(gpu: int, gpu_dir: Optional[Path] = None) -> MemoryInfo:
    """Device-wide memory of one GPU (every allocation counts, whatever namespace holds it)."""
    config = load_config(gpu_dir)
    used = sum(int(a["mib"]) for a in list_allocations(gpu_dir) if int(a["gpu"]) == gpu)
    return MemoryInfo(total_mib=int(config["total_mib"]), reserved_mib=int(config["reserved_mib"]), used_mib=used)


def list_processes(gpu: int, viewer: str = "self", gpu_dir: Optional[Path] = None) -> List[dict]:
    """Processes holding memory on ``gpu`` as a reader sees them: ``[{"pid", "used_mib", "name", "id"}]``.

    viewer="self": as the real driver answers this process: allocations of its own PID namespace with
    their stored pid, those of descendant namespaces (containers seen from the lab host) mapped to the
    PIDs of this reader's /proc, the others dropped. viewer="all": every allocation, pid as stored.
    Allocations of the same process on one GPU are summed, as NVML does.
    """
    allocs = [a for a in list_allocations(gpu_dir) if int(a["gpu"]) == gpu]
    me = own_pidns()
    foreign = {a.get("pidns") for a in allocs if a.get("pidns") != me}
    mapping = visible_pid_map(foreign) if viewer == "self" else {}
    by_pid: dict = {}
    for a in allocs:
        if viewer == "all" or a.get("pidns") == me:
            pid = int(a["pid"])
        else:
            pid = mapping.get((a.get("pidns"), int(a["pid"])))
            if pid is None:
                continue
        entry = by_pid.setdefault(pid, {"pid": pid, "used_mib": 0, "name": _process_name(pid, a), "ids": []})
        entry["used_mib"] += int(a["mib"])
        entry["ids"].append(a.get("id"))
    return list(by_pid.values())


def _process_name(pid: int, alloc: dict) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv0 = f.read().split(b"\0")[0].decode(errors="replace")
        if argv0:
            return argv0
    except OSError:
        pass
    return str(alloc.get("cmd") or "")


def _own_cmd() -> str:
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return " ".join(p.decode(errors="replace") for p in f.read().split(b"\0") if p)
    except OSError:
        return ""


_device_fds: List[int] = []


def device_dir(gpu_dir: Optional[Path] = None) -> Path:
    """Where this process finds the simulated device nodes: /dev when the lab bound them there (inside
    containers), else GPU_DIR/dev."""
    from pathlib import Path

    gpu_dir = Path(_sim_dir_text(gpu_dir))
    try:
        if os.path.samefile("/dev/nvidiactl", gpu_dir / "dev" / "nvidiactl"):
            return Path("/dev")
    except OSError:
        pass
    return gpu_dir / "dev"


def open_device_nodes(gpu_dir: Optional[Path] = None) -> None:
    """Open nvidiactl, nvidia-uvm and every nvidiaN once per process, as a CUDA context does, so that
    tools finding holders by their open files (fuser, /proc/*/fd) see this process."""
    if _device_fds:
        return
    config = load_config(gpu_dir)
    dev = device_dir(gpu_dir)
    for node in ["nvidiactl", "nvidia-uvm"] + [f"nvidia{i}" for i in range(int(config["count"]))]:
        try:
            _device_fds.append(os.open(dev / node, os.O_RDONLY | os.O_CLOEXEC))
        except OSError:
            pass


class Holding:
    """Memory held by this process (and any fork that inherits the fd); see ``allocate``."""

    def __init__(self, path: Path, fd: int, record: dict):
        self.path = path
        self.fd = fd
        self.record = record

    @property
    def id(self) -> str:
        return self.record["id"]

    def free(self) -> None:
        """Give the memory back now (cudaFree): remove the allocation and drop the lock."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self.close()

    def close(self) -> None:
        """Drop the lock only (as process exit does): the driver frees it after its delay."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def allocate(
    gpu: int,
    mib: int,
    gpu_dir: Optional[Path] = None,
    *,
    cmd: Optional[str] = None,
    stuck: bool = False,
    require_free: bool = False,
    tag: Optional[str] = None,
) -> Holding:
    """Hold ``mib`` MiB on ``gpu`` for as long as this process (or a fork of it) lives.

    ``require_free``: fail with NotEnoughMemory unless that much is free (atomic with other allocators).
    Example: ``h = allocate(0, 86000, require_free=True)``.
    """
    from pathlib import Path

    gpu_dir = Path(_sim_dir_text(gpu_dir))
    config = load_config(gpu_dir)
    if not 0 <= gpu < int(config["count"]):
        raise ValueError(f"no GPU {gpu} (count {config['count']})")
    open_device_nodes(gpu_dir)
    alloc_id = f"{gpu}-{os.getpid()}-{os.urandom(6).hex()}"  # uuid's import cost each scheduler ~5 ms
    record = {
        "id": alloc_id,
        "gpu": gpu,
        "mib": int(mib),
        "pid": os.getpid(),
        "pidns": own_pidns(),
        "cmd": cmd if cmd is not None else _own_cmd(),
        "created": time.time(),
        "stuck": bool(stuck),
        "ctl": _ctl_id(),
        "tag": tag,
    }
    alloc_dir = gpu_dir / "alloc"
    tmp = alloc_dir / f".{alloc_id}.tmp"
    final = alloc_dir / f"{alloc_id}.json"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, json.dumps(record).encode())
        # Lock before the file becomes visible, so the driver never sees it unheld.
        fcntl.flock(fd, fcntl.LOCK_SH)
        with _ledger_lock(gpu_dir, exclusive=True):
            if require_free:
                free = memory_info(gpu, gpu_dir).free_mib
                if free < mib:
                    raise NotEnoughMemory(f"GPU {gpu}: need {mib} MiB, {free} MiB free")
            os.rename(tmp, final)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return Holding(final, fd, record)


class _ledger_lock:
    def __init__(self, gpu_dir: Path, exclusive: bool):
        self.path = os.path.join(gpu_dir, "ledger.lock")
        self.mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH

    def __enter__(self):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        fcntl.flock(self.fd, self.mode)
        return self

    def __exit__(self, *exc):
        os.close(self.fd)


def _holder_alive(path: Path) -> Optional[bool]:
    """True while some process holds the allocation's lock; None when the file is gone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops our probe lock too
    return False


def set_stuck(gpu_dir: Path, stuck: bool, *, ctl: Optional[str] = None, pidns: Optional[Iterable[str]] = None,
              tag: Optional[str] = None) -> List[str]:
    """Mark allocations stuck (never freed) or not; selects by container control-dir id, pid namespaces
    or tag. Rewrites in place so the holder's lock (on the inode) is kept. Returns the ids changed."""
    from pathlib import Path

    pidns_set = set(pidns or [])
    changed = []
    for a in list_allocations(gpu_dir):
        if not ((ctl and a.get("ctl") == ctl) or a.get("pidns") in pidns_set or (tag and a.get("tag") == tag)):
            continue
        if bool(a.get("stuck")) == stuck:
            continue
        a["stuck"] = stuck
        path = Path(gpu_dir) / "alloc" / f"{a['id']}.json"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            old_len = os.fstat(fd).st_size
            text = json.dumps(a).encode()
            # One pwrite padded with spaces (valid JSON whitespace): readers see old or new, never empty.
            os.pwrite(fd, text.ljust(old_len), 0)
        finally:
            os.close(fd)
        changed.append(a["id"])
    if changed:
        _tell_the_driver(Path(gpu_dir))
    return changed


def _tell_the_driver(gpu_dir: Path) -> None:
    """An in-place rewrite changes no directory entry; the driver looks again when alloc/'s mtime moves."""
    try:
        os.utime(gpu_dir / "alloc")
    except OSError:
        pass


# ------------------------------------------------------------------------------------------- the driver


def release_step(gpu_dir: Path, pending: dict, now: float, delay_s: float) -> List[dict]:
    """One pass of the driver: note allocations whose holder is gone; free those gone for ``delay_s``.

    ``pending`` maps id -> when the holder was first seen gone (kept between passes).
    Returns the release records written to released.jsonl.
    """
    from pathlib import Path

    alloc_dir = Path(gpu_dir) / "alloc"
    released = []
    seen = set()
    try:
        names = os.listdir(alloc_dir)
    except OSError:
        return released
    for name in names:
        path = alloc_dir / name
        if name.startswith("."):
            # an allocator that died between create and rename leaves a dot file
            if name.endswith(".tmp") and _holder_alive(path) is False:
                try:
                    if now - path.stat().st_mtime > 5:
                        path.unlink()
                except OSError:
                    pass
            continue
        if not name.endswith(".json"):
            continue
        alloc_id = name[:-5]
        seen.add(alloc_id)
        alive = _holder_alive(path)
        if alive is None:
            continue
        if alive:
            pending.pop(alloc_id, None)
            continue
        gone_since = pending.setdefault(alloc_id, now)
        if now - gone_since < delay_s:
            continue
        record = _read_alloc(path)
        if record is None or record.get("stuck"):
            continue
        pending.pop(alloc_id, None)
        entry = {"id": alloc_id, "gpu": record.get("gpu"), "mib": record.get("mib"), "freed_at": time.time()}
        # said before the memory goes: whoever sees it free finds the record (the other order raced)
        with open(Path(gpu_dir) / "released.jsonl", "a") as f:
            f.write(json.dumps(entry) + "\n")
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        released.append(entry)
    for gone in set(pending) - seen:
        pending.pop(gone, None)
    return released


def run_driver(gpu_dir: Path, poll_s: float = 0.02, rescan_s: float = 1.0) -> None:
    """The per-host driver daemon: free memory of dead holders after release_delay_s, forever.

    A pass of ``release_step`` probes every allocation's lock; the driver runs one only when something
    can have changed: a holder's lock went (a thread per allocation blocks on it), an entry of alloc/
    came or went (its mtime, read every ``poll_s``), a release delay ran out, or ``rescan_s`` passed.
    Probing every lock every 20 ms instead cost each lab host 4% of a core while a server ran."""
    import threading
    from pathlib import Path

    gpu_dir = Path(gpu_dir)
    alloc_dir = gpu_dir / "alloc"
    delay_s = float(load_config(gpu_dir).get("release_delay_s", 0.15))
    pending: dict = {}
    watched: set = set()
    unheld = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    seen_mtime, last_pass, wake_at = None, 0.0, None
    while True:
        now = time.monotonic()
        try:
            mtime = os.stat(alloc_dir).st_mtime_ns
        except OSError:
            mtime = None
        if (unheld.is_set() or mtime != seen_mtime or now - last_pass >= rescan_s
                or (wake_at is not None and now >= wake_at)):
            unheld.clear()
            # an mtime is coarse (a few ms): an entry made in the same tick after this stat would leave
            # it unchanged, so a fresh one counts as seen only once it is older than that
            fresh = mtime is not None and time.time_ns() - mtime < 50_000_000
            seen_mtime, last_pass = (None if fresh else mtime), now
            release_step(gpu_dir, pending, now, delay_s)
            _watch_locks(alloc_dir, watched, unheld)
            # a holder gone but not yet past its delay; one already past it is stuck, seen by the rescan
            wake_at = min((gone + delay_s for gone in pending.values() if gone + delay_s > now), default=None)
        unheld.wait(poll_s)


def _watch_locks(alloc_dir: Path, watched: set, unheld) -> None:
    """A thread for each allocation not yet watched, that sets ``unheld`` once its holders' lock is gone."""
    import threading

    try:
        names = {name for name in os.listdir(alloc_dir) if name.endswith(".json") and not name.startswith(".")}
    except OSError:
        return
    watched &= names
    for name in names - watched:
        watched.add(name)
        threading.Thread(target=_wait_unheld, args=(os.path.join(alloc_dir, name), unheld), daemon=True).start()


def _wait_unheld(path: str, unheld) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        unheld.set()
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # blocks while a holder's LOCK_SH lives, in whatever process
        fcntl.flock(fd, fcntl.LOCK_UN)  # before the pass probes it: ours would read as a holder
    finally:
        os.close(fd)
    unheld.set()


# ------------------------------------------------------------------------------------------------- CLI


def _parse_gpus(text: str, count: int) -> List[int]:
    if text == "all":
        return list(range(count))
    return [int(x) for x in text.split(",") if x != ""]


def main(argv: Optional[List[str]] = None) -> int:
    """``driver GPU_DIR`` | ``hold --gpu all|0,1 --mib N [--sim-dir D] [--tag T]`` | ``status [--sim-dir D]``."""
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="gpusim", description="the lab's simulated GPU driver")
    sub = parser.add_subparsers(dest="command", required=True)
    p_driver = sub.add_parser("driver", help="run the release daemon for GPU_DIR")
    p_driver.add_argument("gpu_dir", type=Path)
    p_driver.add_argument("--poll-s", type=float, default=0.02)
    p_hold = sub.add_parser("hold", help="hold memory until killed")
    p_hold.add_argument("--gpu", default="all")
    p_hold.add_argument("--mib", type=int, required=True)
    p_hold.add_argument("--sim-dir", type=Path, default=None)
    p_hold.add_argument("--tag", default=None)
    p_status = sub.add_parser("status", help="print memory per GPU as JSON")
    p_status.add_argument("--sim-dir", type=Path, default=None)
    args = parser.parse_args(argv)

    if args.command == "driver":
        run_driver(args.gpu_dir, args.poll_s)
        return 0
    if args.command == "hold":
        config = load_config(args.sim_dir)
        holdings = [allocate(g, args.mib, args.sim_dir, tag=args.tag)
                    for g in _parse_gpus(args.gpu, int(config["count"]))]
        print(f"holding {args.mib} MiB on GPUs {[h.record['gpu'] for h in holdings]} as pid {os.getpid()}",
              flush=True)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        while True:
            signal.pause()
    if args.command == "status":
        config = load_config(args.sim_dir)
        out = []
        for g in range(int(config["count"])):
            m = memory_info(g, args.sim_dir)
            out.append({"index": g, "used_mib": m.used_mib, "reserved_mib": m.reserved_mib,
                        "total_mib": m.total_mib})
        print(json.dumps(out))
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
