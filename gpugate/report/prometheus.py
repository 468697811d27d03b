"""The status as a node_exporter textfile-collector file, written atomically.

Example::

    write_atomically("/var/lib/node_exporter/gpugate.prom", status_prometheus(rows))
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

def _label(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def status_prometheus(rows: Sequence[Mapping[str, Any]]) -> str:
    """The node_exporter textfile collector's format: per server up, desired, drifted, as desired,
    reachable, the last transition's outcome and duration; per GPU used MiB. Every server's series
    carry its ``engine`` label (the families keep their ``gpugate_sglang_`` names, which dashboards
    already query, whatever the engine)."""
    metrics: dict[str, tuple[str, list[str]]] = {
        "gpugate_sglang_up": ("1 when the server serves (main alive, /health 200, every scheduler alive)", []),
        "gpugate_sglang_desired": ("1 when a server should run here (sglang_present)", []),
        "gpugate_sglang_drifted": ("1 when it runs with other flags or model than desired, or should not run", []),
        "gpugate_sglang_as_desired": ("1 when the status verdict is serving or stopped as desired", []),
        "gpugate_sglang_reachable": ("0 when the Proxmox host could not be reached", []),
        "gpugate_sglang_last_transition": ("1 for the outcome of the latest transition (label outcome)", []),
        "gpugate_sglang_last_transition_duration_seconds": ("wall time of the latest ended transition", []),
        "gpugate_gpu_used_mib": ("GPU memory in use (NVML v2), per GPU seen from the container", []),
        "gpugate_sglang_router_listed": ("1 when the server's router lists it (routed servers; label router)", []),
        "gpugate_sglang_router_healthy": ("1 when its router lists it healthy and ready (label router)", []),
        "gpugate_sglang_router_cordoned": ("1 when it is declared out of its router (router_cordon: true; "
                                           "label router): listed 0 is then as desired", []),
        "gpugate_sglang_canary_soaking": ("1 while a canary soaks on this server (docs/canary.md; label router)", []),
        "gpugate_sglang_canary_last_verdict": ("1 for the verdict of the server's last canary (labels verdict, "
                                               "router): pass, regression, low-traffic, no-baseline", []),
        "gpugate_weight_cache_ready": ("1 when the server's weight-cache daemons serve on every GPU (label key)", []),
        "gpugate_weight_cache_used_mib": ("GPU memory a weight-cache daemon holds (labels gpu, pid)", []),
    }
    for row in rows:
        labels = (f'host="{_label(row.get("host"))}",vmid="{_label(row.get("vmid"))}",port="{_label(row.get("port"))}",'
                  f'engine="{_label(row.get("engine") or "")}"')
        reachable = row.get("kind") != "unreachable"
        metrics["gpugate_sglang_up"][1].append(f"{{{labels}}} {int(bool(row.get('up')))}")
        metrics["gpugate_sglang_desired"][1].append(f"{{{labels}}} {int(bool(row.get('desired')))}")
        metrics["gpugate_sglang_drifted"][1].append(f"{{{labels}}} {int(bool(row.get('drifted')))}")
        metrics["gpugate_sglang_as_desired"][1].append(f"{{{labels}}} {int(bool(row.get('ok')))}")
        metrics["gpugate_sglang_reachable"][1].append(f"{{{labels}}} {int(reachable)}")
        transition = row.get("transition") or {}
        outcome = transition.get("outcome") or ("running" if transition.get("active") else None)
        if outcome:
            metrics["gpugate_sglang_last_transition"][1].append(f'{{{labels},outcome="{_label(outcome)}"}} 1')
        if isinstance(transition.get("duration_s"), (int, float)):
            metrics["gpugate_sglang_last_transition_duration_seconds"][1].append(
                f"{{{labels}}} {transition['duration_s']}")
        view = row.get("router") or {}
        if view.get("listed") is not None:
            routed = f'{labels},router="{_label(view.get("router"))}"'
            metrics["gpugate_sglang_router_listed"][1].append(f"{{{routed}}} {int(bool(view.get('listed')))}")
            metrics["gpugate_sglang_router_healthy"][1].append(f"{{{routed}}} {int(bool(view.get('healthy')))}")
            metrics["gpugate_sglang_router_cordoned"][1].append(f"{{{routed}}} {int(bool(view.get('cordoned')))}")
        canary = row.get("canary") or {}
        if canary:
            routed = f'{labels},router="{_label(canary.get("router") or "")}"'
            metrics["gpugate_sglang_canary_soaking"][1].append(f"{{{routed}}} {int(canary.get('state') == 'soaking')}")
            if canary.get("verdict"):
                metrics["gpugate_sglang_canary_last_verdict"][1].append(
                    f'{{{routed},verdict="{_label(canary["verdict"])}"}} 1')
        cache = row.get("weight_cache") or {}
        if cache:
            key = _label(str((cache.get("key") or {}).get("id") or ""))
            metrics["gpugate_weight_cache_ready"][1].append(f'{{{labels},key="{key}"}} {int(bool(cache.get("running")))}')
            for gpu in cache.get("gpus") or []:
                if isinstance(gpu.get("used_mib"), (int, float)):
                    metrics["gpugate_weight_cache_used_mib"][1].append(
                        f'{{{labels},gpu="{gpu.get("index")}",pid="{gpu.get("pid")}"}} {gpu["used_mib"]}')
        for index, used in enumerate(row.get("gpu_used") or []):
            if isinstance(used, (int, float)):
                metrics["gpugate_gpu_used_mib"][1].append(f'{{{labels},gpu="{index}"}} {used}')
    lines = []
    for name, (help_text, samples) in metrics.items():
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"] + [name + sample for sample in samples]
    return "\n".join(lines) + "\n"


def write_atomically(path: str | os.PathLike[str], text: str, mode: int = 0o644) -> None:
    """Write ``text`` to ``path`` so that a reader (the textfile collector) sees the old file or the
    new one, never half: a temporary file in the same directory, fsync'd, then renamed over it."""
    target = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(target))
    handle, temporary = tempfile.mkstemp(prefix=".gpugate-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(handle, "w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(temporary, mode)
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


