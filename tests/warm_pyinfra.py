"""The real pyinfra CLI without paying its imports in every test: a warm interpreter (one per test
process) that has imported ``pyinfra_cli.main`` forks once per run, and the child runs the CLI's own
entry point (``pyinfra_cli.main.main``, what the ``pyinfra`` console script calls) with the test's
argv, environment, working directory and stdio.

Why: importing pyinfra (gevent, paramiko, click, its facts and operations) is 0.34 of the 0.5 CPU-s
of a pyinfra run on this machine, and the suite makes several hundred runs on 2 cores
(docs/testing.md has the figures). The child is what a fresh ``pyinfra`` process would be after its
imports: nothing of gpugate is imported before the fork, no greenlet has run, and its ``sys.path`` is
the console script's (its bin directory, then ``PYTHONPATH`` as the test's environment gives it).
Everything after the imports is the real thing: argument parsing, the inventory, gpugate's connector,
SSH to the lab, the operations, the exit status. Runs the suite cannot make this way still exec a fresh
``pyinfra``: the product's own ``gpugate`` commands, and every test that runs ``pyinfra_exe()`` itself.
``GPUGATE_TEST_FRESH_PYINFRA=1`` makes every run a fresh exec (the same results, slower).

Example (in a test)::

    process = warm_pyinfra.popen([pyinfra_exe(), "-y", "inventory.py", "deploy.py"], cwd=REPO_ROOT,
                                 env=lab.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    for line in process.stdout: ...
    process.wait()  # process.returncode as subprocess gives it (negative: killed by that signal)

The server (``python tests/warm_pyinfra.py SOCKET``, the controller venv's interpreter) reads one JSON
request per connection with the three stdio descriptors beside it (SCM_RIGHTS), answers ``pid N``, and
``exit CODE`` once the child has ended. It uses the functions gevent's monkey patching replaced only in
their original form (it never runs the gevent hub), so the child starts as a fresh process would.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

FRESH_ENV = "GPUGATE_TEST_FRESH_PYINFRA"


# ------------------------------------------------------------------ the server (the warm interpreter)


def serve(path: str) -> None:
    import gc

    import pyinfra_cli.main as cli_main  # the imports every run would pay; this patches the stdlib for gevent
    from gevent import monkey

    fork, waitpid = monkey.get_original("os", ["fork", "waitpid"])
    parent = os.getppid()
    select = monkey.get_original("select", "select")
    plain_socket = monkey.get_original("socket", "socket")
    listener = plain_socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    gc.collect()
    gc.freeze()  # the children share these pages instead of copying them on the first refcount change
    children: dict[int, Any] = {}
    while True:
        ready = select([listener], [], [], 0.02)[0]
        while True:  # the children that ended: their exit status to their client
            try:
                pid, status = waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(b"exit %d\n" % os.waitstatus_to_exitcode(status))
                except OSError:
                    pass
                conn.close()
        if not ready:
            if os.getppid() != parent:  # the test process is gone
                return
            continue
        fd, _ = listener._accept()
        conn = plain_socket(fileno=fd)
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        request = json.loads(message)
        pid = fork()
        if pid == 0:
            listener.close()
            for other in children.values():
                other.close()
            conn.close()
            _run_child(cli_main, request, fds)  # never returns
        for passed in fds:
            os.close(passed)
        conn.sendall(b"pid %d\n" % pid)
        children[pid] = conn


def _run_child(cli_main: Any, request: Mapping[str, Any], fds: Sequence[int]) -> None:
    """In the forked child: become the fresh ``pyinfra`` process the request describes, run the CLI's
    entry point and exit with its status, as the console script would."""
    for target, passed in enumerate(fds):
        os.dup2(passed, target)
    for passed in set(fds):
        if passed > 2:
            os.close(passed)
    from gevent import monkey

    # the dispositions an exec from the test process would give: what it ignores stays ignored (a
    # test under nohup), the rest default; then what Python sets at its start (SIGINT, SIGPIPE)
    set_handler = monkey.get_original("signal", "signal")
    ignored = set(request.get("ignored_signals") or ())
    for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGQUIT, signal.SIGCHLD):
        set_handler(sig, signal.SIG_IGN if int(sig) in ignored else signal.SIG_DFL)
    if int(signal.SIGINT) not in ignored:
        set_handler(signal.SIGINT, signal.default_int_handler)
    set_handler(signal.SIGPIPE, signal.SIG_IGN)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script = request["argv"][0]
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.path.dirname(script), *extra, *sys.path[1:]]
    sys.argv = list(request["argv"])
    sys.exit(cli_main.main())


# ------------------------------------------------------------------ the client (the test process)


class _Server:
    """The warm interpreter of this test process, started on first use."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.process: subprocess.Popen | None = None
        self.path = ""

    def address(self, python: str) -> str | None:
        with self.lock:
            if self.process is not None and self.process.poll() is None:
                return self.path
            self.path = os.path.join(tempfile.mkdtemp(prefix="warm-pyinfra-"), "socket")
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            self.process = subprocess.Popen([python, __file__, self.path], env=env, stdin=subprocess.DEVNULL,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                            start_new_session=True)
            deadline = time.monotonic() + 30
            while not os.path.exists(self.path):
                if self.process.poll() is not None or time.monotonic() > deadline:
                    return None
                time.sleep(0.02)
            return self.path

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


_SERVER = _Server()
atexit.register(_SERVER.close)


class WarmProcess:
    """A pyinfra run in a child of the warm interpreter, used as a ``subprocess.Popen``: ``pid``,
    ``stdout``/``stderr`` (text, where PIPE was asked), ``poll``, ``wait``, ``send_signal``, ``kill``,
    ``terminate``, ``returncode``."""

    def __init__(self, conn: socket.socket, args: list[str], stdout: Any, stderr: Any) -> None:
        self.conn = conn
        self.args = args
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None
        self._buffer = b""
        self._read_lock = threading.Lock()
        self.pid = int(self._line(None).split()[1])

    def _line(self, timeout: float | None) -> str:
        self.conn.settimeout(timeout)
        while b"\n" not in self._buffer:
            chunk = self.conn.recv(64)
            if not chunk:
                raise ConnectionError("the warm pyinfra server went away")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.wait(timeout=0.001)
            except subprocess.TimeoutExpired:
                pass
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self._read_lock:
            if self.returncode is None:
                try:
                    self.returncode = int(self._line(timeout).split()[1])
                except (socket.timeout, TimeoutError):
                    raise subprocess.TimeoutExpired(self.args, timeout) from None
                self.conn.close()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def _fd_for(stream: Any, default: int, mode: int) -> tuple[int, Any]:
    """What the child gets for one stdio stream -> (descriptor to pass, our end when PIPE)."""
    if stream == subprocess.PIPE:
        read_end, write_end = os.pipe()
        return write_end, os.fdopen(read_end, "r", errors="replace")
    if stream == subprocess.DEVNULL:
        return os.open(os.devnull, mode), None
    if stream is None:
        return os.dup(default), None
    return os.dup(stream if isinstance(stream, int) else stream.fileno()), None


def popen(argv: Sequence[str], cwd: str | Path, env: Mapping[str, str], stdout: Any = None, stderr: Any = None,
          stdin: Any = subprocess.DEVNULL, text: bool = True) -> Any:
    """``subprocess.Popen(argv, cwd=, env=, stdin=, stdout=, stderr=, text=True)`` where ``argv[0]`` is
    the pyinfra console script: a child of the warm interpreter where it runs, else that Popen."""
    if not text:
        raise ValueError("warm_pyinfra gives text streams only")
    argv = list(argv)
    python = _script_python(argv[0])
    address = None if os.environ.get(FRESH_ENV) == "1" or python is None else _SERVER.address(python)
    if address is None:
        return subprocess.Popen(argv, cwd=cwd, env=dict(env), stdin=stdin, stdout=stdout, stderr=stderr, text=True)
    in_fd, _ = _fd_for(stdin, 0, os.O_RDONLY)
    out_fd, out_file = _fd_for(stdout, 1, os.O_WRONLY)
    if stderr == subprocess.STDOUT:
        err_fd, err_file = os.dup(out_fd), None
    else:
        err_fd, err_file = _fd_for(stderr, 2, os.O_WRONLY)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(address)
        ignored = [int(sig) for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGQUIT)
                   if signal.getsignal(sig) == signal.SIG_IGN]
        request = {"argv": argv, "cwd": str(cwd), "env": dict(env), "ignored_signals": ignored}
        socket.send_fds(conn, [json.dumps(request).encode()], [in_fd, out_fd, err_fd])
    finally:
        for fd in (in_fd, out_fd, err_fd):
            os.close(fd)
    return WarmProcess(conn, argv, out_file, err_file)


def run(argv: Sequence[str], cwd: str | Path, env: Mapping[str, str], timeout: float, capture_output: bool = True,
        text: bool = True, stdin: Any = subprocess.DEVNULL) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, cwd=, env=, capture_output=True, text=True, timeout=, stdin=DEVNULL)``
    through :func:`popen` (the same keywords, so a test's call changes only its function)."""
    if not capture_output:
        raise ValueError("warm_pyinfra.run captures the output (capture_output=True)")
    process = popen(argv, cwd, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=stdin, text=text)
    if isinstance(process, subprocess.Popen):
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            raise
        return subprocess.CompletedProcess(process.args, process.returncode, out, err)
    outputs: dict[str, str] = {}

    def drain(name: str, stream: Any) -> None:
        outputs[name] = stream.read()
        stream.close()

    readers = [threading.Thread(target=drain, args=(name, stream), daemon=True)
               for name, stream in (("out", process.stdout), ("err", process.stderr))]
    for reader in readers:
        reader.start()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        for reader in readers:
            reader.join()
        raise
    for reader in readers:
        reader.join()
    return subprocess.CompletedProcess(process.args, process.returncode, outputs.get("out", ""), outputs.get("err", ""))


def _script_python(exe: str) -> str | None:
    """The interpreter of a console script (its ``#!`` line), if it is a Python one."""
    try:
        with open(exe, "rb") as handle:
            first = handle.readline(400).decode(errors="replace")
    except OSError:
        return None
    if not first.startswith("#!") or "python" not in first:
        return None
    return first[2:].strip().split()[0]


if __name__ == "__main__":
    serve(sys.argv[1])
