"""vLLM's own flag table, built from vLLM's own parser (stdlib only; runs in the container): the
parser ``vllm serve`` parses, ``make_arg_parser(FlexibleArgumentParser())`` (the frontend's options
and ``AsyncEngineArgs.add_cli_args``). What is vLLM's here (where its release and its parser are);
the description of the parser and the cache are gpugate/engine/argparse_table.py's, sent inline
beside this file.

Two callers, one builder: the ``EngineFlagTable`` fact (through ``Engine.table_command``) in a
container where vLLM is installed, and ``scripts/flags_snapshot.py vllm VERSION`` against the real
wheel (the snapshots in gpugate/engine/vllm/flagtables/). The lab's stand-in is importable under
the same module names, so the same code builds a table from it in a lab container.

Example (in a container)::

    $ python3 table_builder.py --cache-dir /var/lib/gpugate/vllm-flags
    {"schema": 1, "version": "0.33.0", "key": "0.33.0-...", "cached": false, "table": {...}}
"""

from __future__ import annotations

import os
import sys
import time

try:  # sent inline into a container: registered beside this file
    import gpugate_argparse_table as core
except ImportError:
    from gpugate.engine import argparse_table as core

LABEL = "vLLM"
PACKAGE = "vllm"
SOURCE_NAME = "vllm/engine/arg_utils.py"
CACHE_DIR = "/var/lib/gpugate/vllm-flags"
VERSION_KEY = "vllm_version"
cache_key = core.cache_key


def installed_version():
    """The installed vLLM's version from package metadata (never imports vllm), or None."""
    return core.installed_version(PACKAGE)


def source_file():
    """The path of ``SOURCE_NAME`` (found without importing vllm), or None."""
    return core.source_file(PACKAGE, SOURCE_NAME)


# where releases keep the serve parser's maker, newest first (0.33: entrypoints.common; 0.32:
# entrypoints.launchers; before: entrypoints.openai)
PARSER_MODULES = ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.launchers.cli_args",
                  "vllm.entrypoints.openai.cli_args")


def _parser():
    """vLLM's serve parser, wherever the release keeps it (FlexibleArgumentParser moved to
    vllm.utils.argparse_utils too)."""
    import importlib
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ModuleNotFoundError as missing:
        if missing.name != "vllm.utils.argparse_utils":
            raise  # a module the release needs: the error names it
        from vllm.utils import FlexibleArgumentParser
    for name in PARSER_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as missing:
            if missing.name is None or not name.startswith(missing.name):
                raise  # not this candidate's absence: a module the release needs
            continue
        return module.make_arg_parser(FlexibleArgumentParser())
    raise ModuleNotFoundError("no make_arg_parser in %s" % ", ".join(PARSER_MODULES), name=PARSER_MODULES[-1])


def build(include_help=False, source="container"):
    """Import the installed vLLM's parser and describe it. Heavy (torch)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # never open a GPU to read a parser
    path = source_file()
    if path is None:
        raise RuntimeError("no vllm package (vllm/engine/arg_utils.py) for this python")
    version = installed_version()
    saved = core.quiet_stdout()
    try:
        began = time.monotonic()
        parser = _parser()
        imported = time.monotonic() - began
        if version is None:
            import vllm
            version = getattr(vllm, "__version__", None) or "unknown"
    finally:
        core.restore_stdout(saved)
    table = core.table_from_parser(parser, version, core.sha256_file(path), include_help, source, VERSION_KEY)
    table["import_s"] = round(imported, 3)
    return table


def collect(cache_dir=CACHE_DIR, known=(), build_if_missing=True, include_help=False):
    """The fact's answer (gpugate/engine/argparse_table.py's ``collect`` for vLLM)."""
    return core.collect(cache_dir, sys.modules[__name__], known, build_if_missing, include_help)


if __name__ == "__main__":
    sys.exit(core.main(sys.modules[__name__]))
