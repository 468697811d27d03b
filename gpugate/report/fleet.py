"""One report for the whole fleet: pyinfra runs a runbook file once per host (in parallel), and
these state callbacks gather each host's item and print the report once, unreachable hosts
included (pyinfra drops them from the run otherwise).

Example::

    fleet_report(state, "status", render, missing=unreachable).add(host.name, row)

What lives as long as one run lives in the run's State callback handlers, as sglang.server's ``Run``
does (``Run.of(state)``): each report and the connect errors are handlers of pyinfra's State, found
there by class (and key), never kept as attributes of the State.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from pyinfra.api.state import BaseStateCallback

from gpugate.report.text import natural_key

_Handler = TypeVar("_Handler", bound=BaseStateCallback)


def handler_of(state: Any, kind: type[_Handler], test: Callable[[_Handler], bool] = lambda handler: True,
               ) -> _Handler | None:
    """This run's State callback handler of class ``kind`` (that passes ``test``), or None: the one
    place a per-run object is found (none before pyinfra's ``State.init``, which starts the list).

    >>> class Seen(BaseStateCallback): ...
    >>> class FakeState: callback_handlers = [Seen()]
    >>> handler_of(FakeState(), Seen) is FakeState.callback_handlers[0], handler_of(FakeState(), FleetReport)
    (True, None)
    """
    for handler in getattr(_real_state(state), "callback_handlers", None) or ():
        if isinstance(handler, kind) and test(handler):
            return handler
    return None


# ---------------------------------------------------------------- printing one report for the fleet


class FleetReport(BaseStateCallback):
    """One item per host, collected while the runbook's deploy file runs (once per host, in
    parallel), printed ONCE as ``render(items in host order)`` on stdout when pyinfra has
    disconnected from the last host: the report is the last thing the run prints, and
    ``2>/dev/null`` leaves nothing else (pyinfra logs to stderr).

    ``missing(host, reason)``, when given, makes the item of a host of the run that never got
    one: pyinfra drops a host that fails to connect before the deploy file runs, and a report
    that leaves it out hides exactly the host that needs a look (``reason``: what
    ConnectErrors recorded).

    .. code:: python

        fleet_report(state, "status", render_status).add(host.name, row)
    """

    def __init__(self, render: Callable[[list[Any]], str | None], out: Callable[[str], None] | None = None,
                 missing: Callable[[Any, str], Any] | None = None, key: str = "") -> None:
        self.key = key  # the report's name in the run (fleet_report)
        self.render = render
        self.out = out or (lambda text: print(text, flush=True))
        self.missing = missing
        self.items: dict[str, Any] = {}
        self.disconnected: set[str] = set()
        self.printed = False

    def add(self, host_name: str, item: Any) -> None:
        self.items[host_name] = item

    def add_missing(self, state: Any) -> None:
        """An item for every host of the run (``--limit`` applied) that has none: an unreachable one."""
        if self.missing is None or getattr(state, "inventory", None) is None:
            return
        errors = connect_errors(state)
        for host in state.inventory:
            if host.name not in self.items and state.is_host_in_limit(host):
                self.items[host.name] = self.missing(host, errors.get(host.name) or "could not connect")

    def text(self) -> str | None:
        return self.render([self.items[name] for name in sorted(self.items, key=natural_key)])

    def host_disconnect(self, state: Any, host: Any) -> None:  # type: ignore[override]
        self.disconnected.add(host.name)
        if self.printed or not self.disconnected >= {h.name for h in state.activated_hosts}:
            return
        self.printed = True
        self.add_missing(state)
        if self.items:
            text = self.text()
            if text is not None:  # a render that printed (or wrote) itself returns None
                self.out(text)


def fleet_report(state: Any, key: str, render: Callable[[list[Any]], str | None],
                 missing: Callable[[Any, str], Any] | None = None) -> FleetReport:
    """The run's ``FleetReport`` named ``key``: one of the run's State callback handlers (made and
    registered on first use)."""
    report = handler_of(state, FleetReport, lambda report: report.key == key)
    if report is None:
        report = FleetReport(render, missing=missing, key=key)
        _real_state(state).add_callback_handler(report)
    return report


class ConnectErrors(BaseStateCallback):
    """Why each host failed to connect (pyinfra logs it, then drops the host). Installed by
    inventory.py while pyinfra loads the inventory, before it connects: a deploy file runs only
    after connecting, too late to hear of a failure.

    When every host of the run failed, pyinfra stops before any deploy file runs ("No hosts
    remaining"); ``on_all_failed`` is then called once (the status runbook prints its rows
    from it: a fleet that is entirely unreachable is the report most worth reading).
    """

    def __init__(self) -> None:
        self.errors: dict[str, str] = {}
        self.on_all_failed: Callable[[Any], None] | None = None

    def host_connect_error(self, state: Any, host: Any, error: Any) -> None:  # type: ignore[override]
        text = (str(error.args[0]) if getattr(error, "args", None) else str(error)) or type(error).__name__
        self.errors[host.name] = " ".join(text.split())[:200]
        wanted = [h.name for h in state.inventory if state.is_host_in_limit(h)]
        if self.on_all_failed is not None and wanted and set(wanted) <= set(self.errors):
            hook, self.on_all_failed = self.on_all_failed, None
            hook(state)


def _real_state(state: Any) -> Any:
    """pyinfra's ``from pyinfra import state`` is a context proxy; callbacks get the State itself.
    Whatever is stored on a state must go on the State, where both find it."""
    module = getattr(state, "_get_module", None)
    return module() if callable(module) else state


def watch_connections(state: Any, on_all_failed: Callable[[Any], None] | None = None) -> ConnectErrors:
    """Install (once) and return the run's ConnectErrors, a State callback handler; inventory.py
    calls it at load time, with the status's ``on_all_failed`` for a status run, so that a status
    run whose every host is unreachable still prints its rows (the runbook itself never runs then)."""
    state = _real_state(state)
    recorder = handler_of(state, ConnectErrors) if getattr(state, "initialised", False) else None
    if recorder is None and getattr(state, "initialised", False):
        recorder = ConnectErrors()
        state.add_callback_handler(recorder)
    elif recorder is None:
        # The CLI loads the inventory before State.init(), which starts the callback list afresh,
        # and pyinfra has no hook between it and connecting: register right after it (as pyinfra's
        # CLI sets its own should_raise_failed_hosts on the State), still before pyinfra connects.
        recorder = getattr(state.init, "recorder", None)
        if recorder is None:
            recorder = ConnectErrors()
            init = state.init

            def init_then_watch(*args: Any, **kwargs: Any) -> Any:
                result = init(*args, **kwargs)
                state.add_callback_handler(recorder)
                return result

            init_then_watch.recorder = recorder  # type: ignore[attr-defined]  # a second call finds it
            state.init = init_then_watch
    if on_all_failed is not None:
        recorder.on_all_failed = on_all_failed
    return recorder


def connect_errors(state: Any) -> dict[str, str]:
    """host name -> why it could not connect (empty when inventory.py installed no recorder)."""
    recorder = handler_of(state, ConnectErrors)
    return dict(recorder.errors) if recorder is not None else {}


