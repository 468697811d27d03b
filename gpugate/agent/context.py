"""What the steps of one transition share (gpugate.agent.transition runs them): the start document
and what it asks (the desired spec, the spec it replaces, the budgets), the run's journal (with the
secrets masked), the processes it started (reaped while the agent lives, their log pumps), the gated
engine launched before the stop, whether anything was touched, the warnings and the rollback target.

The steps (gpugate.agent.stop.Stop, gpugate.agent.start.Start, gpugate.agent.weight_cache.WeightCache)
each take the context in their constructor; they read and write it here, and call each other only
through their public methods.
"""

from __future__ import annotations

import json
import os

from gpugate.agent.engine import engine
from gpugate.agent import state
from gpugate.rules import procfs, redact

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is never imported at run time (~10 ms of every agent command)
    import subprocess
    from typing import Any, Dict, List, Optional, Union

    from gpugate.agent.journal import Journal

    Doc = Dict[str, Any]  # a start document, a spec document (SpecDoc), a journal event
    Table = Dict[int, Dict[str, Any]]  # procfs.table()
    Budgets = Dict[str, Optional[float]]

DEFAULT_BUDGETS = {"drain_timeout_s": 60.0, "kill_grace_s": 10.0, "gate_timeout_s": 120.0,
                   "start_timeout_s": 2700.0, "max_used_mib": 64, "generate_timeout_s": 30.0,
                   "rollback_start_timeout_s": None}  # type: Budgets  # None: start_timeout_s


def budgets(doc: Doc) -> Budgets:
    """DEFAULT_BUDGETS with the start document's numbers where it gives them.

    >>> budgets({"budgets": {"drain_timeout_s": 5, "bogus": 1}})["drain_timeout_s"]
    5.0
    """
    chosen = dict(DEFAULT_BUDGETS)
    for key, value in (doc.get("budgets") or {}).items():
        if key in chosen and isinstance(value, (int, float)) and not isinstance(value, bool):
            chosen[key] = float(value)
    return chosen


class Context(object):
    """One run's shared state (see the module's docstring); ``budget(name)`` is a number the start
    document gave or DEFAULT_BUDGETS holds."""

    __slots__ = ("doc", "run", "by", "journal", "budgets", "desired", "replaces", "recovered", "secret_env", "redactor",
                 "port", "children", "exit_codes", "pumps", "touched", "warnings", "rollback", "gated")

    def __init__(self, doc: Doc, journal: Journal, recovered: Doc | None = None) -> None:
        self.doc = doc
        self.run: str = doc["run"]
        self.by: Optional[str] = doc.get("operator")
        self.journal = journal
        self.budgets = budgets(doc)
        self.desired: Optional[Doc] = doc.get("desired")
        self.replaces: Optional[Doc] = doc.get("replaces")
        self.recovered = recovered
        rollback_to: Optional[Doc] = doc.get("rollback_to") if isinstance(doc.get("rollback_to"), dict) else None
        # the operator's secret env names (SpecDoc secret_env) of every spec of the run: a spec captured
        # from the running server carries none of its own, and its values are masked by them too
        self.secret_env: List[str] = sorted(set(name for spec in (self.desired, self.replaces, rollback_to) if spec
                                                for name in spec.get("secret_env") or []))
        self.redactor = redact.Redactor(redact.spec_secrets(self.desired, self.secret_env)
                                        + redact.spec_secrets(self.replaces, self.secret_env)
                                        + redact.spec_secrets(rollback_to, self.secret_env))
        self.port: int = (self.desired or {}).get("port") or int(doc.get("port") or engine.DEFAULT_PORT)
        self.children: Dict[int, subprocess.Popen[bytes]] = {}  # pid -> Popen of what we started (reaped by us while we live)
        self.exit_codes: Dict[int, Optional[int]] = {}
        self.pumps: Dict[Union[int, str], subprocess.Popen[bytes]] = {}  # port (or "cache-<port>") -> the log pump we started for it
        self.touched = False
        self.warnings: List[str] = []
        self.rollback: Optional[Doc] = None
        # the engine launched with --gated-launch-port before the stop, until activated (gpugate.agent.start)
        self.gated: Optional[Doc] = None

    def budget(self, name: str) -> float:
        """A budget that always has a number (every one but ``rollback_start_timeout_s``)."""
        value = self.budgets[name]
        assert value is not None, name
        return value

    # ------------------------------------------------------------------ the journal
    def event(self, step: str, phase: str, **fields: Any) -> None:
        self.journal.write(self.redactor.deep(dict(step=step, phase=phase, **fields)))

    def progress(self, step: str, **fields: Any) -> None:
        self.journal.progress(step, **self.redactor.deep(fields))

    # ------------------------------------------------------------------ the processes we started
    def reap(self) -> None:
        """Collect the exit codes of the children that ended (``exit_codes``)."""
        for pid, child in list(self.children.items()):
            if child.poll() is not None:
                self.children.pop(pid, None)
                self.exit_codes[pid] = child.returncode

    def gated_tree(self, table: Table) -> List[int]:
        """The gated engine's live tree until its activation (spared by the stop of the old server,
        expected by the gate); once activated it is the port's server like any other."""
        gated = self.gated
        if not gated or gated["activated"] or not procfs.alive(gated["pid"], gated["start_ticks"]):
            return []
        return [gated["pid"]] + procfs.descendants(table, gated["pid"])

    def log_pump(self, log_path: str, spec: Doc) -> int | None:
        """The write end of a pipe into a log pump (``logpump``: its own session, outliving us; it
        masks the secret values in every line and rotates the log by size while the server runs),
        kept in ``pumps`` under ``spec["port"]``. None when it cannot start: the server then writes
        the file itself (rotated only at starts)."""
        import subprocess

        program = state.program()
        if not os.path.isfile(program):
            return None
        read_fd, write_fd = os.pipe()
        secrets = redact.spec_secrets(spec, self.secret_env) + list(self.redactor.values)
        # Its arguments travel in the environment and the interpreter is named /proc/self/exe, so its
        # command line never names sglang (the log path, a venv's path): an operator's `pkill -f sglang`
        # ends the server, never the pump that still has to write the server's last lines.
        env = dict(state.BASE_ENV, GPUGATE_LOG_SECRETS=json.dumps(sorted(set(secrets))),
                   GPUGATE_LOGPUMP=json.dumps({"path": log_path}))
        try:
            pump = subprocess.Popen(["/proc/self/exe", program, "logpump", procfs.PROBE_MARKER],
                                    stdin=read_fd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                                    cwd="/", start_new_session=True, close_fds=True)
        except OSError as error:
            self.warnings.append("log pump: %s" % error)
            os.close(write_fd)
            return None
        finally:
            os.close(read_fd)
        self.children[pump.pid] = pump
        self.pumps[spec["port"]] = pump
        return write_fd
