"""The desired SGLang server as ONE value: a frozen ``Spec`` that owns its defaults, its validation,
the argv (rendered once, here) and the GPUs it will use.

Everything the controller knows about "what should run" comes from here: ``deploy.py`` and the
runbooks map host data to ``sglang.server``'s arguments (``gpugate.runbooks.server_arguments``, with
the defaults of :data:`DEFAULTS`), the operation builds a :class:`Spec` with :func:`build_spec` and
sends :meth:`Spec.doc` to the container's agent (docs/agent-protocol.md, ``SpecDoc``).

Example::

    >>> spec = build_spec("/opt/models/m", 30000, {"tp": 4, "base-gpu-id": 4}, {"HF_TOKEN": "x"}, host="0.0.0.0")
    >>> spec.argv[:9]
    ('/usr/bin/python3', '-m', 'sglang.launch_server', '--model-path', '/opt/models/m', '--host', '0.0.0.0', '--port', '30000')
    >>> spec.gpus
    (4, 5, 6, 7)
    >>> spec.record()["env_names"], spec.record()["flags"]["tp-size"]
    (['HF_TOKEN'], 4)
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from gpugate.rules import gpus as rules_gpus
from gpugate.sglang_args import (SECRET_MASK, FlagError, is_secret_value, redact_argv, render_argv,
                                 render_flag_args, secret_flag_options, validate_flags)

__all__ = ["DEFAULTS", "BUDGET_KEYS", "Spec", "SpecError", "build_spec", "gpu_set", "redact_flags", "budgets"]

# The one place defaults live: group_data/all.py and gpugate.runbooks.server_arguments take them
# from here (so the docs, the inventory and the operation cannot disagree).
DEFAULTS: dict[str, Any] = {
    "port": 30000,                 # SGLang's own default port
    "host": "127.0.0.1",           # --host: the address the server listens on in the container
    "supervisor": "auto",          # "systemd" (a unit) where the container's PID 1 is systemd, else
                                   # "process" (own session, pid file, log); or either, named
    "python": "/usr/bin/python3",  # the interpreter that runs `-m sglang.launch_server`
    "present": True,               # False: no server on the port
    "max_used_mib": 64,            # the gate: a GPU is free at or under this many MiB (NVML v2)
    "gate_timeout_s": 120.0,       # how long the gate waits for this server's GPUs after the stop
    "drain_timeout_s": 60.0,       # SGLang's SIGTERM drain has no deadline: this is ours, then SIGKILL
    "kill_grace_s": 10.0,          # after SIGKILL: how long the tree may take to vanish
    "start_timeout_s": 2700.0,     # until healthy and generating (45 min: a cold TP8 load + CUDA graphs)
    "generate_timeout_s": 30.0,    # the first real generation after /health turns 200
    "min_free_mib": 64,            # free space the log and state directories need before a stop
    "max_failures": 0,             # rolling restarts: stop after more failed containers than this
}

# The budgets the agent enforces (docs/agent-protocol.md, "start"), by their names in DEFAULTS.
BUDGET_KEYS = ("drain_timeout_s", "kill_grace_s", "gate_timeout_s", "start_timeout_s", "max_used_mib",
               "generate_timeout_s")

SUPERVISORS = ("process", "systemd", "auto")


def resolve_supervisor(requested: str, container: Mapping[str, Any] | None) -> str:
    """``auto`` -> ``systemd`` where the container's PID 1 is systemd (the agent's observe reports
    ``container.pid1``), else ``process``; ``process``/``systemd`` as asked.

    >>> resolve_supervisor("auto", {"pid1": "systemd"}), resolve_supervisor("auto", {"pid1": "init"})
    ('systemd', 'process')
    """
    if requested != "auto":
        return requested
    return "systemd" if (container or {}).get("pid1") == "systemd" else "process"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class SpecError(ValueError):
    """The desired server is not valid; raised before anything is touched, with what to fix."""


def redact_flags(flags: Mapping[str, Any]) -> dict[str, Any]:
    """Flags with the values of secret flags (``--api-key``...) replaced by ``***``, and the whole
    value of a JSON-valued flag whose document has a key naming a secret (``{"hf_token": ...}``).

    >>> redact_flags({"tp-size": 8, "api-key": "sk-1", "model-loader-extra-config": '{"hf_token":"hf_1"}'})
    {'tp-size': 8, 'api-key': '***', 'model-loader-extra-config': '***'}
    """
    return {name: SECRET_MASK if value not in (None, False) and is_secret_value(name, value) else value
            for name, value in flags.items()}


def _int_flag(flags: Mapping[str, Any], name: str, default: int) -> int:
    value = flags.get(name, default)
    if isinstance(value, bool) or value is None:
        return default
    try:
        return int(value)
    except (TypeError, ValueError):
        raise SpecError(f"--{name} must be an integer, got {value!r}") from None


def gpu_set(flags: Mapping[str, Any], env: Mapping[str, Any] | None = None) -> tuple[int, ...]:
    """The GPUs (indexes as the container numbers them) a server with these flags and this
    environment uses, as SGLang assigns them: ``tp x pp x dp`` ranks (dp only without
    ``--enable-dp-attention``: with it the DP ranks share the TP GPUs), divided over ``--nnodes``,
    from ``--base-gpu-id`` every ``--gpu-id-step``, then mapped through ``CUDA_VISIBLE_DEVICES``.
    The one rule the agent uses too (gpugate.rules.gpus.gpu_set). ``flags`` in any
    spelling ``validate_flags`` accepts. Raises SpecError when the set cannot be told (a
    ``CUDA_VISIBLE_DEVICES`` too short for the ranks, or of UUIDs).

    >>> gpu_set({"tp": 8})
    (0, 1, 2, 3, 4, 5, 6, 7)
    >>> gpu_set({"tp": 4, "base-gpu-id": 4})
    (4, 5, 6, 7)
    >>> gpu_set({"tp": 2, "dp": 2}), gpu_set({"tp": 2, "dp": 2, "enable-dp-attention": True})
    ((0, 1, 2, 3), (0, 1))
    >>> gpu_set({"tp": 2, "gpu-id-step": 2}, {"CUDA_VISIBLE_DEVICES": "3,4,5,6"})
    (3, 5)
    """
    try:
        normal = validate_flags(flags or {})
    except FlagError as error:
        raise SpecError(str(error)) from None
    try:
        return tuple(rules_gpus.gpu_set(
            tp=_int_flag(normal, "tp-size", 1), pp=_int_flag(normal, "pp-size", 1),
            dp=_int_flag(normal, "dp-size", 1), dp_attention=bool(normal.get("enable-dp-attention")),
            nnodes=_int_flag(normal, "nnodes", 1), base_gpu_id=_int_flag(normal, "base-gpu-id", 0),
            gpu_id_step=_int_flag(normal, "gpu-id-step", 1), visible=(env or {}).get("CUDA_VISIBLE_DEVICES")))
    except rules_gpus.GpuSetError as error:
        raise SpecError(str(error)) from None


def budgets(values: Mapping[str, Any] | None = None) -> dict[str, float]:
    """The agent's budgets: :data:`DEFAULTS` overridden by ``values`` (names of BUDGET_KEYS).

    >>> budgets({"drain_timeout_s": 5})["drain_timeout_s"], budgets()["max_used_mib"]
    (5.0, 64.0)
    """
    given = dict(values or {})
    return {key: float(given[key] if given.get(key) is not None else DEFAULTS[key]) for key in BUDGET_KEYS}



def option_items(args: list[str]) -> list[str]:
    """Arguments grouped one option (with its values) per item.

    >>> option_items(["--tp-size", "8", "--disable-radix-cache", "--x", "a", "b"])
    ['--tp-size 8', '--disable-radix-cache', '--x a b']
    """
    out: list[str] = []
    for token in args:
        if token.startswith("--") or not out:
            out.append(token)
        else:
            out[-1] += " " + token
    return out

@dataclasses.dataclass(frozen=True)
class Spec:
    """One desired server, validated (build it with :func:`build_spec`). ``argv`` is the exact
    command, rendered once; ``gpus`` the GPUs it will use (None: cannot be told before the
    container is asked, e.g. ``CUDA_VISIBLE_DEVICES`` of UUIDs: the gate then waits for every GPU)."""

    model_path: str
    port: int
    flags: Mapping[str, Any]        # normalised (canonical names, typed values)
    env: Mapping[str, str]
    host: str = DEFAULTS["host"]
    supervisor: str = DEFAULTS["supervisor"]
    python: str = DEFAULTS["python"]
    extra_args: tuple[str, ...] = ()
    sglang_version: str | None = None
    argv: tuple[str, ...] = ()
    gpus: tuple[int, ...] | None = None
    warnings: tuple[str, ...] = ()

    def record(self, by: str | None = None) -> dict[str, Any]:
        """What may be shown and stored anywhere: secret flags ``***``, env as names only (the
        agent adds the value hashes), argv redacted.

        >>> build_spec("/m", 30000, {"api-key": "sk-123456"}).record()["argv"][-2:]
        ['--api-key', '***']
        """
        record = {"model_path": self.model_path, "port": self.port, "host": self.host,
                  "flags": redact_flags(self.flags), "env_names": sorted(self.env),
                  "supervisor": self.supervisor, "python": self.python, "argv": redact_argv(list(self.argv)),
                  "gpus": list(self.gpus) if self.gpus is not None else None}
        if self.extra_args:
            record["extra_args"] = redact_argv(list(self.extra_args))
        if self.sglang_version:
            record["sglang_version"] = self.sglang_version
        if by:
            record["by"] = by
        return record

    def expect_info(self) -> dict[str, Any]:
        """The /get_server_info keys and values this server must report (checked at verify)."""
        from gpugate.sglang_args import server_info_view

        # secret values are never expected by value (the failure message would show them); a
        # JSON-text flag is expected as the exact text SGLang keeps (server_info_view)
        secret = {name.replace("-", "_") for name, value in self.flags.items() if is_secret_value(name, value)}
        info = {key: value for key, value in server_info_view(self.flags).items() if key not in secret}
        info["host"] = self.host
        return info

    def secret_flags(self) -> list[str]:
        """Option strings whose values the agent must mask beyond its own list (--api-key,
        --admin-api-key): a JSON-valued flag holding a secret key, ``--ssl-keyfile-password``...
        The SpecDoc's ``secret_flags`` (and observe's, for the running argv).

        >>> build_spec("/m", 30000, {"model-loader-extra-config": {"hf_token": "hf_1"}}).secret_flags()
        ['--model-loader-extra-config']
        """
        return secret_flag_options(self.flags)

    def doc(self, unit_text: str | None = None, by: str | None = None) -> dict[str, Any]:
        """The SpecDoc the agent runs (docs/agent-protocol.md): it holds the env values and the
        exact argv, so it travels only on the hand-off's stdin."""
        doc: dict[str, Any] = {"argv": list(self.argv), "env": dict(self.env), "port": self.port,
                               "gpus": list(self.gpus) if self.gpus is not None else None,
                               "supervisor": self.supervisor, "record": self.record(by),
                               "expect_info": self.expect_info()}
        if self.secret_flags():
            doc["secret_flags"] = self.secret_flags()
        if self.supervisor == "systemd":
            doc["unit_text"] = unit_text or ""
        return doc

    def display_args(self) -> list[str]:
        """The server's arguments after ``-m sglang.launch_server``, one option (with its values)
        per item, secrets ``***``: the lines of a first start's plan."""
        return option_items(redact_argv(list(self.argv))[3:])


def _one_line(what: str, text: str) -> None:
    if any(c in text for c in "\0\n\r"):
        raise SpecError(f"{what} must be one line (no newline, carriage return or NUL)")


def build_spec(model_path: str | None, port: int = DEFAULTS["port"], flags: Mapping[str, Any] | None = None,
               env: Mapping[str, Any] | None = None, *, host: str | None = None, supervisor: str | None = None,
               python: str | None = None, extra_args: Sequence[str] | None = None,
               sglang_version: str | None = None, table: Any = None) -> Spec:
    """Validate the desired server completely (no host needed) and render its argv once; raise
    SpecError naming the problem. ``table``: a per-version flag table (gpugate.sglang_args,
    H3) to validate against instead of the built-in one. ``extra_args``: argv elements passed
    verbatim after the flags, unchecked (a warning says so).

    >>> build_spec("/m", 30000, {"tp": 2}).argv[-2:]
    ('--tp-size', '2')
    >>> build_spec("/m", 30000, {"kv-cache-dtype": "fp9"})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    gpugate.spec.SpecError: --kv-cache-dtype: ...
    """
    host = DEFAULTS["host"] if host is None else host
    supervisor = DEFAULTS["supervisor"] if supervisor is None else supervisor
    python = DEFAULTS["python"] if python is None else python
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise SpecError(f"port must be an integer in 1..65535, got {port!r}")
    if not isinstance(model_path, str) or not model_path.strip():
        raise SpecError("model_path is required (a directory in the container or a repo id)")
    _one_line("model_path", model_path)
    if not isinstance(host, str) or not host.strip() or any(c.isspace() for c in host):
        raise SpecError(f"host must be an address or host name, got {host!r}")
    if supervisor not in SUPERVISORS:
        raise SpecError(f"supervisor must be one of {', '.join(SUPERVISORS)}, got {supervisor!r}")
    if not isinstance(python, str) or not python.startswith("/") or any(c in python for c in "\0\n\r "):
        raise SpecError(f"python must be an absolute path, got {python!r}")
    clean_env: dict[str, str] = {}
    for name, value in (env or {}).items():
        if not isinstance(name, str) or not _ENV_NAME.match(name):
            raise SpecError(f"env name {name!r} is not a valid variable name")
        if not isinstance(value, str):
            raise SpecError(f"env {name}: the value must be a string, got {type(value).__name__} (quote it)")
        _one_line(f"env {name}", value)
        clean_env[name] = value
    extras = tuple(extra_args or ())
    for item in extras:
        if not isinstance(item, str) or not item:
            raise SpecError(f"extra_args must be a list of non-empty strings, got {item!r}")
        _one_line("an extra_args element", item)
    if sglang_version is not None and (not isinstance(sglang_version, str) or not sglang_version.strip()):
        raise SpecError(f"sglang_version must be a version string, got {sglang_version!r}")
    try:
        # a per-version table (H3's, when given) goes through; the built-in one otherwise
        normal = (validate_flags(flags or {}, table=table) if table is not None  # type: ignore[call-arg]
                  else validate_flags(flags or {}))
        for name, value in normal.items():
            # argv carries any byte but NUL; a line break would still end a line of the systemd unit
            for text in (value if isinstance(value, (list, tuple)) else [value]):
                if isinstance(text, str) and any(c in text for c in "\0\n\r"):
                    raise FlagError(name, "value must be one line (no newline, carriage return or NUL)")
        # the header only (model path, host, port: checked there); the flags are rendered from
        # the values validated above, so each flag is validated once
        header = render_argv(model_path, port, {}, host=host)
    except FlagError as error:
        raise SpecError(str(error)) from None
    argv = (python, *header, *render_flag_args(normal), *extras)
    warnings: list[str] = []
    if extras:
        warnings.append("extra_args passed verbatim, unchecked: " + " ".join(redact_argv(list(extras))))
    try:
        gpus: tuple[int, ...] | None = gpu_set(normal, clean_env)
    except SpecError as error:
        if "UUID" not in str(error):
            raise
        gpus = None
        warnings.append(f"{error}; the gate waits for every GPU")
    return Spec(model_path=model_path, port=port, flags=dict(normal), env=clean_env, host=host,
                supervisor=supervisor, python=python, extra_args=extras, sglang_version=sglang_version,
                argv=argv, gpus=gpus, warnings=tuple(warnings))
