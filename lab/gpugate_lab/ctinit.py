"""PID 1 of a lab container, exec'd as ``/sbin/init -S -E ctinit.py <shutdown timeout>`` (stdlib only).

It reaps every orphan of the container (as a real init does). SIGPWR or SIGTERM (``pct shutdown``)
sends SIGTERM to every process of the container and exits once none is left, or sends SIGKILL at the
deadline. SIGKILL from the host (``pct stop``) ends the whole PID namespace.
"""

import os
import signal
import sys
import time

WATCHED = {signal.SIGCHLD, signal.SIGTERM, signal.SIGPWR, signal.SIGINT}


def reap() -> bool:
    """Reap every exited child; True while some child remains."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True


def kill_all(sig: int) -> None:
    try:
        os.kill(-1, sig)
    except ProcessLookupError:
        pass


def main() -> None:
    # Blocked signals are queued even for a namespace init (unhandled ones would be dropped).
    signal.pthread_sigmask(signal.SIG_BLOCK, WATCHED)
    grace = float(sys.argv[1]) if len(sys.argv) > 1 else 60.0
    deadline = None
    while True:
        wait = 3600.0 if deadline is None else max(0.0, deadline - time.monotonic())
        info = signal.sigtimedwait(WATCHED, wait)
        if info is not None and info.si_signo != signal.SIGCHLD and deadline is None:
            deadline = time.monotonic() + grace
            kill_all(signal.SIGTERM)
        alive = reap()
        if deadline is not None:
            if not alive:
                sys.exit(0)
            if time.monotonic() >= deadline:
                kill_all(signal.SIGKILL)
                deadline = time.monotonic() + 5


if __name__ == "__main__":
    main()
