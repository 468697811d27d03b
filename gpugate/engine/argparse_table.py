"""An engine's flag table read from its own argparse parser (stdlib only; runs in the container and
in scripts/flags_snapshot.py): every action described as data (option strings, dest, type, nargs,
choices, kind, default; for a deprecated flag the engine's own warning), and the container's cache
of those tables (``collect``). Each engine's ``table_builder.py`` says how to find its release and
fill a parser; this is the rest, shared. Sent inline beside it as ``gpugate_argparse_table``.

Example::

    >>> import argparse
    >>> parser = argparse.ArgumentParser()
    >>> _ = parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    >>> row = table_from_parser(parser, "1.0", "ab" * 32)["actions"][0]
    >>> row["options"], row["kind"], row["choices"]
    (['--kv-cache-dtype'], 'store', ['auto', 'fp8'])
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import time

SCHEMA = 1
# Types an engine passes to add_argument, by the names the table records. Anything else is recorded
# as "<module>.<qualname>" (a converter gpugate cannot run: values are passed as text, unchecked).
_PLAIN_TYPES = {str: "str", int: "int", float: "float", json.loads: "json"}
_KINDS = {
    "_StoreAction": "store",
    "_StoreTrueAction": "store_true",
    "_StoreFalseAction": "store_false",
    "_StoreConstAction": "store_const",
    "_AppendAction": "append",
    "_AppendConstAction": "append_const",
    "_CountAction": "count",
    "_ExtendAction": "extend",
    "BooleanOptionalAction": "boolean_optional",
}


def installed_version(package):
    """The installed ``package``'s version from its metadata (never imports it), or None."""
    try:
        from importlib import metadata
        return metadata.version(package)
    except Exception:  # PackageNotFoundError, a broken dist-info
        return None


def source_file(package, name):
    """The path of ``name`` (``sglang/srt/server_args.py``) in the installed ``package``, found
    without importing it, or None."""
    import importlib.util
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    roots = list(spec.submodule_search_locations or [])
    if not roots and spec.origin:
        roots = [os.path.dirname(spec.origin)]
    for root in roots:
        path = os.path.join(root, *name.split("/")[1:])
        if os.path.isfile(path):
            return path
    return None


def sha256_file(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 16), b""):
            digest.update(block)
    return digest.hexdigest()


def cache_key(version, sha):
    """``<version>-<first 16 hex of the sha>``: the cache file's name without ``.json``."""
    safe = "".join(c if c.isalnum() or c in ".+-_" else "_" for c in str(version))
    return "%s-%s" % (safe, sha[:16])


# ------------------------------------------------------------------------------ one action
def _json_value(value):
    """A default as JSON: itself when JSON can carry it, else {"repr": ...}."""
    try:
        json.dumps(value, allow_nan=False)
        return value
    except (TypeError, ValueError):
        return {"repr": repr(value)[:200]}


def _type_name(converter):
    if converter is None:
        return None
    for known, name in _PLAIN_TYPES.items():
        if converter is known:
            return name
    module = getattr(converter, "__module__", None) or "?"
    qualname = getattr(converter, "__qualname__", None) or getattr(converter, "__name__", None) or repr(converter)
    return "%s.%s" % (module, qualname)


class _Captured(logging.Handler):
    def __init__(self):
        logging.Handler.__init__(self)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


class _ErrorRaised(Exception):
    pass


class _ScratchParser(argparse.ArgumentParser):
    def error(self, message):
        raise _ErrorRaised(message)


def _strip_ansi(text):
    out, skip = [], False
    for char in text:
        if char == "\x1b":
            skip = True
            continue
        if skip:
            if char.isalpha():
                skip = False
            continue
        out.append(char)
    return "".join(out)


def deprecation_text(action):
    """What the engine says when ``action`` (a deprecated flag) is used: the action is run once on a
    scratch namespace, its logged warning (or its parser error) captured. '' when it says nothing."""
    handler = _Captured()
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    option = action.option_strings[0] if action.option_strings else ""
    nargs = action.nargs
    values = [] if nargs in (0, "*") else (None if nargs in (None, "?") else [])
    if nargs is None and action.choices:
        values = list(action.choices)[0]
    try:
        action(_ScratchParser(prog="server"), argparse.Namespace(), values, option)
    except _ErrorRaised as error:
        handler.messages.append(str(error))
    except Exception as error:  # a deprecated action we cannot run without real values
        handler.messages.append("(could not capture the engine's text: %s)" % type(error).__name__)
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    return " ".join(_strip_ansi(m).strip() for m in handler.messages if m.strip())


def negatives(action):
    """The option strings of a switch (argparse's BooleanOptionalAction or a subclass: vLLM's
    EnableDisableAction pairs --enable-x with --disable-x) that store False, found by running the
    action once per option on a scratch namespace."""
    out = []
    for option in action.option_strings:
        scratch = argparse.Namespace()
        try:
            action(_ScratchParser(prog="server"), scratch, None, option)
        except Exception:  # noqa: BLE001 -- an action that needs more: no negative known
            continue
        if getattr(scratch, action.dest, None) is False:
            out.append(option)
    return out


def describe_action(action, include_help=False):
    """One argparse action as a JSON-able dict (the table's row)."""
    cls = type(action).__name__
    kind = _KINDS.get(cls)
    if kind is None and isinstance(action, argparse.BooleanOptionalAction):
        kind = "boolean_optional"  # a subclass (vLLM's EnableDisableAction): a switch all the same
    row = {
        "options": list(action.option_strings),
        "dest": action.dest,
        "kind": kind or "custom",
        "action_class": "%s.%s" % (type(action).__module__, cls),
        "type": _type_name(action.type),
        "nargs": action.nargs,
        "choices": [_json_value(c) for c in action.choices] if action.choices is not None else None,
        "default": _json_value(action.default),
        "required": bool(action.required),
    }
    if action.const is not None:
        row["const"] = _json_value(action.const)
    if kind == "boolean_optional":
        row["negatives"] = negatives(action)
    if kind is None:
        # The engine's own Action subclasses (SGLang's deprecated flags, LoRAPathAction...). The
        # deprecated ones carry new_flag / const_value / error_message; record them and its own words.
        if "Deprecated" in cls:
            row["deprecated"] = {
                "new_flag": getattr(action, "new_flag", None),
                "error_message": getattr(action, "error_message", None),
                "const_value": _json_value(getattr(action, "const_value", None)),
                "message": deprecation_text(action),
                "stops": getattr(action, "error_message", None) is not None,
            }
            if action.nargs == 0:
                row["kind"] = "store_true" if "StoreTrue" in cls else "store_const"
            else:
                row["kind"] = "store"
        elif action.nargs == 0:
            row["kind"] = "store_const"
        else:
            row["kind"] = "store"
    if include_help or row.get("deprecated"):
        row["help"] = action.help if isinstance(action.help, str) else None
    return row


def table_from_parser(parser, version, sha, include_help=False, source="", version_key="sglang_version"):
    """The table of an argparse parser the engine filled (``version_key``: how the document names
    the release: ``sglang_version``, ``vllm_version``)."""
    actions = [describe_action(a, include_help) for a in parser._actions
               if a.option_strings and not isinstance(a, argparse._HelpAction)]
    names = sorted({o for row in actions for o in row["options"]})
    return {"schema": SCHEMA, version_key: version, "server_args_sha256": sha, "source": source,
            "option_count": len(names), "actions": actions}



def _write_atomic(path, text):
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=0o755, exist_ok=True)
    tmp = "%s.tmp.%d" % (path, os.getpid())
    with open(tmp, "w") as handle:
        handle.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def collect(cache_dir, engine, known=(), build_if_missing=True, include_help=False):
    """The fact's answer: version, the parser source's sha, and the table unless the controller
    already ``known``s its key. Builds (and caches) the table the first time for a version.
    ``engine``: the engine's builder module (``installed_version()``, ``source_file()``,
    ``build(include_help)``, ``LABEL``, ``PACKAGE``).

    -> {"schema", "version", "server_args_sha256", "key", "cache_path", "cached": bool,
        "built": bool, "build_s": float|None, "table": {...} (absent when known), "error": str}
    """
    out = {"schema": SCHEMA, "version": engine.installed_version(), "server_args_sha256": None, "key": None,
           "cache_path": None, "cached": False, "built": False, "build_s": None}
    path = engine.source_file()
    if path is None:
        out["error"] = "no %s package for this python (%s not found)" % (engine.PACKAGE, engine.SOURCE_NAME)
        return out
    sha = sha256_file(path)
    version = out["version"] or "unknown"
    key = cache_key(version, sha)
    cache_path = os.path.join(cache_dir, key + ".json")
    out.update(server_args_sha256=sha, key=key, cache_path=cache_path)
    table = None
    if os.path.isfile(cache_path):
        try:
            with open(cache_path) as handle:
                table = json.load(handle)
            out["cached"] = True
        except (OSError, ValueError):
            table = None  # a torn or foreign file: rebuild it
    if table is None:
        if not build_if_missing:
            out["error"] = "no cached table for %s" % key
            return out
        began = time.monotonic()
        try:
            table = engine.build(include_help=include_help)
        except BaseException as error:  # an engine that does not import: say so, never a traceback
            out["error"] = "building %s's flag table failed: %s: %s" % (engine.LABEL, type(error).__name__,
                                                                      str(error)[:400])
            return out
        out["build_s"] = round(time.monotonic() - began, 3)
        out["built"] = True
        try:
            _write_atomic(cache_path, json.dumps(table, sort_keys=True))
        except OSError as error:
            out["cache_error"] = "%s: %s" % (type(error).__name__, error)
    if key not in set(known or ()):
        out["table"] = table
    return out


def quiet_stdout():
    """Send fd 1 to stderr while an engine imports (whatever it prints cannot be mistaken for the
    one JSON answer); returns the saved fd for :func:`restore_stdout`."""
    saved = os.dup(1)
    os.dup2(2, 1)
    return saved


def restore_stdout(saved):
    import sys
    sys.stdout.flush()
    os.dup2(saved, 1)
    os.close(saved)


def main(engine, argv=None):
    """``python3 table_builder.py [--no-cache] [--help-text]``: the table as JSON on stdout."""
    import sys
    parser = argparse.ArgumentParser(description="print %s's own flag table as JSON" % engine.LABEL)
    parser.add_argument("--cache-dir", default=engine.CACHE_DIR)
    parser.add_argument("--no-cache", action="store_true", help="build, print, write nothing")
    parser.add_argument("--help-text", action="store_true", help="keep each flag's help text")
    parser.add_argument("--source", default="container", help="what the table was built from")
    args = parser.parse_args(argv)
    if args.no_cache:
        document = engine.build(include_help=args.help_text, source=args.source)
    else:
        document = collect(args.cache_dir, engine, include_help=args.help_text)
    sys.stdout.write(json.dumps(document, sort_keys=True) + "\n")
    return 0
