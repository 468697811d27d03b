"""``gpugate lab up --router``: a real smg (the pinned ``smg`` wheel of the test extra) on loopback in
front of every lab container's server, as a gateway in front of NAT'd Proxmox containers would be.

- Each container's server port is published on 127.0.0.1 (one port per container, ``ports.json``):
  a forwarder process accepts there, in this machine's network namespace, and connects inside the
  container's own network namespace (``setns`` on ``/proc/<its init>/ns/net``, looked up per
  connection, so a restarted container is found again) to ``127.0.0.1:<server port>``. Nothing
  listens on any other address, and nothing leaves the namespaces the lab made.
- smg listens on 127.0.0.1 (more smg arguments from ``$GPUGATE_LAB_SMG_ARGS``, e.g.
  ``--disable-retries``) with health checks every second (smg's default is 60 s; the lab's
  tests should not wait minutes for smg to notice a worker).
- fleet.yaml gets ``routers: {lab: {url: http://127.0.0.1:<smg port>, kind: smg}}`` and each server
  ``router: lab, router_url: http://127.0.0.1:<its published port>``. Workers are not registered at
  ``up``: the servers do not run yet; the first deploy adds each once it is verified.

State in ``<lab>/router/``: ``state.json`` (ports, pids), ``smg.log``, ``forward.log``. ``gpugate lab
down`` ends both processes (by their recorded pids, checked against their command lines).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from gpugate_lab import nsutil

ROUTER_NAME = "lab"
SMG_HEALTH_INTERVAL_S = 1


def router_dir(lab_dir: Path) -> Path:
    return Path(lab_dir) / "router"


def read_state(lab_dir: Path) -> dict | None:
    try:
        return json.loads((router_dir(lab_dir) / "state.json").read_text())
    except (OSError, ValueError):
        return None


def _alive(pid: int | None, marker: str) -> bool:
    if not pid:
        return False
    return marker in " ".join(nsutil.cmdline(pid))


def smg_binary() -> str:
    """The smg console script of this environment (installed by the test extra)."""
    found = shutil.which("smg") or str(Path(sys.executable).with_name("smg"))
    if not os.path.exists(found):
        raise RuntimeError("smg is not installed: pip install -e '.[test]' installs the pinned smg")
    return found


def _wait_http(url: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as response:  # noqa: S310 -- loopback
                if response.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.1)
    return False


def start(lab_dir: Path, containers: list[tuple[str, int, int]], pick_port) -> dict:
    """Start (or keep) smg and the forwarder for ``containers`` (host, vmid, server port); returns
    the state: ``{"url", "ports": {"pve1:129": port}, "smg_pid", "forward_pid"}``."""
    lab_dir = Path(lab_dir).resolve()
    rdir = router_dir(lab_dir)
    rdir.mkdir(parents=True, exist_ok=True)
    old = read_state(lab_dir) or {}
    ports = dict(old.get("ports") or {})
    forwarding = _alive(old.get("forward_pid"), "gpugate_lab.router")
    targets = {}
    for host, vmid, port in containers:
        key = f"{host}:{vmid}"
        # a running forwarder holds its ports: keep them (pick_port would find them taken)
        ports[key] = ports[key] if forwarding and key in ports else pick_port(ports.get(key))
        targets[key] = {"host": host, "vmid": vmid, "port": port, "published": ports[key]}
    state: dict = {"ports": ports, "targets": targets}
    smg_alive = _alive(old.get("smg_pid"), "smg")
    state["smg_port"] = old["smg_port"] if smg_alive else pick_port(old.get("smg_port"))
    # smg's Prometheus server binds 0.0.0.0:29000 unless told: two labs at once (CI, helpers) collided
    # there ("Address already in use": smg exits), and the lab listens on loopback only
    state["smg_metrics_port"] = old.get("smg_metrics_port") if smg_alive else pick_port(old.get("smg_metrics_port"))
    if smg_alive:
        state["smg_pid"] = old["smg_pid"]
    else:
        with open(rdir / "smg.log", "ab") as log:
            proc = subprocess.Popen(
                [smg_binary(), "launch", "--host", "127.0.0.1", "--port", str(state["smg_port"]),
                 "--prometheus-host", "127.0.0.1", "--prometheus-port", str(state["smg_metrics_port"]),
                 "--health-check-interval-secs", str(SMG_HEALTH_INTERVAL_S), "--health-success-threshold", "1",
                 "--log-level", "warn", *shlex.split(os.environ.get("GPUGATE_LAB_SMG_ARGS", ""))],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        state["smg_pid"] = proc.pid
    if _alive(old.get("forward_pid"), "gpugate_lab.router") and old.get("targets") == targets:
        state["forward_pid"] = old["forward_pid"]
    else:
        if old.get("forward_pid") and _alive(old.get("forward_pid"), "gpugate_lab.router"):
            os.kill(old["forward_pid"], signal.SIGKILL)
        (rdir / "state.json").write_text(json.dumps(state, indent=2) + "\n")
        with open(rdir / "forward.log", "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "gpugate_lab.router", "forward", str(lab_dir)],
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        state["forward_pid"] = proc.pid
    state["url"] = f"http://127.0.0.1:{state['smg_port']}"
    (rdir / "state.json").write_text(json.dumps(state, indent=2) + "\n")
    if not _wait_http(state["url"] + "/workers", 20):
        raise RuntimeError(f"smg did not answer at {state['url']} within 20 s; see {rdir / 'smg.log'}")
    for port in ports.values():  # the forwarder listens before anyone is told its ports
        if not _wait_listening(int(port), 10):
            raise RuntimeError(f"the lab's forwarder does not listen on 127.0.0.1:{port}; see {rdir / 'forward.log'}")
    return state


def _wait_listening(port: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return True
        except OSError:
            time.sleep(0.05)
    return False


def stop(lab_dir: Path) -> None:
    """End smg and the forwarder (their recorded pids, when they are still those processes)."""
    state = read_state(lab_dir) or {}
    for key, marker in (("smg_pid", "smg"), ("forward_pid", "gpugate_lab.router")):
        pid = state.get(key)
        if _alive(pid, marker):
            os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------- the forwarder process
def _netns_fd(lab_dir: Path, host: str, vmid: int) -> int:
    from gpugate_lab import container, core  # noqa: PLC0415

    pid = container.find_init(core.host_dir(lab_dir, host), vmid, core.host_cgroup_dir(lab_dir, host))
    if not pid:
        raise OSError(f"container {vmid} on {host} is not running")
    return os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while True:
            data = source.recv(65536)
            if not data:
                break
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for sock, how in ((sink, socket.SHUT_WR), (source, socket.SHUT_RD)):
            try:
                sock.shutdown(how)
            except OSError:
                pass


def _serve_one(lab_dir: Path, target: dict, client: socket.socket) -> None:
    """One connection: this thread enters the container's network namespace (a thread's own, in
    Linux), connects to the server there and copies both ways."""
    upstream = None
    try:
        fd = _netns_fd(lab_dir, target["host"], target["vmid"])
        try:
            nsutil.setns(fd, nsutil.CLONE_NEWNET)
        finally:
            os.close(fd)
        upstream = socket.create_connection(("127.0.0.1", int(target["port"])), timeout=10)
        upstream.settimeout(None)
        back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
        back.start()
        _pump(client, upstream)
        back.join()
    except OSError:
        pass  # refused inside the container: the client sees the connection close, as with NAT
    finally:
        for sock in (client, upstream):
            if sock is not None:
                sock.close()


def forward(lab_dir: Path) -> None:
    state = read_state(lab_dir) or {}
    listeners = []
    for target in (state.get("targets") or {}).values():
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", int(target["published"])))
        listener.listen(256)
        listeners.append((listener, target))

    def accept_loop(listener: socket.socket, target: dict) -> None:
        while True:
            client, _address = listener.accept()
            threading.Thread(target=_serve_one, args=(Path(lab_dir), target, client), daemon=True).start()

    threads = [threading.Thread(target=accept_loop, args=item, daemon=True) for item in listeners]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "forward":
        forward(Path(sys.argv[2]))
    else:
        sys.stderr.write("usage: python -m gpugate_lab.router forward LAB_DIR\n")
        sys.exit(2)
