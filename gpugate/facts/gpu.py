"""GPU facts: what the GPUs hold, read where it matters.

- ``GpuState``: inside a container (``@pct/<pve-host>:<vmid>``): per-GPU memory through NVML v2 (or
  nvidia-smi), the container's processes holding ``/dev/nvidia*``, which source answered, errors.
- ``HostGpuProcesses``: on a Proxmox host itself (plain ``@ssh``/``@local`` host): every GPU process
  with its host pid and the container (vmid) it belongs to, for "memory is held, not by this container".

Both are one remote command (``gpugate.remote.build_probe_command``) that always exits 0; failures are
data (``errors``), and an empty or unreadable answer reads as an error, never as "idle".

Example (CLI)::

    pyinfra inventory.py fact gpugate.facts.gpu.GpuState
    pyinfra pve1.example.org fact gpugate.facts.gpu.HostGpuProcesses
"""

from __future__ import annotations

from typing import Optional

from pyinfra.api import FactBase
from typing_extensions import TypedDict, override

from gpugate.remote import build_probe_command, parse_probe_output


class GpuProcess(TypedDict, total=False):
    pid: int
    used_mib: Optional[int]
    alive: bool  # False: the driver lists a pid that does not exist (memory not freed)


class GpuInfo(TypedDict, total=False):
    index: int
    uuid: Optional[str]
    name: Optional[str]
    total_mib: Optional[int]
    used_mib: Optional[int]  # v2 "used" (reserved memory not counted); None when unknown
    reserved_mib: Optional[int]
    used_v1_mib: Optional[int]  # only when read through v1 (reserved counted in)
    error: Optional[str]
    processes: list[GpuProcess]
    processes_error: str


class GpuHolder(TypedDict, total=False):
    pid: int
    ppid: int
    pgid: int
    state: str  # /proc/PID/stat state: R, S, D (stuck in the kernel), Z (exited) ...
    comm: str
    cmdline: str
    devices: list[str]
    gpus: list[int]  # GPU indices where NVML/nvidia-smi lists this pid
    used_mib: Optional[int]
    listed_only: bool  # listed by the driver, no /dev/nvidia* fd seen
    vmid: Optional[int]  # HostGpuProcesses only: the container, None for the host


class ProbeError(TypedDict):
    source: str  # nvml, nvidia-smi, proc, probe, fact
    kind: str  # DriverNotLoaded, ModuleNotFound, GpuIsLost, Timeout, NoPython ...
    message: str


class GpuStateResult(TypedDict, total=False):
    schema: int
    source: str  # "nvml" | "nvidia-smi" | "none"
    memory_api: Optional[str]  # "v2" | "v1" | None
    driver: Optional[str]
    errors: list[ProbeError]
    gpus: list[GpuInfo]
    holders: list[GpuHolder]
    scope: str
    probe_pid: Optional[int]
    read_at: Optional[float]  # wall clock of the GPU read
    elapsed_ms: Optional[float]


class HostGpuProcessesResult(TypedDict):
    source: str
    errors: list[ProbeError]
    gpus: list[GpuInfo]
    processes: list[GpuHolder]  # with host pid and vmid


def unreadable_state(kind: str, message: str) -> GpuStateResult:
    """A GpuState that says the read failed (so no gate ever takes it for idle)."""
    return GpuStateResult(
        schema=1,
        source="none",
        memory_api=None,
        driver=None,
        errors=[ProbeError(source="fact", kind=kind, message=message)],
        gpus=[],
        holders=[],
        scope="container",
        probe_pid=None,
        read_at=None,
        elapsed_ms=None,
    )


def gpu_section(output: list[str], section: str = "gpu") -> GpuStateResult:
    """The GPU document from a probe command's output lines (tolerant: never raises)."""
    try:
        document = parse_probe_output(output)
    except ValueError:
        text = " | ".join(line.strip() for line in output if line.strip())
        return unreadable_state("UnreadableOutput", text[:500] or "no output")
    gpu = document.get(section)
    if not isinstance(gpu, dict):
        return unreadable_state("MissingSection", f"the probe printed no {section!r} section")
    if "source" not in gpu:  # a section that failed as a whole (no python3, a probe bug)
        failed = unreadable_state("ProbeFailed", str(gpu.get("error")))
        failed["errors"] = gpu.get("errors") or failed["errors"]
        return failed
    return GpuStateResult(**gpu)  # type: ignore[typeddict-item]


class GpuState(FactBase[GpuStateResult]):
    """
    The GPUs as seen from inside the container: memory per GPU and the processes holding them.

    ``used_mib`` is NVML v2 "used" (the driver's reserved memory, ~615 MiB on an H200, not counted:
    an idle GPU reads 0). ``holders`` are the container's processes with ``/dev/nvidia*`` open
    (the probe itself excluded), with their state (D: stuck in the driver; Z: exited).

    .. code:: python

        state = host.get_fact(GpuState)
        busy = [gpu["index"] for gpu in state["gpus"] if (gpu["used_mib"] or 0) > 64]
    """

    @override
    def command(self) -> str:
        return build_probe_command({"gpu": {}})

    @override
    @staticmethod
    def default() -> GpuStateResult:
        return unreadable_state("NoOutput", "the GPU probe printed nothing")

    @override
    def process(self, output: list[str]) -> GpuStateResult:
        return gpu_section(output)


class HostGpuProcesses(FactBase[HostGpuProcessesResult]):
    """
    On a Proxmox host: every process holding ``/dev/nvidia*`` or listed by the driver, with its
    host pid, cmdline, state and the container (``vmid``, from ``/proc/PID/cgroup``'s
    ``/lxc/<vmid>/``) it runs in; ``vmid`` is None for the host's own processes.

    .. code:: python

        for process in host.get_fact(HostGpuProcesses)["processes"]:
            print(process["vmid"], process["pid"], process["used_mib"], process["cmdline"])
    """

    @override
    def command(self) -> str:
        return build_probe_command({"gpu": {"scope": "host"}})

    @override
    @staticmethod
    def default() -> HostGpuProcessesResult:
        failed = unreadable_state("NoOutput", "the GPU probe printed nothing")
        return HostGpuProcessesResult(
            source="none", errors=failed["errors"], gpus=[], processes=[]
        )

    @override
    def process(self, output: list[str]) -> HostGpuProcessesResult:
        gpu = gpu_section(output)
        return HostGpuProcessesResult(
            source=gpu.get("source", "none"),
            errors=gpu.get("errors", []),
            gpus=gpu.get("gpus", []),
            processes=gpu.get("holders", []),
        )
