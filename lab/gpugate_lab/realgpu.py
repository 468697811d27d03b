"""`gpugate lab up --gpus real`: lab containers that see this machine's real NVIDIA GPUs (stdlib only).

In a real-GPU lab everything stays as in the simulated lab (sshd per host, ``pct``, containers made of
namespaces) except the GPUs: each container gets, at the same paths as on the machine,

- the real device nodes (``/dev/nvidia0..N``, ``/dev/nvidiactl``, ``/dev/nvidia-uvm[-tools]``,
  ``/dev/nvidia-modeset``, ``/dev/nvidia-caps/``) instead of the simulated files;
- the driver's user-space libraries (``libcuda``, ``libnvidia-ml``, ... as ``ldconfig -p`` and
  ``$LD_LIBRARY_PATH`` find them) and ``nvidia-smi``: bound file by file, because a container runtime
  often bind-mounts them onto placeholders that the container's /usr overlay would not show;
- the Python environment that holds torch (e.g. ``/opt/torch/.venv``), overlaid so that the lab's SGLang
  stand-in is installed in it, as SGLang would be: ``<env>/bin/python3 -m sglang.launch_server``;
- the real ``pynvml`` (nvidia-ml-py) for the container's ``/usr/bin/python3``, so gpugate's probe reads
  the real NVML, and ``/run/gpugate-lab/gpu.json`` (``{"mode": "real", "device": "cuda"}``), which
  tells the stand-in's workers to hold real CUDA memory and run a real model.

Everything is described by one JSON document, the *binding*, written to ``hosts/<host>/gpu-real.json``
by ``lab up`` and read by each container's PID 1 while it builds its filesystem. ``discover()`` builds
it from the machine; tests build one from a fake driver directory (sources anywhere, targets where a
container expects them), so the binding code runs without a GPU.

Example::

    >>> binding = discover()                                    # doctest: +SKIP
    NoDriver: no NVIDIA device nodes in /dev (...)
    >>> parse_ldconfig("\\tlibcuda.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so.1\\n")
    [('libcuda.so.1', '/usr/lib/x86_64-linux-gnu/libcuda.so.1')]
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

BINDING_FILE = "gpu-real.json"
MARKER_FILE = "gpu.json"  # in the container's labctl dir, seen inside as /run/gpugate-lab/gpu.json
DRIVER_LIB_PREFIXES = ("libcuda.", "libcudadebugger.", "libnvidia-", "libnvcuvid.", "libnvoptix.")
DEVICE_GLOBS = ("nvidia[0-9]*", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
EXTRA_TOOL_DIRS = ("/usr/local/nvidia/bin", "/usr/bin", "/usr/sbin", "/bin")
# Where a container may get a placeholder created for a bind target it lacks: its own or overlaid
# directories. Anywhere else the placeholder would be written into the machine's root.
PLACEHOLDER_ROOTS = ("/usr/", "/etc/", "/var/", "/opt/", "/home/", "/srv/", "/run/", "/tmp/", "/dev/")


class NoDriver(Exception):
    """This machine has no usable NVIDIA driver for a real-GPU lab; str() says what is missing."""


# ---------------------------------------------------------------- pure helpers


def parse_ldconfig(text: str) -> list[tuple[str, str]]:
    """``ldconfig -p`` output -> [(soname, path)], in order; header and odd lines skipped.

    Example: ``parse_ldconfig("\\tlibnvidia-ml.so.1 (libc6,x86-64) => /usr/lib/libnvidia-ml.so.1")``
    -> ``[("libnvidia-ml.so.1", "/usr/lib/libnvidia-ml.so.1")]``
    """
    out = []
    for line in text.splitlines():
        if "=>" not in line:
            continue
        left, _, path = line.partition("=>")
        name = left.strip().split(" ", 1)[0]
        path = path.strip()
        if name and path.startswith("/"):
            out.append((name, path))
    return out


def is_driver_library(name: str) -> bool:
    """True for the NVIDIA driver's user-space libraries (not CUDA toolkit ones such as libcudart).

    Example: ``is_driver_library("libcuda.so.1")`` -> True; ``is_driver_library("libcudart.so.12")`` -> False
    """
    base = os.path.basename(name)
    return base.startswith(DRIVER_LIB_PREFIXES)


def may_create_placeholder(target: str) -> bool:
    """A missing bind target may be created only inside the container's own or overlaid trees."""
    return target.startswith(PLACEHOLDER_ROOTS)


def site_packages_of(env_dir: Path) -> Optional[str]:
    """``lib/python3.X/site-packages`` of a venv (relative), or None."""
    found = sorted(glob.glob(str(Path(env_dir) / "lib" / "python3*" / "site-packages")))
    return os.path.relpath(found[-1], env_dir) if found else None


def venv_home(env_dir: Path) -> Optional[str]:
    """The ``home`` of a venv's pyvenv.cfg (the base interpreter's bin dir), or None."""
    try:
        for line in (Path(env_dir) / "pyvenv.cfg").read_text().splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "home":
                return value.strip()
    except OSError:
        return None
    return None


# ---------------------------------------------------------------- discovery (reads the machine)


def _devices(dev_dir: str) -> list[dict]:
    found: list[dict] = []
    for pattern in DEVICE_GLOBS:
        for path in sorted(glob.glob(os.path.join(dev_dir, pattern))):
            try:
                mode = os.stat(path).st_mode
            except OSError:
                continue
            if stat.S_ISCHR(mode):
                found.append({"source": path, "target": "/dev/" + os.path.basename(path), "kind": "device"})
    caps = os.path.join(dev_dir, "nvidia-caps")
    if os.path.isdir(caps):
        found.append({"source": caps, "target": "/dev/nvidia-caps", "kind": "dir"})
    return found


def _library_binds(ldconfig_text: str, ld_library_path: str) -> tuple[list[dict], list[dict], list[str]]:
    """(file binds, symlinks, lib dirs not in the ld cache) for the driver's libraries."""
    paths: list[str] = [path for name, path in parse_ldconfig(ldconfig_text) if is_driver_library(name)]
    cached_dirs = {os.path.dirname(p) for p in paths}
    extra_dirs: list[str] = []
    for directory in [d for d in ld_library_path.split(":") if d]:
        hits = sorted(glob.glob(os.path.join(directory, "lib*.so*")))
        hits = [h for h in hits if is_driver_library(h)]
        if hits and directory not in cached_dirs:
            extra_dirs.append(directory)
        paths.extend(hits)
    binds: dict[str, dict] = {}
    links: dict[str, dict] = {}
    for path in paths:
        real = os.path.realpath(path)
        if not os.path.isfile(real):
            continue
        binds.setdefault(real, {"source": real, "target": real, "kind": "file"})
        if os.path.islink(path):
            links.setdefault(path, {"path": path, "to": os.readlink(path)})
    return list(binds.values()), list(links.values()), extra_dirs


def find_nvidia_smi(path_env: str = "") -> Optional[str]:
    """The machine's real nvidia-smi (PATH, then the usual driver dirs), or None."""
    search = ":".join([p for p in path_env.split(":") if p] + list(EXTRA_TOOL_DIRS))
    found = shutil.which("nvidia-smi", path=search)
    return os.path.realpath(found) if found else None


def find_torch_env(explicit: Optional[str] = None, python: str = sys.executable) -> dict:
    """The Python environment that holds torch: ``{"dir", "python", "site_packages", "venv"}``.

    ``explicit`` ($GPUGATE_TORCH_ENV): a venv dir or an interpreter. Else the interpreter running this
    (on the H200 machine ``python3`` is /opt/torch/.venv/bin/python3). Raises NoDriver when that
    interpreter cannot import torch.
    """
    candidate = explicit or python
    if os.path.isdir(candidate):
        interpreter = os.path.join(candidate, "bin", "python3")
    else:
        interpreter = candidate
    probe = ("import importlib.util, json, sys; s = importlib.util.find_spec('torch'); "
             "n = importlib.util.find_spec('pynvml'); "
             "print(json.dumps({'prefix': sys.prefix, 'base': sys.base_prefix, 'torch': bool(s), "
             "'pynvml': n.origin if n else None, 'exe': sys.executable}))")
    try:
        out = subprocess.run([interpreter, "-c", probe], capture_output=True, text=True, timeout=60,
                             stdin=subprocess.DEVNULL, env={"PATH": "/usr/bin:/bin"})
        info = json.loads(out.stdout)
    except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
        raise NoDriver(f"cannot run {interpreter} to find torch ({exc}); set GPUGATE_TORCH_ENV to a venv with torch") from None
    if not info["torch"]:
        raise NoDriver(f"{interpreter} cannot import torch: a real-GPU lab needs the Python environment that "
                       "holds torch (set GPUGATE_TORCH_ENV=/path/to/venv)")
    venv = info["prefix"] != info["base"]
    env_dir = info["prefix"]
    return {
        "dir": env_dir,
        "python": os.path.join(env_dir, "bin", "python3") if venv else "/usr/bin/python3",
        "site_packages": site_packages_of(Path(env_dir)) if venv else None,
        "venv": venv,
        "pynvml": info["pynvml"],
        "home": venv_home(Path(env_dir)) if venv else None,
    }


def query_gpus(nvidia_smi: Optional[str]) -> list[dict]:
    """Per GPU: index, name, uuid, total_mib, used_mib (nvidia-smi's CSV; [] when it cannot answer)."""
    if not nvidia_smi:
        return []
    try:
        out = subprocess.run([nvidia_smi, "--query-gpu=index,name,uuid,memory.total,memory.used",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return parse_gpu_csv(out.stdout) if out.returncode == 0 else []


def parse_gpu_csv(text: str) -> list[dict]:
    """nvidia-smi ``index,name,uuid,memory.total,memory.used`` CSV -> dicts.

    Example: ``parse_gpu_csv("0, NVIDIA H200, GPU-1, 143771, 0")[0]["total_mib"]`` -> 143771
    """
    gpus = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 5:
            continue
        try:
            gpus.append({"index": int(parts[0]), "name": parts[1], "uuid": parts[2],
                         "total_mib": int(float(parts[3])), "used_mib": int(float(parts[4]))})
        except ValueError:
            continue
    return gpus


def discover(dev_dir: str = "/dev", ldconfig_text: Optional[str] = None, environ: Optional[Dict[str, str]] = None,
             torch_env: Optional[str] = None) -> dict:
    """The binding of this machine's real GPUs. Raises NoDriver naming what is missing.

    Example: ``discover()["devices"][0]`` -> ``{"source": "/dev/nvidia0", "target": "/dev/nvidia0", "kind": "device"}``
    """
    environ = dict(os.environ if environ is None else environ)
    devices = _devices(dev_dir)
    names = {os.path.basename(d["target"]) for d in devices}
    if "nvidiactl" not in names or not any(n[6:].isdigit() for n in names if n.startswith("nvidia")):
        raise NoDriver(f"no NVIDIA device nodes in {dev_dir} (nvidiactl, nvidia0...): is the NVIDIA driver loaded? "
                       "`gpugate lab up --gpus real` needs a machine with NVIDIA GPUs; without one use "
                       "`gpugate lab up` (simulated GPUs)")
    if ldconfig_text is None:
        try:
            ldconfig_text = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=30,
                                           stdin=subprocess.DEVNULL).stdout
        except (OSError, subprocess.TimeoutExpired):
            ldconfig_text = ""
    libs, links, extra_dirs = _library_binds(ldconfig_text, environ.get("LD_LIBRARY_PATH", ""))
    if not any(os.path.basename(b["target"]).startswith("libcuda.") for b in libs):
        raise NoDriver("the NVIDIA driver's libcuda is not installed (neither `ldconfig -p` nor $LD_LIBRARY_PATH "
                       "finds libcuda.so.1)")
    smi = find_nvidia_smi(environ.get("PATH", ""))
    tools = [{"source": smi, "target": smi, "kind": "file"}] if smi else []
    env = find_torch_env(torch_env or environ.get("GPUGATE_TORCH_ENV"))
    if not env.get("pynvml"):  # nvidia-ml-py beside gpugate (e.g. the carried wheels), if the env has none
        import importlib.util  # noqa: PLC0415

        spec = importlib.util.find_spec("pynvml")
        if spec and spec.origin and "pynvml_sim" not in spec.origin:
            env["pynvml"] = spec.origin
    return {
        "mode": "real",
        "device": "cuda",
        "devices": devices,
        "binds": libs + tools,
        "links": links,
        "ld_dirs": extra_dirs,
        "nvidia_smi": smi,
        "torch_env": env,
        "gpus": query_gpus(smi),
    }


# ---------------------------------------------------------------- files of the lab (outside containers)


def binding_path(host_dir: Path) -> Path:
    return Path(host_dir) / BINDING_FILE


def read_binding(host_dir: Path) -> Optional[dict]:
    """The host's binding, or None in a simulated lab."""
    try:
        return json.loads(binding_path(host_dir).read_text())
    except (OSError, ValueError):
        return None


def write_binding(host_dir: Path, binding: Optional[dict]) -> None:
    """Write (or with None remove) the host's binding: it decides the mode of every container start."""
    path = binding_path(host_dir)
    if binding is None:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(binding, indent=1) + "\n")
    os.replace(tmp, path)


def env_upper(cdir: Path) -> Path:
    return Path(cdir) / "torchenv-upper"


def install_real_extras(cdir: Path, binding: dict, standin_dir: Path) -> None:
    """Per container, outside it: the real pynvml and nvidia-smi in its /usr overlay, the stand-ins in
    its torch env overlay, and the marker that puts the stand-ins in real mode. Idempotent.
    (``standin_dir``: the SGLang stand-in's folder, kept for callers; every stand-in comes from the lab.)"""
    cdir = Path(cdir)
    usr = cdir / "usr-upper"
    dist = usr / "lib" / "python3" / "dist-packages"
    dist.mkdir(parents=True, exist_ok=True)
    smi = binding.get("nvidia_smi")
    if smi:  # a binding without nvidia-smi (a CPU rehearsal) keeps the lab's simulated NVML and nvidia-smi
        pynvml_src = (binding.get("torch_env") or {}).get("pynvml") or binding.get("pynvml")
        if pynvml_src and os.path.isfile(pynvml_src):
            shutil.copyfile(pynvml_src, dist / "pynvml.py")  # the real nvidia-ml-py in place of the lab's
        else:  # never the simulation's NVML beside real GPUs: the probe then reads the real nvidia-smi
            (dist / "pynvml.py").unlink(missing_ok=True)
        smi_link = usr / "bin" / "nvidia-smi"
        smi_link.parent.mkdir(parents=True, exist_ok=True)
        if smi_link.exists() or smi_link.is_symlink():
            smi_link.unlink()
        if smi != "/usr/bin/nvidia-smi":
            smi_link.symlink_to(smi)
    env = binding.get("torch_env") or {}
    if env.get("venv") and env.get("site_packages"):
        target = env_upper(cdir) / env["site_packages"]
        target.mkdir(parents=True, exist_ok=True)
        (cdir / "torchenv-work").mkdir(exist_ok=True)
        # the engine stand-ins, their parsers' snapshots (never gpugate's own flags) and what they share
        # (the driver shim, the streamed answers, gpugate_standin and its real-GPU mode): a venv sees
        # none of the container's dist-packages
        from gpugate_lab import container_files  # noqa: PLC0415
        container_files.install_standins(target, lab_path=cdir)
    labctl = cdir / "labctl"
    labctl.mkdir(exist_ok=True)
    (labctl / MARKER_FILE).write_text(json.dumps({"mode": "real", "device": binding.get("device", "cuda")}) + "\n")


def remove_real_extras(cdir: Path) -> None:
    """Back to a simulated container: the marker and the env overlay go (usr extras are rewritten)."""
    (Path(cdir) / "labctl" / MARKER_FILE).unlink(missing_ok=True)
    shutil.rmtree(env_upper(cdir), ignore_errors=True)


def machine_path(binding: dict, target: Optional[str]) -> Optional[str]:
    """Where a container path of the binding lies on this machine (its bind's source)."""
    for entry in binding.get("binds") or []:
        if entry["target"] == target:
            return entry["source"]
    return target


def write_host_tools(host_dir: Path, binding: Optional[dict], sim_wrapper: str) -> None:
    """The lab host's nvidia-smi on its PATH: the real one in a real-GPU lab, else the simulation."""
    smi = Path(host_dir) / "bin" / "nvidia-smi"
    real = machine_path(binding, binding.get("nvidia_smi")) if binding else None
    smi.write_text(f"#!/bin/sh\nexec {real} \"$@\"\n" if real else sim_wrapper)
    smi.chmod(0o755)


# ---------------------------------------------------------------- inside the container's PID 1


def _ensure_target(target: str, is_dir: bool) -> bool:
    """The bind target exists (created as a placeholder where that is safe); False when it cannot."""
    if os.path.lexists(target) and not os.path.islink(target):
        return True
    if os.path.islink(target):
        return os.path.exists(target)
    if not may_create_placeholder(target):
        return False
    try:
        if is_dir:
            os.makedirs(target, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            open(target, "a").close()
    except OSError:
        return False
    return True


def bind_devices(binding: dict, staging: str, bind) -> list[str]:
    """Bind the real device nodes into the container's new /dev (prepared at ``staging``)."""
    done = []
    for dev in binding.get("devices") or []:
        name = dev["target"][len("/dev/"):]
        dst = os.path.join(staging, name)
        if dev.get("kind") == "dir":
            os.makedirs(dst, exist_ok=True)
        else:
            open(dst, "w").close()
        bind(dev["source"], dst)
        done.append(dev["target"])
    return done


def stage_sources(binding: dict, cdir: Path, bind, log=lambda msg: None) -> dict:
    """Before the container's overlays and own dirs hide them: bind every source the binding needs
    (driver files, nvidia-smi, the torch env, the venv's base interpreter) to a staging place under the
    container's dir, and return {source: staged path}. Without this a source under /usr would be read
    through the /usr overlay (which shows what lies under a runtime's bind mount, not the library) and
    /opt/torch/.venv through the container's own /opt (empty)."""
    stage = Path(cdir) / "realgpu-stage"
    stage.mkdir(exist_ok=True)
    env = binding.get("torch_env") or {}
    sources = [e["source"] for e in binding.get("binds") or []]
    if env.get("venv"):
        sources.append(env.get("source") or env["dir"])
    if env.get("home"):
        sources.append(os.path.dirname(env["home"].rstrip("/")))
    staged: dict = {}
    for index, source in enumerate(sources):
        if source in staged or not os.path.exists(source):
            continue
        dst = stage / str(index)
        try:
            if os.path.isdir(source):
                dst.mkdir(exist_ok=True)
            else:
                dst.touch()
            bind(source, str(dst))
            staged[source] = str(dst)
        except OSError as exc:
            log(f"real GPU: could not stage {source}: {exc}")
    return staged


def bind_driver(binding: dict, cdir: Path, bind, mount, log=lambda msg: None, staged: Optional[dict] = None) -> None:
    """After the container's overlays: driver libraries and tools, their symlinks, the torch env
    (overlaid with the container's upper dir holding the stand-in), and an ld.so.conf for library
    dirs the machine's ld cache does not name. ``staged``: stage_sources()'s answer."""
    staged = staged or {}
    for entry in binding.get("binds") or []:
        source = staged.get(entry["source"], entry["source"])
        if not os.path.exists(source):
            log(f"real GPU: {entry['source']} is missing on this machine; not bound")
            continue
        is_dir = os.path.isdir(source)
        if _ensure_target(entry["target"], is_dir):
            bind(source, entry["target"], True)
        else:
            log(f"real GPU: no place for {entry['target']} in the container; not bound")
    for link in binding.get("links") or []:
        if not os.path.lexists(link["path"]) and may_create_placeholder(link["path"]):
            try:
                os.makedirs(os.path.dirname(link["path"]), exist_ok=True)
                os.symlink(link["to"], link["path"])
            except OSError as exc:
                log(f"real GPU: symlink {link['path']}: {exc}")
    env = binding.get("torch_env") or {}
    home = env.get("home")
    if home:  # the venv's base interpreter, where the container's own dirs would hide it
        prefix = os.path.dirname(home.rstrip("/"))
        source = staged.get(prefix, prefix)
        if prefix.startswith(("/root/", "/opt/", "/home/", "/srv/")) and os.path.isdir(source) \
                and _ensure_target(prefix, True):
            bind(source, prefix, True)
    if env.get("venv"):
        source = env.get("source") or env["dir"]
        source = staged.get(source, source)
        target = env["dir"]
        upper, work = env_upper(cdir), Path(cdir) / "torchenv-work"
        upper.mkdir(exist_ok=True)
        work.mkdir(exist_ok=True)
        if _ensure_target(target, True):
            mount("overlay", target, "overlay", 0, f"lowerdir={source},upperdir={upper},workdir={work}")
        else:
            log(f"real GPU: no place for the torch env {target} in the container")
    if binding.get("ld_dirs"):
        conf = "/etc/ld.so.conf.d/gpugate-nvidia.conf"
        os.makedirs(os.path.dirname(conf), exist_ok=True)
        with open(conf, "w") as handle:
            handle.write("\n".join(binding["ld_dirs"]) + "\n")
        subprocess.run(["ldconfig"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=60, check=False)


def gpu_usage(binding: dict) -> list[dict]:
    """Per-GPU used MiB as the real nvidia-smi reads it (for `gpugate lab status`)."""
    return [{"index": g["index"], "used_mib": g["used_mib"], "total_mib": g["total_mib"]}
            for g in query_gpus(machine_path(binding, binding.get("nvidia_smi")))]
