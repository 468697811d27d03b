"""The init of one lab host: PID 1 of the host's own PID, mount, UTS and cgroup namespaces.

Started by ``gpugate lab up`` (gpugate_lab.core) as::

    python -S -E -c BOOT <lab_dir> <host> <cgroup_dir or "">

The launcher process joins the host's cgroup, unshares the namespaces and forks PID 1, which mounts
its own /proc, /run (with /run/sshd and /run/gpugate-sim), cgroup2 and a /usr/sbin overlay holding
``pct``; sets the hostname; starts the simulated GPU driver, sshd and the containers marked
``onboot: 1``; reports "ready" to the launcher; then reaps children until it is killed.
Stdlib only (besides gpugate_lab), so it runs with ``-S``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from gpugate_lab import container, nsutil

PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)  # the directory that holds gpugate_lab


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def wait_listening(port: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return True
        except OSError:
            time.sleep(0.005)
    return False


def _mount_host_fs(host_dir: Path, cgroup_dir: str) -> None:
    nsutil.make_private("/")
    nsutil.mount("proc", "/proc", "proc", nsutil.MS_NOSUID | nsutil.MS_NODEV | nsutil.MS_NOEXEC)
    nsutil.mount("tmpfs", "/run", "tmpfs", nsutil.MS_NOSUID | nsutil.MS_NODEV, "mode=755")
    os.makedirs("/run/sshd", mode=0o755)
    os.makedirs("/run/lock", exist_ok=True)
    os.makedirs("/run/gpugate-sim")
    gdir = container.gpu_dir(host_dir)
    if gdir.is_dir():
        nsutil.bind(str(gdir), "/run/gpugate-sim")
    mode = "off"
    cg_mount = nsutil.cgroup2_mount()
    if cgroup_dir and cg_mount:
        try:
            nsutil.umount(cg_mount)
            nsutil.mount("cgroup2", cg_mount, "cgroup2", nsutil.MS_NOSUID | nsutil.MS_NODEV | nsutil.MS_NOEXEC)
            mode = "on"
        except OSError as exc:
            log(f"cgroup2 remount failed ({exc}); containers tracked by init.pid")
    (host_dir / "cgroup_mode").write_text(mode + "\n")
    # /usr/sbin/pct, as on Proxmox, for login shells that reset PATH and for callers using the full path.
    upper, work = host_dir / "sbin-upper", host_dir / "sbin-work"
    upper.mkdir(exist_ok=True)
    work.mkdir(exist_ok=True)
    shutil.copy2(host_dir / "bin" / "pct", upper / "pct")
    try:
        nsutil.mount("overlay", "/usr/sbin", "overlay", 0, f"lowerdir=/usr/sbin,upperdir={upper},workdir={work}")
    except OSError as exc:
        log(f"/usr/sbin overlay failed ({exc}); pct only on PATH via sshd SetEnv")
    _hide_machine_dotfiles(host_dir)


def _hide_machine_dotfiles(host_dir: Path) -> None:
    """Give root on the lab host Debian's stock shell start-up files, as a Proxmox node has.

    sshd runs every command through root's shell, which reads ~/.bashrc: this machine's (pyenv, cargo)
    would add ~0.3 s to every command over SSH and put its own PATH in front of the host's.
    """
    stock = {".bashrc": "/usr/share/base-files/dot.bashrc", ".profile": "/usr/share/base-files/dot.profile"}
    for name, source in stock.items():
        target = Path("/root") / name
        if not target.exists():
            continue
        copy = host_dir / f"root{name}"
        copy.write_text(Path(source).read_text() if Path(source).exists() else "")
        try:
            nsutil.bind(str(copy), str(target))
        except OSError as exc:
            log(f"could not replace /root/{name} on the lab host ({exc})")


def _start_driver(host_dir: Path) -> None:
    gdir = container.gpu_dir(host_dir)
    if not (Path(__file__).parent / "gpusim.py").exists():
        log("gpugate_lab.gpusim not present: no simulated GPU driver on this host")
        return
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "PYTHONPATH": PACKAGE_ROOT}
    with open(host_dir / "driver.log", "ab") as out:
        subprocess.Popen(
            [sys.executable, "-m", "gpugate_lab.gpusim", "driver", str(gdir)],
            stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env, cwd="/",
        )


def _start_sshd(host_dir: Path) -> int:
    port = int((host_dir / "port").read_text())
    with open(host_dir / "sshd.log", "ab") as out:
        subprocess.Popen(
            ["/usr/sbin/sshd", "-D", "-e", "-f", str(host_dir / "sshd_config")],
            stdin=subprocess.DEVNULL, stdout=out, stderr=out, cwd="/",
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
        )
    return port


def _boot(host_dir: Path, name: str, cgroup_dir: str) -> None:
    _mount_host_fs(host_dir, cgroup_dir)
    nsutil.sethostname(name)
    _start_driver(host_dir)
    port = _start_sshd(host_dir)
    cgroup_base = container.host_cgroup_base_inside(host_dir)
    for vmid in container.list_vmids(host_dir):
        plain, _ = container.parse_config((container.ct_dir(host_dir, vmid) / "config").read_text())
        if plain.get("onboot") == "1":
            container.start_container(host_dir, vmid, cgroup_base)
    if not wait_listening(port):
        raise RuntimeError(f"sshd did not listen on 127.0.0.1:{port}; see {host_dir / 'sshd.log'}")


def _reap_forever() -> None:
    watched = {signal.SIGCHLD, signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, watched)
    while True:
        info = signal.sigwaitinfo(watched)
        if info.si_signo in (signal.SIGTERM, signal.SIGINT):
            try:
                os.kill(-1, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os._exit(0)
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break


def main(argv: list[str]) -> None:
    lab_dir, name, cgroup_dir = Path(argv[0]), argv[1], argv[2]
    host_dir = lab_dir / "hosts" / name
    if cgroup_dir:
        nsutil.join_cgroup(cgroup_dir)
    nsutil.unshare(nsutil.CLONE_NEWNS | nsutil.CLONE_NEWUTS | nsutil.CLONE_NEWPID | nsutil.CLONE_NEWCGROUP)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        try:
            os.setsid()
            _boot(host_dir, name, cgroup_dir)
            os.write(write_fd, b"ready\n")
        except BaseException as exc:  # the launcher prints it and `lab up` fails
            os.write(write_fd, f"error {type(exc).__name__}: {exc}\n".encode())
            os._exit(1)
        os.close(write_fd)
        _reap_forever()
    os.close(write_fd)
    (host_dir / "init.pid").write_text(f"{pid}\n")
    with os.fdopen(read_fd, "rb") as reader:
        answer = reader.read().decode(errors="replace").strip()
    if answer != "ready":
        log(f"host {name} failed to start: {answer or 'init died'}")
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        sys.exit(1)
    sys.exit(0)
