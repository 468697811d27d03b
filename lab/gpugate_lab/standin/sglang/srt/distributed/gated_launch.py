"""The stand-in's ``sglang.srt.distributed.gated_launch``: SGLang 0.5.23's ``--gated-launch-port``.

SGLang (distributed/gated_launch.py, called by bootstrap.py's ``measure_pre_model_load_memory``, right
after the distributed init and before any sizable allocation): rank 0 of the world group serves, in a
thread (uvicorn, ``log_level="warning"``), ``GET /health`` -> ``OK`` and ``POST /gate/activate`` -> ``OK``
(plain text) on ``--host``:``--gated-launch-port``, logs "Gated launch control server started on H:P";
every rank logs "Gated launch waiting for activation. rank=R", then polls every
``POLL_INTERVAL_SECONDS`` (1 s): rank 0 reads its flag and broadcasts it over the world group's CPU
group; every ``LOG_INTERVAL_SECONDS`` (10 s) "Gated launch still waiting for activation. rank=R
elapsed=N s"; once activated "Gated launch activated. elapsed=X.XX s", and the start goes on (weights, KV
pool, graphs; the server's own port is bound only after). The control server keeps running for the
scheduler's life. If its port is taken, uvicorn logs the bind error in its thread and that thread ends:
nothing can activate the gate, the ranks wait on.

The stand-in: the same server (http.server in a thread of the rank-0 scheduler), the same lines, the
same poll (``$SGLANG_STANDIN_GATE_POLL_S``, default 0.05; ``$SGLANG_STANDIN_GATE_LOG_S``, default 10);
the broadcast is a pipe from rank 0 to each other rank (one byte once activated; the pipe's end
without that byte means rank 0 is gone: the rank fails, as a broken collective does).

The gate, in a scheduler's job (launch_server.py builds it): rank 0
``{"host", "port", "notify_fds": [fd per other rank]}``, the others ``{"wait_fd": fd}``.
"""

import os
import select
import time

from sglang import _timing

# http.server and threading are imported by rank 0's serve() alone: every scheduler imports this module,
# and http.server (with http.client and email) was a third of a scheduler's start

POLL_INTERVAL_SECONDS = 1.0  # SGLang's; the stand-in's: _timing.interval_s("GATE_POLL")
LOG_INTERVAL_SECONDS = 10.0


class _GatedLaunchServer:
    def __init__(self):
        self.activated = False
        self._server = None
        self._thread = None

    def serve(self, host, port, log):
        import threading  # noqa: PLC0415
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer  # noqa: PLC0415

        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            server_version = "uvicorn"
            sys_version = ""

            def log_message(self, fmt, *args):  # log_level="warning": no access log
                pass

            def _send(self, code, body, content_type):
                data = body.encode()
                self.send_response(code)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path.split("?")[0] == "/health":
                    return self._send(200, "OK", "text/plain; charset=utf-8")
                return self._send(404, '{"detail":"Not Found"}', "application/json")

            def do_POST(self):
                length = int(self.headers.get("content-length") or 0)
                if length:
                    self.rfile.read(length)
                if self.path.split("?")[0] == "/gate/activate":
                    owner.activated = True
                    return self._send(200, "OK", "text/plain; charset=utf-8")
                if self.path.split("?")[0] == "/health":
                    return self._send(405, '{"detail":"Method Not Allowed"}', "application/json")
                return self._send(404, '{"detail":"Not Found"}', "application/json")

        def run():
            try:
                server = ThreadingHTTPServer((host, int(port)), Handler)
            except OSError as exc:  # uvicorn: logged by its error logger, then the thread's sys.exit(1)
                log("ERROR:    [Errno %d] error while attempting to bind on address ('%s', %d): %s"
                    % (exc.errno or 98, host, int(port), (exc.strerror or "address already in use").lower()),
                    bare=True)
                return
            server.daemon_threads = True
            self._server = server
            server.serve_forever(poll_interval=0.2)

        self._thread = threading.Thread(target=run, daemon=True, name="gated-launch")
        self._thread.start()
        log("Gated launch control server started on %s:%s" % (host, port))


def maybe_wait_for_gated_launch(gate, rank, log):
    """Block until the gate is activated; returns the seconds waited (0.0 without a gate).

    ``log(message, bare=False)`` writes the scheduler's log line. Raises RuntimeError when rank 0 went
    away before activating (the broadcast's peer is gone)."""
    if not gate:
        return 0.0
    server = None
    if gate.get("port") is not None and "wait_fd" not in gate:
        server = _GatedLaunchServer()
        server.serve(gate.get("host") or "127.0.0.1", gate["port"], log)
    log("Gated launch waiting for activation. rank=%d" % rank)
    tic = time.perf_counter()
    _wait_until_activated(gate, server, rank, log)
    log("Gated launch activated. elapsed=%.2f s" % (time.perf_counter() - tic))
    return time.perf_counter() - tic


def _wait_until_activated(gate, server, rank, log):
    poll, every = _timing.interval_s("GATE_POLL"), _timing.interval_s("GATE_LOG")
    started_at = time.perf_counter()
    next_log_at = started_at + every
    while True:
        if server is not None:
            activated = server.activated
            if activated:  # the broadcast of the flag to the other ranks
                for fd in gate.get("notify_fds") or []:
                    try:
                        os.write(fd, b"1")
                        os.close(fd)
                    except OSError:
                        pass
        else:
            activated = _received(gate["wait_fd"])
        if activated:
            return
        now = time.perf_counter()
        if now >= next_log_at:
            log("Gated launch still waiting for activation. rank=%d elapsed=%.0f s" % (rank, now - started_at))
            next_log_at = now + every
        time.sleep(poll)


def _received(fd):
    ready, _, _ = select.select([fd], [], [], 0)
    if not ready:
        return False
    data = os.read(fd, 1)
    if not data:
        raise RuntimeError("Connection closed by peer: rank 0 of the world group is gone (gated launch broadcast)")
    return True
