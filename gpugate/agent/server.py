"""The server on a port as the container sees it: its main process and tree, its workers, who
listens on the port (netlink sock_diag, else /proc/net/tcp*), and its HTTP endpoints (/health,
a generation, the info document: the engine's paths) over a raw socket (no urllib import: every ms of observe counts).
"""

from __future__ import annotations

import os
import re
import time

from gpugate.agent.engine import engine
from gpugate.agent import state
from gpugate.rules import procfs, redact
from gpugate.rules.procfs import read_file

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is never imported at run time (~10 ms of every agent command)
    from typing import Any, Dict, Iterable, List, Sequence, Set, Tuple

    Table = Dict[int, Dict[str, Any]]  # procfs.table()


def connect_host(host: str | None) -> str:
    """Where to reach a server bound to ``host`` from inside the container.

    >>> connect_host("0.0.0.0"), connect_host("[::1]")
    ('127.0.0.1', '::1')
    """
    if not host or host in ("0.0.0.0", "::", "[::]", "*"):
        return "127.0.0.1"
    return host.strip("[]")


def listeners(port: int) -> Set[str]:
    """Socket inodes (``socket:[N]``) in LISTEN on TCP ``port`` (v4 and v6, any address): netlink
    sock_diag (walks only the listening sockets: ~0.2 ms), else /proc/net/tcp* (~10-20 ms on a
    busy host, it walks every socket)."""
    try:
        return _listeners_netlink(int(port))
    except (OSError, ValueError, AttributeError):
        pass
    inodes: Set[str] = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in (read_file(path) or "").splitlines()[1:]:
            cols = line.split()
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == int(port):
                inodes.add("socket:[%s]" % cols[9])
    return inodes


def _listeners_netlink(port: int) -> Set[str]:
    import _socket as socket  # the C module: the socket module's import converts its enums (~3-5 ms)
    import struct

    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 4)  # NETLINK_SOCK_DIAG
    inodes: Set[str] = set()
    try:
        sock.settimeout(2.0)
        for seq, family in enumerate((socket.AF_INET, socket.AF_INET6), start=1):
            # inet_diag_req_v2: family, protocol, ext, pad, states (1 << TCP_LISTEN), inet_diag_sockid
            request = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 1 << 10) + b"\0" * 48
            # nlmsghdr: len, SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, seq, pid
            sock.send(struct.pack("=IHHII", 16 + len(request), 20, 0x301, seq, 0) + request)
            done = False
            while not done:
                data = sock.recv(65536)
                offset = 0
                while offset + 16 <= len(data):
                    length, kind, _, _, _ = struct.unpack_from("=IHHII", data, offset)
                    if length < 16:
                        raise ValueError("bad netlink message")
                    if kind == 3:  # NLMSG_DONE
                        done = True
                        break
                    if kind == 2:  # NLMSG_ERROR
                        raise OSError("sock_diag refused the request")
                    body = offset + 16
                    sport = struct.unpack_from("!H", data, body + 4)[0]
                    if sport == port:
                        inodes.add("socket:[%d]" % struct.unpack_from("=I", data, body + 68)[0])
                    offset += (length + 3) & ~3
    finally:
        sock.close()
    return inodes


def socket_owners(inodes: Iterable[str] | None) -> List[int]:
    """pids holding any of the socket ``inodes`` (a /proc/*/fd scan; only when something listens)."""
    pids: List[int] = []
    if not inodes:
        return pids
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            for fd in os.listdir("/proc/%s/fd" % name):
                if os.readlink("/proc/%s/fd/%s" % (name, fd)) in inodes:
                    pids.append(int(name))
                    break
        except OSError:
            continue
    return sorted(pids)


def pid1_comm() -> str | None:
    return (read_file("/proc/1/comm") or "").strip() or None


def memory_limit_bytes() -> int | None:
    limits = []
    for line in (read_file("/proc/meminfo") or "").splitlines():
        if line.startswith("MemTotal:"):
            limits.append(int(line.split()[1]) * 1024)
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        text = (read_file(path) or "").strip()
        if text.isdigit() and int(text) < 1 << 60:
            limits.append(int(text))
    return min(limits) if limits else None


def _connect(host: str, port: int, timeout: float) -> Any:
    """socket.create_connection((host, port), timeout) on the C module ``_socket``: the socket
    module's import (its enums) costs ~3-5 ms of every command, and a str host in getaddrinfo
    imports the idna codec; an ASCII host goes as bytes."""
    import _socket

    name: str | bytes
    try:
        name = host.encode("ascii")
    except UnicodeEncodeError:
        name = host
    error: OSError | None = None
    for family, kind, proto, _, address in _socket.getaddrinfo(name, port, 0, _socket.SOCK_STREAM):
        sock = _socket.socket(family, kind, proto)
        try:
            sock.settimeout(timeout)
            sock.connect(address)
            return sock
        except OSError as failure:
            error = failure
            sock.close()
    raise error or OSError("getaddrinfo returned no address for %s" % host)


def http_get(host: str | None, port: int, path: str, timeout: float = 3.0, token: str | None = None,
             method: str = "GET", body: bytes | None = None) -> Tuple[int | None, str]:
    """(status, body) or (None, error text). 503 is an answer, not an error. ``token``: the
    server's --api-key / --admin-api-key, sent as a bearer token (never printed). ``method``
    POST sends ``body`` as JSON, or an empty body (gated launch's ``POST /gate/activate``)."""
    deadline = time.time() + timeout
    try:
        conn = _connect(connect_host(host), int(port), timeout)
    except OSError as error:
        return None, "%s: %s" % (type(error).__name__, error)
    try:
        auth = "Authorization: Bearer %s\r\n" % token if token else ""
        length = ("Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body) if body is not None
                  else "Content-Length: 0\r\n" if method == "POST" else "")
        conn.sendall(("%s %s HTTP/1.0\r\nHost: 127.0.0.1:%d\r\n%s%sConnection: close\r\n\r\n"
                      % (method, path, int(port), auth, length)).encode() + (body or b""))
        chunks: List[bytes] = []
        size = 0
        while size < 4 * 1024 * 1024:
            conn.settimeout(max(0.05, deadline - time.time()))
            data = conn.recv(65536)
            if not data:
                break
            chunks.append(data)
            size += len(data)
            head = b"".join(chunks)
            if b"\r\n\r\n" in head:
                header, _, body = head.partition(b"\r\n\r\n")
                match = re.search(rb"(?im)^content-length:\s*(\d+)", header)
                if match and len(body) >= int(match.group(1)):
                    break
    except OSError as error:
        return None, "%s: %s" % (type(error).__name__, error)
    finally:
        conn.close()
    raw = b"".join(chunks)
    header, _, body = raw.partition(b"\r\n\r\n")
    parts = header.split(b"\r\n", 1)[0].split()
    if len(parts) < 2 or not parts[1].isdigit():
        return None, "not an HTTP answer"
    return int(parts[1]), body.decode("utf-8", "replace")


def generation(host: str | None, port: int, timeout: float = 30.0, token: str | None = None,
               argv: Sequence[str] | None = None) -> Tuple[int | None, str]:
    """A real generation, the request the engine says proves one (``generation_request`` of the
    server's ``argv``: a GET of the engine's generate path, or a 1-token completion): (status,
    error)."""
    method, path, body = engine.generation_request(argv)
    return http_get(host, port, path, timeout, token, method=method, body=body)


def health(host: str | None, port: int, generate: bool = False, timeout: float = 3.0, generate_timeout: float = 30.0,
           token: str | None = None, argv: Sequence[str] | None = None) -> Dict[str, Any]:
    status, error = http_get(host, port, engine.HEALTH_PATH, timeout, token)
    doc: Dict[str, Any] = {"health": status, "health_error": error if status is None else None,
           "health_generate": None, "health_generate_error": None}
    if generate and status == 200:
        code, error = generation(host, port, generate_timeout, token, argv)
        doc["health_generate"] = code
        doc["health_generate_error"] = error if code is None else None
    return doc


def server_info(host: str | None, port: int, timeout: float = 3.0, keys: Iterable[str] | None = None,
                token: str | None = None) -> Dict[str, Any]:
    """The engine's info document (its ``read_info``: by default the first of ``INFO_PATHS`` that
    answers, or what the engine assembles from several): the resolved args, or an error (``status``
    401/403: the admin key is needed and we do not have it)."""
    info = engine.read_info(lambda path: http_get(host, port, path, timeout, token))
    if keys is not None and isinstance(info.get("args"), dict):
        info["args"] = dict((key, info["args"][key]) for key in keys if key in info["args"])
    return info


def own_pids(table: Table) -> Set[int]:
    return procfs.ancestors(table, os.getpid())


def find_server(table: Table, port: int, own: Set[int] | None = None) -> Tuple[Dict[str, Any] | None, List[int]]:
    """The main process serving/configured for ``port`` and its tree (pids with start ticks)."""
    own = own if own is not None else own_pids(table)
    recorded = state.read_pid_file(port)
    candidates = [p for p in table.values() if p["pid"] not in own and p["state"] not in ("Z", "X")
                  and engine.is_main_argv(p["argv"]) and engine.argv_port(p["argv"]) == int(port)]
    main = None
    if recorded:
        for proc in candidates:
            if proc["pid"] == recorded["pid"] and recorded.get("start_ticks") in (None, proc["start_ticks"]):
                main = proc
    if main is None and candidates:
        pids = set(p["pid"] for p in candidates)
        top = [p for p in candidates if p["ppid"] not in pids] or candidates
        main = sorted(top, key=lambda p: (p["start_ticks"], p["pid"]))[0]
    tree = [main["pid"]] + procfs.descendants(table, main["pid"]) if main else []
    return main, tree


def summary(proc: Dict[str, Any], redactor: redact.Redactor) -> Dict[str, Any]:
    return {"pid": proc["pid"], "ppid": proc["ppid"], "pgid": proc["pgid"], "state": proc["state"],
            "cmdline": redactor.text(" ".join(redact.redact_argv(proc["argv"])))[:300]}


def workers_of(table: Table, tree: Iterable[int], expected: int | None) -> Dict[str, Any]:
    """The scheduler workers (one per rank) of a server's ``tree``: alive, dead against
    ``expected`` (the ranks its GPUs say), zombies."""
    schedulers = [table[pid] for pid in tree if pid in table and engine.is_scheduler_argv(table[pid]["argv"])]
    live = [p for p in schedulers if p["state"] not in ("Z", "X")]
    return {"expected": expected, "alive": len(live), "dead": max(0, (expected or 0) - len(live)),
            "zombies": [p["pid"] for p in schedulers if p["state"] in ("Z", "X")]}


def supervisor_of(pid: int, port: int) -> str:
    cgroup = read_file("/proc/%d/cgroup" % pid) or ""
    return "systemd" if state.paths(port)["unit_name"] in cgroup else "process"
