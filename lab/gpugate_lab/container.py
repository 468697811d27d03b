"""Lab containers: real PID/mount/UTS/net/IPC/cgroup namespaces nested in a lab host (stdlib only).

A container lives in ``$LAB/hosts/<host>/ct/<vmid>/``: ``config`` (pct config text), ``init.pid`` (the
init's PID in the lab host's PID namespace), persistent upper dirs for the /etc, /root, /var and /usr
overlays, and its own /opt, /home, /srv. Its PID 1 is a small reaping init whose cmdline starts with
``/sbin/init``; its cgroup is ``<host cgroup>/lxc/<vmid>`` as on Proxmox.

Everything here runs inside a lab host (from ``pct`` or the host init), except the read-only helpers
used by ``gpugate lab status``.

Example (on a lab host):
    >>> start_container(Path("/tmp/gpugate-lab/hosts/pve1"), 129)   # doctest: +SKIP
    4242
"""

from __future__ import annotations

import os
import sys
import time

from gpugate_lab import nsutil

# The lab's `pct exec`, run for every remote command of every tool, imports this module: what exec and
# list need (find_init, host_cgroup_base_inside, list_vmids, container_hostname) is plain os.path, and
# pathlib, json, signal and gpugate_lab.realgpu (shutil, subprocess, glob, typing) are imported by the
# functions that use them (~20 ms of CPU a command). ct_dir and gpu_dir still return a Path.

CONTAINER_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
OVERLAID = ("etc", "var", "usr")
# /root is the container's own (seeded from /etc/skel): the machine's root dotfiles (pyenv, ...)
# have no place in a container, and a real CT's /root is its own.
OWN_DIRS = ("opt", "home", "srv")
DEV_FROM_HOST = ("null", "zero", "full", "random", "urandom", "tty")
LAB_MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
    "_gpugate_lab": "stand-in model directory; no weights",
}
# A model of another architecture (Qwen2.5-7B's shapes): its weights do not fit the lab model's
# parameters, so SGLang cannot load it in place (a live weight update) and the server restarts.
LAB_MODEL_OTHER_ARCH_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
    "torch_dtype": "bfloat16",
    "_gpugate_lab": "stand-in model directory of another architecture; no weights",
}
# PEFT's adapter_config.json (LoraConfig.save_pretrained) of the lab's two adapters of lab-model: a
# small one on the attention projections and a larger one on every linear layer
LAB_LORA = {
    "lab-lora-a": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
    "lab-lora-b": {"r": 16, "lora_alpha": 32,
                   "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]},
}


def safetensors_placeholder(note: str) -> bytes:
    """A valid safetensors file holding no tensor (its header's metadata says what it stands for): a
    model directory with weights, as SGLang's loader looks for them (``*.safetensors``).

    >>> blob = safetensors_placeholder("x")
    >>> import json, struct; json.loads(blob[8:8 + struct.unpack("<Q", blob[:8])[0]])
    {'__metadata__': {'format': 'pt', '_gpugate_lab': 'x'}}
    """
    import json
    import struct

    header = json.dumps({"__metadata__": {"format": "pt", "_gpugate_lab": note}}).encode()
    header += b" " * (-len(header) % 8)  # the format pads the header to 8 bytes
    return struct.pack("<Q", len(header)) + header


def peft_adapter_config(base: str, r: int, lora_alpha: int, target_modules: list) -> dict:
    """adapter_config.json as PEFT 0.13 writes it for a causal LM's LoRA."""
    return {"alpha_pattern": {}, "auto_mapping": None, "base_model_name_or_path": base, "bias": "none",
            "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
            "layer_replication": None, "layers_pattern": None, "layers_to_transform": None,
            "loftq_config": {}, "lora_alpha": lora_alpha, "lora_dropout": 0.05, "megatron_config": None,
            "megatron_core": "megatron.core", "modules_to_save": None, "peft_type": "LORA", "r": r,
            "rank_pattern": {}, "revision": None, "target_modules": target_modules, "task_type": "CAUSAL_LM",
            "use_dora": False, "use_rslora": False}


def write_lab_models(models: Path) -> None:
    """The lab's model files under ``models`` (the container's /opt/models), those missing only:
    ``lab-model`` and a second checkpoint of it, ``lab-model-v2`` (same config.json); ``lab-model-qwen2``,
    another architecture; the adapters ``lab-lora-a`` and ``lab-lora-b`` of lab-model. Weights are
    placeholder files, the stand-ins read the JSON only."""
    import json

    def put(path: Path, data: bytes) -> None:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)

    def as_json(doc: dict) -> bytes:
        return (json.dumps(doc, indent=2) + "\n").encode()

    v2 = dict(LAB_MODEL_CONFIG, _gpugate_lab="stand-in model directory, a second checkpoint of lab-model; no weights")
    for name, config in (("lab-model", LAB_MODEL_CONFIG), ("lab-model-v2", v2),
                         ("lab-model-qwen2", LAB_MODEL_OTHER_ARCH_CONFIG)):
        put(models / name / "config.json", as_json(config))
        put(models / name / "model.safetensors", safetensors_placeholder(f"weights of {name}"))
    for name, lora in LAB_LORA.items():
        put(models / name / "adapter_config.json",
            as_json(peft_adapter_config("/opt/models/lab-model", lora["r"], lora["lora_alpha"], lora["target_modules"])))
        put(models / name / "adapter_model.safetensors", safetensors_placeholder(f"LoRA weights of {name}"))

# The container's PID 1 (lab/gpugate_lab/ctinit.py, self-contained) is exec'd with argv[0] "/sbin/init".
INIT_SCRIPT = os.path.join(os.path.dirname(os.path.realpath(__file__)), "ctinit.py")
INIT_IN_CT = "/run/lxc-init.py"  # where the container sees it (the package may be hidden by its mounts)


class ContainerError(Exception):
    """A pct-level failure; str() is the message pct prints."""


def ct_dir(host_dir: Path, vmid: int) -> Path:
    from pathlib import Path

    return Path(host_dir) / "ct" / str(vmid)


def _ct_path(host_dir: Path | str, vmid: int, *parts: str) -> str:
    """ct_dir(host_dir, vmid) / parts... as a string, without pathlib."""
    return os.path.join(os.fspath(host_dir), "ct", str(vmid), *parts)


def _read_text(path: str) -> str:
    with open(path) as handle:
        return handle.read()


def host_name(host_dir: Path) -> str:
    return os.path.basename(os.path.normpath(os.fspath(host_dir)))


def gpu_dir(host_dir: Path) -> Path:
    from pathlib import Path

    return Path(host_dir) / "gpu"


def default_config(vmid: int, gpu_count: int) -> str:
    """The pct config text of a lab container (Proxmox's file format, GPU passthrough entries included)."""
    lines = [
        "arch: amd64",
        "cores: 32",
        "features: nesting=1",
        f"hostname: ct{vmid}",
        "memory: 262144",
        f"net0: name=eth0,bridge=vmbr0,hwaddr=BC:24:11:00:{vmid // 256 % 256:02X}:{vmid % 256:02X},ip=dhcp,type=veth",
        "onboot: 1",
        "ostype: debian",
        f"rootfs: local-lvm:vm-{vmid}-disk-0,size=500G",
        "swap: 0",
        "lxc.cgroup2.devices.allow: c 195:* rwm",
        "lxc.cgroup2.devices.allow: c 509:* rwm",
    ]
    for name in [f"nvidia{i}" for i in range(gpu_count)] + ["nvidiactl", "nvidia-uvm"]:
        lines.append(f"lxc.mount.entry: /dev/{name} dev/{name} none bind,optional,create=file")
    return "\n".join(lines) + "\n"


GPU_MAJOR_LINES = ("lxc.cgroup2.devices.allow: c 195:* rwm", "lxc.cgroup2.devices.allow: c 509:* rwm")


def gpu_config_lines(gpus: list[int], style: str = "dev") -> list[str]:
    """The config lines that pass GPUs ``gpus`` (and nvidiactl, nvidia-uvm) into a container, as an
    operator writes them: ``dev`` -- ``devN: /dev/nvidiaK`` (PVE 8.1+, pve-container
    src/PVE/LXC/Config.pm ``dev[n]``); ``raw`` -- ``lxc.cgroup2.devices.allow`` for the majors and one
    ``lxc.mount.entry`` bind per node (the older, still common setup).

    >>> gpu_config_lines([2, 3])
    ['dev0: /dev/nvidia2', 'dev1: /dev/nvidia3', 'dev2: /dev/nvidiactl', 'dev3: /dev/nvidia-uvm']
    >>> gpu_config_lines([1], "raw")[-1]
    'lxc.mount.entry: /dev/nvidia-uvm dev/nvidia-uvm none bind,optional,create=file'
    """
    nodes = [f"nvidia{i}" for i in gpus] + ["nvidiactl", "nvidia-uvm"]
    if style == "dev":
        return [f"dev{n}: /dev/{name}" for n, name in enumerate(nodes)]
    return list(GPU_MAJOR_LINES) + [f"lxc.mount.entry: /dev/{name} dev/{name} none bind,optional,create=file"
                                    for name in nodes]


def _is_gpu_line(line: str) -> bool:
    key, _, value = line.partition(":")
    value = value.strip()
    if key.startswith("dev") and key[3:].isdigit():
        return value.partition(",")[0].removeprefix("path=").startswith("/dev/nvidia")
    if key == "lxc.mount.entry":
        return value.startswith("/dev/nvidia")
    return line.strip() in GPU_MAJOR_LINES


def with_gpu_map(text: str, gpus: list[int], style: str = "dev") -> str:
    """Config text with its GPU lines replaced by those passing ``gpus`` (gpu_config_lines): plain
    ``devN`` keys before the raw ``lxc.*`` lines, as Proxmox writes the file. Other lines and
    snapshot sections are kept.

    >>> print(with_gpu_map("hostname: ct130\\nlxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind\\n", [4]), end="")
    hostname: ct130
    dev0: /dev/nvidia4
    dev1: /dev/nvidiactl
    dev2: /dev/nvidia-uvm
    """
    head, sep, snapshots = text.partition("\n[")
    kept = [line for line in head.splitlines() if line.strip() and not _is_gpu_line(line)]
    plain = [line for line in kept if not line.startswith("lxc.")]
    raw = [line for line in kept if line.startswith("lxc.")]
    added = gpu_config_lines(gpus, style)
    lines = plain + [x for x in added if not x.startswith("lxc.")] + raw + [x for x in added if x.startswith("lxc.")]
    return "\n".join(lines) + "\n" + (sep.lstrip("\n") + snapshots if sep else "")


def set_gpu_map(host_dir: Path, vmid: int, gpus: list[int], style: str = "dev") -> None:
    """Pass exactly GPUs ``gpus`` into container ``vmid`` (its config; like ``pct set --devN``, it
    takes effect at the container's next start: the lab binds only the nodes its config passes)."""
    path = _ct_path(host_dir, vmid, "config")
    text = _read_text(path)
    with open(path, "w") as handle:
        handle.write(with_gpu_map(text, gpus, style))


def passed_device_nodes(text: str) -> set[str]:
    """The /dev/nvidia* nodes (names under /dev) a container config passes in, by ``devN`` paths and
    ``lxc.mount.entry`` binds: what LXC makes of the config at start.

    >>> sorted(passed_device_nodes("dev0: /dev/nvidia2,mode=0666\\nlxc.mount.entry: /dev/nvidiactl dev/nvidiactl none bind"))
    ['nvidia2', 'nvidiactl']
    """
    plain, raw = parse_config(text)
    paths = [value.partition(",")[0].removeprefix("path=") for key, value in plain.items()
             if key.startswith("dev") and key[3:].isdigit()]
    paths += [value.split()[0] for key, value in raw if key == "lxc.mount.entry" and value.split()]
    return {path[len("/dev/"):] for path in paths if path.startswith("/dev/nvidia")}


def parse_config(text: str) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """Split pct config text into (plain keys, raw lxc.* entries in order); snapshots ignored."""
    plain: dict[str, str] = {}
    raw: list[tuple[str, str]] = []
    for line in text.splitlines():
        if line.startswith("["):
            break  # snapshot sections
        if not line.strip() or line.startswith("#") or ":" not in line:
            continue
        key, _, value = line.partition(":")
        value = value.strip()
        if key.startswith("lxc."):
            raw.append((key, value))
        else:
            plain[key] = value
    return plain, raw


def format_config(text: str) -> str:
    """What `pct config` prints: sorted keys (digest omitted), raw lxc.* lines last."""
    plain, raw = parse_config(text)
    out = [f"{key}: {plain[key]}" for key in sorted(plain) if key != "digest"]
    out += [f"{key}: {value}" for key, value in raw]
    return "\n".join(out) + ("\n" if out else "")


def create_container(host_dir: Path, vmid: int, gpu_count: int = 8) -> Path:
    """Create the container's directory (config, persistent dirs, lab models); idempotent."""
    from pathlib import Path

    cdir = ct_dir(host_dir, vmid)
    for name in OVERLAID:
        (cdir / f"{name}-upper").mkdir(parents=True, exist_ok=True)
        (cdir / f"{name}-work").mkdir(parents=True, exist_ok=True)
    for name in OWN_DIRS:
        (cdir / name).mkdir(parents=True, exist_ok=True)
    root_home = cdir / "root-upper"
    if not root_home.exists():
        root_home.mkdir(mode=0o700)
        for dotfile in (".bashrc", ".profile"):
            skel = Path("/etc/skel") / dotfile
            if skel.exists():
                (root_home / dotfile).write_bytes(skel.read_bytes())
    (cdir / "labctl").mkdir(exist_ok=True)
    write_lab_models(cdir / "opt" / "models")
    config = cdir / "config"
    if not config.exists():
        config.write_text(default_config(vmid, gpu_count))
    return cdir


SYSTEMD = "/lib/systemd/systemd"
INIT_FLAVOURS = ("lab", "systemd")


def set_init_flavour(host_dir: Path, vmid: int, flavour: str) -> None:
    """``lab`` (the default: a small reaping init) or ``systemd`` (Debian's systemd as PID 1, as in a
    Proxmox container of a systemd distribution; needs the systemd package on this machine). Takes
    effect at the container's next start."""
    if flavour not in INIT_FLAVOURS:
        raise ContainerError(f"unknown init flavour {flavour!r}; one of {', '.join(INIT_FLAVOURS)}")
    if flavour == "systemd" and not os.path.exists(SYSTEMD):
        raise ContainerError(f"no {SYSTEMD} on this machine (apt-get install systemd)")
    (ct_dir(host_dir, vmid) / "init").write_text(flavour + "\n")


def init_flavour(host_dir: Path, vmid: int) -> str:
    try:
        flavour = (ct_dir(host_dir, vmid) / "init").read_text().strip()
    except OSError:
        return "lab"
    return flavour if flavour in INIT_FLAVOURS else "lab"


def _exec_systemd() -> None:
    """PID 1 becomes systemd: cgroup2 at /sys/fs/cgroup (this container's cgroup namespace, the only
    layout systemd runs in here: the machine's v1 hierarchies are hidden), ``container=lxc`` as LXC
    sets it, the basic target (journald, no getty, none of the machine's services)."""
    try:
        nsutil.mount("cgroup2", "/sys/fs/cgroup", "cgroup2", nsutil.MS_NOSUID | nsutil.MS_NODEV | nsutil.MS_NOEXEC)
    except OSError as exc:
        raise ContainerError(f"systemd needs cgroup2 at /sys/fs/cgroup: {exc}") from None
    env = {"container": "lxc", "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           "LANG": "C.UTF-8"}
    os.execve(SYSTEMD, ["/sbin/init", "--unit=basic.target", "--log-target=console", "--log-level=warning"], env)


def container_hostname(host_dir: Path, vmid: int) -> str:
    try:
        plain, _ = parse_config(_read_text(_ct_path(host_dir, vmid, "config")))
    except OSError:
        plain = {}
    return plain.get("hostname", f"ct{vmid}")


def list_vmids(host_dir: Path) -> list[int]:
    base = os.path.join(os.fspath(host_dir), "ct")
    if not os.path.isdir(base):
        return []
    return sorted(int(name) for name in os.listdir(base)
                  if name.isdigit() and os.path.exists(os.path.join(base, name, "config")))


def _init_from_cgroup(cgroup_dir: str) -> int | None:
    # The container's own cgroup first; then its subtree: systemd as PID 1 moves itself into init.scope.
    for directory in [cgroup_dir] + [root for root, _dirs, _files in os.walk(cgroup_dir)][1:]:
        try:
            with open(os.path.join(directory, "cgroup.procs")) as handle:
                pids = [int(x) for x in handle.read().split()]
        except OSError:
            if directory == cgroup_dir:
                return None
            continue
        for pid in pids:
            chain = nsutil.nspid_chain(pid)
            if len(chain) > 1 and chain[-1] == 1:
                return pid
    return None


def find_init(host_dir: Path, vmid: int, cgroup_base: str | None) -> int | None:
    """PID (in the caller's PID namespace) of the container's init, or None when it is stopped.

    cgroup_base is the lab host's cgroup directory as the caller sees it; the cgroup is the source of
    truth (it works from the host and from the real machine). Without cgroups, init.pid is used.
    """
    if cgroup_base:
        return _init_from_cgroup(os.path.join(cgroup_base, "lxc", str(vmid)))
    try:
        pid = int(_read_text(_ct_path(host_dir, vmid, "init.pid")))
    except (OSError, ValueError):
        return None
    args = nsutil.cmdline(pid)
    return pid if args and args[0] == "/sbin/init" else None


def host_cgroup_base_inside(host_dir: Path) -> str | None:
    """Inside a lab host the cgroup2 hierarchy is remounted with the host's cgroup as its root.

    The host init writes ``cgroup_mode`` ("on"/"off"); "off" means the machine gave the lab no
    writable cgroup v2 and containers are found through init.pid instead.
    """
    try:
        mode = _read_text(os.path.join(os.fspath(host_dir), "cgroup_mode")).strip()
    except OSError:
        mode = "off"
    return nsutil.cgroup2_mount() if mode == "on" else None


def _setup_container_fs(host_dir: Path, vmid: int) -> None:
    """Runs as the container's PID 1 before exec: mounts, hostname, loopback."""
    import socket  # noqa: F401 -- nsutil.loopback_up, called after the mounts below have hidden the stdlib
    from pathlib import Path

    from gpugate_lab import realgpu  # now: the mounts below may hide the package (and the stdlib it needs)

    cdir = ct_dir(host_dir, vmid)
    gdir = gpu_dir(host_dir)
    init_code = Path(INIT_SCRIPT).read_bytes()  # read now: the mounts below may hide the package
    passed = passed_device_nodes((cdir / "config").read_text())  # the GPUs its config passes in
    real_gpus = realgpu.read_binding(host_dir)  # `lab up --gpus real`: the machine's GPUs, not the sim's
    nsutil.make_private("/")
    staged = realgpu.stage_sources(real_gpus, cdir, nsutil.bind) if real_gpus else {}
    try:
        nsutil.umount("/usr/sbin")  # the host's own /usr/sbin overlay (its pct) is not the container's
    except OSError:
        pass
    for name in OVERLAID:
        nsutil.mount(
            "overlay",
            f"/{name}",
            "overlay",
            0,
            f"lowerdir=/{name},upperdir={cdir}/{name}-upper,workdir={cdir}/{name}-work",
        )
    for name in OWN_DIRS:
        os.makedirs(f"/{name}", exist_ok=True)
        nsutil.bind(str(cdir / name), f"/{name}")
    nsutil.bind(str(cdir / "root-upper"), "/root")
    nsutil.mount("tmpfs", "/run", "tmpfs", nsutil.MS_NOSUID | nsutil.MS_NODEV, "mode=755")
    Path(INIT_IN_CT).write_bytes(init_code)
    for sub in ("gpugate-sim", "gpugate-lab", "lock", "user"):
        os.makedirs(f"/run/{sub}", exist_ok=True)
    if gdir.is_dir():
        nsutil.bind(str(gdir), "/run/gpugate-sim")
    nsutil.bind(str(cdir / "labctl"), "/run/gpugate-lab", readonly=True)
    # /dev: a fresh tmpfs, prepared under /run while the machine's /dev is still visible (its basic
    # nodes are bound, since mknod may be refused), then moved over /dev.
    staging = "/run/.gpugate-dev"
    os.makedirs(staging)
    nsutil.mount("tmpfs", staging, "tmpfs", nsutil.MS_NOSUID, "mode=755")
    for name in DEV_FROM_HOST:
        open(f"{staging}/{name}", "w").close()
        nsutil.bind(f"/dev/{name}", f"{staging}/{name}")
    sim_dev = "/run/gpugate-sim/dev"
    if real_gpus:
        realgpu.bind_devices(real_gpus, staging, nsutil.bind)
    elif os.path.isdir(sim_dev):
        for entry in sorted(os.listdir(sim_dev)):
            if entry.startswith("nvidia") and entry[6:].isdigit() and entry not in passed:
                continue  # a GPU its config does not pass in: no device node, as LXC leaves it
            src = os.path.join(sim_dev, entry)
            if os.path.isdir(src):
                os.makedirs(f"{staging}/{entry}", exist_ok=True)
            else:
                open(f"{staging}/{entry}", "w").close()
            nsutil.bind(src, f"{staging}/{entry}")
    nsutil.mount(staging, "/dev", None, nsutil.MS_MOVE)
    os.rmdir(staging)
    os.makedirs("/dev/pts", exist_ok=True)
    os.makedirs("/dev/shm", exist_ok=True)
    nsutil.mount("devpts", "/dev/pts", "devpts", nsutil.MS_NOSUID | nsutil.MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620")
    os.symlink("pts/ptmx", "/dev/ptmx")
    nsutil.mount("tmpfs", "/dev/shm", "tmpfs", nsutil.MS_NOSUID | nsutil.MS_NODEV, "mode=1777")
    for link, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"/dev/{link}")
    nsutil.mount("proc", "/proc", "proc", nsutil.MS_NOSUID | nsutil.MS_NODEV | nsutil.MS_NOEXEC)
    cg_mount = nsutil.cgroup2_mount()
    if cg_mount:
        try:
            nsutil.umount(cg_mount)
            nsutil.mount("cgroup2", cg_mount, "cgroup2", nsutil.MS_NOSUID | nsutil.MS_NODEV | nsutil.MS_NOEXEC)
        except OSError:
            pass  # the container then sees the host's cgroup tree; only cosmetic
    if real_gpus:  # after the overlays (placeholders land in their upper dirs), before /tmp hides cdir
        realgpu.bind_driver(real_gpus, cdir, nsutil.bind, nsutil.mount,
                            log=lambda msg: sys.stderr.write(msg + "\n"), staged=staged)
    # /tmp last: the lab's state dir may live under /tmp and every source above comes from it.
    nsutil.mount("tmpfs", "/tmp", "tmpfs", nsutil.MS_NOSUID | nsutil.MS_NODEV, "mode=1777")
    # Everything not overlaid or mounted above is the machine's: keep the container from writing it.
    try:
        nsutil.mount("none", "/", None, nsutil.MS_BIND | nsutil.MS_REMOUNT | nsutil.MS_RDONLY)
    except OSError:
        pass
    nsutil.sethostname(container_hostname(host_dir, vmid))
    nsutil.loopback_up()
    os.chdir("/")


def start_container(host_dir: Path, vmid: int, cgroup_base: str | None) -> int:
    """Start the container (like `pct start`): returns its init's PID in the caller's namespace.

    Raises ContainerError("CT <vmid> already running") when it runs already.
    """
    import signal

    if find_init(host_dir, vmid, cgroup_base):
        raise ContainerError(f"CT {vmid} already running")
    cgroup_dir = None
    if cgroup_base:
        cgroup_dir = os.path.join(cgroup_base, "lxc", str(vmid))
        os.makedirs(cgroup_dir, exist_ok=True)
    read_fd, write_fd = os.pipe()
    child = os.fork()
    if child == 0:  # intermediate: enters the cgroup, unshares, forks the init, reports its pid
        code = 1
        try:
            os.close(read_fd)
            devnull = os.open("/dev/null", os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            os.setsid()
            if cgroup_dir:
                nsutil.join_cgroup(cgroup_dir)
            nsutil.unshare(
                nsutil.CLONE_NEWNS | nsutil.CLONE_NEWUTS | nsutil.CLONE_NEWIPC | nsutil.CLONE_NEWNET
                | nsutil.CLONE_NEWPID | nsutil.CLONE_NEWCGROUP
            )
            init = os.fork()
            if init == 0:
                try:
                    flavour = init_flavour(host_dir, vmid)
                    if flavour == "systemd":  # its console: opened now, the lab dir is hidden below
                        console = os.open(str(ct_dir(host_dir, vmid) / "console.log"),
                                          os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                    _setup_container_fs(host_dir, vmid)
                    os.write(write_fd, b"ok\n")
                    if flavour == "systemd":
                        os.dup2(console, 1)
                        os.dup2(console, 2)
                        _exec_systemd()
                    timeout = _shutdown_timeout(host_dir, vmid)
                    os.execv(CONTAINER_PYTHON, ["/sbin/init", "-S", "-E", INIT_IN_CT, str(timeout)])
                except BaseException as exc:  # report any failure to pct start
                    os.write(write_fd, f"error {exc}\n".encode())
                    os._exit(1)
            os.write(write_fd, f"pid {init}\n".encode())
            code = 0
        except BaseException as exc:
            os.write(write_fd, f"error {exc}\n".encode())
        finally:
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as reader:
        buf = reader.read()
    os.waitpid(child, 0)
    pid = None
    errors = []
    for line in buf.decode(errors="replace").splitlines():
        if line.startswith("pid "):
            pid = int(line[4:])
        elif line.startswith("error "):
            errors.append(line[6:])
    if errors or pid is None or b"ok" not in buf:
        if pid:
            _kill(pid, signal.SIGKILL)
        raise ContainerError(f"startup for container '{vmid}' failed: {'; '.join(errors) or 'no init'}")
    (ct_dir(host_dir, vmid) / "init.pid").write_text(f"{pid}\n")
    return pid


def _shutdown_timeout(host_dir: Path, vmid: int) -> int:
    return 60


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _wait_gone(host_dir: Path, vmid: int, cgroup_base: str | None, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not find_init(host_dir, vmid, cgroup_base):
            return True
        time.sleep(0.01)
    return not find_init(host_dir, vmid, cgroup_base)


def stop_container(host_dir: Path, vmid: int, cgroup_base: str | None) -> None:
    """Hard stop (like `pct stop`): SIGKILL the init, which takes the whole PID namespace with it."""
    import signal

    pid = find_init(host_dir, vmid, cgroup_base)
    if not pid:
        raise ContainerError(f"CT {vmid} not running")
    _kill(pid, signal.SIGKILL)
    if not _wait_gone(host_dir, vmid, cgroup_base, 10):
        raise ContainerError("container did not stop")


def shutdown_container(host_dir: Path, vmid: int, cgroup_base: str | None, timeout_s: float = 60, force: bool = False) -> None:
    """Clean shutdown (like `pct shutdown`): SIGPWR to init, which SIGTERMs every process and waits."""
    import signal

    pid = find_init(host_dir, vmid, cgroup_base)
    if not pid:
        raise ContainerError(f"CT {vmid} not running")
    _kill(pid, signal.SIGPWR)
    if _wait_gone(host_dir, vmid, cgroup_base, timeout_s):
        return
    if force:
        _kill(pid, signal.SIGKILL)
        if _wait_gone(host_dir, vmid, cgroup_base, 10):
            return
    raise ContainerError("container did not stop")
