"""A second engine that only the tests register (tests/engines/echo_engine-0.1.dist-info names it in
the ``gpugate.engines`` entry point group; the lab tests put tests/engines on PYTHONPATH): a tiny
HTTP server with flags of its own. It proves the seam: it deploys, restarts and rolls back through
the real CLI in the lab with no change to gpugate (tests/e2e/test_engine_seam_lab.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpugate.engine import Engine, FlagError, Launch, Running, ServerInputs

# the server's own flags: name -> type (echo_engine/server.py's parser)
FLAGS = {"greeting": str, "fail-at-start": bool, "load-s": float}
ENTRY = ("-m", "echo_server")


class Echo(Engine):
    name = "echo"
    label = "Echo"
    model_option = "--model"
    host_option = "--host"
    info_endpoint = "/info"
    drain_words = "Echo's drain"
    container_module = "echo_engine.container"

    def choose_table(self, container: Mapping[str, Any] | None, pinned: str | None) -> tuple[Any, str]:
        return FLAGS, "Echo's own flags"

    def canonical_name(self, name: str, table: Any = None) -> str:
        bare = str(name).lstrip("-").replace("_", "-")
        if bare not in FLAGS:
            raise FlagError(bare, f"not a flag of Echo (flags: {', '.join(sorted(FLAGS))})")
        return bare

    def validate_flags(self, flags: Mapping[str, object] | None, table: Any = None) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, value in (flags or {}).items():
            bare = self.canonical_name(name)
            kind = FLAGS[bare]
            if kind is bool and not isinstance(value, bool):
                raise FlagError(bare, f"must be true or false, got {value!r}")
            try:
                out[bare] = kind(value)
            except (TypeError, ValueError):
                raise FlagError(bare, f"must be a {kind.__name__}, got {value!r}") from None
        return dict(sorted(out.items()))

    def _args(self, flags: Mapping[str, Any]) -> list[str]:
        args: list[str] = []
        for name, value in sorted(flags.items()):
            if value is True:
                args.append(f"--{name}")
            elif value is not False and value is not None:
                args += [f"--{name}", str(value)]
        return args

    def launch(self, inputs: ServerInputs, table: Any = None) -> Launch:
        flags = self.validate_flags(inputs.flags)
        argv = (inputs.python, *ENTRY, "--model", inputs.model_path, "--host", inputs.host, "--port", str(inputs.port),
                *self._args(flags), *inputs.extra_args)
        return Launch(flags=flags, argv=argv, args_start=3, gpus=(0,), shown_argv=argv, shown_flags=dict(flags),
                      expect_info={"greeting": flags.get("greeting", "hello")})

    def read_running(self, argv: Sequence[str], table: Any = None) -> Running:
        args = list(argv)[3:] if list(argv)[1:3] == list(ENTRY) else list(argv)
        running = Running(model_path=None, host="127.0.0.1", port=8000, args_start=3)
        index = 0
        while index < len(args):
            name = args[index].lstrip("-")
            if name in FLAGS and FLAGS[name] is bool:
                running.flags[name] = True
                index += 1
                continue
            value = args[index + 1] if index + 1 < len(args) else ""
            if name == "model":
                running.model_path = value
            elif name == "host":
                running.host = value
            elif name == "port":
                running.port = int(value)
            elif name in FLAGS:
                running.flags[name] = FLAGS[name](value)
            else:
                running.unknown.append(name)
            index += 2
        return running

    def flag_lines(self, running: Mapping[str, Any], desired: Mapping[str, Any], table: Any = None) -> list[str]:
        lines = []
        for name in sorted(set(running) | set(desired)):
            if running.get(name) != desired.get(name):
                if name in running:
                    lines.append(" ".join(["-", *self._args({name: running[name]})]))
                if name in desired:
                    lines.append(" ".join(["+", *self._args({name: desired[name]})]))
        return lines

    def redact_argv(self, argv: Sequence[str], table: Any = None) -> list[str]:
        return list(argv)


ENGINE = Echo()
