"""Return an SGLang server to the flags it ran with before the last change.

    pyinfra inventory.py runbooks/rollback.py --limit '@pct/pve1:129' --dry   # the diff back
    pyinfra -y inventory.py runbooks/rollback.py --limit '@pct/pve1:129'

Reads the previous spec recorded by sglang.server in the container
(/var/lib/gpugate/sglang-<port>.json, "previous": model path, flags, interpreter, supervisor,
env names; the env values from /etc/gpugate/sglang-<port>.env.previous) and applies it through
sglang.server: the same lock, drain, gate, start, health check and verification as a deploy.
The rollback is itself a change: running it twice returns to the newer flags. The next deploy.py
applies fleet.yaml again; change fleet.yaml if the rollback is meant to stay. See docs/runbooks.md.
"""

from pyinfra import host
from pyinfra.facts.files import FileContents

from gpugate.facts.sglang import SglangServer
from gpugate.operations import sglang
from gpugate.runbooks import RollbackError, parse_env_lines, refused, rollback_spec, server_arguments
from gpugate.transition import paths

arguments = server_arguments(host.data)
port = arguments["port"]
files = paths(port)
server = host.get_fact(SglangServer, port=port, python=arguments["python"])
try:
    if "error" in server:
        raise RollbackError(f"the server probe failed: {server['error']}")
    previous = rollback_spec(server.get("state"), files["state"])
    env = {}
    if previous["env_names"]:
        # The values live only in the container (mode 0600), never in the state file.
        env = parse_env_lines(host.get_fact(FileContents, path=files["env"] + ".previous") or [])
        missing = sorted(set(previous["env_names"]) - set(env))
        if missing:
            raise RollbackError(f"{files['env']}.previous lacks {', '.join(missing)}: cannot restore the "
                                f"previous server's environment")
        env = {name: env[name] for name in previous["env_names"]}
except RollbackError as error:
    refused(name=f"Roll back SGLang on :{port}", reason=f"{host.name}: cannot roll back: {error}. Nothing was touched.")
else:
    arguments.update(model_path=previous["model_path"], flags=previous["flags"], env=env,
                     supervisor=previous["supervisor"], python=previous["python"], present=True)
    sglang.server(name=f"Roll back SGLang on :{port} to the previous flags", **arguments)
