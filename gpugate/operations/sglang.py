"""Operations for the SGLang server in a container.

``sglang.server``: the desired server. The controller plans; the container's agent runs the
transition to its end (docs/transition.md, docs/agent-protocol.md):

    observe (one command)  ->  plan (pure: gpugate.plan)  ->  --dry stops here
    ->  ONE hand-off command (the agent, detached, holds the container's transition lock)
    ->  follow the agent's journal, print progress and the outcome

Its death, a Ctrl-C or a dropped connection change nothing in the container: the transition runs to
its end there, and a re-run attaches to it (or reads how it ended).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import sys
import time
import types
import uuid
from collections.abc import Callable, Iterator, Mapping, MutableSet
from typing import Any, TypeVar, cast

from pyinfra import logger
from pyinfra.api import FunctionCommand, StringCommand, operation
from pyinfra.api.exceptions import ArgumentTypeError
from pyinfra.api.state import BaseStateCallback
from pyinfra.context import host, state

from gpugate import agentcmd
from gpugate.facts.sglang import SglangObservation, SglangObservationInline, flag_table, observation_from
from gpugate.plan import Narrator, Plan, make_plan, outcome_lines, plan_lines, same_desired, stall_text
from gpugate.engine import DEFAULT_ENGINE, get as engine
from gpugate.match import for_container, served_live
from gpugate.report.status import desired_differences, history_spec_text
from gpugate.claims import (GpuClaim, ServerClaim, ServerRoute, hand_off_holding_gpu_locks, own_claim_run,
                            routes_of_inventory, servers_of_inventory)
from gpugate.connectors.pct import PctConnector, PctFailure, PctFailureKind
from gpugate.settings import SETTINGS, SettingsError, resolved, server_keys, suggest
from gpugate.spec import Desired, Routing, Spec, SpecError, desired_states, for_version, gpus_taken

FOLLOW_WAIT_S = 3.0       # one follow command waits up to this long for new journal events
FOLLOW_RETRIES = 3        # consecutive failed follow commands before the controller gives up watching
LINK_SILENT_S = 5.0       # a follow unanswered this long beyond its own wait: the link is said to be silent


def emit(step: str, **fields: Any) -> None:
    """The audit log (gpugate.audit; ``path`` among the fields picks the file). Never fails."""
    try:
        from gpugate import audit
        audit.emit(step, **fields)
    except Exception:  # an audit problem must not break a restart
        logger.debug("audit emit failed for %s", step, exc_info=True)


def _operator() -> str:
    try:
        from gpugate.audit import operator
        return operator()
    except Exception:
        return "unknown"


# ---------------------------------------------------------------- one pyinfra run: the Run object
@dataclasses.dataclass
class Watch:
    """A container whose transition this process hands off or follows (for Ctrl-C)."""

    host: str
    port: int
    run: str
    narrator: Narrator
    handed_off: bool = False
    read_at: float | None = None   # when a follow last answered: the narrator's step is as of then


def _staleness(watch: Watch, now: float) -> str:
    """How old the narrator's step may be: the journal arrives in FOLLOW_WAIT_S batches, so an
    interrupt's "beginning" can be a run already at load.

    >>> _staleness(Watch("h", 30000, "r", Narrator(), True, read_at=100.0), 104.2)
    '; its journal last read 4 s ago: it may be further on'
    """
    if watch.read_at is None:
        return "; no journal event read yet: it may be further on"
    age = now - watch.read_at
    return f"; its journal last read {age:.0f} s ago: it may be further on" if age >= 1.0 else ""


@dataclasses.dataclass(frozen=True)
class Left:
    """A container this run took out of its router (recorded before the DELETE, so an interrupt
    during it counts): which router, and whether an interrupt before its hand-off puts it back
    (a member: yes; a cordoned server leaves because it is declared out: no)."""

    label: str          # "[@pct/pve1:129] sglang :30000"
    router: str
    put_back: bool = True


_SIGNAL_WORDS: dict[int, str] = {signal.SIGINT: "interrupted", signal.SIGTERM: "interrupted (SIGTERM)",
                 signal.SIGHUP: "interrupted (SIGHUP)"}


class Run(BaseStateCallback):
    """What sglang.server keeps for one pyinfra run, all in this one object: per container the
    outcome, refusals, failures and the containers a rolling restart left untouched (the summary,
    printed once when the operation ends), the transitions it hands off or follows (what an
    interrupt says), and the desired GPU claims of the whole inventory (read once).

    pyinfra's own operations keep nothing between hosts; these must (a rolling restart stops on an
    earlier container's failure, Ctrl-C speaks for every container). The one place to find it:
    ``Run.of(state)``, the run's State callback handler of this class (pyinfra's place for an object
    that lives as long as a run and hears its operations end), made by the run's first sglang.server
    call, which also makes the run's Ctrl-C its own (:meth:`catch_interrupts`).
    """

    def __init__(self) -> None:
        self.outcomes: dict[str, str] = {}
        self.failed: list[str] = []      # transitions that did not end verified (rolling stops on them)
        self.refused: list[str] = []
        self.untouched: list[str] = []
        self.watching: dict[str, Watch] = {}
        self.unavailable: set[str] = set()  # containers said to be stopped or missing (a connect error's line)
        self.servers: dict[tuple[str, int], str] = {}  # (container, port) -> its server's engine, for the lines
        self.left: dict[str, Left] = {}  # containers this run took out of their router, until back in
        self.interrupted: int | None = None  # the signal, while the containers it caught leaving are put back
        self.put_back_lines: list[str] = []  # what each put-back did, said when the last one ends
        self.canaries: dict[str, str] = {}  # router -> its canary's verdict in this run (one canary per router)
        # container -> (its server's label, router, soak_s, wall-clock start) while its canary soaks: an
        # interrupt then says the canary runs the new spec unjudged, never "nothing was touched"
        self.soaking: dict[str, tuple[str, str, float, float]] = {}
        self.printed = False
        self._claims: list[ServerClaim] | None = None
        self._routes: list[ServerRoute] | None = None

    @classmethod
    def of(cls, state: Any) -> Run:
        """This pyinfra run's Run (made, registered and catching interrupts on the first call)."""
        for handler in state.callback_handlers:
            if isinstance(handler, cls):
                return handler
        run = cls()
        state.add_callback_handler(run)
        run.catch_interrupts()
        return run

    def ended(self, name: str, outcome: str, refused: bool = False) -> None:
        """A container this run no longer follows: its outcome, counted as failed (rolling stops on it)
        or as refused (nothing touched)."""
        self.watching.pop(name, None)
        (self.refused if refused else self.failed).append(name)
        self.outcomes[name] = outcome

    def stop_rolling(self, max_failures: int) -> bool:
        """A rolling change stops at any container it did not leave as desired: failed, interrupted,
        refused or unreachable while it ran all count (a refusal at prepare, shown in the plan
        before the operator said yes, does not)."""
        return len(self.failed) + len(self.refused) > max_failures

    def desired_claims(self, inventory: Any) -> list[ServerClaim]:
        """Every desired server of the inventory as a GPU claim (gpugate.claims), whatever ``--limit``
        runs now (the fleet is the desired state): read once per run, host data is fixed by then."""
        if self._claims is None:
            self._claims = servers_of_inventory((h.name, h.data.dict()) for h in inventory)
        return self._claims

    def desired_routes(self, inventory: Any) -> list[ServerRoute]:
        """Every routed server of the inventory (gpugate.claims.routes_of_inventory), read once per run."""
        if self._routes is None:
            self._routes = routes_of_inventory((h.name, h.data.dict()) for h in inventory)
        return self._routes

    def operation_end(self, state: Any, op_hash: Any) -> None:  # type: ignore[override]
        if self.printed or not (self.failed or self.refused or self.untouched):
            return
        self.printed = True
        lines = ["sglang.server summary:"]
        for name, outcome in sorted(self.outcomes.items()):
            lines.append(f"    {name}: {outcome}")
        if self.untouched:
            stopped_by = self.failed + self.refused
            lines.append("    not touched (the rolling restart stopped after "
                         f"{len(stopped_by)} failed container(s): {', '.join(stopped_by)}): "
                         + ", ".join(self.untouched))
        for line in lines:
            logger.warning(line)

    def catch_interrupts(self) -> None:
        """Replace pyinfra's Ctrl-C handler (which prints "Exiting upon user request!" and exits 0)
        with :meth:`on_interrupt` for this run, under pyinfra's CLI: a change interrupted must never
        look like success. SIGTERM (a CI timeout) and SIGHUP (the terminal closed) too, unless ignored
        (nohup: the operator asked for the run to outlive the terminal)."""
        import pyinfra

        if not getattr(pyinfra, "is_cli", False):
            return
        try:
            for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                if signum != signal.SIGINT and signal.getsignal(signum) == signal.SIG_IGN:
                    continue
                signal.signal(signum, self.on_interrupt)
        except (ValueError, OSError):  # not the main thread: leave pyinfra's
            pass

    def on_interrupt(self, signum: int, frame: Any) -> None:
        """Say what each container is still doing, and exit non-zero (128 + the signal). The
        transition itself runs on in the container (the agent ignores the SSH session).

        A container caught after it left its router but before its hand-off still serves, untouched
        but out of the router (issue 32 item 5): the run does not exit yet; the container's own
        operation sees :attr:`interrupted`, puts it back (:func:`_put_back`) and the last one to end
        exits (:meth:`put_back_done`). The handler itself only writes and sets the flag: it may run
        inside gevent's hub, where no request can wait. A second interrupt exits at once, saying
        what is left out."""
        word = _SIGNAL_WORDS.get(signum, f"interrupted (signal {signum})")
        if self.interrupted is not None:
            self._exit(signum, self.put_back_lines + [
                f"{left.label} {word} again while being put back into router {left.router}: it may be out of it "
                f"(the server was not stopped); the next deploy adds it once it answers as this server"
                for left in self.putting_back()] + self._interrupt_lines(word))
        putting_back = self.putting_back()
        if putting_back:
            self.interrupted = signum
            self._write([f"{left.label} {word} after it left router {left.router}, before its hand-off (the server "
                         f"was not stopped): putting it back into router {left.router}; interrupt again to exit at "
                         f"once, leaving it out" for left in putting_back])
            return
        self._exit(signum, self._interrupt_lines(word))

    def putting_back(self) -> list[Left]:
        """The containers an interrupt puts back: out of their router by this run, no hand-off begun."""
        return [left for name, left in self.left.items() if left.put_back and name not in self.watching]

    def put_back_done(self, name: str, line: str) -> None:
        """One put-back ended (``line``: what it did); the last one exits, saying everything."""
        self.left.pop(name, None)
        self.put_back_lines.append(line)
        if self.interrupted is not None and not self.putting_back():
            word = _SIGNAL_WORDS.get(self.interrupted, f"interrupted (signal {self.interrupted})")
            self._exit(self.interrupted, self.put_back_lines + self._interrupt_lines(word))

    def _interrupt_lines(self, word: str) -> list[str]:
        """What an interrupt leaves, per container this run touched (besides the put-backs)."""
        lines = []
        now = time.time()
        for watch in list(self.watching.values()):
            left = self.left.get(watch.host)
            out = (f"; it is out of router {left.router} meanwhile (left before the hand-off): the next deploy adds it "
                   f"once it serves" if left is not None and left.put_back else "")
            if watch.handed_off:
                lines.append(f"[{watch.host}] {self.servers.get((watch.host, watch.port), DEFAULT_ENGINE)} :{watch.port} {word}: the transition continues in the container: "
                             f"{watch.narrator.doing(now)} (run {watch.run}{_staleness(watch, now)}); follow with "
                             f"runbooks/status.py, or re-run to attach to it{out}")
            else:
                lines.append(f"[{watch.host}] {self.servers.get((watch.host, watch.port), DEFAULT_ENGINE)} :{watch.port} {word} during the hand-off of run {watch.run}: "
                             f"the transition may have begun in the container; see runbooks/status.py{out}")
        for name, (label, router_name, soak_s, began) in list(self.soaking.items()):
            lines.append(f"[{name}] {label} {word} during its canary soak ({now - began:.0f}/{soak_s:g} s): it runs the "
                         f"new spec (verified, back in router {router_name}) with NO verdict; the rest of the rolling "
                         f"change is not touched; the next deploy does not soak it again (it serves as desired): "
                         f"roll it back (runbooks/rollback.py) or re-run the change with a canary on another replica")
        for name, left in self.left.items():
            if not left.put_back and name not in self.watching:
                lines.append(f"{left.label} {word} while leaving router {left.router} (cordoned, as declared): it is "
                             f"out of it or leaving (the server was not stopped; its requests in flight end on their "
                             f"own); the next deploy finishes the leave")
        if not lines and not self.put_back_lines:
            lines.append(f"{word} before any hand-off: nothing was touched")
        return lines

    def _write(self, lines: list[str]) -> None:
        # A signal handler interrupts whatever the main thread was doing, perhaps inside a buffered
        # write: only unbuffered writes.
        try:
            os.write(2, "".join(line + "\n" for line in lines).encode())
        except BaseException:
            pass

    def _exit(self, signum: int, lines: list[str]) -> None:
        """Say ``lines`` and exit 128 + the signal, whatever else fails."""
        try:
            self._write(lines)
            emit("interrupted", phase="end", handed_off=any(w.handed_off for w in self.watching.values()),
                 signal=int(signum), runs=[w.run for w in self.watching.values()], put_back=self.put_back_lines)
            sys.stdout.flush()
        except BaseException:
            pass
        finally:
            os._exit(128 + int(signum))

    def keep_fleet_order(self, state: Any) -> None:
        """Make a rolling restart visit the containers in the inventory's order (once per run).

        pyinfra keeps its active hosts in a plain set and a ``_serial`` operation visits them in
        that set's (hash) order; an operator who lists pve1 first expects pve1 to restart first,
        and the summary's "not touched" to be the containers after the one that failed. pyinfra has
        no setting for the order and a set has none to give, so this replaces ``state.active_hosts``
        with an ordered set of the same hosts (FleetOrderedHosts): the one thing gpugate changes in
        pyinfra's State, only for a rolling change, and before pyinfra takes the order."""
        if isinstance(state.active_hosts, FleetOrderedHosts):
            return
        order = {host: index for index, host in enumerate(state.inventory)}
        state.active_hosts = FleetOrderedHosts(sorted(state.active_hosts, key=lambda host: order.get(host, len(order))))


class FleetOrderedHosts(MutableSet):
    """pyinfra's active hosts in inventory (fleet) order (:meth:`Run.keep_fleet_order` says why).
    pyinfra only adds, discards and iterates them.

    >>> hosts = FleetOrderedHosts(["b", "a", "c"]); hosts -= {"a"}; list(hosts)
    ['b', 'c']
    """

    def __init__(self, hosts: Any = ()) -> None:
        self._hosts: dict[Any, None] = dict.fromkeys(hosts)

    def __contains__(self, host: object) -> bool:
        return host in self._hosts

    def __iter__(self) -> Iterator[Any]:
        return iter(list(self._hosts))

    def __len__(self) -> int:
        return len(self._hosts)

    def add(self, host: Any) -> None:
        self._hosts[host] = None

    def discard(self, host: Any) -> None:
        self._hosts.pop(host, None)


# ---------------------------------------------------------------- talking to the container
@dataclasses.dataclass(frozen=True)
class Trouble:
    """Why an agent command gave no answer: the line the operator reads (``text``, also what
    ``str()`` gives) and, where pct or the link to the Proxmox host said why, the connector's
    ``PctFailure.kind``: code decides on the kind, never on the words.

    >>> Trouble("container 129 on pve1 is stopped", "not-running").container_gone
    True
    """

    text: str
    kind: PctFailureKind | None = None

    def __str__(self) -> str:
        return self.text

    @property
    def container_gone(self) -> bool:
        """The container is stopped or no longer exists: nothing more can be read from it."""
        return self.kind in ("not-running", "unknown-vmid")


def _pct(host_obj: Any) -> PctConnector | None:
    """The host's pct connector; None under another connector, which runs the same commands without
    pct's failures, containers found stopped at the first command, or the Proxmox host's GPU locks."""
    connector = host_obj.connector
    return connector if isinstance(connector, PctConnector) else None


def _pct_trouble(failure: PctFailure | None, pve_host: str, vmid: Any) -> Trouble | None:
    """Why a command did not run in the container, from the connector's structured failure
    (gpugate.connectors.pct.PctFailure): 'container 129 on pve1 is stopped', 'pve1: the SSH
    connection was lost'; None when pct ran the command (its own exit status is the command's)."""
    if failure is None:
        return None
    if failure.kind == "not-running":
        return Trouble(f"container {vmid} on {pve_host} is stopped", failure.kind)
    if failure.kind == "unknown-vmid":
        return Trouble(f"container {vmid} on {pve_host} does not exist (any more)", failure.kind)
    if failure.kind == "link-lost":
        return Trouble(f"{pve_host}: the SSH connection was lost (the link to the Proxmox host, not the container)",
                       failure.kind)
    return Trouble(failure.describe(pve_host, vmid), failure.kind)


def _last_trouble(host_obj: Any) -> Trouble | None:
    """Why the host's last command did not run in the container, as its connector recorded it."""
    connector = _pct(host_obj)
    if connector is None:
        return None
    return _pct_trouble(connector.last_failure, host_obj.data.get("pve_host") or connector.pve_host_name,
                        host_obj.data.get("pct_vmid"))


def _run(host_obj: Any, command: Any, stdin: str | None = None, timeout: float | None = None
         ) -> tuple[bool, dict[str, Any], Trouble | None]:
    """One agent command -> (ran, answer, trouble). ``trouble``: why no answer came (the
    container is stopped, the connection failed); never raw output."""
    kwargs: dict[str, Any] = {}
    if stdin is not None:
        kwargs["_stdin"] = stdin
    if timeout is not None:
        kwargs["_timeout"] = int(timeout)
    try:
        status, output = host_obj.run_shell_command(
            command if isinstance(command, StringCommand) else StringCommand(command), **kwargs)
    except Exception as error:  # SSH dropped, timeout: the caller decides
        return _no_answer(host_obj, error)
    return _answer(host_obj, status, output)


def _no_answer(host_obj: Any, error: Exception) -> tuple[bool, dict[str, Any], Trouble | None]:
    trouble = _last_trouble(host_obj)
    return False, {}, trouble or Trouble(f"no answer from the container ({type(error).__name__}: {str(error)[:200]})")


def _answer(host_obj: Any, status: bool, output: Any) -> tuple[bool, dict[str, Any], Trouble | None]:
    """An agent command's ``(status, output)`` -> (ran, answer, trouble), as :func:`_run` says."""
    if not status:
        trouble = _last_trouble(host_obj)
        if trouble:
            return False, {}, trouble
        detail = " | ".join(line for line in output.stderr_lines if line.strip())[-300:]
        return False, {}, Trouble(f"the command failed in the container: {detail or 'no output'}")
    answer = agentcmd.parse_output(output.stdout_lines)
    return True, answer, None


def _observe(host_obj: Any, python: str, kwargs: Mapping[str, Any]) -> tuple[dict[str, Any] | None, Trouble | None]:
    """The SglangObservation: one command; once more with the agent inline when this controller's
    agent is not installed in the container (read-only: the hand-off installs it)."""
    doc: dict[str, Any] = {}
    installed = True
    for fact_cls in (SglangObservation, SglangObservationInline):
        _ran, answer, trouble = _run(host_obj, fact_cls().command(python=python, **kwargs))
        if trouble:
            return None, trouble
        doc = observation_from(answer)
        if not doc.get("agent_missing"):
            break
        installed = False
    if doc.get("no_python") or doc.get("agent_missing"):
        return None, Trouble(doc.get("error") or "the container's agent did not answer")
    if "error" in doc:
        return None, Trouble(f"the observation failed: {doc['error']}")
    doc["agent_installed"] = installed
    return doc, None


def _spec_for_version(host_obj: Any, python: str, spec: Spec, flags: Mapping[str, Any] | None,
                      pinned: str | None, observation: Mapping[str, Any] | None = None,
                      gated_choice: bool | None = None) -> Spec:
    """``spec`` validated again against SGLang's own flag table for this container (the container's,
    built once and cached there; else the pinned version's snapshot; else the newest: see
    gpugate.engine.sglang.flags.choose_table). SpecError names the flag and the version; the table used and
    SGLang's deprecation warnings join the spec's warnings (the plan's notes)."""
    show = not state.is_executing or not state.check_for_changes

    def run(command: str) -> dict[str, Any]:
        _ran, answer, trouble = _run(host_obj, command)
        return answer if not trouble else {"schema": 1, "version": None, "error": trouble.text}

    # observation: observe already named the container's table; known to us, it costs no command
    doc = flag_table(host_obj, python, say=host_obj.log if show else None, run=run, observation=observation,
                     engine_name=spec.engine)
    serving = engine(spec.engine)
    table, note = serving.choose_table(doc, pinned)
    checked = for_version(spec, table)
    extra = (f"flags checked against {note}",) + tuple(serving.flag_warnings(checked.flags, table))
    return dataclasses.replace(checked, launch=dataclasses.replace(checked.launch,
                                                                   warnings=tuple(checked.warnings) + extra))


def _claim_overlaps(host_obj: Any, spec: Spec, desired_siblings: tuple[int, ...] = ()) -> list[str]:
    """Plan-time GPU claims (issue 12 item 3): the lines naming this container's desired server and
    every other desired server of the same Proxmox host (the whole inventory, whatever ``--limit``
    runs now: the fleet is the desired state) whose GPUs overlap it. Empty when the GPUs cannot be
    told before the start (UUIDs in CUDA_VISIBLE_DEVICES) or the host is not a pct container.

    ``mine`` is the spec this operation was given (it may differ from the host data), so this
    container's own inventory entry (one server per container there) is replaced by it, never
    compared with it: a port change of this container is the plan's replace, not a claim."""
    from gpugate.claims import claim_host, overlaps_of  # noqa: PLC0415

    vmid = host_obj.data.get("pct_vmid")
    if spec.gpus is None or vmid is None:
        return []
    mine = (claim_host(host_obj.name, host_obj.data), int(vmid), int(spec.port), tuple(spec.gpus))
    fleet = Run.of(state).desired_claims(state.inventory)  # once per pyinfra run, not once per container
    # this container's own entry is the spec this operation was given; with several servers in the
    # container, only this server's (its siblings claim GPUs of their own)
    same = 3 if desired_siblings else 2
    servers = [mine if claim[:same] == mine[:same] else claim for claim in fleet]
    # inventory order, so both containers of a pair print the same line
    return overlaps_of(mine, servers if mine in servers else [*servers, mine])


def _map_refusals(host_obj: Any, spec: Spec, desired_siblings: tuple[int, ...] = ()) -> list[str]:
    """This server against the GPUs its Proxmox node passes into each container (gpugate.proxmox.plan_map_refusals)."""
    from gpugate.claims import claim_host  # noqa: PLC0415
    from gpugate.proxmox import plan_map_refusals  # noqa: PLC0415

    if spec.gpus is None or host_obj.data.get("pct_vmid") is None:
        return []
    mine = (claim_host(host_obj.name, host_obj.data), int(host_obj.data.get("pct_vmid")), int(spec.port), tuple(spec.gpus))
    same = 3 if desired_siblings else 2
    servers = [c for c in Run.of(state).desired_claims(state.inventory) if c[:same] != mine[:same]]
    return plan_map_refusals(_pct(host_obj), id(state), mine, servers, spec.flags,
                             lambda line: host_obj.log_styled(line, fg="yellow", log_func=logger.warning))


def _shared_worker_urls(host_obj: Any, desired: Desired) -> list[str]:
    """Plan-time worker URLs (issue 32): the lines naming this server and every other routed server
    of the inventory (whatever ``--limit`` runs now, ``--data`` overrides included) behind the same
    router with the same worker URL. This server's own entry is the one this operation was given."""
    from gpugate.claims import shared_worker_urls  # noqa: PLC0415

    routing = desired.routing
    if routing is None:
        return []
    me = f"{host_obj.name} :{desired.port}"
    mine = (me, routing.router, routing.endpoint, routing.worker_url)
    routes = [mine if route[0] == me else route for route in Run.of(state).desired_routes(state.inventory)]
    return [line for line in shared_worker_urls(routes if mine in routes else [*routes, mine])
            if line.startswith(f"{me} and ") or f" and {me} both " in line]


# ---------------------------------------------------------------- the FunctionCommands
def _fail(state: Any, host: Any, message: str) -> bool:  # noqa: A002 -- pyinfra passes them by these names
    host.log_styled(message, fg="red", log_func=logger.error)
    return False


def _refuse(message: str, port: int):
    """Fail this container only, touching nothing: printed at prepare (and so under --dry, whose
    exit status then is non-zero) and when executing; the other containers go on."""
    book = Run.of(state)
    if not state.is_executing:
        host.log_styled(message, fg="yellow", log_func=logger.warning)
        # --dry ends after prepare: count the refusal so that pyinfra exits non-zero, without
        # pyinfra's "continue?" prompt (fail_hosts would ask, and drop the host from the run)
        state.failed_hosts.add(host)
    else:
        book.refused.append(host.name)
        book.outcomes[host.name] = "refused (nothing touched)"
    yield FunctionCommand(_fail, (message,), {})


def _unavailable(message: str):
    """A stopped or missing container whose connect check was left to the observe (the connector's
    ``pct_connect_check`` false: a run of deploy.py alone), as a container that failed to connect is:
    connect's own line, said once, this container failed alone, and neither refused nor failed in the
    run's book (a rolling change goes on past it, as it goes on past a container that did not connect)."""
    book = Run.of(state)
    if host.name not in book.unavailable:
        book.unavailable.add(host.name)
        host.log_styled(message, fg="red", log_func=logger.error)
    if not state.is_executing:
        state.failed_hosts.add(host)  # --dry: the run exits non-zero, as after a failed connect
    yield FunctionCommand(_not_reached, (), {})


def _not_reached(state: Any, host: Any) -> bool:  # noqa: A002 -- pyinfra passes them by these names
    return False


@dataclasses.dataclass
class Job:
    """Everything the execute step needs (no state shared with other hosts)."""

    plan: Plan
    spec: Spec | None
    port: int
    python: str
    budgets: dict[str, float]
    observation: dict[str, Any]
    audit_log: str | None
    rolling: bool
    max_failures: int
    restart: bool
    end_pids: list[int]
    story: dict[str, Any]
    # to plan again after following another operator's run of a different spec (issue: a second
    # operator must never report the other spec's verify as its own)
    observe_args: dict[str, Any] = dataclasses.field(default_factory=dict)
    desired: Desired | None = None  # what the plan was made from (its spec checked for this container's release)
    restoring: bool = False
    end_other_gpu_holders: bool = False
    routing: Routing | None = None          # behind a router: leave before the hand-off, rejoin after
    router_worker: dict[str, Any] | None = None   # its entry there when it left (what it rejoins with)
    desired_spec: Spec | None = None        # the desired state's server (a rollback runbook's job has spec None)
    desired_problem: str | None = None      # why the desired state makes no server, when it does not


def _label(host_obj: Any, port: int) -> str:
    """``sglang :30000``: a container's server as its lines name it (by its engine)."""
    return f"{Run.of(state).servers.get((host_obj.name, port), DEFAULT_ENGINE)} :{port}"


def _say(host_obj: Any, port: int, message: str, error: bool = False) -> None:
    if error:
        host_obj.log_styled(f"{_label(host_obj, port)} {message}", fg="red", log_func=logger.error)
    else:
        host_obj.log(f"{_label(host_obj, port)} {message}")


def _audit(job: Job, host_obj: Any, step: str, phase: str, **fields: Any) -> None:
    emit(step, path=job.audit_log, host=host_obj.name, vmid=host_obj.data.get("pct_vmid"), port=job.port,
         phase=phase, **fields)


def _run_id(host_obj: Any) -> str:
    vmid = host_obj.data.get("pct_vmid") or "ct"
    return f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{vmid}-{uuid.uuid4().hex[:6]}"


def _execute(state: Any, host: Any, job: Job) -> bool:  # noqa: A002 -- pyinfra passes them by these names
    host_obj = host
    book = Run.of(state)
    name = host_obj.name
    if job.rolling and book.stop_rolling(job.max_failures):
        book.untouched.append(name)
        book.outcomes[name] = "not touched (rolling restart stopped)"
        host_obj.log_styled(f"{_label(host_obj, job.port)} not touched: the rolling restart stopped after the failure of "
                            f"{', '.join(book.failed + book.refused)}", fg="yellow", log_func=logger.warning)
        return True
    plan = job.plan
    if plan.action == "attach":
        if not job.observation.get("agent_installed", True):
            _install_agent(host_obj, job.python)  # follow needs this controller's agent in the container
        ok = _attach(host_obj, job, str(plan.attach_run))
        ended = book.outcomes.get(name)
        if job.routing is not None and not job.routing.cordon and ended in ("verified", "rolled_back"):
            # the run it followed may be one whose controller was interrupted after the leave: a member
            # that serves (as desired, or the previous server again) is in its router
            from gpugate import router  # noqa: PLC0415
            listing = router.preflight(job.routing)
            draining = listing.worker is not None and listing.worker.get("status") == "draining"
            if listing.kind is None and (listing.worker is None or draining):
                # listed draining: the leave of a controller that died (smg drops the entry once its
                # settle time is over) is no membership; re-added as it was, once the entry is gone
                job.router_worker = listing.worker
                how = "verified" if ended == "verified" else "rolled back (the previous server serves again)"
                ok = _rejoin_router(host_obj, job, str(plan.attach_run), f"the run it followed ended {how}, " + (
                    "listed draining (taken out before the run, by a controller that is gone)" if draining
                    else "not listed"), add=True) and ok
        return ok
    if plan.action == "live":
        return _apply_live(host_obj, job)
    run = _run_id(host_obj)
    _audit(job, host_obj, "plan", "begin", run=run, **job.story)
    if job.routing is not None and not _leave_router(host_obj, job, run):
        return False
    # a pct container claims its GPUs on the Proxmox host (gpugate.claims): the locks and the hand-off
    # in one round trip, the host's lock holder runs the start once it holds them
    connector = _pct(host_obj) if plan.gpus else None
    doc: dict[str, Any] = {"run": run, "operator": _operator(), "budgets": job.budgets, "restart": bool(plan.restart),
                           "rollback_to": plan.rollback_to, "replaces": plan.replaces, "port": job.port}
    if job.observe_args.get("engine"):  # the agent loads this engine's container module (gpugate.agent.engine)
        doc["engine"] = job.observe_args["engine"]
    if plan.target is not None:
        doc["desired"] = {"history": plan.target.get("key"), "port": job.port}
    elif job.spec is not None:
        unit = render_unit(job.spec, job.budgets["drain_timeout_s"] + job.budgets["kill_grace_s"]) \
            if job.spec.supervisor == "systemd" else None
        doc["desired"] = job.spec.doc(unit_text=unit, by=_operator())
        if job.spec.weight_cache and job.spec.supervisor == "systemd":
            doc["desired"]["weight_cache"]["unit_text"] = render_unit(job.spec, job.budgets["kill_grace_s"],
                                                                      "sglang-weight-cache.service.j2")
    else:
        doc["desired"] = None
    if job.end_pids:
        doc["end_gpu_holders"] = job.end_pids
    watch = Watch(name, job.port, run, _narrator(job))
    if book.interrupted is None:
        book.watching[name] = watch
    if book.interrupted is not None:  # interrupted since it left (or in between): no hand-off, put it back
        book.watching.pop(name, None)
        return _put_back(host_obj, job, run)
    stdin = agentcmd.start_stdin(doc, include_source=not job.observation.get("agent_installed", True))
    if connector is not None:  # the holder sets claim_until to its claim's window
        try:
            claim = hand_off_holding_gpu_locks(connector, list(plan.gpus or ()), run,
                                               agentcmd.start_command(job.python), stdin, python=job.python,
                                               timeout=120)
        except Exception as error:  # SSH dropped, timeout: the hand-off may have begun
            ran, answer, trouble = _no_answer(host_obj, error)
        else:
            if claim.started is None:  # the locks were not taken: no hand-off, nothing touched
                book.watching.pop(name, None)
                refused = _claim_refused(host_obj, job, run, claim)
                if refused is not None:
                    return refused
                ran, answer, trouble = False, {}, Trouble("the GPU lock holder ran no hand-off")
            else:
                _claim_refused(host_obj, job, run, claim)  # the stale claims it released on the way
                ran, answer, trouble = _answer(host_obj, *claim.started)
    else:
        ran, answer, trouble = _run(host_obj, agentcmd.start_command(job.python), stdin=stdin, timeout=120)
    if trouble or not ran:
        book.ended(name, "hand-off failed")
        _say(host_obj, job.port, f"the hand-off got no answer: {trouble}; the container may have begun run {run}: "
                                 f"see runbooks/status.py", error=True)
        _left_out(host_obj, job, "the hand-off got no answer; the next deploy adds it once it serves as desired")
        return False
    if answer.get("busy"):
        busy = answer["busy"] or {}
        book.watching.pop(name, None)
        _say(host_obj, job.port, f"another transition holds the container's lock (run {busy.get('run')}"
                                 f"{' by ' + busy['by'] if busy.get('by') else ''}): following it instead")
        _left_out(host_obj, job, "another run holds the container; the next deploy adds it once it serves as "
                                 "desired")
        return _attach(host_obj, job, str(busy.get("run")))
    if not answer.get("ok"):
        book.ended(name, "refused by the agent (nothing touched)", refused=True)
        _say(host_obj, job.port, f"the agent refused the hand-off, nothing touched: {answer.get('error')}", error=True)
        _audit(job, host_obj, "outcome", "end", run=run, outcome="refused", message=answer.get("error"))
        _rejoin_router(host_obj, job, run, "the old server still serves")
        return False
    watch.handed_off = True
    _audit(job, host_obj, "handoff", "end", run=run, agent_pid=answer.get("pid"), recovered=answer.get("recovered"))
    if answer.get("recovered"):
        _say(host_obj, job.port, f"run {answer['recovered']} had been interrupted (its agent died): this run recovers it")
    ok = _follow(host_obj, job, run, attached=False, watch=watch)
    if job.routing is not None:
        ok = _after_transition(host_obj, job, run, book.outcomes.get(name)) and ok
        if ok and _canary_due(job, book.outcomes.get(name)):
            ok = _canary(state, host_obj, job, run)
    return ok


# ---------------------------------------------------------------- the canary (gpugate.canary, docs/canary.md)
def _canary_lines(name: str, routing: Routing, replicas: list[str]) -> list[str]:
    """The canary plan as ``--dry`` and the plan print it: which replica, how long, the thresholds.
    ``replicas``: the router's replicas in this run, in the fleet's order, the order a rolling change
    visits them (the plan of each container is made concurrently, so not "the first planned"): the
    first of them that changes is the canary.

    >>> r = Routing("gw", "http://g:1", "http://a:1", canary={"soak_s": 60.0, "min_requests": 50, "ttft_p95_ratio": 1.25,
    ...     "itl_p95_ratio": 1.25, "error_ratio_points": 0.5, "throughput_ratio": 0.8, "preemption_ratio_points": 1.0,
    ...     "proceed_on_low_traffic": False})
    >>> _canary_lines("@pct/pve1:129", r, ["@pct/pve1:129", "@pct/pve1:130"])[0]
    'router gw: CANARY: this replica changes first and soaks 60 s under traffic, judged against the unchanged replicas (their /metrics, same window); the change rolls one replica at a time, whatever rolling says'
    >>> print(_canary_lines("@pct/pve1:130", r, ["@pct/pve1:129", "@pct/pve1:130"])[0])
    router gw: canary @pct/pve1:129 soaks first (the next in the fleet's order if it has nothing to change); this replica changes after it passes (no soak of its own)
    """
    from gpugate import canary  # noqa: PLC0415

    first = replicas[0] if replicas else name
    if first != name:
        return [f"router {routing.router}: canary {first} soaks first (the next in the fleet's order if it has "
                f"nothing to change); this replica changes after it passes (no soak of its own)"]
    rule = canary.policy(routing.canary)
    low = ("goes on (proceed_on_low_traffic: true)" if rule.proceed_on_low_traffic
           else "rolls it back and stops (proceed_on_low_traffic: false)")
    return [f"router {routing.router}: CANARY: this replica changes first and soaks {rule.soak_s:g} s under traffic, "
            f"judged against the unchanged replicas (their /metrics, same window); the change rolls one replica at "
            f"a time, whatever rolling says",
            f"router {routing.router}: canary limits: TTFT p95 at most {rule.ttft_p95_ratio:g}x, ITL p95 at most "
            f"{rule.itl_p95_ratio:g}x, failed requests at most +{rule.error_ratio_points:g} points, preempted at most "
            f"+{rule.preemption_ratio_points:g} points, tokens/s per running request at least {rule.throughput_ratio:g}x "
            f"the others'; at least {rule.min_requests} requests each side, else too little traffic: {low}",
            f"router {routing.router}: canary regression: back to its last good spec (verified, back in the router), "
            f"the rolling change stops there (the rest not touched), exit non-zero"]


def _replicas_in_order(router_name: str) -> list[str]:
    """The containers of this run routed to ``router_name``, in the inventory's order (the order a
    rolling change visits them: :meth:`Run.keep_fleet_order`)."""
    routed = {route[0].rsplit(" :", 1)[0] for route in Run.of(state).desired_routes(state.inventory)
              if route[1] == router_name}
    return [h.name for h in state.inventory if h in state.active_hosts and h.name in routed]


def _canary_due(job: Job, outcome: str | None) -> bool:
    """The first replica of a rolling change behind a router with a canary, verified and back in its
    router: it soaks before the rest (one per router and run; a rollback, a first start, a cordoned
    server never)."""
    routing = job.routing
    book = Run.of(state)
    return bool(routing is not None and routing.canary and not routing.cordon and job.rolling and outcome == "verified"
                and job.spec is not None and not job.restoring and job.plan.target is None
                and job.plan.action == "restart" and routing.router not in book.canaries)


def _canary(state: Any, host_obj: Any, job: Job, run: str) -> bool:
    """Soak the canary against the unchanged replicas and act on the verdict: pass, the rest roll;
    a regression (or too little traffic, unless proceed_on_low_traffic) rolls it back to its last good
    spec (verified, back in the router) and stops the rolling change; no baseline: said, the rest roll."""
    from gpugate import canary, router  # noqa: PLC0415 -- only a canary reads metrics

    routing, book, name = job.routing, Run.of(state), host_obj.name
    assert routing is not None and routing.canary is not None
    rule = canary.policy(routing.canary)
    roles = engine(routing.engine).canary_metrics
    try:
        peers = router.peers_of(routing)
    except router.RouterError as error:
        peers = []
        _say(host_obj, job.port, f"canary: router {routing.router} did not list the others ({error})", error=True)
    _say(host_obj, job.port, f"canary: soaking {rule.soak_s:g} s under the traffic router {routing.router} sends, "
                             f"against {len(peers)} unchanged replica(s) ({', '.join(peers) or 'none'})")
    _record_canary(host_obj, job, {"state": "soaking", "run": run, "router": routing.router, "soak_s": rule.soak_s,
                                   "began": time.time(), "others": peers})
    if not roles:
        verdict = canary.Verdict("no-baseline", [f"{engine(routing.engine).label} names no metrics to judge by"],
                                 [], {}, {})
    else:
        book.soaking[name] = (_label(host_obj, job.port), routing.router, rule.soak_s, time.time())
        try:
            verdict = canary.soak(routing.worker_url, peers, roles, rule, router.metrics_page,
                                  lambda line: _say(host_obj, job.port, line), stop=lambda: book.interrupted is not None)
        finally:
            book.soaking.pop(name, None)
    book.canaries[routing.router] = verdict.kind
    lines = canary.side_by_side(verdict, f"{len(peers)} others") if verdict.rows else []
    _audit(job, host_obj, "canary", "end", run=run, router=routing.router, **verdict.doc(),
           thresholds=dict(routing.canary))
    record = {"state": "ended", "run": run, "router": routing.router, "soak_s": rule.soak_s, "ended": time.time(),
              **verdict.doc()}
    if verdict.kind == "pass":
        _say(host_obj, job.port, f"canary PASSED its {rule.soak_s:g} s soak: the rest of router {routing.router}'s "
                                 f"replicas roll as planned")
        for line in lines:
            host_obj.log(line)
        _record_canary(host_obj, job, record)
        return True
    if verdict.kind == "no-baseline":
        _say(host_obj, job.port, f"canary: NO VERDICT ({'; '.join(verdict.reasons)}): the rolling change goes on "
                                 f"without one", error=True)
        _record_canary(host_obj, job, record)
        return True
    if verdict.kind == "low-traffic" and rule.proceed_on_low_traffic:
        _say(host_obj, job.port, f"canary: TOO LITTLE TRAFFIC for a verdict ({'; '.join(verdict.reasons)}); "
                                 f"proceed_on_low_traffic: true: the rolling change goes on", error=True)
        for line in lines:
            host_obj.log(line)
        _record_canary(host_obj, job, record)
        return True
    word = ("canary REGRESSION" if verdict.kind == "regression" else
            "canary: TOO LITTLE TRAFFIC for a verdict (min_requests " + str(rule.min_requests) + ")")
    _say(host_obj, job.port, f"{word}: {'; '.join(verdict.reasons)}", error=True)
    for line in lines:
        host_obj.log_styled(line, fg="red" if verdict.kind == "regression" else "yellow", log_func=logger.error)
    _say(host_obj, job.port, "canary: rolling it back to its last good spec (the rollback runbook's transition), "
                             "then stopping the rolling change", error=True)
    restored = _restore_canary(state, host_obj, job)
    back = "rolled back to its last good spec (verified, back in the router)" if restored else \
        "its rollback FAILED (see above)"
    record["rolled_back"] = restored
    _record_canary(host_obj, job, record)
    if name not in book.failed:
        book.failed.append(name)
    how = "REGRESSION" if verdict.kind == "regression" else "too little traffic"
    book.outcomes[name] = f"canary {how}: {back}"
    if verdict.kind == "low-traffic":
        _say(host_obj, job.port, "canary: send more traffic through the router during the soak, lengthen soak_s, "
                                 "lower min_requests, or set proceed_on_low_traffic: true", error=True)
    return False


def _restore_canary(state: Any, host_obj: Any, job: Job) -> bool:
    """The canary back to the newest good spec of its history that differs from the one it runs (the
    rollback runbook's plan, ``restore_previous``): leave, drain, the agent's transition, verify,
    rejoin. True when it ended verified and back in its router."""
    book = Run.of(state)
    desired = job.desired
    assert desired is not None
    observed_args = {key: value for key, value in job.observe_args.items() if key in ("port", "engine")}
    observation, trouble = _observe(host_obj, job.python, observed_args)
    if trouble or observation is None:
        _say(host_obj, job.port, f"canary: its rollback could not observe the container: {trouble}", error=True)
        return False
    planned = dataclasses.replace(desired, spec=None, rollback_to=1)
    plan = make_plan(observation, planned, restoring=True, executing=True)
    if plan.problems or plan.target is None:
        _say(host_obj, job.port, "canary: no good spec to roll back to: " + "; ".join(plan.problems or plan.reasons),
             error=True)
        return False
    for line in plan_lines(plan, job.port):
        host_obj.log(line)
    back = Job(plan, None, job.port, job.python, job.budgets, observation, job.audit_log, False, job.max_failures,
               False, [], _story(observation, plan, None), observe_args=observed_args, desired=planned, restoring=True,
               routing=job.routing, desired_spec=job.spec)
    ok = _execute(state, host_obj, back)
    return ok and book.outcomes.get(host_obj.name) == "verified"


def _record_canary(host_obj: Any, job: Job, record: Mapping[str, Any]) -> None:
    """Where the status reads it (the container's state dir: gpugate.agent.observe reports it);
    a record that cannot be written is said, never a failure of the change."""
    ran, _answer, trouble = _run(host_obj, agentcmd.canary_record_command(job.port), stdin=json.dumps(record))
    if trouble or not ran:
        _say(host_obj, job.port, f"canary: its record could not be written in the container ({trouble})")


def _apply_live(host_obj: Any, job: Job) -> bool:
    """A change the engine applies while it serves (docs/live-changes.md): one agent command that
    holds the container's transition lock, applies, verifies, and undoes on a refusal or a failed
    verify; the server is never stopped. False (the run exits non-zero) when it was undone."""
    book = Run.of(state)
    name, spec, plan = host_obj.name, job.spec, job.plan
    assert spec is not None  # a live plan is made for a desired server
    run = _run_id(host_obj)
    _audit(job, host_obj, "plan", "begin", run=run, **job.story)
    if not job.observation.get("agent_installed", True):
        _install_agent(host_obj, job.python)
    previous = served_live(job.observation.get("sglang") or {}, spec)
    unit = render_unit(spec, job.budgets["drain_timeout_s"] + job.budgets["kill_grace_s"]) \
        if spec.supervisor == "systemd" else None
    doc: dict[str, Any] = {"run": run, "port": job.port, "by": _operator(), "timeout_s": job.budgets["start_timeout_s"],
                           "changes": [dict(change.op or {}) for change in plan.changes], "expect": spec.live.doc(),
                           "previous": previous.doc() if previous is not None else {},
                           "desired": spec.doc(unit_text=unit, by=_operator()),
                           # should the engine die under the change: the run that starts the last good spec
                           "recovery_run": _run_id(host_obj), "budgets": job.budgets}
    if job.observe_args.get("engine"):
        doc["engine"] = job.observe_args["engine"]
    left = _leave_for_live(host_obj, job, run)
    if left is None:  # refused by the router, or interrupted: nothing touched
        return False
    ran, answer, trouble = _run(host_obj, agentcmd.live_command(job.python), stdin=json.dumps(doc),
                                timeout=job.budgets["start_timeout_s"] * (len(plan.changes) * 2 + 2) + 30)
    if left:  # it serves either way (the new state verified, or the previous one put back)
        ok = _apply_live_answer(host_obj, job, run, ran, answer, trouble)
        why = "the live change is verified" if ok else "the live change ended (see above)"
        return _rejoin_router(host_obj, job, run, why) and ok
    return _apply_live_answer(host_obj, job, run, ran, answer, trouble)


def _leave_for_live(host_obj: Any, job: Job, run: str) -> bool | None:
    """A routed server whose weights change live leaves its router while they load, where the others
    can serve (the router's preflight: ``min_serving``); else it stays in and SGLang holds its requests
    during the load (a pause, no failure). Adapters never leave. -> left, not left, None: refused."""
    routing = job.routing
    weights = any((change.op or {}).get("op") == "update_weights" for change in job.plan.changes)
    if routing is None or routing.cordon or not weights:
        return False
    from gpugate import router  # noqa: PLC0415 -- only routed servers talk to a router

    preflight = router.preflight(routing, **_identity_of(job.observation))
    if preflight.problem is not None or preflight.worker is None:
        _say(host_obj, job.port, f"router {routing.router}: it stays in while the weights load "
                                 f"({preflight.problem or 'not listed'}); the engine holds its requests meanwhile")
        return False
    return True if _leave_router(host_obj, job, run) else None


def _apply_live_answer(host_obj: Any, job: Job, run: str, ran: bool, answer: dict[str, Any],
                       trouble: Trouble | None) -> bool:
    """The live command's answer, said; False (a non-zero exit) unless it was verified."""
    book = Run.of(state)
    name, plan = host_obj.name, job.plan
    if trouble or not ran:
        book.ended(name, "live change: no answer")
        _say(host_obj, job.port, f"the live change got no answer: {trouble}; see runbooks/status.py", error=True)
        return False
    if answer.get("busy") is not None:
        book.ended(name, "refused by the agent (nothing touched)", refused=True)
        _say(host_obj, job.port, f"REFUSED, nothing touched: another run holds the container's lock (run "
                                 f"{(answer['busy'] or {}).get('run')}); deploy again once it has ended", error=True)
        return False
    _audit(job, host_obj, "outcome", "end", run=run, outcome=answer.get("outcome") or "refused", live=True,
           message=answer.get("error"))
    if answer.get("ok"):
        book.outcomes[name] = "verified"  # not ended(): that counts a failure (a rolling change stops on it)
        for change in plan.changes:
            host_obj.log(f"    applied live: {change.text}")
        _say(host_obj, job.port, f"changed live and verified: pid {answer.get('pid')} kept serving "
                                 f"({answer.get('elapsed_s')} s; run {run})")
        for warning in answer.get("warnings") or []:
            _say(host_obj, job.port, f"warning: {warning}")
        return True
    if answer.get("outcome") is None:
        book.ended(name, "refused by the agent (nothing touched)", refused=True)
        _say(host_obj, job.port, f"REFUSED by the agent, nothing touched: {answer.get('error')}", error=True)
        return False
    if answer.get("engine_died"):
        recovery = answer.get("recovery") or {}
        _say(host_obj, job.port, f"LIVE CHANGE FAILED: {answer.get('error')}; the history is unchanged", error=True)
        if not recovery.get("ok"):
            book.ended(name, "live_engine_died")
            _say(host_obj, job.port, f"the last good spec could not be started: {recovery.get('error') or recovery}",
                 error=True)
            return False
        _say(host_obj, job.port, f"starting the last good spec again (run {recovery.get('run')}), as a restart")
        _follow(host_obj, job, str(recovery.get("run")), attached=False,
                watch=Watch(name, job.port, str(recovery.get("run")), _narrator(job)))
        if name not in book.failed:  # the server may serve again: the live change itself failed
            book.failed.append(name)
        return False
    book.ended(name, str(answer.get("outcome")))
    undone = ", ".join(answer.get("undone") or []) or "nothing had been applied"
    word = "LIVE CHANGE FAILED, UNDONE" if answer.get("outcome") == "live_undone" else "LIVE CHANGE FAILED, UNDO FAILED"
    _say(host_obj, job.port, f"{word} ({undone}): {answer.get('error')}; the history is unchanged (run {run})",
         error=True)
    return False


def _claim_refused(host_obj: Any, job: Job, run: str, claim: GpuClaim) -> bool | None:
    """The GPU claim's answer (gpugate.claims): stale claims released on the way are said; None: go
    on with the hand-off; else what _execute returns (this container's own run holds the claim:
    followed; another's: refused, nothing touched)."""
    book = Run.of(state)
    name = host_obj.name
    for gone in claim.released:
        _say(host_obj, job.port, f"released a stale GPU claim: run {gone.get('run')} of container "
                                 f"{gone.get('vmid')} never began ({gone.get('why')})")
    own = None if claim.locked or claim.began is not True else own_claim_run(claim.owner,
                                                                             host_obj.data.get("pct_vmid"))
    if own:  # this container's own run holds the claim: follow it, as the plan does a running one
        _say(host_obj, job.port, f"the GPU claim is held by run {own} of this container: following it instead")
        return _attach(host_obj, job, own)
    if not claim.locked:
        book.refused.append(name)
        book.outcomes[name] = "refused (GPU claims; nothing touched)"
        _say(host_obj, job.port, f"REFUSED, nothing touched: {claim.message}", error=True)
        _audit(job, host_obj, "outcome", "end", run=run, outcome="refused", message=claim.message)
        _rejoin_router(host_obj, job, run, "the old server still serves")
        return False
    return None


# ---------------------------------------------------------------- a routed server (gpugate.router)
def _leave_router(host_obj: Any, job: Job, run: str) -> bool:
    """Before the hand-off: the router's preflight again (now: in a rolling change the previous
    container has only just rejoined), then out of the router and drained. False: refused,
    nothing touched; or interrupted (then put back: :func:`_put_back`)."""
    from gpugate import router  # noqa: PLC0415

    book = Run.of(state)
    routing = job.routing
    assert routing is not None
    if book.interrupted is not None:  # the run is being interrupted: this container is not touched
        return _put_back(host_obj, job, run)
    client = router.client_for(routing)
    preflight = router.preflight(routing, client, **_identity_of(job.observation))
    problem = preflight.problem
    if problem is None and preflight.worker is not None:
        job.router_worker = preflight.worker  # what it rejoins (or is put back) with
        # recorded before the DELETE: an interrupt during it must not say "nothing was touched"
        book.left[host_obj.name] = Left(f"[{host_obj.name}] {_label(host_obj, job.port)}", routing.router,
                                        put_back=not routing.cordon)
        try:
            router.leave(routing, client, job.budgets["drain_timeout_s"],
                         lambda line: _say(host_obj, job.port, line), stop=lambda: book.interrupted is not None)
        except router.RouterError as error:
            problem = f"router {routing.router} refused to take it out: {error}"
        if book.interrupted is not None:
            return _put_back(host_obj, job, run)
        if problem is not None:
            book.left.pop(host_obj.name, None)
    if problem is not None:
        book.refused.append(host_obj.name)
        book.outcomes[host_obj.name] = "refused (router; nothing touched)"
        _say(host_obj, job.port, f"REFUSED, nothing touched: {problem}", error=True)
        _audit(job, host_obj, "outcome", "end", run=run, outcome="refused", message=problem)
        return False
    _audit(job, host_obj, "router", "end", run=run, router=routing.router, action="left" if preflight.worker else "absent",
           worker_id=(preflight.worker or {}).get("id"))
    return True


def _put_back(host_obj: Any, job: Job, run: str) -> bool:
    """An interrupted run (:meth:`Run.on_interrupt`) at a container before its hand-off: nothing
    stopped there. One it took out of its router is put back (its worker URL must still answer as
    this server: gpugate.router.put_back), or left out saying exactly so and what the next deploy
    does; the last put-back exits the run. False: this container's change was not made."""
    from gpugate import router  # noqa: PLC0415

    book = Run.of(state)
    name = host_obj.name
    book.ended(name, "interrupted before its hand-off (the server was not stopped)")
    left = book.left.get(name)
    routing = job.routing
    if left is None or routing is None or not left.put_back:
        return False
    word = _SIGNAL_WORDS.get(book.interrupted or signal.SIGINT, "interrupted")
    _say(host_obj, job.port, f"router {routing.router}: {word} before the hand-off: putting it back (checking "
                             f"first that {routing.worker_url} still answers as this server)")
    ok, message = router.put_back(routing, router.client_for(routing), job.router_worker,
                                  **_identity_of(job.observation), timeout_s=routing.join_timeout_s,
                                  say=lambda line: _say(host_obj, job.port, line))
    _audit(job, host_obj, "router", "end", run=run, router=routing.router,
           action="put back" if ok else "put back failed", message=message)
    if ok:
        line = (f"{left.label} {word} before its hand-off: {message}; the server was not stopped and nothing else "
                f"was touched (a re-run applies the change)")
    else:
        line = (f"{left.label} {word} before its hand-off: NOT put back: {message}. It is left like this: the "
                f"server still serves (it was not stopped), out of router {routing.router}, which sends it "
                f"nothing. The next deploy (no flag needed) has nothing to leave: it applies the desired state and "
                f"adds it to router {routing.router} once it serves and is verified")
    book.outcomes[name] = "interrupted; " + ("put back into the router" if ok else "left out of the router")
    book.put_back_done(name, line)  # the last one exits the run
    return False


def _identity_of(observation: Mapping[str, Any] | None) -> dict[str, Any]:
    """What the router's preflight checks the worker URL against (gpugate.router.identity_problem):
    this server as the container's observe saw it (read there by its engine's rule, as the router
    reads the URL: Routing.engine)."""
    return {"observed": (observation or {}).get("sglang") or {}}


def _rejoin_router(host_obj: Any, job: Job, run: str, why: str, add: bool = False) -> bool:
    """Put the server back into its router: one that left before the hand-off, or (``add``: it
    serves as desired, verified) one its router does not list. A cordoned server stays out. False
    (and a failure of this container) when it cannot."""
    from gpugate import router  # noqa: PLC0415

    routing = job.routing
    book = Run.of(state)
    if routing is None:
        return True
    if routing.cordon:
        if job.router_worker is not None:
            _say(host_obj, job.port, f"router {routing.router}: {why}; cordoned (router_cordon: true): it stays "
                                     f"out of the router, as declared")
        book.left.pop(host_obj.name, None)
        return True
    if job.router_worker is None and not add:
        return True
    _say(host_obj, job.port, f"router {routing.router}: {why}: {'re-adding' if job.router_worker else 'adding'} it")
    ok, message = router.rejoin(routing, router.client_for(routing), job.router_worker, routing.join_timeout_s,
                                lambda line: _say(host_obj, job.port, line))
    _say(host_obj, job.port, f"router {routing.router}: {message}" if not message.startswith("back") else message,
         error=not ok)
    _audit(job, host_obj, "router", "end", run=run, router=routing.router, action="rejoined" if ok else "rejoin failed",
           message=message)
    if ok:
        book.left.pop(host_obj.name, None)
    else:
        if host_obj.name not in book.failed:
            book.failed.append(host_obj.name)
        book.outcomes[host_obj.name] = f"{book.outcomes.get(host_obj.name, '?')}; {message}"
    return ok


def _register_only(state: Any, host: Any, job: Job) -> bool:  # noqa: A002 -- pyinfra passes them by these names
    """A server that serves as desired, declared behind a router that does not list it: added to the
    router (its worker URL answered as this server at plan time), nothing restarted."""
    return _rejoin_router(host, job, _run_id(host), "serves as desired, not listed", add=True)


def _cordon_only(state: Any, host: Any, job: Job) -> bool:  # noqa: A002 -- pyinfra passes them by these names
    """A server that serves as desired, declared out of its router (``router_cordon: true``) and still
    listed: taken out and drained (:func:`_leave_router`), nothing stopped; it stays out."""
    run = _run_id(host)
    routing = job.routing
    assert routing is not None
    if not _leave_router(host, job, run):
        return False
    Run.of(state).left.pop(host.name, None)
    _say(host, job.port, f"router {routing.router}: cordoned (router_cordon: true): out of the router, as declared; "
                         f"the server keeps running (router_cordon: false puts it back)")
    return True


def _left_out(host_obj: Any, job: Job, why: str) -> None:
    routing = job.routing
    if routing is not None and job.router_worker is not None and not routing.cordon:
        _say(host_obj, job.port, f"router {routing.router}: left out of the router ({routing.worker_url}): {why}",
             error=True)


def _after_transition(host_obj: Any, job: Job, run: str, outcome: str | None) -> bool:
    """After the agent's outcome: a server that serves again (verified, or the old one rolled back)
    rejoins; NOTHING SERVES, or an outcome this run did not see, leaves it out and says so."""
    serves_here = job.spec is not None or job.plan.target is not None
    if outcome == "verified" and serves_here:
        return _rejoin_router(host_obj, job, run, "verified", add=True)
    if outcome == "rolled_back":  # a member again, listed or not before (a controller that died left it out)
        return _rejoin_router(host_obj, job, run, "rolled back: the previous server serves again", add=True)
    if outcome == "refused":
        return _rejoin_router(host_obj, job, run, "the agent touched nothing: the old server still serves")
    if outcome == "verified":
        _left_out(host_obj, job, "no server is desired here any more")
        return True
    if outcome == "nothing_serves":
        _left_out(host_obj, job, "NOTHING SERVES on this port; fix the cause: the next deploy adds it once it "
                                 "serves and is verified")
    else:
        _left_out(host_obj, job, f"the run ended {outcome or 'unseen'}; the next deploy adds it once it serves "
                                 f"as desired")
    return False


def _install_agent(host_obj: Any, python: str) -> bool:
    """Install this controller's agent without starting anything (the agent's ``install``: content-
    addressed, checked by hash). Used to follow a transition that another controller version
    started, with this controller's ``follow``."""
    ran, answer, _trouble = _run(host_obj, agentcmd.install_command(python), stdin=agentcmd.install_stdin(),
                                 timeout=60)
    return ran and bool(answer.get("ok"))


def _run_saying_silence(host_obj: Any, job: Job, command: Any, timeout: float) -> tuple[bool, dict[str, Any], Trouble | None]:
    """_run of a follow, with a progress line every LINK_SILENT_S while the link stays silent
    beyond the follow's own wait (a frozen SSH link is otherwise silence until its timeout)."""
    import gevent  # pyinfra's own: the command's wait is a greenlet's, so a timer greenlet can speak

    began = time.time()
    link = host_obj.data.get("pve_host") or host_obj.name  # the Proxmox host the SSH link goes to

    def say_silence() -> None:
        while True:
            _say(host_obj, job.port, f"no answer from the container for {time.time() - began:.0f} s (a follow "
                                     f"answers within {FOLLOW_WAIT_S:g} s): the SSH link to {link} is silent; "
                                     f"the transition goes on in the container, still waiting (up to {timeout:g} s)")
            gevent.sleep(LINK_SILENT_S)

    speaker = gevent.spawn_later(FOLLOW_WAIT_S + LINK_SILENT_S, say_silence)
    try:
        return _run(host_obj, command, timeout=timeout)
    finally:
        speaker.kill(block=False)


def _follow(host_obj: Any, job: Job, run: str, attached: bool, watch: Watch | None = None,
            seen: dict[str, Any] | None = None) -> bool:
    """Follow the run's journal to its outcome, printing progress; the exit status is the
    outcome's (only ``verified`` succeeds). ``seen`` gets the run's desired record and operator (its
    ``run`` event) and ``ended`` once its outcome was read: an attached run may be another spec's."""
    seen = {} if seen is None else seen
    book = Run.of(state)
    name = host_obj.name
    if watch is None:
        # an attached run is another's: its verify is of its own spec, never this job's restored one
        watch = Watch(name, job.port, run, Narrator(job.observe_args.get("engine") or DEFAULT_ENGINE) if attached else _narrator(job), handed_off=True)
        book.watching[name] = watch
        _say(host_obj, job.port, f"following run {run}")
    narrator = watch.narrator
    offset = 0
    misses = 0
    answer: dict[str, Any] = {}
    while True:
        ran, answer, trouble = _run_saying_silence(
            host_obj, job, agentcmd.follow_command(job.python, run, offset, wait_s=FOLLOW_WAIT_S, batch=True),
            timeout=FOLLOW_WAIT_S + 60)
        if trouble is not None and trouble.container_gone:
            book.ended(name, trouble.text)
            _say(host_obj, job.port, f"{trouble}: following run {run} ends here (it was at "
                                     f"{narrator.doing(time.time())}); start the container and re-run", error=True)
            _audit(job, host_obj, "outcome", "end", run=run, outcome="container stopped", message=trouble.text)
            return False
        if not ran or answer.get("agent_missing") or (answer.get("error") and not answer.get("events")):
            misses += 1
            why = trouble or answer.get("error") or "no answer"
            if misses >= FOLLOW_RETRIES:
                book.ended(name, "lost sight of the transition")
                _say(host_obj, job.port, f"lost sight of run {run} ({why}); the transition continues in the container: "
                                         f"{narrator.doing(time.time())}; follow with runbooks/status.py", error=True)
                return False
            time.sleep(1.0)
            continue
        misses = 0
        watch.read_at = time.time()
        stalled = None if answer.get("events") else stall_text(answer.get("agent"),
                                                               float(job.desired.agent_silence_s if job.desired else 30.0))
        if stalled:  # silence has a bound: say what is seen and leave the container alone
            book.ended(name, "stalled")
            _say(host_obj, job.port, f"{stalled}: the transition of run {run} is stalled (at "
                                     f"{narrator.doing(time.time())}); nothing was touched, this controller stops "
                                     f"following it; follow with runbooks/status.py", error=True)
            _audit(job, host_obj, "outcome", "end", run=run, outcome="stalled", message=stalled)
            return False
        for event in answer.get("events") or []:
            if event.get("step") == "rollback" and event.get("phase") == "begin":
                seen["rollback_to"] = event.get("to")  # what serves again if the outcome is rolled_back
            if event.get("step") == "run" and event.get("phase") == "begin" and "desired" not in seen:
                seen.update(desired=event.get("desired"), by=event.get("by"))
                if attached and (job.restoring or not same_desired(event.get("desired"), job.spec, job.port)):
                    seen["differs"] = True
                    _say(host_obj, job.port, f"run {run}{' by ' + str(event['by']) if event.get('by') else ''} "
                                             f"applies {_record_text(event.get('desired'))}, not this run's "
                                             f"desired state: its lines below are about that spec")
            for line in narrator.lines(event):
                _say(host_obj, job.port, line)
            if event.get("phase") != "progress" and event.get("step") not in ("outcome",):
                fields = {k: v for k, v in event.items() if k not in ("step", "phase", "t", "run", "host", "vmid", "path")}
                fields["agent_port"] = fields.pop("port", None)
                _audit(job, host_obj, str(event.get("step")), str(event.get("phase")), run=run, agent_t=event.get("t"),
                       **fields)
        offset = int(answer.get("offset") or offset)
        if answer.get("ended"):
            break
    book.watching.pop(name, None)
    seen["ended"] = True
    outcome = answer.get("outcome")
    ok, lines = outcome_lines(outcome, answer.get("reasons"), answer.get("message"), job.port, narrator)
    for line in lines:
        _say(host_obj, job.port, line, error=not ok)
    capacity = _capacity(job, narrator)
    if capacity.get("line") and outcome == "verified":
        _say(host_obj, job.port, capacity["line"])
    if not seen.get("differs"):
        for line in _restored_lines(job, outcome, seen.get("rollback_to")):
            _say(host_obj, job.port, line, error=outcome != "verified")
    book.outcomes[name] = str(outcome)
    if not ok:
        book.failed.append(name)
    story = dict(job.story)
    if seen.get("differs"):  # the flags that ran are the other run's, never this run's desired ones
        record = seen.get("desired") or {}
        story.update(argv_after=record.get("argv"), flags_after=record.get("flags"), attached_other_spec=True,
                     attached_by=seen.get("by"))
    _audit(job, host_obj, "outcome", "end", run=run, outcome=outcome, reasons=answer.get("reasons"),
           message=answer.get("message"), attached=attached, timings=narrator.timings, total_s=narrator.total_s(),
           capacity_before=capacity.get("before"), capacity_after=capacity.get("after"), **story)
    return ok


def _narrator(job: Job) -> Narrator:
    narrator = Narrator(job.observe_args.get("engine") or DEFAULT_ENGINE)
    if job.restoring:  # its run's "desired" spec is the recorded one it restores
        narrator.desired_what = "the restored spec"
    return narrator


def _restored_lines(job: Job, outcome: str | None, rollback_to: Mapping[str, Any] | None) -> list[str]:
    """After a rollback, which spec serves (its history label, key, when and by whom it was verified)
    and how the desired state differs from it (issue 20): the rollback runbook's verified restore, or
    a deploy whose agent rolled back (its rollback's target, from the journal)."""
    server = job.observation.get("sglang") or {}
    if job.restoring and outcome == "verified" and job.plan.target is not None:
        record = job.plan.target
        return [f"restored {history_spec_text(record, server)}, which its commit makes good 0 (newest); "
                f"{desired_differences(record, job.desired_spec, job.desired_problem)}"]
    if not job.restoring and outcome == "rolled_back" and rollback_to:
        return [f"serving again: {history_spec_text(rollback_to, server)}; "
                f"{desired_differences(rollback_to, job.spec)}"]
    return []


def _record_text(record: Mapping[str, Any] | None) -> str:
    """A run's desired record in a few words (redacted already): ``no server`` or its flags."""
    if not record:
        return "no server (a stop)"
    flags = record.get("flags")
    if isinstance(flags, Mapping) and flags:
        return "the flags " + ", ".join(f"{k}={v}" for k, v in sorted(flags.items()))
    return f"another spec (argv {record.get('argv_hash') or '?'})"


MAX_REPLANS = 2  # a third operator's run arriving each time: give up rather than loop


def _attach(host_obj: Any, job: Job, run: str, depth: int = 0) -> bool:
    """Follow a transition that another run holds the container's lock for. When it ran this
    run's own desired state, its outcome is this run's. When it ran another spec (a second operator),
    its "verified" is not ours: observe and plan again, and hand this run's spec off (the normal path);
    a rollback runbook, whose target depended on what ran before, stops there, non-zero."""
    book = Run.of(state)
    name = host_obj.name
    seen: dict[str, Any] = {}
    ok = _follow(host_obj, job, run, attached=True, seen=seen)
    if not seen.get("ended") or not seen.get("differs") and "desired" in seen:
        return ok
    by = f" by {seen['by']}" if seen.get("by") else ""
    message = f"another operator's run applied a different spec (run {run}{by})"
    if name in book.failed:  # the other run's failure is not this run's: the rolling restart decides on ours
        book.failed.remove(name)
    if job.restoring or not job.observe_args or job.desired is None or depth >= MAX_REPLANS:
        book.failed.append(name)
        book.outcomes[name] = message
        _say(host_obj, job.port, f"{message}; this run's desired state was not applied: see runbooks/status.py "
                                 f"and re-run if it is still wanted", error=True)
        _audit(job, host_obj, "outcome", "end", run=run, outcome="not applied", message=message)
        return False
    _say(host_obj, job.port, f"{message}: planning this run's desired state again")
    observation, trouble = _observe(host_obj, job.python, job.observe_args)
    if trouble or observation is None:
        book.failed.append(name)
        book.outcomes[name] = message
        _say(host_obj, job.port, f"{message}; observing again failed ({trouble}): this run's desired state was not "
                                 f"applied", error=True)
        return False
    plan = make_plan(observation, job.desired, restoring=job.restoring, executing=True)
    lines = plan_lines(plan, job.port)
    if plan.problems:
        book.refused.append(name)
        book.outcomes[name] = "refused (nothing touched)"
        for line in lines:
            host_obj.log_styled(line, fg="yellow", log_func=logger.warning)
        return False
    if plan.action == "noop":
        _say(host_obj, job.port, plan.reasons[0])
        book.outcomes[name] = "no change"
        return True
    for line in lines:
        host_obj.log(line)
    new_job = dataclasses.replace(job, plan=plan, observation=observation, story=_story(observation, plan, job.spec),
                                  end_pids=_end_pids(observation, job.spec, job.end_other_gpu_holders))
    if plan.action == "attach":
        return _attach(host_obj, new_job, str(plan.attach_run), depth + 1)
    return _execute(state, host_obj, new_job)


def _end_pids(observation: Mapping[str, Any], spec: Spec | None, end_other_gpu_holders: bool) -> list[int]:
    """The other processes with memory on the server's GPUs the operator agreed to end."""
    if not end_other_gpu_holders or spec is None:
        return []
    wanted = set(spec.gpus or [])
    return [int(h["pid"]) for h in (observation.get("container") or {}).get("gpu_holders") or []
            if h.get("memory") and not h.get("server_part") and (not wanted or wanted & set(h.get("gpus") or []))]


def _capacity(job: Job, narrator: Narrator) -> dict[str, Any]:
    """The effect the server reports (the engine's capacity figures): before from the observation,
    after from the agent's verify."""
    before_info = ((job.observation.get("sglang") or {}).get("server_info") or {}).get("args") or None
    serving = narrator.engine
    before = serving.capacity(before_info) if before_info else None
    after = serving.capacity(narrator.capacity) if narrator.capacity else None
    try:
        line = serving.capacity_line(before, after) if after else None
    except Exception:
        line = None
    return {"before": before, "after": after, "line": line}


def _systemd_quote(arg: str) -> str:
    # systemd's ExecStart splits like a shell with double quotes; '%' and '$' are its specifiers
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%").replace("$", "$$") + '"'


def render_unit(spec: Spec, stop_timeout_s: float, template: str = "sglang.service.j2") -> str:
    """The systemd unit (gpugate/templates/sglang.service.j2, package data) for this spec; with
    ``template`` sglang-weight-cache.service.j2, the unit of its weight-cache daemons."""
    import shlex

    from gpugate.resources import render_template

    argv = spec.daemon_argv if template == "sglang-weight-cache.service.j2" else spec.argv
    serving = engine(spec.engine)
    return render_template(
        template, port=spec.port, exec_start=" ".join(_systemd_quote(a) for a in argv),
        env_file=f"/etc/gpugate/sglang-{spec.port}.env", stop_timeout_s=int(stop_timeout_s),
        argv_comment=shlex.join(serving.redact_argv(list(argv))), label=serving.label,
        restart=serving.systemd_restart[0], restart_why=serving.systemd_restart[1])


def _story(observation: Mapping[str, Any], plan: Plan, spec: Spec | None) -> dict[str, Any]:
    """Flags before and after, redacted: the audit's plan and outcome events."""
    server = observation.get("sglang") or {}
    command = server.get("command") or {}
    main = server.get("main") or {}
    serving = engine(spec.engine if spec else server.get("engine") or DEFAULT_ENGINE)
    after_argv = list(spec.launch.shown_argv) if spec else (list((plan.target or {}).get("argv") or []) or None)
    after_flags = dict(spec.launch.shown_flags) if spec else ((plan.target or {}).get("flags"))
    return {"action": plan.action, "plan_reasons": list(plan.reasons), "restore_previous": plan.target is not None, "argv_before": main.get("argv"),
            "flags_before": serving.redact_flags(command.get("flags") or {}) if command else None,
            "argv_after": after_argv, "flags_after": after_flags, "diff": list(plan.lines)}


def _cli_dry() -> bool:
    """Whether this pyinfra CLI run has ``--dry``: the click command's own parameter where its
    context is visible; deploy files run in gevent greenlets, where click's (thread-local) context
    is not, so then the command line (``--dry`` takes no value and has no short form).

    >>> _cli_dry()  # not under pyinfra's CLI
    False
    """
    try:
        import click
        ctx = click.get_current_context(silent=True)
        while ctx is not None:
            if "dry" in ctx.params:
                return bool(ctx.params["dry"])
            ctx = ctx.parent
    except Exception:  # not under pyinfra's CLI
        pass
    import pyinfra
    return bool(getattr(pyinfra, "is_cli", False)) and "--dry" in sys.argv[1:]


def _plan_under_dry() -> None:
    """``pyinfra -y ... --dry`` must print every container's plan or refusal too. With ``-y`` pyinfra
    skips change detection: at prepare it never runs an operation's body, and ``--dry`` ends the run
    right after prepare, so nothing was printed and a refusal exited 0. Under ``--dry`` nothing
    executes, so detecting changes is what the operator asked for: turn it back on."""
    if not state.is_executing and not state.check_for_changes and _cli_dry():
        state.check_for_changes = True


# ---------------------------------------------------------------- the keyword form
class ServerArgumentError(ArgumentTypeError):
    """sglang.server called with an argument it does not take (or with ``desired=`` and the server's
    settings both): pyinfra's CLI prints it as an argument error at the deploy file's line."""


class _Secret:
    """An env value in an error message: never shown."""

    def __repr__(self) -> str:
        return "(not shown: a secret)"


OWN_ARGUMENTS = ("desired", "restore_previous")  # sglang.server's arguments that are no setting


def server_settings(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword form's arguments (the server's settings by their fleet.yaml ``sglang:`` names,
    the rows of gpugate.settings.SETTINGS with a ``fleet_key``) as host data (the rows' keys), each
    through its row's converter: the same checks as fleet.yaml and ``--data``. A bad value is the
    settings' SettingsError naming the argument; an argument that is no server setting, a
    ServerArgumentError naming the valid ones. None: the row's default where it has none (unset).

    >>> server_settings({"model_path": "/m", "port": 31129, "present": "yes"})
    {'sglang_model_path': '/m', 'sglang_port': 31129, 'sglang_present': True}
    >>> server_settings({"modle_path": "/m"})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    gpugate.operations.sglang.ServerArgumentError: sglang.server got an unknown argument 'modle_path' (did you mean model_path?): ...
    >>> server_settings({"port": "30000"})
    Traceback (most recent call last):
    ...
    gpugate.settings.SettingsError: setting port='30000': expected a port number 1..65535, got '30000' (str)
    """
    rows = server_keys()
    settings: dict[str, Any] = {}
    for name, value in arguments.items():
        row = rows.get(name)
        if row is None:
            raise ServerArgumentError(_unknown_argument(name, tuple(rows)))
        if value is None and row.default is None:
            settings[row.key] = None
            continue
        try:
            settings[row.key] = row.convert(value)
        except ValueError as error:
            raise SettingsError(name, _Secret() if row.key == "sglang_env" else value, str(error)) from None
    return settings


def _unknown_argument(name: str, valid: tuple[str, ...]) -> str:
    known = SETTINGS.get(name)
    if known is not None and known.fleet_key:  # a host-data key: sglang_port for port
        hint = f" (did you mean {known.fleet_key}?)"
    elif known is not None:  # a setting of the run or the container, not of one server
        hint = (f" ({name} is a setting of the container or the run, not of its server: "
                f"set it in host data, e.g. --data {name}=... or fleet.yaml's data:)")
    else:
        hint = suggest(name, valid + OWN_ARGUMENTS)
    return (f"sglang.server got an unknown argument {name!r}{hint}: it takes {', '.join(OWN_ARGUMENTS)} or the "
            f"server's settings by their fleet.yaml sglang: names ({', '.join(valid)}), and pyinfra's global "
            f"arguments (name, _sudo, _serial, ...)")


def desired_of_call(data: Any, desired: Desired | None = None, settings: Mapping[str, Any] | None = None
                    ) -> Desired | None:
    """The desired state one sglang.server call stands for: ``desired`` as given, or the host data
    with the keyword form's ``settings`` over it (:func:`server_settings`), built as every desired
    state is (gpugate.spec.desired_states: the same rows, the same checks, the same cache). The
    keywords name one server: where fleet.yaml's ``sglang:`` lists several, they go over the listed
    server on their port (the others' ports stay its siblings). None where ``--data only_port``
    names another port: this run leaves that server alone.

    >>> d = desired_of_call({"sglang_model_path": "/m", "drain_timeout_s": 5}, settings={"port": 31129, "flags": {"tp": 2}})
    >>> d.port, d.spec.argv[-2:], d.budgets["drain_timeout_s"]
    (31129, ('--tp-size', '2'), 5.0)
    >>> desired_of_call({"only_port": 30000}, settings={"model_path": "/m", "port": 31129}) is None
    True
    """
    arguments = dict(settings or {})
    if desired is not None:
        if arguments:
            raise ServerArgumentError(f"sglang.server takes desired= or the server's settings as keywords "
                                      f"({', '.join(arguments)}), not both")
        return desired
    given = server_settings(arguments)
    values = resolved(data)
    servers = values["sglang_servers"]
    ports = [int(server.get("sglang_port", values["sglang_port"])) for server in servers]
    port = given.get("sglang_port")
    base: Mapping[str, Any] = values
    if servers:
        if port is None and len(servers) > 1:
            raise ServerArgumentError(f"sglang.server: this container has {len(servers)} desired servers (fleet.yaml's "
                                      f"sglang: list, ports {', '.join(map(str, ports))}): name one with port=")
        port = ports[0] if port is None else port
        if port in ports:
            base = {**values, **servers[ports.index(port)]}
    found = desired_states({**base, **given, "sglang_servers": []})
    if not found:
        return None
    siblings = tuple(p for p in ports if p != found[0].port)
    if not siblings:
        return found[0]
    # the list's run order (deploy.py's), this server's entry as the keywords make it (issue 32 item 7)
    order = next((d.run_order for d in desired_states(values) if d.run_order), ())
    if found[0].port in dict(order):
        order = tuple((p, gpus_taken(found[0]) if p == found[0].port else takes) for p, takes in order)
    else:  # a server the list does not have: its turn is not known, the others keep what they hold
        order = ()
    return dataclasses.replace(found[0], siblings=siblings, run_order=order)


def _call_settings(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """A call's keyword form settings: its keyword arguments but its own and pyinfra's global ones."""
    return {key: value for key, value in kwargs.items()
            if key not in OWN_ARGUMENTS and key != "name" and not key.startswith("_")}


def _at_callers_line(error: Exception) -> Exception:
    """``error`` as if raised at the line that called the operation (the deploy file's): pyinfra's
    CLI prints an error at the innermost frame outside pyinfra, which would be gpugate's own."""
    frame = sys._getframe(2)  # noqa: SLF001 -- the caller of the wrapper that calls this
    return error.with_traceback(types.TracebackType(None, frame, frame.f_lasti, frame.f_lineno))


_Operation = TypeVar("_Operation", bound=Callable[..., Any])


def _at_each_call(op: _Operation) -> _Operation:
    """What must happen when a deploy file calls the operation, before pyinfra looks at the call.
    pyinfra runs an operation's body at prepare only to detect changes, and under ``-y`` not at
    all, so the body comes too late for these; and pyinfra has no hook in between (its State
    callbacks hear connects and the execution of operations, nothing between a deploy file's call
    and its change detection). This wrapper is the one place gpugate steps in ahead of pyinfra:

    - the run's object (:meth:`Run.of`) is made here, so that Ctrl-C is this run's from its first
      plan on (before the hand-off, "nothing was touched" and a non-zero exit, not pyinfra's 0);
    - ``--dry -y``: change detection turned back on (:func:`_plan_under_dry`);
    - a rolling restart: the hosts in the inventory's order (:meth:`Run.keep_fleet_order`) before
      pyinfra takes the order of the hosts a ``_serial`` operation visits;
    - the keyword form: the call's Desired built once, here (:func:`desired_of_call`), so that a bad
      argument stops the run at the deploy file's line before any host is touched, and the body is
      given ``desired=`` (the same object at prepare and at execute); the operation named
      ``sglang.server :PORT`` where the call names it not (pyinfra would print its arguments: env
      values and secret flags).
    """

    @functools.wraps(op)
    def call(*args: Any, **kwargs: Any) -> Any:
        run = Run.of(state)
        _plan_under_dry()
        settings = _call_settings(kwargs)
        try:
            desired = desired_of_call(host.data, args[0] if args else kwargs.get("desired"), settings)
        except (ServerArgumentError, SettingsError) as error:
            raise _at_callers_line(error) from None
        if desired is not None:
            kwargs = {key: value for key, value in kwargs.items() if key not in settings}
            if not args:
                kwargs["desired"] = desired
        kwargs.setdefault("name", f"sglang.server :{desired.port if desired is not None else settings.get('port', '')}")
        if getattr(desired, "rolling", False) or kwargs.get("_serial"):
            run.keep_fleet_order(state)
        return op(*args, **kwargs)

    return cast(_Operation, call)


# ---------------------------------------------------------------- the operation
@_at_each_call
@operation()
def server(desired: Desired | None = None, restore_previous: bool = False, **settings: Any):
    """
    Run (or not) the container's desired SGLang server, gated on its GPUs; the container's agent
    runs the transition to its end and rolls back to the last good spec on any failure.

    The server is given either by its settings as keywords (the names of fleet.yaml's ``sglang:``
    section), over the host's data (fleet.yaml, group data, ``--data``), or as one built
    ``desired`` state (deploy.py's form); not both. Every value is checked by its row of
    gpugate.settings.SETTINGS, as fleet.yaml's and ``--data``'s are.

    + model_path: the model path in the container or Hugging Face repo id (required when present)
    + port: the server's port (default 30000)
    + flags: the engine's flags as data, ``{"tp": 8, "kv-cache-dtype": "fp8_e4m3"}``; validated against
      the container's SGLang release before anything is touched
    + env: the server's environment, ``{"NAME": "value"}`` (the values of secret names are never printed,
      the others are shown: docs/transition.md, "Secrets")
    + secret_env: env names whose values are secrets besides those the pattern list names, ``["DB_URL"]``
    + present: ``False``: no server on this port (stopped, its GPUs swept)
    + host: ``--host``, the address the server listens on in the container (default 127.0.0.1)
    + supervisor: ``auto`` (systemd where the container's PID 1 is systemd), ``process`` or ``systemd``
    + python: the interpreter in the container that runs the server (default /usr/bin/python3)
    + engine: the inference engine (default ``sglang``; an installed engine's name)
    + sglang_version: the SGLang release the container must have, a string (``"0.5.23"``)
    + extra_args: argv items passed through after the flags as written, unchecked
    + weight_cache: ``True``: SGLang's weight-cache daemons hold the weights across restarts
    + lora_adapters: LoRA adapters ``{name: path}`` the server serves, loaded and unloaded live where
      the engine can (``{}``: LoRA on, none loaded; docs/live-changes.md)
    + gated_launch: start the new engine before the stop, gated until the GPUs are free (default: where
      the release has it and the supervisor is process)
    + router: the router (fleet.yaml ``routers:``) in front of this server: leave, drain, restart, rejoin
    + router_url: the URL the router reaches this server at
    + router_cordon: ``True``: keep it out of its router (maintenance): taken out (leave, drain) and kept
      out; ``False`` (default): added to its router once it serves and is verified
    + drain_timeout_s: how long the server may drain after SIGTERM before SIGKILL (default 60)
    + desired: instead of the keywords, the container's built desired state
      (``gpugate.spec.desired_states(host.data)``: one per server, as deploy.py iterates them)
    + restore_previous: run a good spec from the container's history instead (the rollback runbook):
      the ``rollback_to``-th newest (default 1) that differs from the running one

    Everything that can be checked before the stop is checked first; a failed check touches
    nothing and the running server keeps running. Exit status: non-zero unless every container
    ended ``verified`` (or had nothing to do). The container's and the run's settings (the GPU
    gate's budgets, ``rolling``, ``max_failures``, ``sglang_restarted``, ...) come from the host's
    data: with ``--data rolling=true`` this operation runs one container at a time (``_serial``)
    and stops once more than ``max_failures`` failed. An unknown keyword, or a value its row
    refuses, stops the run at the deploy file's line, before any host is touched.

    **Example:**

    .. code:: python

        from gpugate.operations import sglang

        sglang.server(
            name="Qwen on GPUs 0-3",
            model_path="/opt/models/qwen3-8b",
            port=30000,
            flags={"tp": 4, "kv-cache-dtype": "fp8_e4m3"},
            env={"HF_HUB_OFFLINE": "1"},
        )
        sglang.server(name="Nothing on :30001", port=30001, present=False)

        # or the inventory's desired state, as deploy.py does
        from pyinfra import host
        from gpugate.spec import desired_states

        for desired in desired_states(host.data):
            sglang.server(name=f"SGLang on :{desired.port}", desired=desired, _serial=desired.rolling)
    """
    desired = desired_of_call(host.data, desired, settings)
    if desired is None:  # --data only_port names another port: not this run's server
        host.noop(f"{settings.get('engine') or DEFAULT_ENGINE} :{settings.get('port')}: not this run's server (only_port={host.data.get('only_port')})")
        return
    book = Run.of(state)
    port, python = desired.port, desired.python
    restoring = bool(restore_previous)
    book.servers[(host.name, port)] = desired.engine  # how this container's lines name its server
    if state.is_executing and desired.rolling and book.stop_rolling(desired.max_failures):
        # a rolling restart that already failed: not even observed
        yield FunctionCommand(_execute, (Job(Plan("noop", ()), None, port, python, {}, {}, desired.audit_log, True,
                                             desired.max_failures, False, [], {}),), {})
        return
    spec = None if restoring else desired.spec
    label = f"{desired.engine} :{port}"
    if desired.problem and not restoring:
        yield from _refuse(f"{label} REFUSED, nothing touched: {desired.problem}", port)
        return
    overlaps = _claim_overlaps(host, spec, desired.siblings) if spec is not None else []
    if overlaps:  # the desired state itself is contradictory: nothing to observe, nothing to touch
        yield from _refuse(f"{label} REFUSED, nothing touched: another desired server of this Proxmox host "
                           f"claims its GPUs: {'; '.join(overlaps)} (give each server its own GPUs: "
                           f"the engine's GPU flags, CUDA_VISIBLE_DEVICES; or sglang_present: false for one)", port)
        return

    shared = _shared_worker_urls(host, desired)
    if shared:  # two servers, one worker URL: the leave of one would take the other out of its router
        yield from _refuse(f"{label} REFUSED, nothing touched: another desired server names its worker URL: "
                           f"{'; '.join(shared)} (the router keeps one worker per URL: give each server the URL "
                           f"the router reaches it at, router_url; a --data sglang_router_url= applies to every "
                           f"host of the inventory)", port)
        return

    # no server wanted (present: false, a rollback): the port, and the engine whose server it is
    observed_args = desired.observe_args() if spec is not None else {
        key: value for key, value in desired.observe_args().items() if key in ("port", "engine")}
    observation, trouble = _observe(host, python, observed_args)
    connector = _pct(host)
    unavailable = connector.unavailable if connector is not None else None
    if (trouble or observation is None) and unavailable:  # the connect check was this observe (pct_connect_check)
        yield from _unavailable(unavailable)
        return
    if trouble or observation is None:
        yield from _refuse(f"{label} REFUSED, nothing touched: {trouble}", port)
        return
    spec = for_container(spec, observation)  # auto: systemd where the container's PID 1 is systemd
    if spec is not None:  # the flags again, against the table of the SGLang that will run (issue 13)
        try:
            spec = _spec_for_version(host, python, spec, desired.flags, desired.sglang_version, observation,
                                     desired.gated_launch)
        except SpecError as error:
            yield from _refuse(f"{label} REFUSED, nothing touched: {error}", port)
            return

    budget = dict(desired.budgets)
    restarted = desired.restarted
    end_other_gpu_holders = desired.end_other_gpu_holders
    planned = dataclasses.replace(desired, spec=spec)  # the server as this container's release makes it
    # executing: the container's servers before this one have run (else what they will hold is foretold)
    plan = make_plan(observation, planned, restoring=restoring, executing=state.is_executing)
    lines = plan_lines(plan, port)
    desired_spec = for_container(desired.spec, observation) if restoring else None
    if restoring and plan.target is not None and not plan.problems:  # which spec, and the desired state
        at = next((i for i, line in enumerate(lines) if line.startswith("    steps: ")), len(lines))
        lines.insert(at, f"    note: that is {history_spec_text(plan.target, observation.get('sglang') or {})}; "
                         f"{desired_differences(plan.target, desired_spec, desired.problem)}")
    show = not state.is_executing or not state.check_for_changes  # once: at prepare, or at execute under -y
    history_note = ((observation.get("sglang") or {}).get("history") or {}).get("problem")
    if history_note and show:  # a history that did not read is never passed over silently (issue 20)
        emit("history", path=desired.audit_log, host=host.name, vmid=host.data.get("pct_vmid"), port=port,
             phase="end", message=history_note)
        if plan.action == "noop":
            host.log(f"    note: {history_note}")
    if plan.problems:
        if plan.last and show:
            host.log(plan.last)
        yield from _refuse("\n".join(line for line in lines if line != plan.last), port)
        return
    if plan.action == "noop" and desired.routing is not None and spec is not None:
        # as desired in the container, but the status also asks the router (gpugate.report.status):
        # membership is declared (a member is listed, a cordoned server is not): until the router
        # agrees, not as desired here either (issue 32 item 8)
        from gpugate import router  # noqa: PLC0415
        routed = desired.routing
        listing = router.preflight(routed)  # the router's list only: a server that stays as it is
        if listing.kind == "no-answer":  # membership unknown is not as desired: it pages (issue 32 item 9)
            yield from _refuse(f"{label} REFUSED: it serves as desired, but {listing.problem}", port)
            return
        out = listing.worker is None or listing.worker.get("status") == "draining"
        if routed.cordon != out:
            # out of it when declared in (added, its URL answering as this server), or in it when
            # declared out (taken out and drained, as a leave before a restart is, nothing stopped)
            check = router.preflight(routed, **_identity_of(observation), adding_as_it_runs=not routed.cordon)
            if check.problem:
                yield from _refuse(f"{label} REFUSED, nothing touched: it serves as desired, but {check.problem}", port)
                return
            if show:
                if routed.cordon:
                    for line in check.lines(routed, budget["drain_timeout_s"], restart=False):
                        host.log(f"{label} serves as desired; {line}")
                else:
                    host.log(f"{label} serves as desired; router {routed.router} does not list it: add it "
                             f"(POST /workers url {routed.worker_url}) and wait until it is listed healthy")
            job = Job(plan, spec, port, python, dict(desired.budgets), observation, desired.audit_log, desired.rolling,
                      desired.max_failures, False, [], {}, desired=planned, routing=routed)
            yield FunctionCommand(_cordon_only if routed.cordon else _register_only, (job,), {})
            return
        if routed.cordon and show:  # said: an operator reading "No changes" sees why it is out of the router
            host.log(f"{label} router {routed.router}: cordoned (router_cordon: true), out of it as declared")
    if plan.action == "noop":
        if plan.last and show:
            host.log(plan.last)
        host.noop(plan.reasons[0])
        return
    mapped = _map_refusals(host, spec, desired.siblings) if spec is not None and plan.action in ("start", "restart") else []
    if mapped:  # the Proxmox node does not pass all its GPUs into its container (issue 36); asked only
        # before a start: pvesh is a command on the node per run, and a server that stays needs no check
        yield from _refuse(f"{label} REFUSED, nothing touched: {'; '.join(mapped)} (the node's own view: gpugate discover)", port)
        return
    routing = desired.routing  # an attach leaves nothing: after the run it follows, a member is added where missing
    router_lines: list[str] = []
    if routing is not None and plan.action not in ("attach", "live"):  # a live change stays in its router
        from gpugate import router  # noqa: PLC0415 -- only routed servers talk to a router
        preflight = router.preflight(routing, **_identity_of(observation))
        if preflight.problem:
            yield from _refuse(f"{label} REFUSED, nothing touched: {preflight.problem}", port)
            return
        router_lines = preflight.lines(routing, budget["drain_timeout_s"])
        if routing.canary and not routing.cordon and plan.action == "restart" and not restoring:
            router_lines += _canary_lines(host.name, routing, _replicas_in_order(routing.router))
    if show:
        for line in lines:
            host.log(line)
        for line in router_lines:
            host.log(f"{label} {line}")
    end_pids = _end_pids(observation, spec, end_other_gpu_holders)
    job = Job(plan, spec, port, python, budget, observation, desired.audit_log, desired.rolling,
              desired.max_failures, restarted, end_pids, _story(observation, plan, spec), observe_args=observed_args,
              desired=planned, restoring=restoring, end_other_gpu_holders=end_other_gpu_holders,
              routing=routing, desired_spec=desired_spec, desired_problem=desired.problem if restoring else None)
    yield FunctionCommand(_execute, (job,), {})
