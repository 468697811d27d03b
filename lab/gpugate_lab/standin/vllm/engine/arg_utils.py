"""``vllm.engine.arg_utils`` of the lab's stand-in: vLLM's serve flags, rebuilt from a snapshot.

``add_cli_args(parser)`` declares exactly the options of one vLLM release's ``vllm serve`` parser
(``make_arg_parser``: the frontend's options and ``AsyncEngineArgs.add_cli_args``), read from
``flag_table.json`` beside this file: the snapshot made from that release's wheel by
scripts/flags_snapshot.py vllm (gpugate/engine/vllm/flagtables/vllm-<version>.json), installed by the
lab. Never gpugate's own validation (gpugate/engine/vllm/flags.py): the same snapshot through other
code, so a flag gpugate lets through that this vLLM refuses is refused as vLLM would (exit 2).

Rebuilt per option (the lab's shared rebuild, standin/_common.py ``add_table_action``): option
strings, dest, nargs, choices, default, switches (vLLM's ``EnableDisableAction``, from
vllm/utils/argparse_utils.py), ``--middleware`` (append), ``--lora-modules``; vLLM's converters by
name, as vllm/engine/arg_utils.py has them: ``optional_type`` ("" and "None" are None), ``parse_type``,
``union_dict_and_str``, ``parse_reasoning_parser``, ``human_readable_int[_or_auto]``; a config
dataclass's JSON (``parse_dataclass``) must be JSON. ``optional_type`` does not say which type it
wraps in the table: the text is kept. ``--log-config-file`` warns as vLLM's
``DeprecatedLogConfigFileAction`` does (``warnings.warn``). Each converter and action class carries
vLLM's module and name, so gpugate's table builder (gpugate/engine/vllm/table_builder.py) reads back
the table it was built from.
"""

import argparse
import json
import os
import re
import warnings

from vllm._lab import common
from vllm.utils.argparse_utils import EnableDisableAction, human_readable_int, human_readable_int_or_auto

TABLE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flag_table.json")
_LOG_CONFIG_FILE_DEPRECATION_MESSAGE = ("--log-config-file is deprecated and will be removed in v0.33.0. Use "
                                        "--logging-config.pylogging_config_file instead.")


def load_table(path=TABLE_FILE):
    with open(path) as handle:
        return json.load(handle)


def _optional(text):
    return None if text in ("", "None") else text


def _union_dict_and_str(text):
    if not re.match(r"(?s)^\s*{.*}\s*$", text):
        return str(text)
    return None if text in ("", "None") else json.loads(text)


def _json_config(text):
    try:
        return json.loads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(repr(error))


# vLLM's converters by their last name (the table records "<module>.<qualname>")
BODIES = {"_optional_type": _optional, "_parse_type": lambda text: text, "union_dict_and_str": _union_dict_and_str,
          "parse_reasoning_parser": lambda text: "" if text.lower() == "none" else text,
          "human_readable_int": human_readable_int, "human_readable_int_or_auto": human_readable_int_or_auto,
          "parse_dataclass": _json_config}


class DeprecatedLogConfigFileAction(argparse.Action):
    """Warn when the legacy ``--log-config-file`` option is used."""

    def __call__(self, parser, namespace, values, option_string=None):
        warnings.warn(_LOG_CONFIG_FILE_DEPRECATION_MESSAGE, stacklevel=1)
        setattr(namespace, self.dest, values)


class _PlainSwitch(argparse.BooleanOptionalAction):
    """A release before EnableDisableAction (0.32: ``--x/--no-x``): argparse's own switch, which vLLM's
    FlexibleArgumentParser would otherwise swap for EnableDisableAction (its registry)."""


_PlainSwitch.__module__, _PlainSwitch.__name__, _PlainSwitch.__qualname__ = ("argparse", "BooleanOptionalAction",
                                                                            "BooleanOptionalAction")
CLASSES = {"vllm.utils.argparse_utils.EnableDisableAction": EnableDisableAction,
           "argparse.BooleanOptionalAction": _PlainSwitch,
           "vllm.engine.arg_utils.DeprecatedLogConfigFileAction": DeprecatedLogConfigFileAction}


def add_cli_args(parser, table=None):
    """Every option of the snapshot's ``vllm serve`` parser, in its order."""
    for row in (table or load_table())["actions"]:
        common.add_table_action(parser, row, BODIES, CLASSES, repr_defaults=True)
    return parser


class AsyncEngineArgs:
    """Only what the stand-in needs of vLLM's AsyncEngineArgs: the CLI declaration."""

    add_cli_args = staticmethod(add_cli_args)
