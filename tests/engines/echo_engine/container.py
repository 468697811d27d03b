"""Echo in the container (gpugate/engine/container.py): its main, its endpoints. Stdlib only."""

import os

ENGINE_NAME = "echo"
LABEL = "Echo"
MAIN_TEXT = "an Echo server (python -m echo_server)"
DEFAULT_PORT = 8000
HEALTH_PATH = "/health"
GENERATE_PATH = "/generate"
INFO_PATHS = ("/info",)


def is_main_argv(argv):
    return bool(argv) and os.path.basename(argv[0]).startswith("python") and list(argv[1:3]) == ["-m", "echo_server"]


def is_server_part(argv):
    return is_main_argv(argv)


def _value(argv, name, default=None):
    argv = list(argv or [])
    return argv[argv.index(name) + 1] if name in argv[:-1] else default


def argv_port(argv):
    return int(_value(argv, "--port", DEFAULT_PORT))


def argv_host(argv):
    return _value(argv, "--host", "127.0.0.1")


def argv_model(argv):
    return _value(argv, "--model")


def server_gpus(argv, env=None, uuids=None):
    return [0]
