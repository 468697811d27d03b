"""Thin stdlib-only wrappers over the Linux calls the lab needs (unshare, setns, mount, hostname).

Python 3.11 has no ``os.unshare``/``os.setns``; ctypes reaches libc directly. Everything here runs on
lab hosts and in containers, so it must stay stdlib only.

Example:
    >>> from gpugate_lab import nsutil
    >>> nsutil.cgroup2_mount()          # doctest: +SKIP
    '/sys/fs/cgroup/unified'
"""

from __future__ import annotations

import fcntl
import os
import struct

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_MOVE = 8192
MS_REC = 16384
MS_PRIVATE = 1 << 18
MNT_DETACH = 2

# setns order matters: the mount namespace last but one (paths under /proc/PID stop resolving once we
# are in it... they do not, because we hold fds), the pid namespace only affects children.
NS_FLAGS = {
    "cgroup": CLONE_NEWCGROUP,
    "ipc": CLONE_NEWIPC,
    "uts": CLONE_NEWUTS,
    "net": CLONE_NEWNET,
    "pid": CLONE_NEWPID,
    "mnt": CLONE_NEWNS,
}

_LIBC = None


def _libc():
    """libc through ctypes, loaded on the first system call: ctypes' import is 4 ms of every lab
    command that makes none (`pvesh`, the host's lookups); the first call comes before any setns, so
    the host's stdlib is still in view. dlopen(NULL): the interpreter's own symbols, libc's among
    them (ctypes.util.find_library("c") would run `ldconfig -p` in a subprocess: ~45 ms CPU)."""
    global _LIBC
    if _LIBC is None:
        import ctypes

        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


def _check(result: int, what: str) -> None:
    if result != 0:
        import ctypes  # loaded by _libc() already

        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def unshare(flags: int) -> None:
    """unshare(2): move the calling process into new namespaces (pid: only its future children)."""
    _check(_libc().unshare(flags), "unshare")


def setns(fd: int, nstype: int = 0) -> None:
    """setns(2) on an open /proc/PID/ns/* file descriptor."""
    _check(_libc().setns(fd, nstype), "setns")


def mount(source: str, target: str, fstype: str | None = None, flags: int = 0, data: str | None = None) -> None:
    """mount(2). Example: mount("tmpfs", "/tmp", "tmpfs", 0, "mode=1777")."""
    libc = _libc()
    import ctypes  # loaded by _libc()

    _check(
        libc.mount(
            source.encode(),
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {fstype or 'bind'} {source} on {target}",
    )


def bind(source: str, target: str, readonly: bool = False) -> None:
    """Bind-mount source on target (target must exist); optionally read-only."""
    mount(source, target, None, MS_BIND | MS_REC)
    if readonly:
        mount("none", target, None, MS_BIND | MS_REMOUNT | MS_RDONLY)


def umount(target: str) -> None:
    """Lazy unmount (MNT_DETACH)."""
    _check(_libc().umount2(target.encode(), MNT_DETACH), f"umount {target}")


def make_private(path: str = "/") -> None:
    """Stop mount events of this namespace from reaching the parent (mount --make-rprivate /)."""
    mount("none", path, None, MS_REC | MS_PRIVATE)


def sethostname(name: str) -> None:
    raw = name.encode()
    _check(_libc().sethostname(raw, len(raw)), "sethostname")


def loopback_up() -> None:
    """ip link set lo up, via SIOCSIFFLAGS (so the container needs no iproute2)."""
    import socket  # here, not at import: every lab `pct exec` imports this module (a container's init
    # imports it before its mounts hide the stdlib: container._setup_container_fs)

    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        ifreq = struct.pack("16sH14s", b"lo", 0, b"\0" * 14)
        flags = struct.unpack("16sH14s", fcntl.ioctl(sock.fileno(), siocgifflags, ifreq))[1]
        fcntl.ioctl(sock.fileno(), siocsifflags, struct.pack("16sH14s", b"lo", flags | iff_up, b"\0" * 14))


def cgroup2_mount(mounts_file: str = "/proc/self/mounts") -> str | None:
    """The path where the cgroup v2 hierarchy is mounted (hybrid: /sys/fs/cgroup/unified), or None."""
    try:
        with open(mounts_file) as handle:
            for line in handle:
                fields = line.split()
                if len(fields) > 2 and fields[2] == "cgroup2":
                    return fields[1]
    except OSError:
        return None
    return None


def join_cgroup(cgroup_dir: str, pid: int = 0) -> None:
    """Move pid (0: the caller) into the cgroup v2 directory."""
    with open(os.path.join(cgroup_dir, "cgroup.procs"), "w") as handle:
        handle.write(str(pid or os.getpid()))


def ns_inode(pid: int | str, ns: str) -> str | None:
    """'pid:[4026531836]' for /proc/PID/ns/<ns>, or None when the process is gone."""
    try:
        return os.readlink(f"/proc/{pid}/ns/{ns}")
    except OSError:
        return None


def nspid_chain(pid: int | str) -> list[int]:
    """NSpid of a process, outermost visible namespace first ([] when gone)."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("NSpid:"):
                    return [int(x) for x in line.split()[1:]]
    except OSError:
        return []
    return []


def cmdline(pid: int | str) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return [part.decode(errors="replace") for part in handle.read().split(b"\0") if part]
    except OSError:
        return []
