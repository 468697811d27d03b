"""The engine seam: everything gpugate knows of the inference server it runs, behind one small
interface, :class:`Engine`. SGLang (gpugate/engine/sglang/) implements it; a second engine (vLLM)
is a folder beside it that implements the same methods, and nothing outside this package names an
engine's flags, argv, processes or endpoints.

The controller's side is this interface; the container's side (process recognition, endpoints,
drain) is the engine's stdlib-only module that the agent imports, and so bundles
(gpugate/engine/sglang/processes.py).

Example::

    >>> from gpugate.engine import get
    >>> sglang = get()
    >>> sglang.name, sglang.render_argv("/m", 30000, sglang.validate_flags({"tp": 2}), "127.0.0.1")[-2:]
    ('sglang', ['--tp-size', '2'])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

__all__ = ["Engine", "FlagError", "get", "ENGINES"]


class FlagError(ValueError):
    """A flag the engine (or gpugate) would reject. ``str()`` names the flag and the problem.

    Example::

        >>> str(FlagError("kv-cache-dtype", "'fp9' is not one of auto, fp8_e5m2, ..."))
        "--kv-cache-dtype: 'fp9' is not one of auto, fp8_e5m2, ..."
    """

    def __init__(self, flag: str, message: str):
        self.flag = flag
        self.message = message
        super().__init__(f"--{flag}: {message}" if flag else message)


class Engine(Protocol):
    """What gpugate needs of an inference server. Flags travel as data: a mapping of canonical
    names to typed values (``{"tp-size": 8, "disable-radix-cache": True}``)."""

    name: str                     # "sglang": the name in messages and in settings
    FlagError: type[FlagError]    # what validation raises: .flag (canonical name) and .message

    # --- flags: the schema per version, validation, what is secret ---
    def choose_table(self, container: Mapping[str, Any] | None, pinned: str | None) -> tuple[Any, str]:
        """The flag table of the release that will run (the container's, else the pinned
        snapshot, else the newest), and a note naming it."""

    def validate_flags(self, flags: Mapping[str, object] | None, table: Any = None) -> dict[str, Any]:
        """Canonical names and typed values, or FlagError naming the flag and what is wrong."""

    def flag_warnings(self, flags: Mapping[str, Any], table: Any = None) -> list[str]:
        """The engine's own deprecation warnings for these flags."""

    def canonical_name(self, name: str, table: Any = None) -> str:
        """The canonical name of a flag as a person writes it (``tp`` -> ``tp-size``)."""

    def is_secret_value(self, name: str, value: Any, table: Any = None) -> bool:
        """Whether this flag's value must never be shown (``--api-key``, a token in a JSON flag)."""

    def secret_flag_options(self, flags: Mapping[str, Any], table: Any = None) -> list[str]:
        """The option strings whose values the agent masks in argv and logs."""

    # --- argv: render once, parse back what runs, compare ---
    def render_argv(self, model_path: str, port: int, flags: Mapping[str, Any], host: str) -> list[str]:
        """The server's argv after the interpreter (``-m sglang.launch_server``, model, host, port, flags)."""

    def render_flag_args(self, flags: Mapping[str, Any], table: Any = None) -> list[str]:
        """The flags alone, as argv elements."""

    def parse_argv(self, argv: Sequence[str], table: Any = None) -> Any:
        """A running command read back: model_path, host, port, flags, unknown (what it does not know)."""

    def diff_flags(self, running: Mapping[str, Any], desired: Mapping[str, Any], table: Any = None) -> Any:
        """added / removed / changed flags, with ``.lines(redact=True)`` for the plan."""

    def redact_argv(self, argv: Sequence[str], table: Any = None) -> list[str]:
        """argv with every secret value ``***``."""

    # --- verify and capacity: what the running server must report ---
    def server_info_view(self, flags: Mapping[str, Any], table: Any = None) -> dict[str, Any]:
        """The keys and values the server's info endpoint must report for these flags (verify)."""

    def capacity_from_server_info(self, info: Mapping[str, Any] | None) -> dict[str, Any]:
        """What the server says it can hold (KV tokens, ...), from its info endpoint."""

    def capacity_line(self, before: Mapping[str, Any] | None, after: Mapping[str, Any] | None) -> str | None:
        """The capacity before and after a change, in one line for the operator."""

    def check_report(self, flags: Mapping[str, Any], pinned: str | None, extra_args: Sequence[str] | None
                     ) -> tuple[bool, list[str]]:
        """`gpugate check`: whether these flags are valid for the pinned release, and why not."""

    # --- fast restarts: the weight cache and the gated launch (docs/weight-cache.md) ---
    def supports(self, option: str, table: Any = None) -> bool:
        """Whether this release has the flag (``gated-launch-port``)."""

    def weight_cache_argv(self, python: str, model_path: str, flags: Mapping[str, Any], table: Any = None) -> list[str]:
        """The command of the daemons that hold this server's weights across engine restarts."""


def _sglang() -> Engine:
    from gpugate.engine.sglang import ENGINE  # noqa: PLC0415 -- an engine is loaded when named

    return ENGINE


ENGINES = {"sglang": _sglang}


def get(name: str = "sglang") -> Engine:
    """The engine of this name (SGLang today); KeyError naming the engines there are."""
    try:
        return ENGINES[name]()
    except KeyError:
        raise KeyError(f"no engine {name!r}; engines: {', '.join(ENGINES)}") from None
