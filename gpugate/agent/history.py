"""The history of good (and failed) specs per port: /var/lib/gpugate/sglang-<port>.json (0600).
Records hold nothing secret (argv redacted, env as names and hashes); the exact specs, which the
rollback needs, never leave the container.
"""

from __future__ import annotations

import json

from gpugate.agent import state
from gpugate.rules import redact


HISTORY_GOOD = 5
HISTORY_FAILED = 10


def spec_key(spec):
    """What makes two specs the same server: exact argv, env, supervisor and unit text.

    >>> spec_key({"argv": ["a"], "env": {"X": "1"}}) == spec_key({"argv": ["a"], "env": {"X": "2"}})
    False
    """
    material = json.dumps([spec.get("argv") or [], sorted((spec.get("env") or {}).items()),
                           spec.get("supervisor") or "process", spec.get("unit_text") or ""])
    return redact.sha256(material.encode("utf-8")).hexdigest()[:16]


def load_history(port):
    doc = state.json_file(state.paths(port)["history"])
    if not isinstance(doc, dict) or doc.get("schema") != 2:
        return {"schema": 2, "port": int(port), "good": [], "failed": [], "last": None}
    doc.setdefault("good", [])
    doc.setdefault("failed", [])
    return doc


def save_history(port, doc):
    state.write_private(state.paths(port)["history"], json.dumps(doc, indent=1, sort_keys=True))


def make_record(spec, by=None, capacity=None, extra=None):
    """A history record of a spec: nothing secret (flags and argv redacted, env as names and
    hashes) plus what the controller's own record says (redacted again here)."""
    redactor = redact.Redactor(redact.spec_secrets(spec))
    flags = tuple(redact.ALWAYS_MASKED_OPTIONS) + tuple(spec.get("secret_flags") or ())
    record = redactor.deep(dict(spec.get("record") or {}))
    env = spec.get("env") or {}
    record.update({"argv": redactor.deep(redact.redact_argv(spec.get("argv") or [], flags)),
                   "argv_hash": redact.argv_hash(spec.get("argv") or []), "env_names": sorted(env),
                   "env_hashes": dict((name, redact.env_hash(value)) for name, value in sorted(env.items())),
                   "port": spec.get("port"), "gpus": spec.get("gpus"), "supervisor": spec.get("supervisor") or "process",
                   "key": spec_key(spec), "at": state.now_iso(), "by": by})
    if capacity is not None:
        record["capacity"] = capacity
    if extra:
        record.update(redactor.deep(extra))
    return record


def public_history(doc):
    return {"good": [entry.get("record") for entry in doc.get("good") or []],
            "failed": list(doc.get("failed") or []), "last": doc.get("last")}


def clean_spec(spec):
    """A SpecDoc without the agent's own marks (keys starting with ``_``).

    >>> clean_spec({"argv": ["a"], "_serving": True})
    {'argv': ['a']}
    """
    if not spec:
        return None
    return dict((key, value) for key, value in spec.items() if not key.startswith("_"))
