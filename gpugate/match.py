"""Running == desired, decided once: :func:`compare` takes the agent's observation of a container
and its desired state, and says whether what runs is what should run, and if not, how it differs.

The plan (gpugate.plan.make_plan: nothing to do, start, restart, stop) and the status
(gpugate.report.status: serving as desired, drifted, down but desired, stopped as desired) both
call it, so the status can never call "as desired" what the deploy would restart, nor "drifted"
what the deploy leaves alone.

What counts (docs/transition.md, "As desired"): the running main's exact argv (by its hash: secret
values included), the value of every env variable the spec sets (by hash) and no variable a good
spec had that the spec drops, the supervisor, the port, and no other server of this container on
the spec's GPUs (a port change). A server that runs exactly the spec but does not serve is "not
serving" (the deploy waits for it or restarts it).

Example::

    >>> from gpugate.spec import build_spec
    >>> spec = build_spec("/m", 30000, {"tp": 2})
    >>> compare({"sglang": {"running": False}}, spec).verdict
    'not_running'
    >>> compare({"sglang": {"running": False}}, None).verdict
    'absent'
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Mapping
from typing import Any

from gpugate.engine import DEFAULT_ENGINE, Change, Engine, LiveState, get as engine
from gpugate.rules.redact import argv_hash, env_hash, shown_env_value
from gpugate.spec import Spec, SpecError, gpu_set, resolve_supervisor

__all__ = ["Match", "compare", "VERDICTS", "CacheVerdict", "cache_verdict"]

VERDICTS = {
    "as_desired": "the desired server runs and serves",
    "absent": "no server runs, and none should",
    "should_not_run": "a server runs and none should",
    "strays": "stray server parts of this port run, and no server should",
    "not_running": "no server runs, and one should",
    "not_serving": "the desired server runs but does not serve",
    "differs": "a server runs that is not the desired one",
}
OK_VERDICTS = ("as_desired", "absent")


@dataclasses.dataclass(frozen=True)
class Match:
    """What :func:`compare` found. ``lines``: the plan's diff (``- --kv-cache-dtype auto``, ``+ env
    HF_TOKEN=***``), secrets ``***``; ``flag_items``: the same command differences for the status
    (the lines of :func:`diff_lines`, in the one format: ``+ --disable-radix-cache``); ``why``: the
    reasons in words; ``replaced``: servers of other ports on the spec's GPUs (a port change)."""

    verdict: str
    why: tuple[str, ...] = ()
    lines: tuple[str, ...] = ()
    flag_items: tuple[str, ...] = ()
    replaced: tuple[Mapping[str, Any], ...] = ()
    exact: bool = False
    # what serves against what is desired (adapters, weights), each live or restart (docs/live-changes.md)
    changes: tuple[Change, ...] = ()

    @property
    def live(self) -> bool:
        """Every difference is one the engine applies while it serves: no restart."""
        return bool(self.changes) and self.exact and all(change.path == "live" for change in self.changes)

    @property
    def ok(self) -> bool:
        return self.verdict in OK_VERDICTS


def compare(observation: Mapping[str, Any], spec: Spec | None, port: int | None = None,
            siblings: tuple[int, ...] = ()) -> Match:
    """Whether what runs in the container (the agent's observe document) is ``spec`` (None: no
    server should run on ``port``), under the supervisor this container runs it with (``auto``
    resolved here, from what the agent saw: :func:`for_container`), as the deploy runs it;
    ``siblings``: the ports of the container's other desired servers (a container may have several)."""
    spec = for_container(spec, observation)
    server = observation.get("sglang") or {}
    running = bool(server.get("running"))
    name = spec.engine if spec is not None else server.get("engine") or DEFAULT_ENGINE  # how lines name the server
    if spec is None:
        if running:
            main = server.get("main") or {}
            return Match("should_not_run", (f"{name} runs on :{port} (pid {main.get('pid')}) and should not",))
        strays = [s for s in server.get("strays") or [] if s.get("port") in (None, port)]
        if strays:
            return Match("strays", (f"{len(strays)} stray {name} server part(s) of :{port} left in the container",))
        return Match("absent", (f"{name} on :{port} is absent, as desired",))
    replaced = tuple(replaced_servers(observation, spec, siblings))
    if not running:
        return Match("not_running", (f"{name} is not running on :{spec.port}",), replaced=replaced,
                     lines=tuple(diff_lines(server, spec) + env_lines(server, spec)))
    # the desired launch with the live state the running one was started with: what differs beyond
    # it is what serves (adapters, weights), live or by a restart
    launch_runs = runs_exactly(server, launched_spec(server, spec))
    changes = tuple(live_changes(observation, spec)) if launch_runs else ()
    live = bool(changes) and all(change.path == "live" for change in changes)
    exact = launch_runs and (live or not changes)
    have, pinned = server.get("sglang_version"), spec.sglang_version
    label = engine(spec.engine).label
    if pinned and have and have != pinned:  # the deploy refuses it: it can never be as desired
        return Match("differs", (f"the container has {label} {have}; sglang_version pins {pinned}",),
                     flag_items=(f"{label} {have} in the container, {pinned} pinned",), replaced=replaced, exact=exact)
    weights = cache_verdict(observation, spec)
    if live and not replaced:
        return Match("differs", ("what it serves differs from the desired state (the engine applies it live)",),
                     lines=tuple(change.line for change in changes), flag_items=tuple(change.line for change in changes),
                     exact=True, changes=changes)
    if exact and not replaced and weights.mode in ("keep", "none"):
        if server.get("serving"):
            return Match("as_desired", exact=True)
        return Match("not_serving", exact=True)
    if exact and not replaced:  # the engine is the desired one; its weight cache is not
        return Match("differs", (weights.why,), flag_items=(weights.why,), exact=True)
    flag_lines, changed_env = diff_lines(server, spec), env_lines(server, spec)
    why = []
    serving_engine = engine(spec.engine)
    signs: tuple[tuple[str, str], ...] = (("the interpreter", "interpreter "),
                                          ("the model", serving_engine.model_option + " "),
                                          ("the listen host", serving_engine.host_option + " "))
    if other_engine(server, spec):
        why.append(f"the running server is {other_engine(server, spec)}'s, the desired one {spec.engine}'s")
        signs += (("", "engine "),)
    command = [what for what, sign in signs if what and any(line[2:].startswith(sign) for line in flag_lines)]
    if command:
        why.append("the running command differs from the desired one: " + ", ".join(command))
    if any(not any(line[2:].startswith(sign) for _, sign in signs) for line in flag_lines):
        why.append("the running flags differ from the desired flags")
    if changed_env:
        why.append("the server's environment differs")
    if not exact and not flag_lines and not changed_env:
        why.append("the running command differs from the desired one (a secret value or the supervisor)")
    # a restart takes every difference: those the engine could apply live come back with its launch
    folded = [change.line if change.path == "restart" else f"restart (its launch carries it): {change.text}"
              for change in changes]
    return Match("differs", tuple(why), lines=tuple(flag_lines + changed_env + folded),
                 flag_items=tuple(flag_items(server, spec)), replaced=replaced, exact=exact, changes=changes)


def launched_spec(server: Mapping[str, Any], spec: Spec) -> Spec:
    """``spec`` as it would have been launched with the live state (model path, adapters) the running
    command carries: a server changed live since its start runs exactly that (its argv still names
    the launch's model and adapters), and :func:`live_changes` says what differs now."""
    running = running_command(server, spec.engine)
    if running is None:
        return spec
    parsed = engine(spec.engine).read_running((server.get("main") or {}).get("argv") or [])
    return spec.with_live(engine(spec.engine).launched_live(parsed))


def served_live(server: Mapping[str, Any], spec: Spec) -> LiveState | None:
    """What the running server serves now: its own answer (observe's ``live``), where it gave one,
    over what its command was launched with; LoRA on or off is the launch's."""
    main = server.get("main") or {}
    if not server.get("running") or not main:
        return None
    serving = engine(spec.engine)
    launched = serving.launched_live(serving.read_running(main.get("argv") or []))
    said = server.get("live") or {}
    adapters = launched.lora_adapters
    if adapters is not None and isinstance(said.get("lora_adapters"), Mapping):
        adapters = dict(said["lora_adapters"])
    return LiveState(said.get("model_path") or launched.model_path, adapters)


def live_changes(observation: Mapping[str, Any], spec: Spec) -> list[Change]:
    """Every difference between what serves and the desired live state, each with the path the
    engine takes for it (live or restart); the two models' shapes as observe read them in the container.

    >>> from gpugate.spec import build_spec
    >>> spec = build_spec("/m", 30000, {}, lora_adapters={"b": "/b"})
    >>> argv = list(build_spec("/m", 30000, {}, lora_adapters={"a": "/a"}).argv)
    >>> [c.line for c in live_changes({"sglang": {"running": True, "main": {"argv": argv},
    ...                                           "live": {"model_path": "/m", "lora_adapters": {"a": "/a"}}}}, spec)]
    ['live: unload adapter a', 'live: load adapter b']
    """
    server = observation.get("sglang") or {}
    have = served_live(server, spec)
    if have is None:
        return []
    shapes = server.get("model_shapes") or {}
    before, after = shapes.get(have.model_path or ""), shapes.get(spec.model_path)
    same = None if before is None or after is None else before == after
    return engine(spec.engine).live_changes(have, spec.live, same_shape=same, weight_cache=spec.weight_cache)


@dataclasses.dataclass(frozen=True)
class CacheVerdict:
    """What a start of ``spec`` does with the weight cache (docs/weight-cache.md): ``keep`` (the
    daemons hold the desired key: an engine-only restart), ``start`` (none runs, or of another
    key: they (re)start first), ``stop`` (one runs and none is wanted), ``none``."""

    mode: str
    why: str
    changes: tuple[str, ...] = ()


def cache_verdict(observation: Mapping[str, Any], spec: Spec | None) -> CacheVerdict:
    """The desired key (from the spec's daemon command and what observe read of the model, SGLang
    and torch) against the running daemons' recorded key."""
    server = observation.get("sglang") or {}
    running = server.get("weight_cache") or None
    if spec is None or not spec.weight_cache:
        if running and running.get("pids"):
            return CacheVerdict("stop", "a weight cache runs for this server and none is wanted")
        return CacheVerdict("none", "no weight cache")
    serving_engine = engine(spec.engine)
    cache = serving_engine.container  # the key is the container's rule: computed there the same way
    want = cache.cache_key(list(spec.daemon_argv), spec.env, server.get("model_config_sha256"),
                           server.get("sglang_version"), server.get("torch_version"))
    if not running:
        return CacheVerdict("start", "no weight cache runs")
    if not running.get("running"):
        return CacheVerdict("start", "the weight cache is not ready: " + "; ".join(running.get("problems") or ["?"]))
    have = running.get("key") or {}
    if have.get("id") != want["id"]:
        shown = [dict(inputs or {}, argv=serving_engine.redact_argv(list((inputs or {}).get("argv") or [])))
                 for inputs in (have.get("inputs"), want["inputs"])]  # a secret's change shows as ***
        changes = tuple(cache.key_changes(*shown))
        return CacheVerdict("start", "the weight cache's key changes (" + (
            ", ".join(changes) or "a secret value of the daemons' command") + ")", changes)
    return CacheVerdict("keep", "the weight cache's key is unchanged")


def for_container(spec: Spec | None, observation: Mapping[str, Any]) -> Spec | None:
    """``spec`` with its supervisor as this container runs it (``auto``: systemd where the agent saw
    PID 1 is systemd, else process)."""
    if spec is None or spec.supervisor != "auto":
        return spec
    return spec.with_supervisor(resolve_supervisor("auto", observation.get("container")))


# ---------------------------------------------------------------- the parts
def running_command(server: Mapping[str, Any], engine_name: str | None = None) -> dict[str, Any] | None:
    """The running main's command as its engine reads it (model, host, port, flags, what it does not
    know); ``engine_name``: the desired server's (else the one observe names)."""
    main = server.get("main")
    if not server.get("running") or not main:
        return None
    parsed = engine(engine_name or server.get("engine") or DEFAULT_ENGINE).read_running(main.get("argv") or [])
    return {"model_path": parsed.model_path, "host": parsed.host, "port": parsed.port, "flags": parsed.flags,
            "unknown": list(parsed.unknown), "python": (main.get("argv") or ["?"])[0]}


def runs_exactly(server: Mapping[str, Any], spec: Spec) -> bool:
    """The running main's exact argv (by hash: secret values included) and environment (by value
    hashes) are the desired spec's, under the spec's supervisor."""
    main = server.get("main") or {}
    if not server.get("running") or main.get("argv_hash") != argv_hash(list(spec.argv)):
        return False
    have = server.get("env_hashes") or {}
    if any(have.get(name) != env_hash(value) for name, value in spec.env.items()):
        return False
    if any(value is not None for name, value in have.items() if name not in spec.env):
        return False
    return (main.get("supervisor") or "process") == spec.supervisor


def env_lines(server: Mapping[str, Any], spec: Spec) -> list[str]:
    """Env differences against the running process's environment, by hash (names the desired spec
    sets, and names a good spec had that the desired one drops), each with the value about to be
    applied, ``***`` for a name that names a secret (gpugate.rules.redact.names_a_secret: the
    pattern list and the spec's ``secret_env``).

    >>> from gpugate.spec import build_spec
    >>> env_lines({"env_hashes": {}}, build_spec("/m", 30000, {}, {"HF_TOKEN": "hf_1", "SGLANG_LOAD_S": "0.5"}))
    ['+ env HF_TOKEN=***', '+ env SGLANG_LOAD_S=0.5']
    """
    have = server.get("env_hashes") or {}
    lines = []
    for name, value in sorted(spec.env.items()):
        shown = shown_env_value(name, value, spec.secret_env)
        if have.get(name) is None:
            lines.append(f"+ env {name}={shown}")
        elif have[name] != env_hash(value):
            lines.append(f"~ env {name}={shown} (value changed)")
    for name in sorted(set(have) - set(spec.env)):
        if have[name] is not None:
            lines.append(f"- env {name}")
    return lines


def interpreter_lines(running: str | None, desired: str | None) -> list[str]:
    """The interpreter change as a pair of lines that say what they are (a bare ``- python3`` reads
    like a flag value); nothing when either side is unknown.

    >>> interpreter_lines("/usr/bin/python3", "/opt/venv/bin/python3")
    ['- interpreter /usr/bin/python3', '+ interpreter /opt/venv/bin/python3']
    """
    if not running or not desired or running == "?" or running == desired:
        return []
    return [f"- interpreter {running}", f"+ interpreter {desired}"]


def other_engine(server: Mapping[str, Any], spec: Spec) -> str | None:
    """The engine of the server that runs, where it is not the desired server's (observe names it).

    >>> other_engine({"engine": "echo"}, None), other_engine({}, None)
    ('echo', None)
    """
    have = server.get("engine")
    return str(have) if have and have != (spec.engine if spec is not None else DEFAULT_ENGINE) else None


def diff_lines(server: Mapping[str, Any], spec: Spec) -> list[str]:
    """What changes from the running command to the desired one, one line per argv change
    (secrets ``***``), model path, host and interpreter included."""
    running = running_command(server, spec.engine)
    if running is None:
        return [f"+ {arg}" for arg in spec.display_args()]
    other = other_engine(server, spec)
    if other:  # another engine's server: its flags are no flags of this one; the whole command changes
        return [f"- engine {other}", f"+ engine {spec.engine}"] + [f"+ {arg}" for arg in spec.display_args()]
    lines: list[str] = interpreter_lines(running["python"], spec.python)
    lines += command_lines(engine(spec.engine), running, spec.model_path, spec.host)
    lines += flag_differences(running["flags"], spec.flags, spec.engine)
    have_extra = running["unknown"]
    if list(have_extra) != list(spec.extra_args):
        if have_extra:
            lines.append("- " + shlex.join(have_extra))
        if spec.extra_args:
            lines.append("+ " + shlex.join(spec.extra_args) + "  (extra_args, unchecked)")
    return lines


def command_lines(serving: Engine, running: Mapping[str, Any], model_path: str | None, host: str | None) -> list[str]:
    """The model and listen host changes, as the engine writes them on its command line.

    >>> command_lines(engine("sglang"), {"model_path": "/a", "host": None}, "/b", "127.0.0.1")
    ['- --model-path /a', '+ --model-path /b']
    """
    lines = []
    if running["model_path"] != model_path:
        lines += [f"- {serving.model_option} {running['model_path']}", f"+ {serving.model_option} {model_path}"]
    if (running["host"] or "127.0.0.1") != (host or "127.0.0.1"):
        lines += [f"- {serving.host_option} {running['host'] or '127.0.0.1'}",
                  f"+ {serving.host_option} {host or '127.0.0.1'}"]
    return lines


def flag_differences(running: Mapping[str, Any], desired: Mapping[str, Any], engine_name: str = DEFAULT_ENGINE
                     ) -> list[str]:
    """THE rendering of a flag difference, wherever one is shown (the plan and ``--dry``, the status,
    the history, the runbooks, the lines from the journal): one line per argv change, sorted by flag
    name, a sign, a space, then the flag as it is written: ``+ --flag value`` desired and not running,
    ``- --flag value`` running and not desired; a changed value is its ``-`` line then its ``+``
    line. Secrets ``***``: compared masked on both sides, so the agent's ``***`` for a running
    --api-key is not a difference (the argv's hash tells a changed secret: status_row).

    >>> flag_differences({"tp-size": 8, "kv-cache-dtype": "auto"}, {"tp-size": 8, "kv-cache-dtype": "fp8_e4m3",
    ...                                                              "disable-radix-cache": True})
    ['+ --disable-radix-cache', '- --kv-cache-dtype auto', '+ --kv-cache-dtype fp8_e4m3']
    >>> flag_differences({"tp-size": 4, "api-key": "***"}, {"tp-size": 4, "api-key": "sk-1"})
    []
    """
    return engine(engine_name).flag_lines(running, desired)


def flag_items(server: Mapping[str, Any], spec: Spec) -> list[str]:
    """The differences of the running command from the desired one for the status: the lines of
    :func:`diff_lines` (one format everywhere: ``- --kv-cache-dtype auto``, ``+ --kv-cache-dtype
    fp8_e4m3``, ``+ --model-path /m``, ``+ interpreter /opt/venv/bin/python3``); none when nothing runs."""
    if running_command(server, spec.engine) is None:
        return []
    return diff_lines(server, spec)


def _gpus(read: Any, spec: Spec) -> tuple[int, ...] | None:
    try:
        return gpu_set(read.flags, engine_name=spec.engine)
    except SpecError:
        return None


def replaced_servers(observation: Mapping[str, Any], spec: Spec, siblings: tuple[int, ...] = ()
                     ) -> list[dict[str, Any]]:
    """Servers of this container on OTHER ports whose GPUs overlap the desired server's: they must
    stop first (a port change: 30000 -> 30001). Each as ``{"port", "pid", "cmdline", "gpus"}``.
    Never a server on other GPUs (two servers on disjoint halves), never one gpugate does not run
    (the agent says ``managed``), and none at all when the container has several desired servers
    (``siblings``: their ports): then a server of another port is another desired server, or a
    stranger, and neither is this one's previous self."""
    if siblings:
        return []
    server = observation.get("sglang") or {}
    wanted = None if spec.gpus is None else set(spec.gpus)
    out = []
    seen_ports = set()
    for stray in server.get("strays") or []:
        port = stray.get("port")
        # a server's main only, once per port: its workers carry its port too (they are its own)
        if not port or port == spec.port or port in seen_ports or stray.get("managed") is False:
            continue
        read = None
        if "gpus" not in stray:  # an observation without the GPUs: read them from the command line
            read = engine(spec.engine).read_running((stray.get("cmdline") or "").split())
            if read.model_path is None:  # no server main (a worker: its main is the server that owns it)
                continue
        elif not stray.get("main"):
            continue
        seen_ports.add(port)
        gpus = tuple(stray["gpus"]) if stray.get("gpus") is not None else None if read is None else _gpus(read, spec)
        if wanted is None or gpus is None or wanted & set(gpus):
            out.append({"port": port, "pid": stray.get("pid"), "cmdline": stray.get("cmdline") or "", "gpus": gpus})
    return out
