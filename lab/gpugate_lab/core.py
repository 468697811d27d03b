"""The local lab: `gpugate lab up|down|status` -- simulated Proxmox hosts made of real parts.

Each host ``pveN`` is a real OpenSSH server on 127.0.0.1 running in its own PID, mount, UTS and cgroup
namespaces under a reaping init (gpugate_lab.hostinit); its containers are nested namespaces
(gpugate_lab.container) managed by the lab's ``pct`` (gpugate_lab.pct).

Example:
    >>> lab = up(Path("/tmp/lab-demo"), hosts=2)          # doctest: +SKIP
    >>> ssh_argv(Path("/tmp/lab-demo"), "pve1") + ["pct", "list"]   # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gpugate_lab import container, nsutil, realgpu

DEFAULT_LAB_DIR = "/tmp/gpugate-lab"
DEFAULT_GPUS = 8
DEFAULT_GPU_MIB = 97887
DEFAULT_VMIDS = (129,)
LAB_MODEL = "/opt/models/lab-model"
# The server the lab's fleet gives a container, per engine: its own default port and its own name for
# the tensor-parallel size; how a share of the host's GPUs is written (see _server_on)
LAB_SERVERS = {
    "sglang": {"model_path": LAB_MODEL, "port": 30000, "flags": {"tp": DEFAULT_GPUS}},
    "vllm": {"model_path": LAB_MODEL, "port": 8000, "flags": {"tensor-parallel-size": DEFAULT_GPUS}},
}
TP_FLAGS = {"sglang": ("tp", "tp-size"), "vllm": ("tensor-parallel-size", "tp")}
PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)  # the directory that holds gpugate_lab
FORBIDDEN_PREFIXES = ("/etc", "/root", "/var", "/usr")
BOOT_CODE = "import sys; sys.path.insert(0, {root!r}); from gpugate_lab.{module} import main; {call}"


class LabError(Exception):
    """The lab could not do what was asked; str() says why."""


def default_lab_dir() -> Path:
    return Path(os.environ.get("GPUGATE_LAB_DIR") or DEFAULT_LAB_DIR)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class HostInfo:
    """One lab host as `gpugate lab status --json` reports it."""

    name: str
    hostname: str
    port: int
    user: str
    key: str
    known_hosts: str
    running: bool = False
    init_pid: int | None = None
    containers: list[dict] = field(default_factory=list)
    gpus: list[dict] = field(default_factory=list)
    gpu_mode: str = "simulated"  # "real": `lab up --gpus real` (gpugate_lab.realgpu)


# ---------------------------------------------------------------- paths and small pure helpers


def host_dir(lab_dir: Path, host: str) -> Path:
    return Path(lab_dir) / "hosts" / host


def host_names(count: int) -> list[str]:
    return [f"pve{i}" for i in range(1, count + 1)]


def existing_hosts(lab_dir: Path) -> list[str]:
    base = Path(lab_dir) / "hosts"
    if not base.is_dir():
        return []
    names = [p.name for p in base.iterdir() if (p / "sshd_config").exists()]
    return sorted(names, key=lambda n: (len(n), n))


def cgroup_name(lab_dir: Path) -> str:
    """Per-lab cgroup directory name, so two labs on one machine never share cgroups."""
    digest = hashlib.sha1(str(Path(lab_dir).resolve()).encode()).hexdigest()[:10]
    return f"gpugate-lab-{digest}"


def lab_cgroup_dir(lab_dir: Path) -> str | None:
    mount = nsutil.cgroup2_mount()
    return os.path.join(mount, cgroup_name(lab_dir)) if mount else None


def host_cgroup_dir(lab_dir: Path, host: str) -> str | None:
    base = lab_cgroup_dir(lab_dir)
    return os.path.join(base, host) if base else None


def sshd_config_text(hdir: Path, port: int, authorized_keys: Path) -> str:
    """sshd_config of one lab host: loopback, key-only root, SFTP, PATH with the lab's pct."""
    path = f"{hdir / 'bin'}:/usr/sbin:/usr/bin:/sbin:/bin"
    return "\n".join([
        f"Port {port}",
        "ListenAddress 127.0.0.1",
        f"HostKey {hdir / 'ssh_host_ed25519_key'}",
        "PidFile none",
        f"AuthorizedKeysFile {authorized_keys}",
        "PermitRootLogin prohibit-password",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",
        "StrictModes no",
        "PrintMotd no",
        "PrintLastLog no",
        "UseDNS no",
        "MaxStartups 200:30:400",
        "MaxSessions 200",
        "LogLevel ERROR",
        "Subsystem sftp internal-sftp",
        f"SetEnv PATH={path} GPUGATE_LAB_HOST={hdir.name}",
        "",
    ])


def fleet_document(lab_dir: Path, hosts: list[tuple[str, int]], vmids: dict[str, list[int]],
                   server: dict | None = None, router: dict | None = None,
                   engines: tuple[str, ...] = ("sglang",),
                   gpu_maps: dict[int, tuple[int, ...]] | None = None) -> dict:
    """The fleet.yaml content for the lab (the shape inventory.py reads). ``engines``: the engine of
    each container, in turn in vmid order (``gpugate lab up --engine sglang,vllm``: one of each);
    its section is named for it, with ``LAB_SERVERS``' server. ``server`` overrides what that server
    is (a real-GPU lab: the torch env's python; ``tp`` is written in the engine's own flag name).
    ``router``: gpugate_lab.router's state (``url``, ``ports``): a ``routers:`` section and each
    server's ``router:``/``router_url:`` (its published port). ``gpu_maps``: the GPUs a container's
    config passes in (``lab up --containers 129:0-1``): its server gets those (see map_share)."""
    doc: dict = {"hosts": {}}
    if router:
        from gpugate_lab.router import ROUTER_NAME  # noqa: PLC0415

        doc["routers"] = {ROUTER_NAME: {"url": router["url"], "kind": "smg"}}
    for name, port in hosts:
        engine_of = engines_of(vmids.get(name, []), engines)
        doc["hosts"][name] = {
            "ssh": {
                "hostname": "127.0.0.1",
                "port": port,
                "user": "root",
                "key": str(Path(lab_dir) / "id_ed25519"),
                "known_hosts_file": str(Path(lab_dir) / "known_hosts"),
            },
            "containers": {
                vmid: {engine_of[vmid]: _server_on(engine_of[vmid], lab_server(engine_of[vmid], server), share)}
                for vmid, share in {**split_gpus(vmids.get(name, []), _host_gpu_count(lab_dir, name)),
                                    **map_shares(vmids.get(name, []), gpu_maps)}.items()
            },
        }
        if router:
            for vmid, container in doc["hosts"][name]["containers"].items():
                published = (router.get("ports") or {}).get(f"{name}:{vmid}")
                if published:
                    container[engine_of[vmid]]["router"] = "lab"
                    container[engine_of[vmid]]["router_url"] = f"http://127.0.0.1:{published}"
    return doc


def engines_of(vmids: list[int], engines: tuple[str, ...]) -> dict[int, str]:
    """Each container's engine: ``engines`` in turn, in vmid order.

    >>> engines_of([130, 129, 131], ("sglang", "vllm"))
    {129: 'sglang', 130: 'vllm', 131: 'sglang'}
    """
    return {vmid: engines[i % len(engines)] for i, vmid in enumerate(sorted(vmids))}


def lab_server(engine: str, server: dict | None = None) -> dict:
    """The server ``engine`` gets in the lab's fleet: ``LAB_SERVERS``' own, with what ``server``
    overrides (its ``tp`` written as this engine's tensor-parallel flag).

    >>> lab_server("vllm", {"flags": {"tp": 1}, "python": "/v/bin/python3"})
    {'model_path': '/opt/models/lab-model', 'port': 8000, 'flags': {'tensor-parallel-size': 1}, 'python': '/v/bin/python3'}
    """
    spec = json.loads(json.dumps(LAB_SERVERS[engine]))
    for key, value in (server or {}).items():
        if key == "flags":
            flags = dict(value)
            tp = next((flags.pop(k) for k in ("tp", "tp-size", "tensor-parallel-size") if k in flags), None)
            spec["flags"] = {**({TP_FLAGS[engine][0]: tp} if tp is not None else spec["flags"]), **flags}
        else:
            spec[key] = value
    return spec


def split_gpus(vmids: list[int], gpu_count: int) -> dict[int, tuple[int, int] | None]:
    """Disjoint GPUs for the containers of one lab host: vmid -> (tp, base GPU id), or None when no
    GPU is left for it. One container keeps the server as given; several share the host's GPUs in
    equal power-of-two blocks (a TP size real models accept), in vmid order, so no two servers of
    the lab's own fleet claim the same GPU (gpugate.claims would refuse them).

    >>> split_gpus([129, 130], 8)
    {129: (4, 0), 130: (4, 4)}
    >>> split_gpus([129, 130, 131], 8), split_gpus([129, 130], 1)
    ({129: (2, 0), 130: (2, 2), 131: (2, 4)}, {129: (1, 0), 130: None})
    """
    if len(vmids) <= 1:
        return {vmid: (0, 0) for vmid in vmids}  # (0, 0): the server as given
    per = gpu_count // len(vmids)
    if per == 0:
        return {vmid: ((1, i) if i < gpu_count else None) for i, vmid in enumerate(sorted(vmids))}
    tp = 1 << (per.bit_length() - 1)
    return {vmid: (tp, i * tp) for i, vmid in enumerate(sorted(vmids))}


def map_shares(vmids: list[int], gpu_maps: dict[int, tuple[int, ...]] | None) -> dict[int, tuple[int, int] | None]:
    """The share (tp, base GPU id) of each container whose config passes in given GPUs: the largest
    power-of-two run of them from the first (a TP size real models accept).

    >>> map_shares([129, 130, 131], {129: (0, 1), 130: (2, 3, 4), 131: ()})
    {129: (2, 0), 130: (2, 2), 131: None}
    """
    shares: dict[int, tuple[int, int] | None] = {}
    for vmid in vmids:
        if gpu_maps is None or vmid not in gpu_maps:
            continue
        gpus = sorted(gpu_maps[vmid])
        run = next((n for n in range(len(gpus), 0, -1) if gpus[:n] == list(range(gpus[0], gpus[0] + n))), 0) if gpus else 0
        shares[vmid] = (1 << (run.bit_length() - 1), gpus[0]) if run else None
    return shares


def _host_gpu_count(lab_dir: Path, host: str) -> int:
    """The lab host's GPU count (its simulated driver's config), else the lab's default."""
    try:
        return int(json.loads((host_dir(lab_dir, host) / "gpu" / "config.json").read_text())["count"])
    except (OSError, ValueError, KeyError, TypeError):
        return DEFAULT_GPUS


def _server_on(engine: str, server: dict, share: tuple[int, int] | None) -> dict:
    """The server for one container with its share of the GPUs (see split_gpus), written as its
    engine places a server on GPUs: SGLang by ``tp`` and ``base-gpu-id``; vLLM (no base GPU id) by
    its tensor-parallel size over the GPUs ``CUDA_VISIBLE_DEVICES`` shows it.

    >>> _server_on("vllm", lab_server("vllm"), (4, 4))["env"]
    {'CUDA_VISIBLE_DEVICES': '4,5,6,7'}
    """
    spec = json.loads(json.dumps(server))
    if share is None:
        spec["present"] = False  # no GPU left for a server here
    elif share != (0, 0):
        tp, base = share
        flags = {k: v for k, v in spec.get("flags", {}).items() if k not in (*TP_FLAGS[engine], "base-gpu-id")}
        if engine == "sglang":
            spec["flags"] = {"tp": tp, **({"base-gpu-id": base} if base else {}), **flags}
        else:
            spec["flags"] = {TP_FLAGS[engine][0]: tp, **flags}
            spec["env"] = {**spec.get("env", {}), "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(base, base + tp)))}
    return spec


def render_fleet_yaml(doc: dict) -> str:
    """YAML without needing PyYAML's flow style quirks: nested block mappings, flow for ssh."""
    lines = ["# written by `gpugate lab up`; the lab's fleet"]
    for name, router in (doc.get("routers") or {}).items():
        lines += ["routers:"] if len(lines) == 1 else []
        lines.append(f"  {name}: {{url: {json.dumps(router['url'])}, kind: {router['kind']}}}")
    lines.append("hosts:")
    for name, host in doc["hosts"].items():
        ssh = host["ssh"]
        lines.append(f"  {name}:")
        lines.append(
            "    ssh: {hostname: %s, port: %d, user: %s, key: %s, known_hosts_file: %s}"
            % (ssh["hostname"], ssh["port"], ssh["user"], json.dumps(ssh["key"]), json.dumps(ssh["known_hosts_file"]))
        )
        if not host["containers"]:
            lines.append("    containers: {}")
            continue
        lines.append("    containers:")
        for vmid, spec in host["containers"].items():
            (engine, sg), = spec.items()
            flags = ", ".join(f"{k}: {json.dumps(v)}" for k, v in sg["flags"].items())
            lines.append(f"      {vmid}:")
            python = f", python: {json.dumps(sg['python'])}" if sg.get("python") else ""
            python += ", present: false" if sg.get("present") is False else ""
            if sg.get("env"):
                python += ", env: {" + ", ".join(f"{k}: {json.dumps(v)}" for k, v in sg["env"].items()) + "}"
            if sg.get("router"):
                python += f", router: {sg['router']}, router_url: {json.dumps(sg['router_url'])}"
                python += ", router_cordon: true" if sg.get("router_cordon") else ""
            lines.append(f"        {engine}: {{model_path: {sg['model_path']}, port: {sg['port']}, flags: {{{flags}}}{python}}}")
    return "\n".join(lines) + "\n"


def pick_port(preferred: int | None = None) -> int:
    """A free TCP port on 127.0.0.1 (the previous one when still free, so known_hosts stays valid)."""
    if preferred:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", preferred))
                return preferred
            except OSError:
                pass
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _keygen(path: Path, comment: str) -> None:
    if not path.exists():
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
            check=True, stdin=subprocess.DEVNULL,
        )


def _wrapper(module: str, call: str, python: str = sys.executable) -> str:
    code = BOOT_CODE.format(root=PACKAGE_ROOT, module=module, call=call)
    return f"#!/bin/sh\nexec {shlex.quote(python)} -S -E -c {shlex.quote(code)} \"$@\"\n"


# ---------------------------------------------------------------- host process state


def host_init_pid(lab_dir: Path, host: str) -> int | None:
    """The host init's PID on this machine when it is alive and really ours, else None."""
    try:
        pid = int((host_dir(lab_dir, host) / "init.pid").read_text())
    except (OSError, ValueError):
        return None
    args = " ".join(nsutil.cmdline(pid))
    if "gpugate_lab.hostinit" in args and str(Path(lab_dir)) in args:
        return pid
    return None


def host_exec_argv(lab_dir: Path, host: str) -> list[str]:
    """argv prefix that runs a command inside a lab host (its pid/mount/uts/cgroup namespaces and cgroup).

    Example: subprocess.run(host_exec_argv(lab, "pve1") + ["pct", "list"])
    """
    pid = host_init_pid(lab_dir, host)
    if pid is None:
        raise LabError(f"lab host {host} is not running (gpugate lab up)")
    cg = host_cgroup_dir(lab_dir, host)
    procs = os.path.join(cg, "cgroup.procs") if cg and os.path.isdir(cg) else "/dev/null"
    script = 'echo $$ > "$1" 2>/dev/null; shift; exec nsenter "$@"'
    path = f"{host_dir(lab_dir, host) / 'bin'}:/usr/sbin:/usr/bin:/sbin:/bin"
    return ["/bin/sh", "-c", script, "gpugate-host-exec", procs, "-t", str(pid), "-p", "-m", "-u", "-C", "--",
            "env", f"PATH={path}"]


def ssh_argv(lab_dir: Path, host: str) -> list[str]:
    """An ssh command line that logs into a lab host as root (host key checked against the lab's file)."""
    hdir = host_dir(lab_dir, host)
    port = int((hdir / "port").read_text())
    return [
        "ssh", "-i", str(Path(lab_dir) / "id_ed25519"), "-p", str(port),
        "-o", f"UserKnownHostsFile={Path(lab_dir) / 'known_hosts'}", "-o", "StrictHostKeyChecking=yes",
        "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes", "-o", "LogLevel=ERROR", "root@127.0.0.1",
    ]


# ---------------------------------------------------------------- up / down / status


def _prepare_gpus(hdir: Path, gpus: int, gpu_mib: int) -> None:
    gdir = hdir / "gpu"
    wanted = (gpus, gpu_mib)
    try:
        cfg = json.loads((gdir / "config.json").read_text())
        if (cfg.get("count"), cfg.get("total_mib")) == wanted:
            return
    except (OSError, ValueError):
        pass
    try:
        from gpugate_lab import gpusim  # noqa: PLC0415 -- built in parallel; optional here
    except ImportError:
        log(f"{hdir.name}: gpugate_lab.gpusim not available; writing bare device nodes only")
        (gdir / "dev").mkdir(parents=True, exist_ok=True)
        (gdir / "alloc").mkdir(exist_ok=True)
        for name in [f"nvidia{i}" for i in range(gpus)] + ["nvidiactl", "nvidia-uvm"]:
            (gdir / "dev" / name).touch()
        return
    gpusim.setup_host(gdir, gpus, gpu_mib)


def _install_extras(cdir: Path) -> None:
    try:
        from gpugate_lab import container_files  # noqa: PLC0415 -- built in parallel; optional here
    except ImportError:
        log(f"{cdir}: gpugate_lab.container_files not available; no nvidia-smi/pynvml/sglang in the container")
        return
    container_files.install_container_extras(cdir / "usr-upper")


def real_gpu_server(binding: dict) -> dict:
    """What a real-GPU lab changes of the lab's server (lab_server): tp over every real GPU (1 on
    one H200), run by the interpreter of the torch environment (the stand-ins are installed there).

    >>> real_gpu_server({"gpus": [{"index": 0}, {"index": 1}], "torch_env": {"python": "/v/bin/python3"}})
    {'flags': {'tp': 2}, 'python': '/v/bin/python3'}
    """
    return {"flags": {"tp": max(1, len(binding.get("gpus") or []))},
            "python": (binding.get("torch_env") or {}).get("python") or "/usr/bin/python3"}


def _apply_gpu_mode(hdir: Path, binding: dict | None, vmids: list[int]) -> None:
    """Record the host's GPU mode and bring its containers' files in line with it."""
    realgpu.write_binding(hdir, binding)
    if binding and binding.get("nvidia_smi"):
        realgpu.write_host_tools(hdir, binding, "")
    standin = Path(container.__file__).resolve().parent / "standin" / "sglang"
    for vmid in vmids:
        cdir = container.ct_dir(hdir, vmid)
        if binding:
            realgpu.install_real_extras(cdir, binding, standin)
        else:
            realgpu.remove_real_extras(cdir)


def _prepare_host(lab_dir: Path, name: str, gpus: int, gpu_mib: int, vmids: list[int],
                  gpu_binding: dict | None = None, init: str | None = None,
                  gpu_maps: dict[int, tuple[int, ...]] | None = None) -> int:
    hdir = host_dir(lab_dir, name)
    (hdir / "bin").mkdir(parents=True, exist_ok=True)
    _keygen(hdir / "ssh_host_ed25519_key", f"root@{name}")
    previous = None
    try:
        previous = int((hdir / "port").read_text())
    except (OSError, ValueError):
        pass
    port = pick_port(previous)
    (hdir / "port").write_text(f"{port}\n")
    (hdir / "sshd_config").write_text(sshd_config_text(hdir, port, Path(lab_dir) / "authorized_keys"))
    pct = hdir / "bin" / "pct"
    pct.write_text(_wrapper("pct", f"sys.exit(main(sys.argv[1:], host_dir={str(hdir)!r}))"))
    pct.chmod(0o755)
    pvesh = hdir / "bin" / "pvesh"
    pvesh.write_text(_wrapper("pvesh", f"sys.exit(main(sys.argv[1:], host_dir={str(hdir)!r}))"))
    pvesh.chmod(0o755)
    smi = hdir / "bin" / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m gpugate_lab.nvidia_smi \"$@\"\n")
    smi.chmod(0o755)
    _prepare_gpus(hdir, gpus, gpu_mib)
    for vmid in vmids:
        cdir = container.create_container(hdir, vmid, gpus)
        _install_extras(cdir)
        if init:
            _set_init(hdir, vmid, init)
        if gpu_maps and vmid in gpu_maps:
            container.set_gpu_map(hdir, vmid, list(gpu_maps[vmid]))
    for vmid in container.list_vmids(hdir):
        if vmid not in vmids:
            _install_extras(container.ct_dir(hdir, vmid))
    _apply_gpu_mode(hdir, gpu_binding, container.list_vmids(hdir))
    return port


def _set_init(hdir: Path, vmid: int, init: str) -> None:
    try:
        container.set_init_flavour(hdir, vmid, init)
    except container.ContainerError as exc:
        raise LabError(str(exc)) from None


def _launch_host(lab_dir: Path, name: str) -> None:
    hdir = host_dir(lab_dir, name)
    cg = host_cgroup_dir(lab_dir, name)
    if cg:
        try:
            os.makedirs(cg, exist_ok=True)
        except OSError as exc:
            log(f"{name}: no cgroup ({exc}); containers will be tracked by pid files")
            cg = None
    code = BOOT_CODE.format(root=PACKAGE_ROOT, module="hostinit", call="main(sys.argv[1:])")
    with open(hdir / "host.log", "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-S", "-E", "-c", code, str(lab_dir), name, cg or ""],
            stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True, cwd="/",
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"},
        )
        if proc.wait(timeout=60) != 0:
            tail = (hdir / "host.log").read_text(errors="replace").strip().splitlines()[-5:]
            raise LabError(f"lab host {name} did not start: " + " | ".join(tail))


def _write_known_hosts(lab_dir: Path) -> None:
    lines = []
    for name in existing_hosts(lab_dir):
        hdir = host_dir(lab_dir, name)
        port = int((hdir / "port").read_text())
        key = " ".join((hdir / "ssh_host_ed25519_key.pub").read_text().split()[:2])
        lines.append(f"[127.0.0.1]:{port} {key}")
    (Path(lab_dir) / "known_hosts").write_text("\n".join(lines) + "\n")


def check_lab_dir(lab_dir: Path) -> None:
    resolved = str(Path(lab_dir).resolve())
    for prefix in FORBIDDEN_PREFIXES:
        if resolved == prefix or resolved.startswith(prefix + "/"):
            raise LabError(f"lab dir {resolved} lies under {prefix}, which containers overlay; choose another")


def planned_hosts(existing: list[str], hosts: int | None) -> list[str]:
    """The hosts ``lab up --hosts N`` brings up on a lab that has ``existing``: pve1..pveN. ``None``
    keeps the lab as it is (1 host for a new lab); more than it has adds hosts; fewer is refused
    with what is there (dropping hosts would delete their containers' state).

    >>> planned_hosts([], None), planned_hosts(["pve1", "pve2"], None), planned_hosts(["pve1"], 2)
    (['pve1'], ['pve1', 'pve2'], ['pve1', 'pve2'])
    """
    wanted = hosts if hosts is not None else (len(existing) or 1)
    if wanted < len(existing):
        raise LabError(
            f"this lab has {len(existing)} hosts ({_name_span(existing)}); --hosts {wanted} would leave "
            f"{_name_span(existing[wanted:])} out. Run `gpugate lab up` (no --hosts) to bring it up as it is, "
            f"or choose another --dir for a {wanted}-host lab, or `gpugate lab down` and remove the directory")
    return host_names(wanted)


def _name_span(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"


FLEET_MARK = ".fleet.yaml.written"  # sha256 of the fleet file as the lab last wrote it


def write_fleet_file(lab_dir: Path, text: str) -> str | None:
    """Write the lab's fleet file without ever overwriting a user's edits; returns a note for the
    operator, or None when there is nothing to say.

    - no ``fleet.yaml``: written (creation);
    - ``fleet.yaml`` as the lab last wrote it (nobody edited it): replaced by the new view;
    - edited since: kept as it is; the lab's view goes to ``fleet.lab.yaml`` beside it, and the
      note says so.
    """
    fleet = Path(lab_dir) / "fleet.yaml"
    beside = Path(lab_dir) / "fleet.lab.yaml"
    mark = Path(lab_dir) / FLEET_MARK
    digest = hashlib.sha256(text.encode()).hexdigest()
    try:
        current = fleet.read_text()
    except FileNotFoundError:
        current = None
    if current == text:
        mark.write_text(digest + "\n")
        beside.unlink(missing_ok=True)
        return None
    written = mark.read_text().strip() if mark.exists() else None
    if current is None or hashlib.sha256(current.encode()).hexdigest() == written:
        fleet.write_text(text)
        mark.write_text(digest + "\n")
        beside.unlink(missing_ok=True)
        return None if current is None else f"{fleet}: updated to the lab's hosts (it had no edits of yours)"
    beside.write_text(text)
    return (f"{fleet} has edits of yours and was kept as it is; the lab's view (hosts, ports) is in {beside}: "
            f"diff {fleet} {beside}")


def up(lab_dir: Path, hosts: int | None = None, gpus: int = DEFAULT_GPUS, gpu_mib: int = DEFAULT_GPU_MIB,
       vmids: tuple[int, ...] = DEFAULT_VMIDS, gpu_binding: dict | None = None, init: str | None = None,
       router: bool = False, engines: tuple[str, ...] | None = None,
       gpu_maps: dict[int, tuple[int, ...]] | None = None) -> dict:
    """Bring the lab up with ``hosts`` hosts (None: the hosts it has; see planned_hosts). Hosts that
    run are left exactly as they are, stopped ones are started, new ones made. Returns the status,
    with ``notes`` (what the operator must know: the fleet file kept, ...). ``init``: the PID 1 of
    the containers of the hosts it starts (``lab`` or ``systemd``; None: as they were). ``router``:
    a real smg on loopback in front of every container's server (gpugate_lab.router). ``engines``:
    each container's engine in turn (``LAB_SERVERS``); None: as the lab had it (``$LAB/engines``),
    else SGLang. ``gpu_maps``: vmid -> the host GPUs its config passes in (``--containers
    129:0-3,130:4-7``, as ``devN`` lines; the container sees only those device nodes, and the lab's
    fleet gives its server those GPUs); a container not named keeps every GPU."""
    if os.geteuid() != 0:
        raise LabError("the lab needs root (namespaces, mounts, sshd)")
    lab_dir = Path(lab_dir).resolve()
    check_lab_dir(lab_dir)
    names = planned_hosts(existing_hosts(lab_dir), hosts)
    lab_dir.mkdir(parents=True, exist_ok=True)
    _keygen(lab_dir / "id_ed25519", "gpugate-lab-client")
    (lab_dir / "authorized_keys").write_text((lab_dir / "id_ed25519.pub").read_text())
    to_start = [n for n in names if host_init_pid(lab_dir, n) is None]
    for name in names:
        if name not in to_start and (realgpu.read_binding(host_dir(lab_dir, name)) is None) != (gpu_binding is None):
            running = "real" if gpu_binding is None else "simulated"
            raise LabError(f"lab host {name} runs with {running} GPUs; `gpugate lab down` first to change the GPU mode")
    if gpu_binding:  # the simulated ledger mirrors the real GPUs' count and size (lab status, add_container)
        gpus = max(1, len(gpu_binding.get("gpus") or [])) if gpu_binding.get("gpus") else gpus
        gpu_mib = int(gpu_binding["gpus"][0]["total_mib"]) if gpu_binding.get("gpus") else gpu_mib
    for name in to_start:
        _prepare_host(lab_dir, name, gpus, gpu_mib, list(vmids), gpu_binding, init, gpu_maps)
    _write_known_hosts(lab_dir)
    if to_start:
        with ThreadPoolExecutor(max_workers=min(16, len(to_start))) as pool:
            for future in [pool.submit(_launch_host, lab_dir, n) for n in to_start]:
                future.result()
    engines = lab_engines(lab_dir, engines)
    state = status(lab_dir)
    vmid_map = {h["name"]: [c["vmid"] for c in h["containers"]] for h in state["hosts"]}
    router_state = None
    if router:
        from gpugate_lab import router as lab_router  # noqa: PLC0415 -- only --router needs smg

        router_state = lab_router.start(lab_dir, [(name, vmid, int(LAB_SERVERS[engine]["port"]))
                                                  for name, ids in vmid_map.items()
                                                  for vmid, engine in engines_of(ids, engines).items()], pick_port)
        state["router"] = {"url": router_state["url"], "ports": router_state["ports"]}
    doc = fleet_document(lab_dir, [(h["name"], h["port"]) for h in state["hosts"]], vmid_map,
                         real_gpu_server(gpu_binding) if gpu_binding else None, router_state, engines,
                         gpu_maps)
    note = write_fleet_file(lab_dir, render_fleet_yaml(doc))
    (lab_dir / "lab.json").write_text(json.dumps(state, indent=2) + "\n")
    state["notes"] = [note] if note else []
    return state


def lab_engines(lab_dir: Path, engines: tuple[str, ...] | None) -> tuple[str, ...]:
    """The lab's engines: ``engines`` (then kept in ``$LAB/engines`` for the next ``lab up``), else
    what was kept, else SGLang. An engine the lab has no server for is a LabError naming the ones it has."""
    marker = Path(lab_dir) / "engines"
    if engines is None:
        try:
            engines = tuple(marker.read_text().split())
        except OSError:
            engines = ("sglang",)
    unknown = [name for name in engines if name not in LAB_SERVERS]
    if unknown or not engines:
        raise LabError(f"--engine {','.join(engines)}: the lab has servers of {', '.join(LAB_SERVERS)} "
                       f"(comma-separated, one per container in turn)")
    marker.write_text(" ".join(engines) + "\n")
    return engines


def _rmdir_cgroup_tree(path: str, timeout_s: float = 5.0) -> None:
    if not os.path.isdir(path):
        return
    deadline = time.monotonic() + timeout_s
    for root, dirs, _files in sorted(os.walk(path), key=lambda t: -t[0].count("/")):
        del dirs
        while True:
            try:
                os.rmdir(root)
                break
            except OSError:
                if time.monotonic() > deadline:
                    log(f"could not remove cgroup {root} (processes left?)")
                    break
                time.sleep(0.01)


def _ended(pid: int) -> bool:
    """The host init ``pid`` is gone or a zombie. A PID namespace's init turns zombie only once the
    kernel has ended and reaped every other process of its namespace: the host is down then. Its own
    reaping is up to this machine's PID 1, which may take a second (a sandbox's PID 1 that reaps
    once a second held every `lab down` that long, about a second of every lab module's teardown)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            state = handle.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in (b"Z", b"X")


def down(lab_dir: Path) -> list[str]:
    """Kill every lab host (its PID namespace takes sshd, driver and containers along). Returns names stopped.

    State (keys, ports, container dirs, the fleet file with any edits) stays, so `lab up` brings back
    the same hosts and host keys.
    """
    lab_dir = Path(lab_dir).resolve()
    from gpugate_lab import router as lab_router  # noqa: PLC0415

    lab_router.stop(lab_dir)
    stopped = []
    pids = {}
    for name in existing_hosts(lab_dir):
        pid = host_init_pid(lab_dir, name)
        if pid:
            os.kill(pid, signal.SIGKILL)
            pids[name] = pid
    deadline = time.monotonic() + 10
    for name, pid in pids.items():
        while not _ended(pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        stopped.append(name)
    for name in existing_hosts(lab_dir):
        (host_dir(lab_dir, name) / "init.pid").unlink(missing_ok=True)
    cg = lab_cgroup_dir(lab_dir)
    if cg:
        _rmdir_cgroup_tree(cg)
    (lab_dir / "lab.json").unlink(missing_ok=True)
    return stopped


def gpu_usage(gdir: Path) -> list[dict]:
    """Per-GPU used MiB (v2 semantics, reserved excluded) read from the driver's ledger."""
    try:
        cfg = json.loads((gdir / "config.json").read_text())
    except (OSError, ValueError):
        return []
    used = [0] * int(cfg.get("count", 0))
    alloc_dir = gdir / "alloc"
    if alloc_dir.is_dir():
        for path in alloc_dir.glob("*.json"):
            try:
                alloc = json.loads(path.read_text())
                used[int(alloc["gpu"])] += int(alloc["mib"])
            except (OSError, ValueError, KeyError, IndexError, TypeError):
                continue
    total = int(cfg.get("total_mib", 0))
    return [{"index": i, "used_mib": u, "total_mib": total} for i, u in enumerate(used)]


def host_status(lab_dir: Path, name: str) -> HostInfo:
    hdir = host_dir(lab_dir, name)
    try:
        port = int((hdir / "port").read_text())
    except (OSError, ValueError):
        port = 0
    pid = host_init_pid(lab_dir, name)
    info = HostInfo(
        name=name, hostname="127.0.0.1", port=port, user="root",
        key=str(Path(lab_dir) / "id_ed25519"), known_hosts=str(Path(lab_dir) / "known_hosts"),
        running=pid is not None, init_pid=pid,
    )
    cg = host_cgroup_dir(lab_dir, name)
    cg_on = (hdir / "cgroup_mode").exists() and (hdir / "cgroup_mode").read_text().strip() == "on"
    for vmid in container.list_vmids(hdir):
        if not pid:
            state = "stopped"
        elif cg_on and cg:
            state = "running" if container.find_init(hdir, vmid, cg) else "stopped"
        else:
            state = "unknown"
        info.containers.append({"vmid": vmid, "status": state, "name": container.container_hostname(hdir, vmid),
                                "init": container.init_flavour(hdir, vmid)})
    binding = realgpu.read_binding(hdir)
    info.gpu_mode = "real" if binding else "simulated"
    if binding and binding.get("nvidia_smi"):
        info.gpus = realgpu.gpu_usage(binding) if pid else []
    else:
        info.gpus = gpu_usage(hdir / "gpu") if pid else []  # a host that is down has no GPU memory in use
    return info


def status(lab_dir: Path) -> dict:
    """What `gpugate lab status --json` prints."""
    lab_dir = Path(lab_dir).resolve()
    return {
        "dir": str(lab_dir),
        "fleet": str(lab_dir / "fleet.yaml"),
        "known_hosts": str(lab_dir / "known_hosts"),
        "key": str(lab_dir / "id_ed25519"),
        "hosts": [asdict(host_status(lab_dir, n)) for n in existing_hosts(lab_dir)],
    }


def format_status(state: dict) -> str:
    """Human-readable `gpugate lab status`."""
    if not state["hosts"]:
        return f"no lab in {state['dir']} (gpugate lab up)\n"
    out = [f"lab {state['dir']}  fleet: {state['fleet']}"]
    for host in state["hosts"]:
        mark = "up" if host["running"] else "down"
        out.append(f"{host['name']}: {mark}  ssh root@{host['hostname']} -p {host['port']} -i {host['key']}")
        for ct in host["containers"]:
            init = ", PID 1 systemd" if ct.get("init") == "systemd" else ""
            out.append(f"  ct {ct['vmid']} ({ct['name']}): {ct['status']}{init}")
        if host["gpus"] and host["running"]:  # a down host's ledger is history, not GPU memory in use
            used = " ".join(f"{g['index']}:{g['used_mib']}" for g in host["gpus"])
            out.append(f"  gpu used MiB (of {host['gpus'][0]['total_mib']}): {used}")
    return "\n".join(out) + "\n"


def add_container(lab_dir: Path, host: str, vmid: int, start: bool = True, init: str | None = None,
                  gpus: tuple[int, ...] | None = None, gpu_style: str = "dev") -> None:
    """Create container <vmid> on a running lab host (like `pct create`), and start it unless start=False.
    ``init="systemd"``: Debian's systemd is its PID 1 (container.set_init_flavour). ``gpus``: the host
    GPUs its config passes in (``gpu_style`` ``dev``: devN lines, ``raw``: lxc.mount.entry lines);
    None: every GPU.

    Example: add_container(Path("/tmp/gpugate-lab"), "pve1", 130)
    """
    lab_dir = Path(lab_dir).resolve()
    hdir = host_dir(lab_dir, host)
    try:
        count = int(json.loads((hdir / "gpu" / "config.json").read_text())["count"])
    except (OSError, ValueError, KeyError):
        count = DEFAULT_GPUS
    cdir = container.create_container(hdir, vmid, count)
    _install_extras(cdir)
    if init:
        _set_init(hdir, vmid, init)
    if gpus is not None:
        container.set_gpu_map(hdir, vmid, list(gpus), gpu_style)
    binding = realgpu.read_binding(hdir)
    if binding:
        _apply_gpu_mode(hdir, binding, [vmid])
    if start:
        result = subprocess.run(host_exec_argv(lab_dir, host) + ["pct", "start", str(vmid)],
                                capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if result.returncode != 0:
            raise LabError(f"pct start {vmid} on {host} failed: {result.stderr.strip()}")
