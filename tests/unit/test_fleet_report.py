"""gpugate.report.fleet keeps its per-run objects (each report, the connect errors) as pyinfra State
callback handlers, found there by class and key: nothing is stored on the State itself."""

from __future__ import annotations

from pyinfra.api import Config, Inventory, State

from gpugate.report.fleet import ConnectErrors, FleetReport, connect_errors, fleet_report, handler_of, watch_connections


def _state(initialised: bool = True) -> State:
    state = State()
    if initialised:
        state.init(Inventory((["@local"], {})), Config())
    return state


def _pokes(state: State) -> list[str]:
    return [key for key in vars(state) if "gpugate" in key]


def test_a_report_is_one_handler_per_key_of_the_run():
    state = _state()
    status = fleet_report(state, "status", lambda items: None)
    assert fleet_report(state, "status", lambda items: "other") is status  # the first call's, for the run
    holders = fleet_report(state, "who_holds_gpus", lambda items: None)
    assert holders is not status and holders.key == "who_holds_gpus"
    assert [h for h in state.callback_handlers if isinstance(h, FleetReport)] == [status, holders]
    assert handler_of(state, FleetReport, lambda report: report.key == "status") is status
    assert _pokes(state) == []


def test_connect_errors_watched_before_init_are_the_runs_handler_after_it():
    state = _state(initialised=False)  # the CLI loads inventory.py before State.init()
    recorder = watch_connections(state)
    assert watch_connections(state) is recorder  # inventory.py loaded twice: one recorder
    assert connect_errors(state) == {}
    state.init(Inventory((["@local"], {})), Config())
    assert handler_of(state, ConnectErrors) is recorder
    assert watch_connections(state) is recorder and state.callback_handlers.count(recorder) == 1
    host = state.inventory.get_host("@local")
    recorder.host_connect_error(state, host, OSError("No route to host"))
    assert connect_errors(state) == {"@local": "No route to host"}
    assert [key for key in vars(state) if key != "init" and "gpugate" in key] == []


def test_connect_errors_watched_after_init_and_the_all_failed_hook():
    state = _state()
    heard = []
    recorder = watch_connections(state, on_all_failed=heard.append)
    assert handler_of(state, ConnectErrors) is recorder and watch_connections(state) is recorder
    recorder.host_connect_error(state, state.inventory.get_host("@local"), OSError("refused"))
    assert heard == [state] and connect_errors(state) == {"@local": "refused"}
    assert _pokes(state) == []
