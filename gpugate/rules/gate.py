"""The GPU gate: ONE decision over a GpuState document (gpugate/agent/gpu_probe.py) and ONE rule for
memory held from outside the container. Pure functions, no I/O.

Callers: gpugate.gate.evaluate (gpu.idle, and the in-container wait of gpugate.remote's wait command),
the agent's gate before a start (gpugate.agent.start), the plan's checks before anything stops
(gpugate.plan) and the status's foreign figure (through gpugate.plan.foreign_memory). Each renders
the decision in its own words; what passes, what blocks and what waiting cannot cure is decided here.

The gate passes when the reading can be trusted and the GPUs in question are idle:

- a source answered (``nvml`` or ``nvidia-smi``) with no error of its own, memory read through the
  v2 API (v1 ``used`` counts the driver's reserved memory in: ~615 MiB on an idle H200), and at
  least one GPU is visible (every GPU named in ``gpus`` is);
- every GPU's ``used_mib`` is known and at or under ``max_used_mib`` plus the memory it is
  expected to hold (``expected_mib``: a weight cache that stays on the GPUs; none by default);
- no process holds them: ``idle_holders_block`` (gpu.idle: the container must be free of GPU
  processes) counts every holder of /dev/nvidia*; without it (a server's gate) only a holder with
  memory on one of these GPUs counts, and a monitor holding the device files at 0 MiB does not.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is never imported at run time (~10 ms of every agent command)
    from typing import Any, Dict, Iterable, Mapping

# Errors that waiting will not cure: fail at once instead of polling until the timeout.
PERMANENT_ERROR_KINDS = (
    "ModuleNotFound",
    "NotFound",
    "LibraryNotFound",
    "DriverNotLoaded",
    "LibRmVersionMismatch",
    "NoPython",
)
ANSWERING_SOURCES = ("nvml", "nvidia-smi")
GONE_STATES = ("Z", "X")


def error_text(error: Mapping[str, Any]) -> str:
    return "%s %s: %s" % (error.get("source"), error.get("kind"), error.get("message"))


def reading_problems(state: Any) -> tuple:
    """-> (reasons the reading cannot be trusted, whether waiting cannot fix them).

    >>> reading_problems({"source": "none", "errors": [{"source": "nvml", "kind": "DriverNotLoaded", "message": "x"}]})
    (['cannot read the GPUs: nvml DriverNotLoaded: x'], True)
    """
    if not isinstance(state, dict):
        return ["no GPU reading (the probe gave no document)"], False
    source = state.get("source")
    errors = state.get("errors") or []
    if source not in ANSWERING_SOURCES:
        detail = "; ".join(error_text(error) for error in errors) or "no source answered"
        permanent = bool(errors) and all(e.get("kind") in PERMANENT_ERROR_KINDS for e in errors)
        return ["cannot read the GPUs: %s" % detail], permanent
    problems = []
    # Errors of a source that was replaced by the next one (e.g. pynvml missing, nvidia-smi
    # answered) are history; the answering source's own errors and the probe's are not.
    for error in errors:
        if error.get("source") in (source, "probe", "proc", "fact"):
            problems.append("reading error: %s" % error_text(error))
    if state.get("memory_api") != "v2":
        return problems + [
            "memory read through the v1 API (%s), which counts the driver's reserved memory as "
            "used: cannot tell an idle GPU from a held one (needs driver >= R510)"
            % (state.get("memory_api") or "unknown")
        ], True
    if not state.get("gpus"):
        problems.append("no GPU visible to %s" % source)
    return problems, False


def foreign_mib(gpu: Mapping[str, Any], holders: list, ignore_pids: Iterable[int] = ()) -> int | None:
    """THE foreign-memory rule: memory on this GPU (MiB) that no process of the container accounts
    for (the host's or another container's: inside a container NVML lists only the container's own
    processes, but memory is device-wide). None when it cannot be told: no reading, a listed
    process without a figure, or nothing listed while the container has holders (a driver before
    535.113 lists host pids only). Never ours to end.

    >>> foreign_mib({"used_mib": 900, "processes": []}, holders=[])
    900
    >>> foreign_mib({"used_mib": 900, "processes": [{"pid": 5, "used_mib": 600}]}, holders=[{"pid": 5}])
    300
    >>> foreign_mib({"used_mib": 900, "processes": []}, holders=[{"pid": 5}]) is None
    True
    """
    used = gpu.get("used_mib")
    if used is None:
        return None
    ignore = set(ignore_pids)
    listed = [p for p in gpu.get("processes") or [] if p.get("pid") not in ignore]
    if not listed:
        return used if not holders else None
    if any(p.get("used_mib") is None for p in listed):
        return None
    return max(0, used - sum(p["used_mib"] for p in listed))


def foreign_by_gpu(state: Mapping[str, Any], gpus: Iterable[int] | None = None) -> Dict[Any, int]:
    """GPU index -> foreign MiB, for the GPUs (of ``gpus``; None: all) where the rule finds some.

    >>> foreign_by_gpu({"gpus": [{"index": 0, "used_mib": 900, "processes": []}, {"index": 1, "used_mib": 0}]})
    {0: 900}
    """
    wanted = None if gpus is None else set(gpus)
    holders = state.get("holders") or []
    out = {}
    for gpu in state.get("gpus") or []:
        if wanted is not None and gpu.get("index") not in wanted:
            continue
        mib = foreign_mib(gpu, holders)
        if mib:
            out[gpu.get("index")] = mib
    return out


def outside_memory(state: Mapping[str, Any], max_used_mib: float = 64,
                   gpus: Iterable[int] | None = None) -> tuple:
    """THE split of the memory no process of the container accounts for (:func:`foreign_mib`), by the
    gate's own threshold: above ``max_used_mib`` it is held from outside (the host's or another
    container's: report it, never kill for it); at or under it, it is driver overhead (NVML v2's
    device total minus the per-process sum: a few MiB with nothing outside, as on an idle H200),
    which passes the gate and is never called memory from outside.
    -> ({index: MiB held from outside}, {index: MiB of driver overhead}).

    >>> outside_memory({"gpus": [{"index": 0, "used_mib": 8, "processes": []},
    ...                          {"index": 1, "used_mib": 900, "processes": []}]})
    ({1: 900}, {0: 8})
    """
    held, overhead = {}, {}
    for index, mib in foreign_by_gpu(state, gpus).items():
        if mib > max_used_mib:
            held[index] = mib
        else:
            overhead[index] = mib
    return held, overhead


def memory_gpus(holder: Mapping[str, Any], gpus: Iterable[int] | None = None) -> list:
    """The GPUs (of ``gpus``; None: any) where ``holder`` holds memory: those the driver lists it
    on, unless it is listed at 0 MiB (an NVML monitor holds the files, not memory).

    >>> memory_gpus({"gpus": [0, 5], "used_mib": 40000}, [4, 5]), memory_gpus({"gpus": [], "used_mib": None})
    ([5], [])
    """
    on = set(holder.get("gpus") or [])
    if gpus is not None:
        on &= set(gpus)
    if not on or (holder.get("used_mib") is not None and holder["used_mib"] <= 0):
        return []
    return sorted(on)


def decide(state: Any, max_used_mib: float = 64, gpus: Iterable[int] | None = None,
           ignore_pids: Iterable[int] = (), expected_mib: Mapping[Any, float] | None = None,
           idle_holders_block: bool = True) -> Dict[str, Any]:
    """THE gate decision over one GPU reading.

    + gpus: the GPUs in question (a server's); None: every visible GPU
    + ignore_pids: processes that are not holders (a known monitor, the caller's own)
    + expected_mib: GPU index -> MiB it may hold beyond ``max_used_mib`` (a weight cache kept on it)
    + idle_holders_block: a holder without memory on these GPUs blocks too (gpu.idle), or not
      (a server's gate: a monitor at 0 MiB never stalls a restart)

    -> {"passed", "undecidable" (the reading cannot be trusted), "permanent" (waiting will not
    change it), "reading_problems", "wanted" (GPU indexes), "missing" (named but not visible),
    "used_mib" {"<index>": MiB|None}, "unknown" [(index, error|None)], "over" [(index, used, limit)],
    "holders" (not ignored), "blocking" [(holder, [GPUs it holds memory on])], "foreign_mib"
    {index: MiB|None}, "stale" {index: [listed processes that no longer exist]}}

    >>> reading = {"source": "nvml", "memory_api": "v2", "errors": [], "holders": [],
    ...            "gpus": [{"index": 0, "used_mib": 0, "processes": []}, {"index": 1, "used_mib": 900}]}
    >>> decide(reading)["over"], decide(reading, gpus=[0])["passed"], decide(reading, expected_mib={1: 900})["passed"]
    ([(1, 900, 64)], True, True)
    """
    ignore = set(int(pid) for pid in ignore_pids)
    expected: Dict[Any, float] = dict(expected_mib or {})
    problems, permanent = reading_problems(state)
    state = state if isinstance(state, dict) else {}
    by_index = dict((gpu.get("index"), gpu) for gpu in state.get("gpus") or [])
    wanted = list(by_index) if gpus is None else sorted(set(gpus))  # every GPU: in the reading's order
    missing = [index for index in wanted if index not in by_index] if by_index or gpus is not None else []
    if missing and state.get("source") in ANSWERING_SOURCES:
        permanent = True  # a GPU the container does not see will not appear by waiting
    holders = [h for h in state.get("holders") or [] if h.get("pid") not in ignore]
    out = {"passed": False, "undecidable": bool(problems), "permanent": permanent,
           "reading_problems": problems, "wanted": wanted, "missing": missing, "used_mib": {},
           "unknown": [], "over": [], "holders": holders, "blocking": [], "foreign_mib": {}, "stale": {}}
    for index in wanted:
        gpu = by_index.get(index)
        if gpu is None:
            continue
        used = gpu.get("used_mib")
        out["used_mib"][str(index)] = used
        out["foreign_mib"][index] = foreign_mib(gpu, holders, ignore)
        stale = [p for p in gpu.get("processes") or [] if p.get("pid") not in ignore and p.get("alive") is False]
        if stale:
            out["stale"][index] = stale
        if used is None:  # a GPU's error comes with no figure (the probe reads nothing more of it)
            out["unknown"].append((index, gpu.get("error")))
            out["undecidable"] = True
        else:
            extra = expected.get(index, expected.get(str(index)))  # keys as ints or as JSON's strings
            limit = max_used_mib + (extra or 0)
            if used > limit:
                out["over"].append((index, used, limit))
    for holder in holders:
        on = memory_gpus(holder, wanted)
        if holder.get("state") in GONE_STATES and not idle_holders_block:
            continue
        if on or idle_holders_block:
            out["blocking"].append((holder, on))
    out["passed"] = not (problems or missing or out["unknown"] or out["over"] or out["blocking"])
    out["permanent"] = out["permanent"] and not out["passed"]
    return out
