"""What the agent asks of the container's supervisor and kernel around a start: systemctl, how a
unit's main process ended, and SGLang's stale /dev/shm segments.
"""

from __future__ import annotations

import os

from gpugate.agent.engine import engine
from gpugate.agent import state
from gpugate.rules.procfs import read_file

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is never imported at run time (~10 ms of every agent command)
    from typing import List, Set, Tuple

    from gpugate.rules import redact


def systemctl(*args: str) -> Tuple[bool, str]:
    import subprocess

    try:
        done = subprocess.run(["systemctl"] + list(args), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return False, str(error)
    return done.returncode == 0, done.stdout.decode("utf-8", "replace")


def start_unit(unit: str, redactor: redact.Redactor) -> int:
    """``systemctl daemon-reload``, ``reset-failed`` and ``start`` of ``unit`` (its file written):
    -> its MainPID, 0 when it has none. A failed reload or start is a Failure (the output masked).

    A unit whose server crashed waits RestartSec to restart (auto-restart: the time the template
    leaves the transition to roll back first); a start then waits for that timer, so the pending
    restart is cancelled first (``stop``; nothing runs): the rollback after a crash at start began
    RestartSec (5 s) late."""
    ok, output = systemctl("show", "-p", "SubState", "--value", unit)
    pending = ["stop", unit] if ok and output.strip() == "auto-restart" else None
    for command in (["daemon-reload"], pending, ["reset-failed", unit], ["start", unit]):
        if command is None:
            continue
        ok, output = systemctl(*command)
        if not ok and command[0] != "reset-failed":
            raise state.Failure("systemctl %s: %s" % (" ".join(command), redactor.text(output)[-300:]))
    ok, output = systemctl("show", "-p", "MainPID", "--value", unit)
    return int(output.strip()) if output.strip().isdigit() else 0


def unit_exit_code(port: int) -> int | None:
    """How a unit's main process ended, as Popen.returncode says it (-N: killed by signal N); None
    when systemd does not say (it still runs, or no unit)."""
    ok, output = systemctl("show", "-p", "ExecMainCode", "-p", "ExecMainStatus", state.paths(port)["unit_name"])
    shown = dict(line.split("=", 1) for line in output.splitlines() if "=" in line) if ok else {}
    code, status = shown.get("ExecMainCode", ""), shown.get("ExecMainStatus", "")
    if not status.isdigit() or code not in ("1", "2", "3"):  # CLD_EXITED, CLD_KILLED, CLD_DUMPED
        return None
    return int(status) if code == "1" else -int(status)


def remove_stale_shm() -> List[str]:
    """SGLang's /dev/shm segments that no live process maps or holds open (a SIGKILLed server
    leaves them; a live server of another port keeps its own)."""
    names = [name for name in state.listdir("/dev/shm") if name.startswith(engine.SHM_PREFIXES)]
    if not names:
        return []
    in_use: Set[str] = set()
    for pid in state.listdir("/proc"):
        if not pid.isdigit():
            continue
        for line in (read_file("/proc/%s/maps" % pid) or "").splitlines():
            if "/dev/shm/" in line:
                in_use.add(line.rsplit("/dev/shm/", 1)[1].split()[0])
        try:
            for fd in os.listdir("/proc/%s/fd" % pid):
                target = os.readlink("/proc/%s/fd/%s" % (pid, fd))
                if target.startswith("/dev/shm/"):
                    in_use.add(target[len("/dev/shm/"):].split()[0])
        except OSError:
            continue
    removed = []
    for name in names:
        if name not in in_use:
            try:
                os.unlink(os.path.join("/dev/shm", name))
                removed.append(name)
            except OSError:
                pass
    return removed
