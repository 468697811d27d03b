"""SGLang's own flag table, built from SGLang's own parser (stdlib only; runs in the container).

``ServerArgs.add_cli_args(argparse.ArgumentParser())`` of the installed SGLang, read action by action:
option strings, dest, type, nargs, choices, the action's kind (store, store_true, boolean_optional,
deprecated...), default, and for a deprecated flag the warning SGLang itself prints (captured by
running the action once on a scratch namespace, so the text is SGLang's, not ours).

Three callers, one builder:

- the ``SglangFlagTable`` fact (gpugate/facts/sglang.py) sends this file inline and calls
  ``collect(...)``: it reads the installed version from package metadata (cheap, no import), and
  only when no table is cached for that version it imports ``sglang.srt.server_args`` (heavy: it
  pulls torch) and writes the table to ``/var/lib/gpugate/sglang-flags/<version>-<sha256 of
  server_args.py>.json``. Later runs only read that file. The cache write is the one write a fact
  of gpugate makes (docs/flags.md says why);
- ``scripts/sglang_flags_snapshot.py`` runs ``python3 table_builder.py --help-text`` against a wheel
  unpacked into a temporary target, to make the snapshots shipped in gpugate/engine/sglang/flagtables/;
- the lab's stand-in is importable as ``sglang.srt.server_args``, so the same code builds a table
  from it in a lab container.

The import runs with ``CUDA_VISIBLE_DEVICES=""`` (set before anything imports torch) so that a table
build never opens a GPU: a plan must not become a GPU holder. Its stdout is sent to stderr while
SGLang imports, so that whatever SGLang prints cannot be mistaken for the one JSON answer.

Example (in a container)::

    $ python3 table_builder.py --cache-dir /var/lib/gpugate/sglang-flags
    {"schema": 1, "version": "0.5.23", "server_args_sha256": "...", "cached": false, "build_s": 4.7,
     "table": {"schema": 1, "sglang_version": "0.5.23", "option_count": 560, "actions": [...]}}
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time

SCHEMA = 1
CACHE_DIR = "/var/lib/gpugate/sglang-flags"
# Types SGLang passes to add_argument, by the names the table records. Anything else is recorded
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


# ------------------------------------------------------------------------------ cheap reads
def installed_version():
    """The installed SGLang's version from package metadata (never imports sglang), or None."""
    try:
        from importlib import metadata
    except ImportError:  # Python < 3.8
        return None
    try:
        return metadata.version("sglang")
    except Exception:  # PackageNotFoundError, a broken dist-info
        return None


def server_args_file():
    """The path of ``sglang/srt/server_args.py`` (found without importing sglang), or None."""
    import importlib.util
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    roots = list(spec.submodule_search_locations or [])
    if not roots and spec.origin:
        roots = [os.path.dirname(spec.origin)]
    for root in roots:
        path = os.path.join(root, "srt", "server_args.py")
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
    """What SGLang says when ``action`` (a deprecated flag) is used: the action is run once on a
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
        action(_ScratchParser(prog="sglang"), argparse.Namespace(), values, option)
    except _ErrorRaised as error:
        handler.messages.append(str(error))
    except Exception as error:  # a deprecated action we cannot run without real values
        handler.messages.append("(could not capture SGLang's text: %s)" % type(error).__name__)
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    return " ".join(_strip_ansi(m).strip() for m in handler.messages if m.strip())


def describe_action(action, include_help=False):
    """One argparse action as a JSON-able dict (the table's row)."""
    cls = type(action).__name__
    kind = _KINDS.get(cls)
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
    if kind is None:
        # SGLang's own Action subclasses: deprecated flags, LoRAPathAction... The deprecated ones
        # carry new_flag / const_value / error_message; record them and SGLang's own words.
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


def table_from_parser(parser, version, sha, include_help=False, source=""):
    """The table of an argparse parser that SGLang's ``add_cli_args`` filled."""
    actions = [describe_action(a, include_help) for a in parser._actions
               if a.option_strings and not isinstance(a, argparse._HelpAction)]
    names = sorted({o for row in actions for o in row["options"]})
    return {"schema": SCHEMA, "sglang_version": version, "server_args_sha256": sha, "source": source,
            "option_count": len(names), "actions": actions}


# ------------------------------------------------------------------------------ build / cache
def build(include_help=False, source="container"):
    """Import the installed SGLang's server_args and describe its parser. Heavy (torch)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # never open a GPU to read a parser
    path = server_args_file()
    if path is None:
        raise RuntimeError("no sglang package (sglang/srt/server_args.py) for this python")
    version = installed_version()
    saved = os.dup(1)
    os.dup2(2, 1)  # anything SGLang prints while importing goes to stderr, not into our answer
    try:
        began = time.monotonic()
        from sglang.srt.server_args import ServerArgs
        imported = time.monotonic() - began
        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        if version is None:
            import sglang
            version = getattr(sglang, "__version__", None) or "unknown"
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
    table = table_from_parser(parser, version, sha256_file(path), include_help, source)
    table["import_s"] = round(imported, 3)
    return table


def _write_atomic(path, text):
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=0o755, exist_ok=True)
    tmp = "%s.tmp.%d" % (path, os.getpid())
    with open(tmp, "w") as handle:
        handle.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def collect(cache_dir=CACHE_DIR, known=(), build_if_missing=True, include_help=False):
    """The fact's answer: version, server_args.py's sha, and the table unless the controller
    already ``known``s its key. Builds (and caches) the table the first time for a version.

    -> {"schema", "version", "server_args_sha256", "key", "cache_path", "cached": bool,
        "built": bool, "build_s": float|None, "table": {...} (absent when known), "error": str}
    """
    out = {"schema": SCHEMA, "version": installed_version(), "server_args_sha256": None, "key": None,
           "cache_path": None, "cached": False, "built": False, "build_s": None}
    path = server_args_file()
    if path is None:
        out["error"] = "no sglang package for this python (sglang/srt/server_args.py not found)"
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
            table = build(include_help=include_help)
        except BaseException as error:  # SGLang that does not import: say so, never a traceback
            out["error"] = "building SGLang's flag table failed: %s: %s" % (type(error).__name__, str(error)[:400])
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


def main(argv=None):
    parser = argparse.ArgumentParser(description="print SGLang's own flag table as JSON")
    parser.add_argument("--cache-dir", default=CACHE_DIR)
    parser.add_argument("--no-cache", action="store_true", help="build, print, write nothing")
    parser.add_argument("--help-text", action="store_true", help="keep each flag's help text")
    parser.add_argument("--source", default="container", help="what the table was built from")
    args = parser.parse_args(argv)
    if args.no_cache:
        document = build(include_help=args.help_text, source=args.source)
    else:
        document = collect(args.cache_dir, include_help=args.help_text)
    sys.stdout.write(json.dumps(document, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
