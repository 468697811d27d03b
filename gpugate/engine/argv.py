"""What a server's command line and environment say, the same for every engine (stdlib only;
bundled into the agent with the engines' container modules).

Example::

    >>> flag_value(["python3", "-m", "vllm.entrypoints.cli.main", "serve", "--port=8001"], "--port")
    '8001'
"""

from __future__ import annotations

import os

from gpugate.rules.procfs import CLEAN_PATH

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is never imported at run time (~10 ms of every agent command)
    from typing import Dict, Mapping, Sequence

# Never what a server needs: the login session that started it, and gpugate's own variables
SESSION_ENV_NAMES = ("USER", "HOME", "LOGNAME", "SHELL", "TERM", "PWD", "OLDPWD", "SHLVL", "MAIL", "LANG",
                     "LANGUAGE", "_", "MOTD_SHOWN", "HOSTNAME", "DISPLAY", "COLORTERM", "LS_COLORS", "EDITOR")
SESSION_ENV_PREFIXES = ("SSH_", "XDG_", "GPUGATE_", "LC_", "DBUS_", "TMUX", "STY", "WINDOW", "LESS")


def flag_value(argv: Sequence[str], *names: str) -> str | None:
    """The last value given for any of ``names`` (``--x v`` or ``--x=v``), else None.

    >>> flag_value(["--port", "1", "--port=2"], "--port")
    '2'
    """
    value = None
    for index, arg in enumerate(argv):
        for name in names:
            if arg == name and index + 1 < len(argv):
                value = argv[index + 1]
            elif arg.startswith(name + "="):
                value = arg[len(name) + 1:]
    return value



def flag_int(argv: Sequence[str], default: int, *names: str) -> int:
    value = flag_value(argv, *names)
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default



def python_module(argv: Sequence[str]) -> str | None:
    """``-m <module>`` of a python argv (within its first options), else None.

    >>> python_module(["python3", "-m", "sglang.launch_server"]), python_module(["sleep", "-m", "x"])
    ('sglang.launch_server', None)
    """
    if not argv or not os.path.basename(argv[0]).startswith("python"):
        return None
    for index, part in enumerate(argv[1:5], start=1):
        if part == "-m" and index + 1 < len(argv):
            return argv[index + 1]
        if part.startswith("-m") and len(part) > 2:
            return part[2:]
    return None




def adopt_env(environ: Mapping[str, str] | None, keep_names: Sequence[str], argv: Sequence[str] | None,
              prefixes: Sequence[str], names: Sequence[str]) -> Dict[str, str]:
    """The part of a server's environment that a record of a server we did not start keeps (and a
    rollback to it gets): the engine's own names (``prefixes``, ``names``) and ``keep_names`` (the
    desired spec's env names); never the login session's (USER, SSH_*, GPUGATE_*...), and PATH
    only when argv[0] is found through it (the clean PATH is set anyway).

    >>> adopt_env({"USER": "root", "HF_TOKEN": "hf-x", "FOO": "1", "BAR": "2"}, ["FOO"], None, ("HF_",), ())
    {'FOO': '1', 'HF_TOKEN': 'hf-x'}
    """
    keep = set(keep_names or ())
    kept = {}
    for name, value in sorted((environ or {}).items()):
        if name.startswith(("SSH_", "GPUGATE_")):
            continue  # the session that started it, and gpugate's own: never what the server needs
        if name in keep:
            kept[name] = value
        elif name in SESSION_ENV_NAMES or name.startswith(SESSION_ENV_PREFIXES):
            continue
        elif name.startswith(tuple(prefixes)) or name in names:
            kept[name] = value
        elif name == "PATH" and argv and "/" not in argv[0] and value != CLEAN_PATH:
            kept[name] = value  # a relative argv[0] ("python3") is found through it: a venv's python
    return kept
