"""The history of good (and failed) specs per port: /var/lib/gpugate/sglang-<port>.json (0600).
Records hold nothing secret (argv redacted, env as names and hashes); the exact specs, which the
rollback needs, never leave the container.
"""

from __future__ import annotations

import errno
import json
import os
import time

from gpugate.agent import state
from gpugate.rules import redact

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is never imported at run time (~10 ms of every agent command)
    from typing import Any, Dict, Tuple

    Doc = Dict[str, Any]  # a history, a record, a spec document


HISTORY_GOOD = 5
HISTORY_FAILED = 10
PREV = ".prev"  # the copy save_history keeps of the history it replaces


def spec_key(spec: Doc) -> str:
    """What makes two specs the same server: exact argv, env, supervisor and unit text.

    >>> spec_key({"argv": ["a"], "env": {"X": "1"}}) == spec_key({"argv": ["a"], "env": {"X": "2"}})
    False
    """
    parts = [spec.get("argv") or [], sorted((spec.get("env") or {}).items()),
             spec.get("supervisor") or "process", spec.get("unit_text") or ""]
    if spec.get("weight_cache"):  # only where there is one: the keys of older records stay as they were
        parts.append((spec["weight_cache"] or {}).get("argv") or [])
    material = json.dumps(parts)
    return redact.sha256(material.encode("utf-8")).hexdigest()[:16]


def empty_history(port: int) -> Doc:
    return {"schema": 2, "port": int(port), "good": [], "failed": [], "last": None}


def shape_problem(doc: Any) -> str | None:
    """Why ``doc`` is not a history this agent can use, or None (every reader relies on this shape:
    a record of the wrong type would fail later, far from the file that caused it).

    >>> shape_problem({"schema": 2, "good": [1, "x"], "failed": []})
    'wrong shape: good[0] is int, not an object'
    >>> shape_problem({"schema": 2, "good": [], "failed": [], "last": None}) is None
    True
    """
    if not isinstance(doc, dict):
        return "wrong shape: %s, not an object" % type(doc).__name__
    if doc.get("schema") != 2:
        return "wrong shape: schema %r, not 2" % (doc.get("schema"),)
    for name in ("good", "failed"):
        items = doc.get(name, [])
        if not isinstance(items, list):
            return "wrong shape: %s is %s, not a list" % (name, type(items).__name__)
        for index, item in enumerate(items):
            if not isinstance(item, dict):
                return "wrong shape: %s[%d] is %s, not an object" % (name, index, type(item).__name__)
            if name == "good" and not (isinstance(item.get("spec"), dict) and isinstance(item.get("record"), dict)):
                return "wrong shape: good[%d] has no spec and record" % index
    if doc.get("last") is not None and not isinstance(doc.get("last"), dict):
        return "wrong shape: last is %s, not an object" % type(doc.get("last")).__name__
    if doc.get("recovered") is not None and not isinstance(doc.get("recovered"), dict):
        return "wrong shape: recovered is %s, not an object" % type(doc.get("recovered")).__name__
    return None


def parse_problem(text: str) -> str | None:
    """Why ``text`` is not JSON (None when it is), in the words the operator reads: a file that
    ends inside its JSON is "truncated JSON" (a disk that filled, a write cut short).

    >>> parse_problem('{"schema": 2, "good": [{"ke'), parse_problem('{}'), parse_problem('{x}')[:12]
    ('truncated JSON', None, 'not JSON (Ex')
    """
    try:
        json.loads(text)
        return None
    except ValueError as error:
        position = getattr(error, "pos", None)
        cut = "Unterminated string" in str(error) or position is not None and position >= len(text.rstrip()) - 1
        if cut or not text.strip():
            return "truncated JSON" if text.strip() else "empty file"
        return "not JSON (%s)" % str(error)[:80]


def read_history(path: str) -> Tuple[Doc | None, str | None]:
    """-> (doc, problem): (None, None) when there is no file; (doc, None) when it reads and has the
    shape; (None, why) otherwise. Never raises: a state file must never end in a traceback."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(16 * 1024 * 1024 + 1)
    except OSError as error:
        if error.errno == errno.ENOENT:
            return None, None
        return None, "cannot be read (%s)" % (error.strerror or type(error).__name__)
    if len(raw) > 16 * 1024 * 1024:
        return None, "over 16 MiB"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, "not UTF-8 text"
    problem = parse_problem(text)
    if problem:
        return None, problem
    doc = json.loads(text)
    problem = shape_problem(doc)
    return (None, problem) if problem else (doc, None)


def aside_name(path: str, problem: str, t: float | None = None) -> str:
    """The name a history that does not read is kept under: it says so, and when.

    >>> aside_name("/v/sglang-30000.json", "truncated JSON", 0)
    '/v/sglang-30000.json.unreadable-19700101T000000Z'
    >>> aside_name("/v/s.json", "wrong shape: good[0] is int", 0)
    '/v/s.json.wrong-shape-19700101T000000Z'
    """
    kind = "wrong-shape" if problem.startswith("wrong shape") else "unreadable"
    return "%s.%s-%s" % (path, kind, time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(t if t is not None else time.time())))


def copy_time(path: str) -> str | None:
    """When the kept copy was written, as the operator reads times (``2026-12-01 21:14Z``)."""
    try:
        return time.strftime("%Y-%m-%d %H:%MZ", time.gmtime(os.stat(path).st_mtime))
    except OSError:
        return None


def recovery_text(port: int, recovered: Doc) -> str:
    """The one line that says what happened to a history that did not read.

    >>> recovery_text(30000, {"reason": "truncated JSON", "kept_as": "/v/h.unreadable-X", "copy_of": "2026-12-01 21:14Z"})
    'the history of :30000 was unreadable (truncated JSON): kept as /v/h.unreadable-X; using the copy of 2026-12-01 21:14Z'
    >>> recovery_text(30000, {"reason": "truncated JSON", "kept_as": None, "copy_of": None})[:99]
    'the history of :30000 is unreadable (truncated JSON): it is set aside by the next transition; no ea'
    """
    if recovered.get("kept_as"):
        head = "the history of :%d was unreadable (%s): kept as %s" % (int(port), recovered.get("reason"), recovered["kept_as"])
    else:
        head = "the history of :%d is unreadable (%s): it is set aside by the next transition" % (int(port), recovered.get("reason"))
        if recovered.get("aside_error"):
            head = "the history of :%d is unreadable (%s) and could not be set aside (%s)" % (
                int(port), recovered.get("reason"), recovered["aside_error"])
    if recovered.get("copy_of"):
        return head + "; using the copy of %s" % recovered["copy_of"]
    return head + "; no earlier copy reads: the history starts empty"


def load_history(port: int, repair: bool = True) -> Doc:
    """The history of ``port``. A file that does not read or has the wrong shape is never taken for
    an empty history silently: with ``repair`` (the agent's transition) it is renamed to a name that
    says so, the previous copy (``.prev``, kept by save_history) is used and written back, and the
    doc's ``recovered`` says what happened; without it (observe: read-only) the same is reported and
    the copy is used, nothing moved."""
    path = state.paths(port)["history"]
    doc, problem = read_history(path)
    if problem is None:
        doc = doc if doc is not None else empty_history(port)
        doc.setdefault("good", [])
        doc.setdefault("failed", [])
        return doc
    prev_doc, _prev_problem = read_history(path + PREV)
    recovered: Doc = {"reason": problem, "kept_as": None, "copy_of": copy_time(path + PREV) if prev_doc else None,
                 "at": state.now_iso()}
    doc = prev_doc if prev_doc is not None else empty_history(port)
    doc.setdefault("good", [])
    doc.setdefault("failed", [])
    if not repair:
        doc["recovered"] = recovered
        return doc
    kept = aside_name(path, problem)
    try:
        os.rename(path, kept)
        recovered["kept_as"] = kept
    except OSError as error:
        recovered["aside_error"] = error.strerror or type(error).__name__
    doc["recovered"] = recovered
    if recovered["kept_as"]:
        try:
            state.write_private(path, json.dumps(doc, indent=1, sort_keys=True))
        except OSError:
            pass  # the next save writes it; the copy is still in .prev
    return doc


def recovery_note(port: int, doc: Doc) -> str | None:
    """The line to report for ``doc``'s recovery, or None: shown while the file set aside exists
    (the operator removes it once looked at), or while the bad file is still in place."""
    recovered = doc.get("recovered")
    if not isinstance(recovered, dict):
        return None
    if recovered.get("kept_as") and not os.path.exists(recovered["kept_as"]):
        return None
    return recovery_text(port, recovered)


def save_history(port: int, doc: Doc) -> None:
    """Atomically replace the history; the copy it replaces (when it reads) is kept as ``.prev``
    first, so that a file cut short later still leaves the one before."""
    path = state.paths(port)["history"]
    current, problem = read_history(path)
    if current is not None and problem is None:
        state.write_private(path + PREV, json.dumps(current, indent=1, sort_keys=True))
    state.write_private(path, json.dumps(doc, indent=1, sort_keys=True))


def make_record(spec: Doc, by: str | None = None, capacity: Doc | None = None, extra: Doc | None = None) -> Doc:
    """A history record of a spec: nothing secret (flags and argv redacted, env as names, hashes
    and the values that are no secret: redact.shown_env) plus what the controller's own record
    says (redacted again here)."""
    redactor = redact.Redactor(redact.spec_secrets(spec))
    flags = tuple(redact.ALWAYS_MASKED_OPTIONS) + tuple(spec.get("secret_flags") or ())
    record = redactor.deep(dict(spec.get("record") or {}))
    env = spec.get("env") or {}
    record.update({"argv": redactor.deep(redact.redact_argv(spec.get("argv") or [], flags)),
                   "argv_hash": redact.argv_hash(spec.get("argv") or []), "env_names": sorted(env),
                   "env_hashes": dict((name, redact.env_hash(value)) for name, value in sorted(env.items())),
                   "env": redact.shown_env(dict(sorted(env.items())), spec.get("secret_env") or ()),
                   "port": spec.get("port"), "gpus": spec.get("gpus"), "supervisor": spec.get("supervisor") or "process",
                   "key": spec_key(spec), "at": state.now_iso(), "by": by})
    if spec.get("weight_cache"):
        record["weight_cache"] = {"argv": redactor.deep(redact.redact_argv((spec["weight_cache"] or {}).get("argv") or [], flags))}
    if capacity is not None:
        record["capacity"] = capacity
    if extra:
        record.update(redactor.deep(extra))
    return record


def public_history(doc: Doc, port: int | None = None) -> Doc:
    port = port or doc.get("port")
    return {"good": [entry.get("record") for entry in doc.get("good") or []],
            "failed": list(doc.get("failed") or []), "last": doc.get("last"),
            "problem": recovery_note(port, doc) if port else None}


def clean_spec(spec: Doc | None) -> Doc | None:
    """A SpecDoc without the agent's own marks (keys starting with ``_``).

    >>> clean_spec({"argv": ["a"], "_serving": True})
    {'argv': ['a']}
    """
    if not spec:
        return None
    return dict((key, value) for key, value in spec.items() if not key.startswith("_"))
