"""``sglang.srt.server_args`` of the lab's stand-in: SGLang's own parser, rebuilt from a snapshot.

``ServerArgs.add_cli_args(parser)`` declares exactly the actions of one SGLang release, read from
``flag_table.json`` beside this file: a snapshot made from that release's wheel by
scripts/flags_snapshot.py sglang (gpugate/engine/sglang/flagtables/sglang-<version>.json), installed by
``gpugate lab up --sglang-version``. Never gpugate's own validation (gpugate/engine/sglang/flags.py): the
stand-in and gpugate read the same snapshot through different code, so when gpugate lets a flag
through that this SGLang refuses, the stand-in refuses it as SGLang would (argparse's message, exit 2).

What is rebuilt, per action: option strings, dest, nargs, choices, default, required, store_true /
store_const / ``--x/--no-x`` switches; SGLang's deprecated flags warn with SGLang's recorded words
(or stop, for a retired flag with an error message); types int, float, str and json.loads, and
SGLang's own converters by name (``human_readable_int``, ``nullable_str``, ``json_list_type``,
``parse_cuda_graph_backend_arg``); any other converter takes the text as it is. Each rebuilt
converter and action class carries SGLang's module and name, so gpugate's table builder
(gpugate/engine/sglang/table_builder.py) reads back the table it was built from.

Stdlib only (runs under the container's python3).
"""

import argparse
import json
import logging
import os
import re

from sglang._sim import common

TABLE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flag_table.json")


def load_table(path=TABLE_FILE):
    with open(path) as handle:
        return json.load(handle)


# ---------------------------------------------------------------- SGLang's converters, by name
def _human_readable_int(value):
    value = value.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)", value)
    if match:
        number, suffix = match.groups()
        iec = {"Ki": 2 ** 10, "Mi": 2 ** 20, "Gi": 2 ** 30, "Ti": 2 ** 40}
        if suffix in iec:
            if "." in number:
                raise argparse.ArgumentTypeError("Decimals are not allowed with IEC suffixes like '%s'." % suffix)
            return int(number) * iec[suffix]
        return int(float(number) * {"k": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9, "T": 10 ** 12}[suffix])
    return int(value)


def _nullable_str(value):
    return None if not value or value == "None" else value


def _json_list_type(value):
    try:
        return json.loads(value)
    except ValueError:
        raise argparse.ArgumentTypeError("Invalid JSON list: %s. Please provide a valid JSON list." % value)


def _cuda_graph_backend(raw):
    if raw == "tc_piecewise":
        raise argparse.ArgumentTypeError("tc_piecewise was removed; select breakable, full, or disabled")
    return raw


def _cuda_graph_config(raw):
    try:
        parsed = json.loads(raw)
    except ValueError as error:
        raise argparse.ArgumentTypeError("--cuda-graph-config must be JSON: %s" % error)
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError("--cuda-graph-config must be a JSON object, got %s" % type(parsed).__name__)
    return parsed


_CONVERTERS = {"human_readable_int": _human_readable_int, "nullable_str": _nullable_str,
               "json_list_type": _json_list_type, "parse_cuda_graph_backend_arg": _cuda_graph_backend,
               "parse_cuda_graph_config_arg": _cuda_graph_config}


def _warn(message):
    # SGLang's print_deprecated_warning: logger.warning(...), before logging is configured, so
    # Python's last-resort handler writes the bare message to stderr
    logging.getLogger("sglang.srt.arg_groups.argparse_actions").warning(message)


def add_action(parser, row):
    """Declare one table row on ``parser`` as SGLang declared it (the lab's shared rebuild,
    standin/_common.py ``add_table_action``, with SGLang's converters and its deprecation warning)."""
    return common.add_table_action(parser, row, _CONVERTERS, warn=_warn)


class ServerArgs:
    """Only what gpugate and the stand-in need of SGLang's ServerArgs: the CLI declaration."""

    @staticmethod
    def add_cli_args(parser, table=None):
        for row in (table or load_table())["actions"]:
            add_action(parser, row)


def prepare_server_args(argv, prog="launch_server.py"):
    """Parse ``argv`` as SGLang does (argparse; exits 2 with argparse's message on a bad flag), then set
    up logging as 0.5.23's ``prepare_server_args`` does before ``ServerArgs.__post_init__``:
    ``basicConfig(level=<--log-level>, format="[%(asctime)s] %(message)s", datefmt="%Y-%m-%d %H:%M:%S",
    force=True)``. (0.5.23's own prog is ``sglang serve``; the weight-cache daemon passes it.)"""
    parser = argparse.ArgumentParser(prog=prog)
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    level = getattr(logging, str(getattr(args, "log_level", None) or "info").upper(), logging.INFO)
    logging.basicConfig(level=level, format="[%(asctime)s] %(message)s", datefmt="%Y-%m-%d %H:%M:%S", force=True)
    return args
