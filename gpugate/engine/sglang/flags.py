"""SGLang's server flags, version by version: validation, argv render/parse, diffs (the engine-neutral
machinery is gpugate/engine/argflags.py; this is SGLang's overlay and its bound functions).

The flag set is SGLang's own, never a table written by hand (docs/flags.md):

- a ``FlagTable`` is built from SGLang's parser (``ServerArgs.add_cli_args``) by
  gpugate/engine/sglang/table_builder.py: in the container, for the SGLang installed there (the
  ``SglangFlagTable`` fact, cached in ``/var/lib/gpugate/sglang-flags/``), or from a release's wheel
  (scripts/flags_snapshot.py sglang -> the snapshots in gpugate/engine/sglang/flagtables/);
- ``table=None`` everywhere means the union of the snapshots: "a flag of some SGLang release gpugate
  has a snapshot of". It is what a fleet file is checked against when no version is known yet; the
  plan checks the flags again against the table of the SGLang that will run (``choose_table``);
- gpugate's own knowledge is a small overlay (``SECRET_FLAGS``, ``SEPARATE_FIELDS``, ``SHORT_NAMES``,
  the known conflicts in ``_check_conflicts``): what SGLang's parser does not declare.

Vocabulary
----------
- *canonical name*: an option string of SGLang without dashes: the one spelled like the ServerArgs
  field (``tp-size``, ``kv-cache-dtype``), else the action's first (``monokernel-backend``).
  Other spellings (``--tensor-parallel-size``, ``tp_size``, the short ``tp``) map onto it.
- *normalised flags*: ``dict[canonical name, typed value]``; a store_true switch that is set is
  ``True``, one that is not set is absent (``disable-radix-cache: false`` == not given); an
  ``--x/--no-x`` switch keeps ``False`` (it renders ``--no-x``).

Example::

    >>> t = load_snapshot("0.5.23")
    >>> validate_flags({"tp": 8, "kv-cache-dtype": "nvfp4"}, table=t)
    {'kv-cache-dtype': 'nvfp4', 'tp-size': 8}
    >>> validate_flags({"cuda-graph-max-bs": 256}, table=t)  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    FlagError: --cuda-graph-max-bs: not a flag of SGLang 0.5.23 (did you mean --cuda-graph-max-bs-decode?)
    >>> flag_warnings({"disable-cuda-graph": True}, table=t)[0][:60]
    "--disable-cuda-graph is deprecated in SGLang 0.5.23: '--disa"
    >>> FLAGS.redact_flags({"tp-size": 8, "api-key": "sk-1", "model-loader-extra-config": '{"hf_token":"hf_1"}'})
    {'tp-size': 8, 'api-key': '***', 'model-loader-extra-config': '***'}

More, on SGLang's tables (the functions bound to :data:`FLAGS`)::

    >>> canonical_name("--tp"), canonical_name("tp_size"), canonical_name("tensor-parallel-size")
    ('tp-size', 'tp-size', 'tp-size')
    >>> canonical_name("cuda-graph-max-bs", "0.5.23")  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    FlagError: --cuda-graph-max-bs: not a flag of SGLang 0.5.23 (did you mean --cuda-graph-max-bs-decode?)
    >>> check_report({"cuda-graph-max-bs": 256}, "0.5.23")[1][0]
    'REFUSED by SGLang 0.5.23 (snapshot, pinned): --cuda-graph-max-bs: not a flag of SGLang 0.5.23 (did you mean --cuda-graph-max-bs-decode or --cuda-graph-max-bs-prefill?)'
    >>> choose_table(None, "0.5.23")[1]
    "the snapshot of SGLang 0.5.23 (pinned; the container's own table is not known)"
    >>> diff_flags({"kv-cache-dtype": "auto"}, {"kv-cache-dtype": "fp8_e4m3"}).lines()
    ['- --kv-cache-dtype auto', '+ --kv-cache-dtype fp8_e4m3']
    >>> flag_warnings({"disable-cuda-graph": True}, "0.5.23")  # doctest: +ELLIPSIS
    ["--disable-cuda-graph is deprecated in SGLang 0.5.23: '--disable-cuda-graph' is deprecated and will be removed in a future release. Use '--cuda-graph-backend-{decode,prefill}=disabled' instead."]
    >>> is_secret_value("api-key", "sk-1"), is_secret_value("model-loader-extra-config", '{"hf_token": "x"}')
    (True, True)
    >>> is_secret_value("json-model-override-args", '{"rope_theta": 1000000}')
    False
    >>> p = parse_argv(["python3", "-m", "sglang.launch_server", "--model-path", "/m",
    ...                 "--port=31000", "--tp", "8", "--disable-radix-cache", "--new-flag", "x"])
    >>> p.model_path, p.port, p.flags
    ('/m', 31000, {'disable-radix-cache': True, 'new-flag': 'x', 'tp-size': 8})
    >>> secret_flag_options({"model-loader-extra-config": '{"hf_token":"x"}', "api-key": "k", "tp-size": 2})
    ['--model-loader-extra-config']
    >>> server_info_view({"tp": 8, "kv-cache-dtype": "fp8_e4m3", "disable-radix-cache": True})
    {'disable_radix_cache': True, 'kv_cache_dtype': 'fp8_e4m3', 'tp_size': 8}
    >>> supports("gated-launch-port", "0.5.23"), supports("gated-launch-port", "0.5.10")
    (True, False)
    >>> validate_flags({"tp": 8, "mem-fraction-static": 0.88, "disable-radix-cache": False})
    {'mem-fraction-static': 0.88, 'tp-size': 8}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import gpugate.engine as engine_seam
from gpugate.engine import argflags
from gpugate.engine.argflags import FlagDiff, FlagSpec, FlagTable, ParsedCommand
from gpugate.engine.sglang import table_builder
from gpugate.rules.redact import SECRET_FLAGS, json_holds_secret

__all__ = ["FlagError", "FlagSpec", "FlagTable", "FlagDiff", "ParsedCommand", "SPECS", "SEPARATE_FIELDS", "SECRET_FLAGS",
           "SHORT_NAMES", "json_holds_secret", "render_argv", "server_args_start", "version_mismatch",
           "weight_cache_argv", "DEFAULT_HOST", "DEFAULT_PORT", "FLAGS",
           "canonical_name", "validate_flags", "flag_warnings", "render_flag_args", "parse_argv", "diff_flags", "build_parser", "server_info_view", "server_info_mismatches", "is_secret_value", "secret_flag_options", "redact_argv", "snapshot_versions", "load_snapshot", "newest_snapshot", "union_table", "table_from_doc", "resolve_table", "choose_table", "known_table_keys", "remember_table", "cached_table_doc", "check_report", "supports", "table_command", "fetch_table"]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 30000
SNAPSHOT_DIR = Path(__file__).resolve().parent / "flagtables"

# ------------------------------------------------------------------------------------------
# gpugate's overlay: what SGLang's parser does not say
# ------------------------------------------------------------------------------------------

# Flags whose values are secrets (SECRET_FLAGS, and names ending in api-key, password, secret): never
# shown in a diff, a log, an error, a record. gpugate.rules.redact holds them, for the agent too.

# Fields of the fleet entry, not flags: given as flags they would be rendered twice (and the
# port is what gpugate uses to find and health-check the server). `config` would hide the real
# flags from gpugate in a file it does not read.
SEPARATE_FIELDS: dict[str, str] = {
    "model-path": "set the model as sglang.model_path, not as a flag",
    "model": "set the model as sglang.model_path, not as a flag",
    "port": "set the port as sglang.port, not as a flag",
    "host": "set the host as sglang.host, not as a flag",
    "config": "gpugate must see every flag to compare it with the running server; "
              "write the flags themselves instead of --config",
}

# Short spellings gpugate has always accepted; SGLang takes them through argparse's prefix
# abbreviation (``--tp 8``). Only these: a general prefix match would turn a flag a release
# removed (``cuda-graph-max-bs``) silently into a newer one (``cuda-graph-max-bs-decode``).
SHORT_NAMES = {"tp": "tp-size", "dp": "dp-size", "pp": "pp-size", "ep": "ep-size"}
# Flags SGLang declares as plain strings but reads as JSON after parsing (a bad value would only
# fail the start, minutes later): gpugate checks them as JSON.
JSON_TEXT_FLAGS = frozenset({"json-model-override-args", "model-loader-extra-config", "preferred-sampling-params",
                             "kv-events-config"})
# ServerArgs fields that some releases declare under another argparse dest (see _spec_from_row).
SERVER_ARGS_FIELDS = frozenset(SHORT_NAMES.values())


FlagError = engine_seam.FlagError  # the seam's: what every engine's validation raises


# ------------------------------------------------------------------------------------------
# Known conflicts (from SGLang's ServerArgs checks), given normalised flags: overlay
# ------------------------------------------------------------------------------------------

def _check_conflicts(flags: Mapping[str, Any]) -> None:
    def on(name: str) -> bool:
        return bool(flags.get(name))

    if on("enable-hierarchical-cache") and on("disable-radix-cache"):
        # Same words as SGLang's _handle_cache_compatibility.
        raise FlagError("enable-hierarchical-cache",
                        "enable-hierarchical-cache and disable-radix-cache are mutually exclusive "
                        "and cannot be used at the same time (SGLang refuses to start); use only one")
    if on("enable-tokenizer-batch-encode") and on("enable-dynamic-batch-tokenizer"):
        raise FlagError("enable-tokenizer-batch-encode",
                        "cannot be combined with --enable-dynamic-batch-tokenizer (SGLang refuses to start)")
    if on("disaggregation-decode-enable-offload-kvcache") and flags.get("disaggregation-mode") != "decode":
        raise FlagError("disaggregation-decode-enable-offload-kvcache",
                        "is only supported with --disaggregation-mode decode")
    if flags.get("speculative-algorithm") == "NGRAM" and on("enable-dp-attention"):
        raise FlagError("speculative-algorithm",
                        "NGRAM speculative decoding does not support --enable-dp-attention")
    if flags.get("tokenizer-metrics-custom-labels-header") == "" and flags.get(
            "tokenizer-metrics-allowed-custom-labels"):
        raise FlagError("tokenizer-metrics-allowed-custom-labels",
                        "needs --tokenizer-metrics-custom-labels-header to be set")
    # Sanity bounds that SGLang only discovers after loading for minutes.
    for name in ("tp-size", "dp-size", "pp-size", "ep-size", "nnodes", "page-size", "tokenizer-worker-num"):
        if isinstance(flags.get(name), int) and flags[name] < 1:
            raise FlagError(name, f"must be at least 1, got {flags[name]}")
    if isinstance(flags.get("mem-fraction-static"), float) and not 0.0 < flags["mem-fraction-static"] <= 1.0:
        raise FlagError("mem-fraction-static", f"must be in (0, 1], got {flags['mem-fraction-static']}")
    if isinstance(flags.get("node-rank"), int) and not 0 <= flags["node-rank"] < flags.get("nnodes", 1):
        raise FlagError("node-rank", f"must be in [0, nnodes={flags.get('nnodes', 1)}), got {flags['node-rank']}")
    for name in ("hicache-size", "cpu-offload-gb", "base-gpu-id"):
        if isinstance(flags.get(name), (int, float)) and flags[name] < 0:
            raise FlagError(name, f"must not be negative, got {flags[name]}")


_ENTRY_TOKENS = ("sglang.launch_server", "-msglang.launch_server")


def server_args_start(argv: Sequence[str]) -> int:
    """Index of the first server argument in a full cmdline (python -m sglang.launch_server ...,
    sglang serve ..., or bare arguments)."""
    for index, token in enumerate(argv):
        if token.startswith("--"):
            break  # server arguments began: a later "sglang.launch_server" is a flag's value
        if token in _ENTRY_TOKENS or token.endswith("/sglang/launch_server.py"):
            return index + 1
        if token == "serve" and index > 0 and argv[index - 1].rsplit("/", 1)[-1] == "sglang":
            return index + 1
    return 0


FLAGS = argflags.ArgparseFlags(argflags.Overlay(
    package="sglang", label="SGLang", version_key="sglang_version", snapshot_dir=SNAPSHOT_DIR,
    separate_fields=SEPARATE_FIELDS, short_names=SHORT_NAMES, field_names=SERVER_ARGS_FIELDS,
    json_text_flags=JSON_TEXT_FLAGS, check_conflicts=_check_conflicts, args_start=server_args_start,
    default_host=DEFAULT_HOST, default_port=DEFAULT_PORT, builder_file=table_builder.__file__,
    cache_dir=table_builder.CACHE_DIR))
canonical_name = FLAGS.canonical_name
validate_flags = FLAGS.validate_flags
flag_warnings = FLAGS.flag_warnings
render_flag_args = FLAGS.render_flag_args
parse_argv = FLAGS.parse_argv
diff_flags = FLAGS.diff_flags
build_parser = FLAGS.build_parser
server_info_view = FLAGS.server_info_view
server_info_mismatches = FLAGS.server_info_mismatches
is_secret_value = FLAGS.is_secret_value
secret_flag_options = FLAGS.secret_flag_options
redact_argv = FLAGS.redact_argv
snapshot_versions = FLAGS.snapshot_versions
load_snapshot = FLAGS.load_snapshot
newest_snapshot = FLAGS.newest_snapshot
union_table = FLAGS.union_table
table_from_doc = FLAGS.table_from_doc
resolve_table = FLAGS.resolve_table
choose_table = FLAGS.choose_table
known_table_keys = FLAGS.known_table_keys
remember_table = FLAGS.remember_table
cached_table_doc = FLAGS.cached_table_doc
check_report = FLAGS.check_report
supports = FLAGS.supports
table_command = FLAGS.table_command
fetch_table = FLAGS.fetch_table
SPECS: Mapping[str, FlagSpec] = argflags.LazySpecs(FLAGS)


def render_argv(model_path: str, port: int, flags: Mapping[str, Any], host: str = DEFAULT_HOST,
                table: FlagTable | str | None = None) -> list[str]:
    """The arguments after the Python interpreter that start SGLang with these flags.

    ``[python3] + render_argv(...)`` is the full command:
    ``-m sglang.launch_server --model-path P --host H --port N`` then the flags, validated (against
    ``table``) and sorted by canonical name. Values are separate argv items (never through a shell),
    written as ``--flag=value`` when they start with '-'.

    Example::

        >>> render_argv("/m", 30000, {"tp": 2, "disable-radix-cache": True})
        ['-m', 'sglang.launch_server', '--model-path', '/m', '--host', '127.0.0.1', '--port', '30000', '--disable-radix-cache', '--tp-size', '2']
    """
    if not isinstance(model_path, str) or not model_path:
        raise FlagError("model-path", f"needs a non-empty path or repo id, got {model_path!r}")
    argflags._check_token("model-path", model_path)
    if not isinstance(host, str) or not host:
        raise FlagError("host", f"needs a host name or address, got {host!r}")
    argflags._check_token("host", host)
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise FlagError("port", f"must be an integer in 1..65535, got {port!r}")
    normalised = validate_flags(flags, table)
    return (["-m", "sglang.launch_server"]
            + argflags._option("model-path", model_path)
            + argflags._option("host", host)
            + ["--port", str(port)]
            + render_flag_args(normalised, table))


def version_mismatch(pinned: str | None, installed: str | None) -> str | None:
    """The problem to report before anything stops when the pin and the container disagree.

    >>> version_mismatch("0.5.23", "0.5.10")
    'the container has SGLang 0.5.10; sglang_version pins 0.5.23'
    """
    if pinned and installed and str(pinned) != str(installed):
        return f"the container has SGLang {installed}; sglang_version pins {pinned}"
    return None


def weight_cache_argv(python: str, model_path: str, flags: Mapping[str, Any],
                      table: FlagTable | str | None = None) -> list[str]:
    """The standalone weight-cache daemon's command for a server with these (validated) flags: the
    flags that shape the weights (weight_cache.WEIGHT_FLAGS), nothing else, so that a change of
    any other flag keeps the daemons (docs/weight-cache.md).

    >>> weight_cache_argv("/usr/bin/python3", "/m", {"tp-size": 2, "kv-cache-dtype": "fp8_e4m3"})
    ['/usr/bin/python3', '-m', 'sglang.srt.weight_cache.daemon', '--model-path', '/m', '--tp-size', '2']
    """
    from gpugate.engine.sglang import weight_cache

    kept = {name: value for name, value in flags.items() if name in weight_cache.WEIGHT_FLAGS}
    return [python, "-m", weight_cache.DAEMON_MODULE, "--model-path", model_path, *render_flag_args(kept, table)]


