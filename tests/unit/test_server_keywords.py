"""sglang.server's keyword form (``sglang.server(model_path=..., flags={...}, port=...)``): the
arguments are the server's settings by their fleet.yaml ``sglang:`` names, checked by the same rows
of gpugate.settings.SETTINGS, over the host's data, and built into the same Desired as deploy.py's
``desired=`` form; the errors name the argument."""

from __future__ import annotations

import re

import pytest
from pyinfra.api import Config, Inventory, State
from pyinfra.api.exceptions import PyinfraError
from pyinfra.context import ctx_host, ctx_state

from gpugate.operations import sglang
from gpugate.operations.sglang import ServerArgumentError, _at_each_call, desired_of_call, server_settings
from gpugate.settings import SettingsError, server_keys
from gpugate.spec import desired_state, desired_states

DATA = {"sglang_model_path": "/opt/models/m", "sglang_flags": {"tp": 8}, "drain_timeout_s": 7, "rolling": "no"}


# ---------------------------------------------------------------- the arguments -> host data, by the rows
def test_each_argument_is_its_rows_host_data_key_through_its_converter():
    assert server_settings({"model_path": "/m", "port": 31129, "flags": {"tp": 2}, "env": {"A": "1"},
                            "present": "no", "weight_cache": 1, "drain_timeout_s": 5, "engine": "SGLang"}) == {
        "sglang_model_path": "/m", "sglang_port": 31129, "sglang_flags": {"tp": 2}, "sglang_env": {"A": "1"},
        "sglang_present": False, "sglang_weight_cache": True, "drain_timeout_s": 5, "engine": "sglang"}
    # None on a row whose default is None: unset (it overrides the host data's value)
    assert server_settings({"sglang_version": None, "gated_launch": None}) == {"sglang_version": None,
                                                                              "sglang_gated_launch": None}


def test_every_server_setting_is_an_argument_and_documented():
    doc = sglang.server.__doc__ or ""
    for name in server_keys():
        assert re.search(rf"^\s+\+ {name}: \S", doc, re.M), f"sglang.server's docstring has no '+ {name}:' line"
    assert re.search(r"^\s+\+ desired: \S", doc, re.M) and re.search(r"^\s+\+ restore_previous: \S", doc, re.M)
    assert "**Example:**" in doc and "sglang.server(" in doc


def test_an_unknown_argument_names_the_valid_ones_with_a_did_you_mean():
    with pytest.raises(ServerArgumentError) as caught:
        server_settings({"modle_path": "/m"})
    said = str(caught.value)
    assert "unknown argument 'modle_path' (did you mean model_path?)" in said
    assert all(name in said for name in server_keys()) and "desired, restore_previous" in said
    # pyinfra's argument error: printed at the deploy file's line, no traceback; a TypeError to Python
    assert isinstance(caught.value, PyinfraError) and isinstance(caught.value, TypeError)


def test_a_host_data_key_or_a_run_setting_as_an_argument_says_where_it_belongs():
    with pytest.raises(ServerArgumentError, match=r"unknown argument 'sglang_port' \(did you mean port\?\)"):
        server_settings({"sglang_port": 30001})
    with pytest.raises(ServerArgumentError, match=r"'rolling' \(rolling is a setting of the container or the run, "
                                                  r"not of its server: set it in host data, e\.g\. --data rolling="):
        server_settings({"rolling": True})


def test_a_bad_value_is_the_settings_error_naming_the_argument():
    with pytest.raises(SettingsError, match=r"^setting port=0: expected a port number 1\.\.65535, got 0 \(int\)$"):
        server_settings({"port": 0})
    with pytest.raises(SettingsError, match=r"^setting flags=\['--tp', '2'\]: expected a mapping of the engine's flags"):
        server_settings({"flags": ["--tp", "2"]})
    with pytest.raises(SettingsError, match=r"^setting present='maybe': expected true or false"):
        server_settings({"present": "maybe"})


def test_a_bad_env_value_is_named_and_never_shown():
    with pytest.raises(SettingsError) as caught:
        server_settings({"env": {"HF_TOKEN": "hf_secret\nmore"}})
    said = str(caught.value)
    assert said.startswith("setting env=(not shown: a secret): HF_TOKEN:") and "hf_secret" not in said
    assert caught.value.key == "env"


# ---------------------------------------------------------------- the Desired: the same path as host data
def test_the_keywords_override_the_host_data_and_build_the_same_desired():
    desired = desired_of_call(DATA, settings={"port": 31129, "flags": {"tp": 2}, "env": {"A": "1"}})
    assert desired == desired_state({**DATA, "sglang_port": 31129, "sglang_flags": {"tp": 2}, "sglang_env": {"A": "1"}})
    assert desired.port == 31129 and desired.spec.argv[-2:] == ("--tp-size", "2")  # flags replaced, not merged
    assert desired.spec.model_path == "/opt/models/m" and desired.budgets["drain_timeout_s"] == 7.0
    assert desired_of_call(DATA, settings={"present": False}).spec is None
    assert desired_of_call({}, settings={}).problem.startswith("model_path is required")


def test_none_unsets_a_pin_of_the_host_data():
    pinned = {**DATA, "sglang_version": "0.5.23"}
    assert desired_of_call(pinned, settings={}).sglang_version == "0.5.23"
    assert desired_of_call(pinned, settings={"sglang_version": None}).sglang_version is None


def test_desired_and_keywords_together_are_refused():
    desired = desired_state(DATA)
    assert desired_of_call(DATA, desired, {}) is desired
    with pytest.raises(ServerArgumentError, match=r"takes desired= or the server's settings as keywords \(port\), not both"):
        desired_of_call(DATA, desired, {"port": 31129})


def test_only_port_leaves_another_ports_server_alone():
    assert desired_of_call({**DATA, "only_port": 30000}, settings={"port": 31129}) is None
    assert desired_of_call({**DATA, "only_port": 31129}, settings={"port": 31129}).port == 31129


def test_with_several_servers_the_keywords_go_over_the_one_on_their_port():
    two = {"sglang_model_path": "/m", "sglang_servers": [
        {"sglang_port": 30000, "sglang_flags": {"tp": 4}},
        {"sglang_port": 30001, "sglang_flags": {"tp": 4, "base-gpu-id": 4}, "sglang_model_path": "/other"}]}
    listed = {d.port: d for d in desired_states(two)}
    second = desired_of_call(two, settings={"port": 30001, "env": {"A": "1"}})
    assert second.siblings == (30000,) and second.spec.model_path == "/other" and second.spec.gpus == (4, 5, 6, 7)
    assert second.spec.env == {"A": "1"} and listed[30001].spec.env == {}
    assert desired_of_call(two, settings={"port": 30001}) == listed[30001]
    third = desired_of_call(two, settings={"port": 30002, "flags": {"tp": 1}})  # a server the list does not have
    assert third.siblings == (30000, 30001) and third.spec.model_path == "/m"
    with pytest.raises(ServerArgumentError, match=r"2 desired servers .*ports 30000, 30001\): name one with port="):
        desired_of_call(two, settings={"flags": {"tp": 2}})


# ---------------------------------------------------------------- the call, before pyinfra looks at it
def _call(data, *args, **kwargs):
    """What the operation body is given when a deploy file calls sglang.server(*args, **kwargs)."""
    state = State(Inventory((["@local"], data)), Config())
    given = []
    with ctx_state.use(state), ctx_host.use(state.inventory.get_host("@local")):
        _at_each_call(lambda *a, **k: given.append((a, k)))(*args, **kwargs)
    return given[0]


def test_the_call_hands_the_body_one_desired_and_names_the_operation():
    args, kwargs = _call(DATA, model_path="/m2", port=31129, _sudo=False)
    assert args == () and set(kwargs) == {"desired", "name", "_sudo"}
    assert kwargs["desired"] == desired_state({**DATA, "sglang_model_path": "/m2", "sglang_port": 31129})
    assert kwargs["name"] == "sglang.server :31129"  # not pyinfra's name, which prints the arguments (env)
    _, named = _call(DATA, name="Mine", port=31129)
    assert named["name"] == "Mine"
    built = desired_state(DATA)
    assert _call(DATA, built) == ((built,), {"name": "sglang.server :30000"})  # the desired= form as it was


def test_a_bad_call_stops_before_the_operation():
    with pytest.raises(ServerArgumentError):
        _call(DATA, desired_state(DATA), port=1)
    with pytest.raises(ServerArgumentError, match="did you mean flags"):
        _call(DATA, flag={"tp": 2})
    with pytest.raises(SettingsError, match="^setting port='x'"):
        _call(DATA, port="x")


def test_a_server_of_another_port_than_only_port_reaches_the_body_as_written():
    _, kwargs = _call({**DATA, "only_port": 30000}, port=31129)
    assert kwargs == {"port": 31129, "name": "sglang.server :31129"}  # the body says "not this run's server"
