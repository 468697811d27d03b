"""SGLang behind the engine seam (gpugate.engine.Engine): its flags as data per release
(flags.py, with the snapshots of real releases in flagtables/), its capacity figures
(capacity.py), and, bundled into the container's agent, how its processes are recognised, which
endpoints answer for health and verification, and how it drains (processes.py).

Example::

    >>> from gpugate.engine.sglang import ENGINE
    >>> ENGINE.validate_flags({"tp": 8, "disable-radix-cache": True})
    {'disable-radix-cache': True, 'tp-size': 8}
"""

from __future__ import annotations

from gpugate.engine.sglang import capacity, flags


class SGLang:
    """The SGLang engine: each method is the engine module's own function (see gpugate.engine.Engine)."""

    name = "sglang"
    FlagError = flags.FlagError

    choose_table = staticmethod(flags.choose_table)
    validate_flags = staticmethod(flags.validate_flags)
    flag_warnings = staticmethod(flags.flag_warnings)
    canonical_name = staticmethod(flags.canonical_name)
    is_secret_value = staticmethod(flags.is_secret_value)
    secret_flag_options = staticmethod(flags.secret_flag_options)
    render_flag_args = staticmethod(flags.render_flag_args)
    parse_argv = staticmethod(flags.parse_argv)
    diff_flags = staticmethod(flags.diff_flags)
    redact_argv = staticmethod(flags.redact_argv)
    server_info_view = staticmethod(flags.server_info_view)
    capacity_from_server_info = staticmethod(capacity.capacity_from_server_info)
    capacity_line = staticmethod(capacity.capacity_line)
    check_report = staticmethod(flags.check_report)
    supports = staticmethod(flags.supports)
    weight_cache_argv = staticmethod(flags.weight_cache_argv)

    @staticmethod
    def render_argv(model_path: str, port: int, flag_values, host: str) -> list[str]:
        return flags.render_argv(model_path, port, flag_values, host=host)


ENGINE = SGLang()
