"""SGLang's own flag table, built from SGLang's own parser (stdlib only; runs in the container). What
is SGLang's here (where its release and parser are); the description of the parser and the cache
are gpugate/engine/argparse_table.py's, sent inline beside this file.

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
- ``scripts/flags_snapshot.py sglang`` runs ``python3 table_builder.py --help-text`` against a wheel
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
import os
import sys
import time

try:  # sent inline into a container: registered beside this file
    import gpugate_argparse_table as core
except ImportError:
    from gpugate.engine import argparse_table as core

LABEL = "SGLang"
PACKAGE = "sglang"
SOURCE_NAME = "sglang/srt/server_args.py"
CACHE_DIR = "/var/lib/gpugate/sglang-flags"
cache_key = core.cache_key


def installed_version():
    """The installed SGLang's version from package metadata (never imports sglang), or None."""
    return core.installed_version(PACKAGE)


def source_file():
    """The path of ``SOURCE_NAME`` (found without importing sglang), or None."""
    return core.source_file(PACKAGE, SOURCE_NAME)


def build(include_help=False, source="container"):
    """Import the installed SGLang's server_args and describe its parser. Heavy (torch)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # never open a GPU to read a parser
    path = source_file()
    if path is None:
        raise RuntimeError("no sglang package (sglang/srt/server_args.py) for this python")
    version = installed_version()
    saved = core.quiet_stdout()
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
        core.restore_stdout(saved)
    table = core.table_from_parser(parser, version, core.sha256_file(path), include_help, source)
    table["import_s"] = round(imported, 3)
    return table


def collect(cache_dir=CACHE_DIR, known=(), build_if_missing=True, include_help=False):
    """The fact's answer (gpugate/engine/argparse_table.py's ``collect`` for SGLang)."""
    return core.collect(cache_dir, sys.modules[__name__], known, build_if_missing, include_help)


if __name__ == "__main__":
    sys.exit(core.main(sys.modules[__name__]))
