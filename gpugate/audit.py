"""The audit log: one JSON event per transition step, appended to a file the operator chooses.

Every event carries the run, the operator, the host and container, the step and what was seen, so that
after a restart the log alone tells the story (``jq`` reads it line by line). Secret values never reach
it: keys that name a secret, and the values of an ``env`` mapping whose names name a secret
(gpugate.rules.redact.names_a_secret), are replaced by ``***``.

Example:

.. code:: python

    from gpugate import audit

    audit.emit("gate", host="@pct/pve1:129", vmid=129, port=30000, phase="end",
               outcome="passed", duration_s=0.21, gpu_used_mib=[0] * 8)

    # later, in a shell:
    #   jq -c 'select(.step == "gate")' audit.jsonl
"""

from __future__ import annotations

import getpass
import json
import os
import re
import socket
import time
import uuid
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

import structlog

from gpugate.rules.redact import names_a_secret

DEFAULT_AUDIT_LOG = "audit.jsonl"
REDACTED = "***"

# Values under these keys are secrets wherever they appear (server env, flags such as --api-key).
_SECRET_KEY = re.compile(r"(token|secret|passw|api[-_]?key|credential|private[-_]?key|auth)", re.I)

_run_id = uuid.uuid4().hex[:12]
_loggers: dict[str, Any] = {}


def operator() -> str:
    """Who is running this: ``$GPUGATE_OPERATOR``, else ``user@machine``."""
    explicit = os.environ.get("GPUGATE_OPERATOR")
    if explicit:
        return explicit
    try:
        user = getpass.getuser()
    except Exception:  # no passwd entry in some containers
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}"


def audit_log_path(path: str | os.PathLike[str] | None = None) -> Path:
    """The file events go to: the argument, else ``$GPUGATE_AUDIT_LOG``, else ``./audit.jsonl``."""
    return Path(path or os.environ.get("GPUGATE_AUDIT_LOG") or DEFAULT_AUDIT_LOG)


def redact(value: Any, key: str = "") -> Any:
    """Return ``value`` with every secret replaced by ``***`` (recursively). An ``env`` mapping (a
    history record's: the agent masked its secret values already, the operator's ``secret_env``
    included) keeps the values that are no secret, by the one rule (redact.names_a_secret).

    >>> redact({"env": {"HF_TOKEN": "hf_1", "SGLANG_LOAD_S": "0.5"}, "api_key": "sk-1"})
    {'env': {'HF_TOKEN': '***', 'SGLANG_LOAD_S': '0.5'}, 'api_key': '***'}
    """
    if key == "env" and isinstance(value, Mapping):
        return {str(k): REDACTED if names_a_secret(k) or not isinstance(v, str) else v for k, v in value.items()}
    if key and (_SECRET_KEY.search(key) or key == "env"):
        if isinstance(value, Mapping):
            return {str(k): REDACTED for k in value}
        return REDACTED if value not in (None, "", False) else value
    if isinstance(value, Mapping):
        return {str(k): redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v) for v in value]
    return value


def _redact_processor(_logger: Any, _name: str, event_dict: MutableMapping[str, Any]) -> dict[str, Any]:
    return {k: redact(v, k) for k, v in event_dict.items()}


class _AppendFileLogger:
    """A structlog logger that appends each rendered line to a file with one write (O_APPEND).

    No lock: one write(2) to an O_APPEND file lands whole between concurrent appenders, and a
    lock here would deadlock the Ctrl-C handler that logs while the interrupted code held it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def msg(self, line: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = (line + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    info = warning = error = msg


def _file_logger(path: Path) -> Any:
    key = str(path.resolve())
    if key not in _loggers:
        _loggers[key] = structlog.wrap_logger(
            _AppendFileLogger(path),
            processors=[
                structlog.processors.EventRenamer("step"),
                _redact_processor,
                structlog.processors.TimeStamper(fmt="iso", utc=True, key="ts"),
                structlog.processors.JSONRenderer(default=str, sort_keys=False),
            ],
            context_class=dict,
            cache_logger_on_first_use=True,
        )
    return _loggers[key]


def emit(step: str, *, path: str | os.PathLike[str] | None = None, **fields: Any) -> dict[str, Any]:
    """Append one event for ``step`` to the audit log and return it (as written, secrets redacted).

    + step: the transition step (observe, lock, stop, drain, kill, sweep, gate, start, load, verify,
      rollback, unlock, ...)
    + path: the audit file (default: ``$GPUGATE_AUDIT_LOG`` or ``./audit.jsonl``)
    + fields: anything JSON-serialisable: host, vmid, port, phase, outcome, duration_s, flags_before,
      flags_after, flags_diff, gpu_used_mib, holders, error...
    """
    event = {"run": _run_id, "operator": operator(), "t": round(time.time(), 3), **fields}
    _file_logger(audit_log_path(path)).info(step, **event)
    return {"step": step, **redact(event)}


def read_events(path: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    """Every event in the audit file, oldest first (for runbooks and tests)."""
    target = audit_log_path(path)
    if not target.exists():
        return []
    return [json.loads(line) for line in target.read_text().splitlines() if line.strip()]
