"""Input refused or taken as meant (issue 12, "Input"): --data values through pyinfra's own --data parser,
fleet.yaml's env values, vmids, interpreters, merge keys, size, and the SGLang version/extra args keys."""

from __future__ import annotations

import textwrap
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpugate.fleet import MAX_FLEET_BYTES, FleetError, fleet_to_inventory, load_fleet
from gpugate.settings import SETTINGS, SettingsError, validated_settings
from gpugate.spec import desired_state


def _pyinfra_parse_cli_arg():
    """pyinfra's own ``--data`` value parser (pyinfra_cli.util.parse_cli_arg), loaded WITHOUT running
    ``pyinfra_cli/__init__.py``: that file gevent-patches the whole interpreter (subprocess, threading,
    socket), and an import at collection time would change every other test of the session."""
    import importlib
    import importlib.util
    import sys
    import types

    if "pyinfra_cli" in sys.modules:
        return importlib.import_module("pyinfra_cli.util").parse_cli_arg
    location = importlib.util.find_spec("pyinfra_cli").submodule_search_locations
    package = types.ModuleType("pyinfra_cli")
    package.__path__ = list(location)
    sys.modules["pyinfra_cli"] = package
    try:
        return importlib.import_module("pyinfra_cli.util").parse_cli_arg
    finally:  # later imports of pyinfra_cli get the real package
        for name in [name for name in sys.modules if name == "pyinfra_cli" or name.startswith("pyinfra_cli.")]:
            if name != "pyinfra_cli.util" or sys.modules[name] is None:
                sys.modules.pop(name, None)
        sys.modules.pop("pyinfra_cli.util", None)


parse_cli_arg = _pyinfra_parse_cli_arg()  # what `pyinfra --data key=value` makes of value


def cli(**values: str) -> dict:
    return {key: parse_cli_arg(value) for key, value in values.items()}


# ---------------------------------------------------------------- --data


@pytest.mark.parametrize(("text", "expected"), [
    ("no", False), ("No", False), ("false", False), ("0", False), ("yes", True), ("TRUE", True), ("1", True),
])
def test_booleans_from_the_command_line_mean_what_they_say(text, expected):
    assert validated_settings(cli(rolling=text)) == {"rolling": expected}
    assert desired_state(cli(sglang_present=text)).present is expected


@pytest.mark.parametrize(("values", "message"), [
    ({"drain_timeout_s": "abc"}, "setting drain_timeout_s='abc': expected a number, got 'abc' (str)"),
    ({"rolling": "maybe"}, "setting rolling='maybe': expected true or false (or yes/no, 1/0), got 'maybe' (str)"),
    ({"rolling": "2"}, "setting rolling=2: expected true or false"),
    ({"gpu_max_used_mib": "1.5"}, "setting gpu_max_used_mib=1.5: expected a whole number"),
    ({"kill_grace_s": "-1"}, "must not be negative, got -1"),
    ({"sglang_port": "70000"}, "expected a port number 1..65535"),
    ({"drain_timout_s": "30"}, "setting drain_timout_s=30: unknown setting (did you mean drain_timeout_s?)"),
    ({"sglang_python": "/bin/sh"}, "/bin/sh is not a Python 3 interpreter"),
    ({"sglang_supervisor": "runit"}, "expected one of process, systemd"),
    ({"sglang_extra_args": '["--a", 1]'}, "expected strings (quote each item), got 1 (int)"),
])
def test_bad_command_line_values_are_refused_naming_the_setting(values, message):
    with pytest.raises(SettingsError) as caught:
        desired_state(cli(**values))
    assert message in str(caught.value)


def test_an_env_value_of_the_wrong_type_is_refused_without_showing_it():
    with pytest.raises(SettingsError) as caught:
        validated_settings(cli(sglang_env='{"HF_TOKEN": 931245077}'))
    assert "quote it" in str(caught.value) and "931245077" not in str(caught.value)


def test_numbers_and_pyinfra_and_connector_keys_pass():
    data = cli(drain_timeout_s="1.5", start_timeout_s="30", ssh_user="ops", pct_sudo="yes", pct_vmid="129",
               sglang_flags='{"tp": 8}', sglang_version="0.5.23", sglang_extra_args='["--x", "1"]')
    data["_sudo"] = True  # pyinfra's global arguments may come as data
    assert validated_settings(data) == {"drain_timeout_s": 1.5, "start_timeout_s": 30, "pct_sudo": True,
                                        "sglang_flags": {"tp": 8}, "sglang_version": "0.5.23",
                                        "sglang_extra_args": ["--x", "1"]}


BOOL_WORDS = ("true", "yes", "1", "false", "no", "0")


@given(st.text(max_size=8))
def test_any_text_is_a_boolean_only_when_it_is_one_of_the_six_words(text):
    try:
        value = validated_settings({"rolling": text})["rolling"]
    except SettingsError:
        assert text.strip().lower() not in BOOL_WORDS
    else:
        assert text.strip().lower() in BOOL_WORDS and value is (text.strip().lower() in ("true", "yes", "1"))


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                       max_size=3), max_leaves=8)


@given(st.sampled_from(sorted(SETTINGS)), json_values)
def test_any_value_of_any_setting_is_taken_or_refused_with_a_settings_error(key, value):
    try:
        validated_settings({key: value})
    except SettingsError as error:
        assert str(error).startswith(f"setting {key}=")


# ---------------------------------------------------------------- fleet.yaml


def write(tmp_path, text: str):
    path = tmp_path / "fleet.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def fleet_error(tmp_path, text: str) -> FleetError:
    with pytest.raises(FleetError) as caught:
        load_fleet(write(tmp_path, text))
    return caught.value


def container(tmp_path, sglang: str, vmid: str = "129") -> dict:
    path = write(tmp_path, f"hosts:\n  pve1:\n    containers:\n      {vmid}:\n        sglang: {sglang}\n")
    (name, data), = fleet_to_inventory(load_fleet(path))["pve_pve1"][0]
    return data


@pytest.mark.parametrize("value", ["0644", "2.20", "30", "yes", "~", "0x1F"])
def test_unquoted_env_values_yaml_would_change_are_refused(tmp_path, value):
    error = fleet_error(tmp_path, f"hosts: {{pve1: {{containers: {{129: {{sglang: {{model_path: /m, "
                                  f"env: {{PIN: {value}}}}}}}}}}}}}")
    assert error.entry == "hosts.pve1.containers.129.sglang.env.PIN"
    assert "quote it" in error.problem and value not in error.problem  # a value may be a secret


def test_quoted_env_values_are_kept_exactly(tmp_path):
    data = container(tmp_path, '{model_path: /m, env: {UMASK: "0755", VERSION: "1.10"}}')
    assert data["sglang_env"] == {"UMASK": "0755", "VERSION": "1.10"}


@pytest.mark.parametrize(("vmid", "shown"), [("0201", "0201"), ('"0201"', "0201")])
def test_a_vmid_with_a_leading_zero_is_refused(tmp_path, vmid, shown):
    error = fleet_error(tmp_path, f"hosts: {{pve1: {{containers: {{{vmid}: {{}}}}}}}}")
    assert error.entry == f"hosts.pve1.containers.{shown}"
    assert "leading zero" in error.problem and "without" in error.problem


def test_integers_yaml_reads_unlike_a_person_are_refused_where_they_are(tmp_path):
    error = fleet_error(tmp_path, "hosts: {pve1: {containers: {129: {sglang: {model_path: /m, port: 8:20}}}}}")
    assert error.entry == "hosts.pve1.containers.129.sglang.port"
    assert error.problem.startswith("8:20 is read by YAML as a base-60 number, 500")
    error = fleet_error(tmp_path, "hosts: {pve1: {containers: {129: {sglang: {model_path: /m, flags: {tp: 010}}}}}}")
    assert error.entry == "hosts.pve1.containers.129.sglang.flags.tp" and "octal number 8" in error.problem


@pytest.mark.parametrize(("python", "ok"), [
    ("/bin/sh", False), ("/usr/bin/python2.7", False), ("/usr/bin/python2", False), ("python3", False),
    ("/usr/bin/python3", True), ("/opt/venv/bin/python", True), ("/usr/local/bin/python3.12", True),
])
def test_python_must_be_a_python3_interpreter(tmp_path, python, ok):
    text = f"hosts: {{pve1: {{containers: {{129: {{sglang: {{model_path: /m, python: '{python}'}}}}}}}}}}"
    if ok:
        assert fleet_to_inventory(load_fleet(write(tmp_path, text)))["pve_pve1"][0][0][1]["sglang_python"] == python
    else:
        assert fleet_error(tmp_path, text).entry == "hosts.pve1.containers.129.sglang.python"


def test_merge_keys_with_overrides_work_and_duplicates_are_still_refused(tmp_path):
    path = write(tmp_path, """
        x-server: &server {model_path: /m, port: 30000, flags: {tp: 4}}   # x-*: anchors only, ignored
        hosts:
          pve1:
            data: &defaults {drain_timeout_s: 30, kill_grace_s: 5}
            containers:
              129:
                data: {<<: *defaults, drain_timeout_s: 120}
                sglang: {<<: *server}
              130:
                sglang:
                  <<: *server
                  port: 30001
                  flags: {tp: 4, base-gpu-id: 4}
        """)
    hosts = dict(fleet_to_inventory(load_fleet(path))["pve_pve1"][0])
    assert hosts["@pct/pve1:129"]["drain_timeout_s"] == 120 and hosts["@pct/pve1:129"]["kill_grace_s"] == 5
    assert hosts["@pct/pve1:130"]["sglang_port"] == 30001
    assert hosts["@pct/pve1:130"]["sglang_flags"] == {"tp-size": 4, "base-gpu-id": 4}
    assert hosts["@pct/pve1:129"]["sglang_flags"] == {"tp-size": 4}  # the anchor itself is unchanged
    error = fleet_error(tmp_path, """
        hosts:
          pve1:
            containers:
              129: {sglang: {model_path: /m, port: 30000, port: 30001}}
        """)
    assert "duplicate key 'port'" in error.problem
    error = fleet_error(tmp_path, "base: {}\nhosts: {pve1: {containers: {129: {}}}}")
    assert error.entry == "base" and "unknown key" in error.problem


def test_unknown_data_keys_are_refused_with_a_did_you_mean(tmp_path):
    error = fleet_error(tmp_path, "hosts: {pve1: {containers: {129: {data: {drain_timout_s: 5}}}}}")
    assert error.entry == "hosts.pve1.containers.129.data.drain_timout_s"
    assert error.problem.startswith("unknown setting (did you mean drain_timeout_s?)")
    error = fleet_error(tmp_path, "groups: {canary: {data: {rollin: true}}}\nhosts: {pve1: {containers: {129: {}}}}")
    assert error.entry == "groups.canary.data.rollin" and "did you mean rolling?" in error.problem


def test_data_booleans_are_read_like_the_command_line(tmp_path):
    path = write(tmp_path, "hosts: {pve1: {data: {rolling: 'no', end_other_gpu_holders: 1}, containers: {129: {}}}}")
    (_, data), = fleet_to_inventory(load_fleet(path))["pve_pve1"][0]
    assert data["rolling"] is False and data["end_other_gpu_holders"] is True


def test_sglang_version_and_extra_args_reach_host_data(tmp_path):
    data = container(tmp_path, '{model_path: /m, sglang_version: "0.5.23", extra_args: ["--new-flag", "3"]}')
    assert data["sglang_version"] == "0.5.23" and data["sglang_extra_args"] == ["--new-flag", "3"]
    error = fleet_error(tmp_path, "hosts: {pve1: {containers: {129: {sglang: {model_path: /m, sglang_version: 0.5}}}}}")
    assert error.entry == "hosts.pve1.containers.129.sglang.sglang_version" and "quoted string" in error.problem
    error = fleet_error(tmp_path, "hosts: {pve1: {containers: {129: {sglang: {model_path: /m, extra_args: [--x, 1]}}}}}")
    assert error.entry == "hosts.pve1.containers.129.sglang.extra_args" and "quote each item" in error.problem


def test_a_fleet_file_over_the_bound_is_refused_at_once(tmp_path):
    path = tmp_path / "fleet.yaml"
    with open(path, "w") as f:
        f.write("hosts:\n  pve1:\n    containers:\n")
        line = "      # " + "x" * 90 + "\n"
        f.write(line * (50 * MAX_FLEET_BYTES // len(line)))  # ~50 MiB of comments
    started = time.monotonic()
    with pytest.raises(FleetError) as caught:
        load_fleet(path)
    assert time.monotonic() - started < 1.0
    assert caught.value.problem.startswith("the file is 50.0 MiB, over the limit of 1 MiB for a fleet file")


def test_an_alias_bomb_is_refused_quickly(tmp_path):
    # 9 levels of 9 aliases: 9**9 strings if anything walked it naively; a 1 KB file
    lines = ["x-a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"x-a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    lines.append("hosts: {pve1: {containers: {129: {sglang: {model_path: /m, extra_args: *a8}}}}}")
    started = time.monotonic()
    error = fleet_error(tmp_path, "\n".join(lines) + "\n")
    assert time.monotonic() - started < 2.0
    # refused before anything is built from it (issue 20: it used to reach the extra_args check, and
    # a bomb of strings there, or under an x- key, took the controller's memory)
    assert error.entry == "line 1, column 1" and error.problem.startswith("refused: its aliases expand to more than")


# ---------------------------------------------------------------- hostile documents (issue 20)


def _laughs(levels: int, width: int = 9) -> str:
    text = 'x-l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n'
    for level in range(1, levels + 1):
        text += f"x-l{level}: &l{level} [" + ", ".join([f"*l{level - 1}"] * width) + "]\n"
    return text


@pytest.mark.parametrize("where", ["an x- key", "the flags"])
def test_an_alias_bomb_is_refused_at_once_naming_the_file(tmp_path, where):
    text = _laughs(9) + textwrap.dedent("""\
        hosts:
          pve1:
            containers:
              129:
                sglang: {model_path: /m, flags: {tp: 8%s}}
        """ % (", json-model-override-args: *l9" if where == "the flags" else ""))
    path = tmp_path / "fleet.yaml"
    path.write_text(text)
    assert len(text) < 2000  # a small file that stands for 9**10 values
    with pytest.raises(FleetError) as caught:
        load_fleet(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: line 1, column 1: refused: its aliases expand to more than")
    assert "\n" not in message


def test_aliases_a_fleet_really_uses_still_load(tmp_path):
    path = tmp_path / "fleet.yaml"
    path.write_text(textwrap.dedent("""\
        x-server: &server {model_path: /m, flags: {tp: 8, kv-cache-dtype: fp8_e4m3}}
        hosts:
          pve1:
            containers:
              129: {sglang: *server}
              130: {sglang: {<<: *server, port: 30001}}
        """))
    fleet = load_fleet(path)
    assert [c.sglang["sglang_flags"]["kv-cache-dtype"] for c in fleet.hosts[0].containers] == ["fp8_e4m3"] * 2


def test_a_document_nested_thousands_deep_is_refused_without_a_traceback(tmp_path):
    path = tmp_path / "fleet.yaml"
    path.write_text("hosts: {pve1: {containers: {129: {sglang: {model_path: /m, flags: {x: "
                    + "[" * 5000 + "]" * 5000 + "}}}}}}\n")
    with pytest.raises(FleetError) as caught:
        load_fleet(path)
    assert "refused: nested more than 64 levels deep" in str(caught.value) and str(path) in str(caught.value)


@pytest.mark.parametrize("key", ["health_poll_s", "lock_wait_s"])
def test_a_setting_that_was_never_read_is_refused_saying_so(tmp_path, key):
    with pytest.raises(SettingsError) as caught:
        validated_settings(cli(**{key: "5"}))
    assert f"setting {key}=5: no longer a setting: it was accepted but never read" in str(caught.value)
    error = fleet_error(tmp_path, textwrap.dedent(f"""\
        hosts:
          pve1:
            data: {{{key}: 5}}
            containers:
              129: {{sglang: {{model_path: /m}}}}
        """))
    assert error.entry == f"hosts.pve1.data.{key}" and error.problem.startswith("no longer a setting")
