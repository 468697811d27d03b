"""``observe``: everything the controller plans from, in one read-only pass (docs/agent-protocol.md):
the server on a port, the GPUs (gpugate.agent.gpu_probe), the container, the transition and the
history.
"""

from __future__ import annotations

import os
import time

from gpugate.agent.engine import engine
from gpugate.agent import history, journal, logs, server, state, weight_cache
from gpugate.rules import gate, procfs, redact
from gpugate.rules.procfs import read_file

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is never imported at run time (~10 ms of every agent command)
    from typing import Any, Dict, Iterable, List

    Doc = Dict[str, Any]  # observe's report, a GPU reading, a pid file


def read_gpus(keep_open: bool = False, exclude: Iterable[int] = ()) -> Doc:
    try:
        from gpugate.agent import gpu_probe  # its import is part of the guarded read

        return gpu_probe.collect(exclude_pids=exclude, keep_nvml_open=keep_open)
    except Exception as error:  # noqa: BLE001 - a document, never a traceback
        return {"schema": 1, "source": "none", "gpus": [], "holders": [], "memory_api": None,
                "errors": [{"source": "agent", "kind": type(error).__name__, "message": str(error)[:300]}]}


def owner_port(table: Dict[int, Dict[str, Any]], pid: int) -> int | None:
    """The port of the live server main a worker belongs to (its nearest main ancestor); None for
    an orphaned part: only those are strays of every port (the stop's sweep reads parts the same way).

    >>> table = {5: {"pid": 5, "ppid": 1, "state": "S", "argv": ["python3", "-m", "sglang.launch_server", "--port", "30001"]},
    ...          6: {"pid": 6, "ppid": 5, "state": "S", "argv": ["sglang::scheduler_TP0"]}}
    >>> owner_port(table, 6), owner_port(table, 7)
    (30001, None)
    """
    for ancestor in procfs.ancestors(table, pid):
        proc = table.get(ancestor)
        if ancestor != pid and proc and proc["state"] not in ("Z", "X") and engine.is_main_argv(proc["argv"]):
            return engine.argv_port(proc["argv"])
    return None


def gpu_uuids(gpu_doc: Doc | None) -> List[str | None]:
    return [g.get("uuid") for g in (gpu_doc or {}).get("gpus") or []]


def gpu_holders(gpu_doc: Doc | None, skip_pids: Iterable[int], redactor: redact.Redactor,
                cache_pids: Dict[int, int] | None = None) -> List[Doc]:
    """GPU holders that are not ``skip_pids``: with the GPUs where they hold memory (a CUDA
    context) and whether they hold memory at all (an NVML monitor holds the files at 0 MiB);
    ``cache_pids``: pid -> the port whose weight-cache daemon it is (a holder that is expected)."""
    out: List[Doc] = []
    cache_pids = cache_pids or {}
    for holder in (gpu_doc or {}).get("holders") or []:
        if holder.get("pid") in skip_pids:
            continue
        gpus = sorted(set(holder.get("gpus") or []))
        memory = bool(gate.memory_gpus(holder))
        argv = procfs.read_argv(holder["pid"])
        stat = procfs.read_stat(holder["pid"])
        out.append({"pid": holder["pid"], "start_ticks": stat[4] if stat else None, "cmdline": redactor.text(" ".join(redact.redact_argv(argv)) or holder.get("cmdline", ""))[:300],
                    "state": holder.get("state"), "gpus": gpus, "used_mib": holder.get("used_mib"),
                    "memory": memory, "server_part": engine.is_server_part(argv), "client": engine.is_client_argv(argv),
                    "weight_cache": cache_pids.get(holder["pid"])})
    return out


def observe(args: Doc) -> Doc:
    """Everything the controller plans from, in one read-only pass (docs/agent-protocol.md)."""
    began = time.time()
    port = int(args.get("port") or engine.DEFAULT_PORT)
    files = state.paths(port)
    table = procfs.table()
    own = server.own_pids(table)
    past = history.load_history(port, repair=False)  # read-only: reports, moves nothing
    redactor = redact.Redactor()
    # the operator's secret env names: asked now, and those of every good spec (names no more declared stay secret)
    declared = list(args.get("secret_env") or [])
    for entry in past.get("good") or []:
        declared += list((entry.get("spec") or {}).get("secret_env") or [])
    for entry in past.get("good") or []:
        redactor.add(redact.spec_secrets(entry.get("spec"), declared))
    env_file = read_file(files["env"])
    if env_file:
        redactor.add(redact.spec_secrets({"env": state.parse_env_file(env_file)}, declared))
    secret_flags = tuple(redact.ALWAYS_MASKED_OPTIONS) + tuple(args.get("secret_flags") or ())

    main, tree = server.find_server(table, port, own)
    gpu_doc = read_gpus(exclude=own)
    environ = procfs.read_environ(main["pid"]) if main else None
    if main:
        redactor.add(redact.secret_flag_values(main["argv"], secret_flags))
        redactor.add(list((environ or {}).get(name) for name in (args.get("env_names") or [])
                          if environ and redact.names_a_secret(name, declared)))
    tree_set = set(tree)
    report: Doc = {"schema": state.SCHEMA, "port": port, "running": main is not None, "main": None,
              "tree": [server.summary(table[pid], redactor) for pid in tree if pid in table],
              "strays": [], "clients": [], "listening": False, "listener_pids": [], "health": None,
              "server_info": None, "env_hashes": {}, "workers": None, "serving": False, "gpus": None,
              "live": None}
    for proc in sorted(table.values(), key=lambda p: p["pid"]):
        if proc["pid"] in tree_set or proc["pid"] in own:
            continue
        if engine.is_server_part(proc["argv"]):
            entry = server.summary(proc, redactor)
            entry["port"] = engine.argv_port(proc["argv"]) if engine.is_main_argv(proc["argv"]) else owner_port(
                table, proc["pid"])
            if entry["port"] is not None and engine.is_main_argv(proc["argv"]):
                entry["main"] = True
                # another port's server: its GPUs read here, from its whole argv and environment (the
                # cmdline above is cut at 300 characters), and whether gpugate runs it (a port change
                # may replace only a server of gpugate's own)
                entry["gpus"] = engine.server_gpus(proc["argv"], procfs.read_environ(proc["pid"]),
                                                   gpu_uuids(gpu_doc))
                entry["managed"] = any(os.path.exists(state.paths(entry["port"])[name]) for name in ("history", "pid"))
            report["strays"].append(entry)
        elif engine.is_client_argv(proc["argv"]):
            report["clients"].append(server.summary(proc, redactor))
    inodes = server.listeners(port)
    report["listening"] = bool(inodes)
    report["listener_pids"] = server.socket_owners(inodes)
    host = engine.argv_host(main["argv"]) if main else args.get("host") or "127.0.0.1"
    if main:
        uptime = float((read_file("/proc/uptime") or "0").split()[0])
        engine.use_for(main["argv"])  # the running server's engine answers for its health and info
        steady = engine.steady_argv(main["argv"])  # a gated launch's --gated-launch-port is not what runs
        report["main"] = {"pid": main["pid"], "pgid": main["pgid"], "state": main["state"],
                          "start_ticks": main["start_ticks"], "argv": redactor.deep(redact.redact_argv(steady, secret_flags)),
                          "argv_hash": redact.argv_hash(steady),
                          "age_s": round(uptime - main["start_ticks"] / float(os.sysconf("SC_CLK_TCK")), 1),
                          "supervisor": server.supervisor_of(main["pid"], port)}
        names = set(args.get("env_names") or [])
        names.update(name for entry in past.get("good") or [] for name in (entry.get("record") or {}).get("env_names") or [])
        report["env_hashes"] = dict((name, redact.env_hash(environ[name]) if environ and name in environ else None)
                                    for name in sorted(names))
        gpus = engine.server_gpus(main["argv"], environ, gpu_uuids(gpu_doc))
        report["gpus"] = gpus
        report["workers"] = server.workers_of(table, tree, engine.expected_workers(gpus))
    if inodes:
        main_argv = main["argv"] if main else []
        report["health"] = server.health(host, port, generate=bool(args.get("generate")), token=engine.argv_token(main_argv),
                                         argv=main_argv)
        if report["health"]["health"] == 200:
            info = server.server_info(host, port, keys=args.get("info_keys") or engine.INFO_KEYS, token=engine.argv_token(main_argv, True))
            report["server_info"] = redactor.deep(info)
            # what it serves now (a live change moves it away from the launch's): docs/live-changes.md
            token = engine.argv_token(main_argv)
            report["live"] = engine.read_live(lambda path: server.http_get(host, port, path, 3.0, token))
    else:
        report["health"] = {"health": None, "health_error": "port %d not listening" % port,
                            "health_generate": None, "health_generate_error": None}
    workers = report["workers"] or {}
    report["serving"] = bool(main and procfs.alive(main["pid"]) and (report["health"] or {}).get("health") == 200
                             and workers.get("expected") is not None and workers.get("dead") == 0
                             and not workers.get("zombies"))
    report["shm_stale"] = sorted(name for name in state.listdir("/dev/shm") if name.startswith(engine.SHM_PREFIXES))
    model_path = args.get("model_path")
    report["model_path_exists"] = os.path.exists(model_path) if model_path and model_path.startswith("/") else None
    report["model_path_kind"] = path_kind(model_path) if model_path and model_path.startswith("/") else None
    tail = int(args.get("tail_lines") or 0)
    report["log_tail"] = [redactor.text(line) for line in logs.server_log_tail(port, tail)] if tail else None
    lock = journal.lock_status()
    report["lock"] = lock
    report["transition"] = redactor.deep(journal.transition_summary(lock=lock))
    report["history"] = history.public_history(past, port)
    report["canary"] = state.json_file(state.paths(port)["canary"])  # written by the controller: figures only
    report["engine"] = engine.ENGINE_NAME
    report["sglang_version"] = engine.engine_version()  # the engine's release, under the key observe always had
    try:
        report["flag_table"] = engine.flag_table_key()
    except Exception as error:  # noqa: BLE001 - a field, never a traceback
        report["flag_table"] = {"error": "%s: %s" % (type(error).__name__, error)}
    report["pid_file"] = state.read_pid_file(port)
    report["warnings"] = pump_warnings(report["pid_file"], main)
    if main is None:
        report["gpus"] = args.get("gpus")
    report["weight_cache"] = weight_cache.view(port, table, gpu_doc)
    report["torch_version"] = engine.torch_version()
    report["model_config_sha256"] = engine.model_config_sha256(model_path)
    # the desired and the served model's shapes: a new checkpoint of the same shapes is a live change
    served = [(report.get("live") or {}).get("model_path"), engine.argv_model(main["argv"]) if main else None]
    report["model_shapes"] = dict((path, engine.model_shape(path)) for path in [model_path] + served
                                  if isinstance(path, str) and path.startswith("/"))
    cache_pids = weight_cache.daemon_ports(table)  # every server's daemons: a port change replaces its own
    skip = tree_set | own
    container = {"free_mib": {state.LOG_DIR: state.free_mib(state.LOG_DIR if os.path.isdir(state.LOG_DIR) else "/var/log"),
                              state.STATE_DIR: state.free_mib(state.STATE_DIR if os.path.isdir(state.STATE_DIR) else "/var/lib")},
                 "unwritable": state.unwritable_state_dirs(),
                 "pid1": server.pid1_comm(), "memory_limit_bytes": server.memory_limit_bytes(),
                 "port_holders": [{"pid": pid, "cmdline": redactor.text(" ".join(redact.redact_argv(table.get(pid, {}).get("argv") or [])))[:300],
                                   "server": pid in tree_set,
                                   "server_part": engine.is_server_part(table.get(pid, {}).get("argv"))}
                                  for pid in report["listener_pids"]],
                 "gpu_holders": gpu_holders(gpu_doc, skip, redactor, cache_pids)}
    report["elapsed_ms"] = round((time.time() - began) * 1000, 1)
    return {"sglang": report, "gpu": gpu_doc, "container": container,
            "agent": {"sha256": state.RUNTIME["sha256"], "schema": state.SCHEMA, "pid": os.getpid()}}


def path_kind(path: str) -> str:
    """What ``path`` is, for the model path's check before the stop: a model is a directory
    (SGLang reads its config.json and weights from it), never a file.

    >>> path_kind("/"), path_kind("/proc/self/stat"), path_kind("/no/such/path")
    ('directory', 'file', 'missing')
    """
    if os.path.isdir(path):
        return "directory"
    if os.path.isfile(path):
        return "file"
    return "other" if os.path.lexists(path) else "missing"


def pump_warnings(recorded: Doc | None, main: Doc | None) -> List[str]:
    """Warnings about the log pump of the server that runs (``recorded``: its pid file): a pump that
    is gone while the server it served runs means the server's output is lost from then on (its
    writes fail with EPIPE; SGLang logs through ``logging``, which drops them, and keeps serving).

    >>> pump_warnings({"pid": 1, "pump": {"pid": 999999999}, "log": "/l"}, {"pid": 1})[0][:38]
    'the log pump (pid 999999999) is gone: '
    """
    pump = (recorded or {}).get("pump")
    if not main or not isinstance(pump, dict) or (recorded or {}).get("pid") != main.get("pid"):
        return []
    if procfs.alive(pump.get("pid"), pump.get("start_ticks")):
        return []
    return ["the log pump (pid %s) is gone: the server's output is no longer written to %s (a restart "
            "starts a new one)" % (pump.get("pid"), (recorded or {}).get("log"))]
