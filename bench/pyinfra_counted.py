"""The pyinfra CLI, with every remote command counted and timed (bench only; not installed).

    python3 bench/pyinfra_counted.py COUNT_FILE -y inventory.py deploy.py

Runs pyinfra's own CLI (``pyinfra_cli.main.main``) unchanged, after wrapping the SSH connector's
``connect``, ``run_shell_command``, ``put_file`` and ``get_file``: each call is one SSH round trip to
a Proxmox host (the ``@pct`` connector sends every command, fact and file through them). At exit,
COUNT_FILE gets one JSON document::

    {"started_at": t, "ended_at": t, "calls": [{"host": "@pct/pve1:129", "kind": "exec",
      "what": "pct exec 129 -- ...", "start": t, "end": t}, ...]}

The host is the pyinfra inventory host (the container), so calls per container are exact.
"""

from __future__ import annotations

import atexit
import json
import sys
import time

STARTED_AT = time.time()


def label(raw: str) -> str:
    """What a remote command is, for the report: ``pct list``, the agent's ``observe`` / ``start`` /
    ``follow`` / ``wait``, the host-side ``GPU lock`` (``GPU lock + start``: the hand-off in the same
    command), else its first words."""
    import re

    if "pct list" in raw[:120]:
        return "pct list"
    tail = raw[raw.rfind(")))") + 3:] if ")))" in raw else raw  # after the packed program
    match = re.search(r"\b(observe|start|follow|wait|logpump)\b", tail)
    if "pct exec" in raw[:40]:
        return match.group(1) if match else "pct exec (inline program)"
    if "python3 -c" in raw[:40] or "python3 -S -c" in raw[:40]:  # the holder; with "start": it hands off too
        return "GPU lock + start (Proxmox host)" if '"start": {"command"' in raw else "GPU lock (Proxmox host)"
    return raw[:40]


def install(calls: list[dict]) -> None:
    """Wrap pyinfra's SSH connector so every remote call appends a record to ``calls``."""
    from pyinfra.connectors.ssh import SSHConnector

    def wrap(name: str, kind: str) -> None:
        original = getattr(SSHConnector, name)

        def counted(self, *args, **kwargs):
            start = time.time()
            try:
                return original(self, *args, **kwargs)
            finally:
                what = raw = ""
                if kind == "exec" and args:
                    command = args[0]
                    raw = command.get_raw_value() if hasattr(command, "get_raw_value") else str(command)
                    what = raw[:160]
                calls.append({"host": self.host.name, "kind": kind, "what": what,
                              "label": label(raw) if kind == "exec" and args else kind,
                              "start": start, "end": time.time()})

        setattr(SSHConnector, name, counted)

    wrap("connect", "connect")
    wrap("run_shell_command", "exec")
    wrap("put_file", "put")
    wrap("get_file", "get")


def main() -> None:
    count_file, sys.argv[1:] = sys.argv[1], sys.argv[2:]
    sys.argv[0] = "pyinfra"
    from pyinfra_cli.main import main as pyinfra_main  # patches gevent first, as the CLI does

    calls: list[dict] = []
    install(calls)

    def write() -> None:
        with open(count_file, "w") as out:
            json.dump({"started_at": STARTED_AT, "ended_at": time.time(), "calls": calls}, out)

    atexit.register(write)
    sys.exit(pyinfra_main())


if __name__ == "__main__":
    main()
