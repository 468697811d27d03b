"""SGLang's flags as data: what an operator sees when a flag is wrong, and argv that round-trips."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpugate.engine.sglang.flags import (
    SNAPSHOT_DIR,
    SPECS,
    FlagError,
    choose_table,
    flag_warnings,
    load_snapshot,
    version_mismatch,
    build_parser,
    canonical_name,
    diff_flags,
    parse_argv,
    redact_argv,
    render_argv,
    server_info_mismatches,
    json_holds_secret,
    server_info_view,
    validate_flags,
)

# --- names -------------------------------------------------------------------------------


@pytest.mark.parametrize("spelling", ["tp", "--tp", "tp_size", "tp-size", "--tp-size", "tensor-parallel-size",
                                      "--tensor-parallel-size"])
def test_every_spelling_of_tp_is_tp_size(spelling):
    assert canonical_name(spelling) == "tp-size"


def test_unknown_flag_names_it_the_version_and_the_close_one():
    with pytest.raises(FlagError) as caught:
        canonical_name("--kv-cache-dtyp", "0.5.23")
    assert str(caught.value) == "--kv-cache-dtyp: not a flag of SGLang 0.5.23 (did you mean --kv-cache-dtype?)"


def test_a_flag_a_release_split_in_two_names_both_halves():
    with pytest.raises(FlagError) as caught:
        validate_flags({"cuda-graph-max-bs": 256}, "0.5.23")
    assert str(caught.value) == ("--cuda-graph-max-bs: not a flag of SGLang 0.5.23 (did you mean "
                                 "--cuda-graph-max-bs-decode or --cuda-graph-max-bs-prefill?)")
    assert validate_flags({"cuda-graph-max-bs": 256}, "0.5.10") == {"cuda-graph-max-bs": 256}


def test_unknown_flag_without_any_close_match_says_so_plainly():
    with pytest.raises(FlagError, match=r"^--frobnicate: not a flag of SGLang 0.5.23$"):
        validate_flags({"frobnicate": 1}, "0.5.23")
    with pytest.raises(FlagError, match=r"^--frobnicate: not a flag of any SGLang release gpugate has a snapshot"):
        validate_flags({"frobnicate": 1})


def test_the_snapshots_are_sglangs_own_tables():
    # What SGLang's parser declared (scripts/flags_snapshot.py sglang), not a list written here.
    new, old = load_snapshot("0.5.23"), load_snapshot("0.5.10")
    assert (new.option_count, old.option_count) == (559, 365)
    assert new.specs["kv-cache-dtype"].choices == ("auto", "fp8_e5m2", "fp8_e4m3", "mxfp8", "bf16", "bfloat16",
                                                   "nvfp4", "fp4_mx_block16")
    assert old.specs["kv-cache-dtype"].choices == ("auto", "fp8_e5m2", "fp8_e4m3", "bf16", "bfloat16", "fp4_e2m1")
    assert new.specs["disable-cuda-graph"].deprecated and not old.specs["disable-cuda-graph"].deprecated
    wanted = {"tp-size", "dp-size", "pp-size", "ep-size", "kv-cache-dtype", "disable-radix-cache",
              "disable-cuda-graph", "disable-custom-all-reduce", "enable-hierarchical-cache",
              "hicache-size", "hicache-ratio", "mem-fraction-static", "max-running-requests", "context-length",
              "api-key", "admin-api-key", "served-model-name", "dist-init-addr", "nnodes", "node-rank"}
    assert wanted <= set(new.specs) and wanted <= set(old.specs)
    assert SPECS["api-key"].secret and SPECS["admin-api-key"].secret and new.specs["ssl-keyfile-password"].secret


def test_deprecated_flags_pass_with_sglangs_own_words():
    assert validate_flags({"disable-cuda-graph": True}, "0.5.23") == {"disable-cuda-graph": True}
    assert flag_warnings({"disable-cuda-graph": True}, "0.5.23") == [
        "--disable-cuda-graph is deprecated in SGLang 0.5.23: '--disable-cuda-graph' is deprecated and will be "
        "removed in a future release. Use '--cuda-graph-backend-{decode,prefill}=disabled' instead."]
    assert flag_warnings({"disable-cuda-graph": True}, "0.5.10") == []


def test_one_flag_has_one_name_across_versions():
    # 0.5.10 declares "--tensor-parallel-size", "--tp-size" (dest tensor_parallel_size); 0.5.23 "--tp-size" first
    for version in ("0.5.10", "0.5.23"):
        assert validate_flags({"tensor-parallel-size": 2},
                              version) == {"tp-size": 2}
        assert server_info_view({"tp": 2}, version) == {"tp_size": 2}


def test_an_x_no_x_switch_keeps_false_and_renders_no_x():
    flags = validate_flags({"enable-tf32-matmul": False}, "0.5.23")
    assert flags == {"enable-tf32-matmul": False}
    assert render_argv("/m", 30000, flags, table="0.5.23")[-1] == "--no-enable-tf32-matmul"
    assert parse_argv(["--model-path", "/m", "--no-enable-tf32-matmul"], "0.5.23").flags == flags


def test_choose_table_prefers_the_container_then_the_pin_then_the_newest():
    container = {"version": "0.5.10", "cached": True, "table": json.loads(
        (SNAPSHOT_DIR / "sglang-0.5.10.json").read_text())}
    table, note = choose_table(container, "0.5.23")
    assert (table.version, note) == ("0.5.10", "SGLang 0.5.10's own flag table, from the container (cached there)")
    # neither cached nor built now (a controller that already held the table): no doubled words
    _table, note = choose_table(dict(container, cached=False), "0.5.23")
    assert note == "SGLang 0.5.10's own flag table, from the container"
    table, note = choose_table({"version": None, "error": "no sglang package for this python"}, "0.5.10")
    assert table.version == "0.5.10" and note.startswith("the snapshot of SGLang 0.5.10 (pinned;")
    table, note = choose_table(None, "9.9.9")
    assert table.version == "0.5.23"
    assert note == "the newest snapshot, SGLang 0.5.23 (no snapshot of the pinned 9.9.9; the container's own table is not known)"
    assert version_mismatch("0.5.23", "0.5.10") == "the container has SGLang 0.5.10; sglang_version pins 0.5.23"


# --- validation ----------------------------------------------------------------------------


def test_validate_normalises_names_types_and_switches():
    flags = validate_flags({"tp": 8, "kv-cache-dtype": "fp8_e4m3", "disable-radix-cache": True,
                            "disable-cuda-graph": False, "mem-fraction-static": 1, "cuda_graph_max_bs": "64"})
    assert flags == {"disable-radix-cache": True, "kv-cache-dtype": "fp8_e4m3", "mem-fraction-static": 1.0,
                     "tp-size": 8, "cuda-graph-max-bs": 64}
    assert list(flags) == sorted(flags)


def test_bad_choice_lists_the_valid_ones():
    with pytest.raises(FlagError) as caught:
        validate_flags({"kv-cache-dtype": "fp9"}, "0.5.10")
    assert str(caught.value) == ("--kv-cache-dtype: 'fp9' is not one of auto, fp8_e5m2, fp8_e4m3, bf16, "
                                 "bfloat16, fp4_e2m1 in SGLang 0.5.10")


def test_bad_choice_close_to_a_valid_one_gets_a_suggestion():
    with pytest.raises(FlagError, match="did you mean fp8_e4m3"):
        validate_flags({"kv-cache-dtype": "fp8-e4m3"})


@pytest.mark.parametrize(("flags", "expected"), [
    ({"tp": "eight"}, "--tp-size: expects an integer, got 'eight' (str)"),
    ({"tp": True}, "--tp-size: expects an integer, got True (bool)"),
    ({"tp": 8.5}, "--tp-size: expects an integer, got 8.5 (float)"),
    ({"mem-fraction-static": "lots"}, "--mem-fraction-static: expects a number, got 'lots' (str)"),
    ({"mem-fraction-static": float("nan")}, "--mem-fraction-static: expects a finite number, got nan"),
    ({"disable-radix-cache": "yes"}, "--disable-radix-cache: is a switch: write true or false, got 'yes' (str)"),
    ({"disable-radix-cache": 1}, "--disable-radix-cache: is a switch: write true or false, got 1 (int)"),
    ({"served-model-name": ["a"]}, "--served-model-name: expects a string, got ['a'] (list)"),
    ({"context-length": None}, "--context-length: has no value; remove the flag to use SGLang's default"),
    ({"cuda-graph-bs": []}, "--cuda-graph-bs: needs at least one item; remove the flag to use SGLang's default"),
    ({"cuda-graph-bs": [1, "x"]}, "--cuda-graph-bs: expects an integer, got 'x' (str)"),
    ({"json-model-override-args": "{not json"}, "--json-model-override-args: expects JSON text"),
])
def test_wrong_types_name_the_flag_and_the_value(flags, expected):
    with pytest.raises(FlagError) as caught:
        validate_flags(flags)
    assert str(caught.value).startswith(expected)


@pytest.mark.parametrize("field", ["model-path", "--model-path", "model", "port", "host", "config"])
def test_fields_given_as_flags_are_refused(field):
    with pytest.raises(FlagError) as caught:
        validate_flags({field: "x"})
    assert "not as a flag" in str(caught.value) or "instead of --config" in str(caught.value)


def test_the_same_flag_under_two_spellings_is_refused():
    with pytest.raises(FlagError, match=r"--tp-size: given twice \(as 'tp' and 'tp-size'\)"):
        validate_flags({"tp": 8, "tp-size": 4})


def test_hierarchical_cache_with_radix_cache_disabled_is_refused_as_sglang_does():
    with pytest.raises(FlagError) as caught:
        validate_flags({"enable-hierarchical-cache": True, "disable-radix-cache": True})
    assert "enable-hierarchical-cache and disable-radix-cache are mutually exclusive" in str(caught.value)
    # Either alone is fine, and a switch set to false does not count.
    validate_flags({"enable-hierarchical-cache": True, "disable-radix-cache": False, "hicache-size": 48})


@pytest.mark.parametrize(("flags", "flag"), [
    ({"enable-tokenizer-batch-encode": True, "enable-dynamic-batch-tokenizer": True}, "enable-tokenizer-batch-encode"),
    ({"disaggregation-decode-enable-offload-kvcache": True}, "disaggregation-decode-enable-offload-kvcache"),
    ({"speculative-algorithm": "NGRAM", "enable-dp-attention": True}, "speculative-algorithm"),
    ({"tp": 0}, "tp-size"),
    ({"mem-fraction-static": 1.5}, "mem-fraction-static"),
    ({"nnodes": 2, "node-rank": 2}, "node-rank"),
    ({"hicache-size": -1}, "hicache-size"),
])
def test_known_conflicts_and_impossible_values_name_the_flag(flags, flag):
    with pytest.raises(FlagError) as caught:
        validate_flags(flags)
    assert caught.value.flag == flag


def test_nul_cannot_reach_argv():
    with pytest.raises(FlagError, match="NUL"):
        validate_flags({"served-model-name": "a\x00b"})


def test_json_flags_accept_mappings_and_are_written_canonically():
    flags = validate_flags({"json-model-override-args": {"b": 1, "a": [1, 2]}})
    assert flags == {"json-model-override-args": '{"a":[1,2],"b":1}'}
    assert validate_flags({"json-model-override-args": ' { "b": 1, "a": [1,2] }'}) == flags


# --- argv ----------------------------------------------------------------------------------


def test_render_is_the_launch_command_with_flags_sorted():
    argv = render_argv("moonshotai/Kimi-K2.5", 30000,
                       {"tp": 8, "kv-cache-dtype": "fp8_e4m3", "disable-radix-cache": True,
                        "chunked-prefill-size": -1, "cuda-graph-bs": [1, 2, 4]})
    assert argv == ["-m", "sglang.launch_server", "--model-path", "moonshotai/Kimi-K2.5",
                    "--host", "127.0.0.1", "--port", "30000",
                    "--chunked-prefill-size=-1", "--cuda-graph-bs", "1", "2", "4",
                    "--disable-radix-cache", "--kv-cache-dtype", "fp8_e4m3", "--tp-size", "8"]


@pytest.mark.parametrize("nasty", ["; rm -rf /", "$(touch /tmp/pwned)", "`id`", "a'b\"c", "line1\nline2",
                                   "-- --port 1", "--tp-size=1", "*", "~root", "${HOME}"])
def test_shell_injection_strings_are_one_literal_argv_item(nasty):
    argv = render_argv(nasty, 30000, {"served-model-name": nasty, "chat-template": nasty})
    assert argv.count(nasty) + sum(a.endswith("=" + nasty) for a in argv) == 3
    parsed = parse_argv(["python3", *argv])
    assert parsed.model_path == nasty
    assert parsed.flags == {"chat-template": nasty, "served-model-name": nasty}
    args = build_parser().parse_args(argv[2:])
    assert (args.model_path, args.served_model_name, args.chat_template) == (nasty, nasty, nasty)


@pytest.mark.parametrize(("model", "port", "host"), [("", 30000, "127.0.0.1"), ("/m", 0, "127.0.0.1"),
                                                     ("/m", True, "127.0.0.1"), ("/m", 30000, "")])
def test_render_refuses_missing_model_bad_port_or_host(model, port, host):
    with pytest.raises(FlagError):
        render_argv(model, port, {}, host=host)


def test_render_validates_the_flags_too():
    with pytest.raises(FlagError, match="--kv-cache-dtype"):
        render_argv("/m", 30000, {"kv-cache-dtype": "fp9"})


def test_parse_reads_a_real_cmdline_with_aliases_abbreviations_and_equals():
    cmdline = ["/usr/bin/python3", "-m", "sglang.launch_server", "--model", "/opt/models/m",
               "--host=0.0.0.0", "--port", "31000", "--tp", "8", "--data-parallel-size=2",
               "--kv-cache-dtype", "fp8_e4m3", "--disable-radix-cache", "--mem-fraction-static", "0.88",
               "--cuda-graph-bs", "1", "2", "--some-future-flag", "x", "--future-switch"]
    parsed = parse_argv(cmdline)
    assert (parsed.model_path, parsed.host, parsed.port) == ("/opt/models/m", "0.0.0.0", 31000)
    assert parsed.flags == {"cuda-graph-bs": [1, 2], "disable-radix-cache": True, "dp-size": 2,
                            "future-switch": True, "kv-cache-dtype": "fp8_e4m3", "mem-fraction-static": 0.88,
                            "some-future-flag": "x", "tp-size": 8}
    assert parsed.unknown == ["some-future-flag", "future-switch"]
    assert parsed.problems == []


def test_parse_of_sglang_serve_and_defaults():
    parsed = parse_argv(["/venv/bin/sglang", "serve", "--model-path", "/m"])
    assert (parsed.model_path, parsed.host, parsed.port, parsed.flags) == ("/m", "127.0.0.1", 30000, {})


def test_parse_never_raises_on_garbage_and_reports_it():
    parsed = parse_argv(["python3", "-m", "sglang.launch_server", "--port", "x", "--tp-size", "eight",
                         "--kv-cache-dtype"])
    assert parsed.port == 30000
    assert parsed.flags["tp-size"] == "eight"
    assert any("--tp-size" in p for p in parsed.problems)
    assert any("--kv-cache-dtype" in p for p in parsed.problems)
    assert any("--port" in p for p in parsed.problems)


def test_the_last_occurrence_wins_as_in_argparse():
    assert parse_argv(["--model-path", "/m", "--tp", "2", "--tp-size", "4"]).flags == {"tp-size": 4}


_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=30)
_flag_values = st.fixed_dictionaries({}, optional={
    "served-model-name": _text,
    "chat-template": _text,
    "api-key": _text,
    "tp": st.integers(min_value=1, max_value=64),
    "chunked-prefill-size": st.integers(min_value=-1, max_value=1 << 20),
    "mem-fraction-static": st.floats(min_value=0.01, max_value=1.0),
    "watchdog-timeout": st.floats(min_value=-1e6, max_value=1e6, allow_nan=False),
    "kv-cache-dtype": st.sampled_from(SPECS["kv-cache-dtype"].choices),
    "disable-radix-cache": st.booleans(),
    "disable-cuda-graph": st.booleans(),
    "cuda-graph-bs": st.lists(st.integers(min_value=1, max_value=512), min_size=1, max_size=4),
    "json-model-override-args": st.dictionaries(_text, st.integers() | _text, max_size=3),
    "log-requests-level": st.sampled_from([0, 1, 2, 3]),
})


@settings(max_examples=150, deadline=None)
# "--" as a whole value: argparse itself drops it ("--host=--" reads as []); fleet.yaml refuses such a host
@given(model=_text.filter(lambda t: t and t != "--"), port=st.integers(min_value=1, max_value=65535),
       host=_text.filter(lambda t: t and t != "--"),
       flags=_flag_values)
def test_render_then_parse_gives_back_the_same_server(model, port, host, flags):
    argv = render_argv(model, port, flags, host=host)
    parsed = parse_argv(["/usr/bin/python3", *argv])
    assert (parsed.model_path, parsed.host, parsed.port) == (model, host, port)
    assert parsed.flags == validate_flags(flags)
    assert parsed.problems == [] and parsed.unknown == []
    assert diff_flags(parsed.flags, flags).is_empty
    # SGLang's own parser (as the stand-in uses it) reads the same values.
    args = build_parser().parse_args(argv[2:])
    assert (args.model_path, args.host, args.port) == (model, host, port)
    for name, value in validate_flags(flags).items():
        assert getattr(args, SPECS[name].dest) == value


# --- diff ----------------------------------------------------------------------------------


def test_diff_lines_for_the_two_restarts_that_started_this_project():
    running = parse_argv(["python3", "-m", "sglang.launch_server", "--model-path", "/m", "--tp", "8",
                          "--kv-cache-dtype", "auto"]).flags
    desired = validate_flags({"tp": 8, "kv-cache-dtype": "fp8_e4m3", "disable-radix-cache": True,
                              "disable-cuda-graph": True, "disable-custom-all-reduce": True})
    diff = diff_flags(running, desired)
    assert not diff.is_empty
    assert diff.lines() == ["+ --disable-cuda-graph", "+ --disable-custom-all-reduce", "+ --disable-radix-cache",
                            "- --kv-cache-dtype auto", "+ --kv-cache-dtype fp8_e4m3"]
    assert diff.changed == {"kv-cache-dtype": ("auto", "fp8_e4m3")}


def test_diff_shows_removed_flags_and_quotes_odd_values():
    diff = diff_flags({"disable-radix-cache": True, "chat-template": "my template.jinja"}, {})
    assert diff.lines() == ["- --chat-template 'my template.jinja'", "- --disable-radix-cache"]


def test_no_diff_for_same_flags_in_other_spellings_or_false_switches():
    assert diff_flags({"tp-size": 8, "mem-fraction-static": 0.9}, {"tp": 8.0, "mem_fraction_static": 0.9,
                                                                   "disable-radix-cache": False}).is_empty


def test_a_flag_written_at_its_default_is_a_difference_by_decision():
    assert diff_flags({}, {"kv-cache-dtype": "auto"}).lines() == ["+ --kv-cache-dtype auto"]


def test_secrets_never_show_in_diff_lines_unless_asked():
    diff = diff_flags({"api-key": "old-secret"}, {"api-key": "new-secret", "admin-api-key": "adm"})
    assert diff.lines() == ["+ --admin-api-key ***", "- --api-key ***", "+ --api-key ***"]
    assert "+ --api-key new-secret" in diff.lines(redact=False)
    assert "old-secret" not in " ".join(diff.lines())


def test_redact_argv_hides_secret_values_in_both_forms():
    argv = ["-m", "sglang.launch_server", "--api-key", "s3cret", "--admin-api-key=adm", "--tp-size", "8"]
    assert redact_argv(argv) == ["-m", "sglang.launch_server", "--api-key", "***", "--admin-api-key=***",
                                 "--tp-size", "8"]


# --- SGLang's parser and /get_server_info ----------------------------------------------------


def test_build_parser_rejects_a_bad_choice_like_sglang(capsys):
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(["--model-path", "/m", "--kv-cache-dtype", "fp9"])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert "launch_server.py: error: argument --kv-cache-dtype: invalid choice: 'fp9'" in err


def test_build_parser_needs_the_model_and_knows_aliases_and_abbreviations():
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["--tp", "2"])
    args = parser.parse_args(["--model", "/m", "--tp", "2", "--dp", "2", "--ep", "2", "--disable-radix-cache"])
    assert (args.model_path, args.tp_size, args.dp_size, args.ep_size, args.disable_radix_cache) == \
        ("/m", 2, 2, 2, True)
    defaults = parser.parse_args(["--model-path", "/m"])
    assert (defaults.port, defaults.kv_cache_dtype, defaults.disable_radix_cache, defaults.hicache_size) == \
        (30000, "auto", False, 0)


def test_module_is_stdlib_only_for_lab_containers():
    # The system python of a lab container has no pyinfra and no third-party packages.
    code = ("import sys, runpy; sys.modules['yaml']=None; sys.modules['pyinfra']=None;"
            "ns = runpy.run_path(sys.argv[1]); print(ns['validate_flags']({'tp': 2}))")
    from gpugate.engine.sglang import flags as sglang_args
    out = subprocess.run([sys.executable, "-I", "-c", code, sglang_args.__file__], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "{'tp-size': 2}"


def test_server_info_view_and_mismatches():
    flags = validate_flags({"tp": 8, "kv-cache-dtype": "fp8_e4m3", "disable-radix-cache": True, "api-key": "k",
                            "json-model-override-args": {"a": 1}})
    # json-model-override-args is a plain str in SGLang's parser: ServerArgs keeps the argv's text
    assert server_info_view(flags) == {"api_key": "k", "disable_radix_cache": True, "json_model_override_args": '{"a":1}',
                                       "kv_cache_dtype": "fp8_e4m3", "tp_size": 8}
    info = {"tp_size": 8, "kv_cache_dtype": "auto", "disable_radix_cache": True, "api_key": None,
            "json_model_override_args": '{"a": 1}', "mem_fraction_static": 0.83}
    assert server_info_mismatches(flags, info) == {"kv-cache-dtype": ("fp8_e4m3", "auto")}


def test_a_flag_value_that_looks_like_the_entry_point_is_still_a_value():
    parsed = parse_argv(["--model-path", "/m", "--served-model-name", "sglang.launch_server"])
    assert (parsed.model_path, parsed.flags) == ("/m", {"served-model-name": "sglang.launch_server"})


def test_gpugate_check_reads_a_fleet_offline_and_names_the_table(tmp_path):
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("""
hosts:
  pve1:
    ssh: {hostname: pve1.example.net}
    containers:
      129:
        sglang: {model_path: /m, sglang_version: "0.5.23", flags: {tp: 8, kv-cache-dtype: fp4_e2m1}}
      130:
        sglang: {model_path: /m, sglang_version: "0.5.10", flags: {tp: 8, kv-cache-dtype: fp4_e2m1}}
      131:
        sglang: {model_path: /m, flags: {disable-cuda-graph: true}, extra_args: ["--api-key", "sk-secret-1"]}
""")
    out = subprocess.run([sys.executable, "-m", "gpugate.cli", "check", str(fleet)], capture_output=True, text=True)
    assert out.returncode == 1, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("pve1 129 :30000: REFUSED by SGLang 0.5.23 (snapshot, pinned): --kv-cache-dtype: "
                               "'fp4_e2m1' is not one of")
    assert lines[1] == "pve1 130 :30000: ok for SGLang 0.5.10 (snapshot, pinned), 2 flag(s)"
    assert lines[2] == "pve1 131 :30000: ok for SGLang 0.5.23 (the newest snapshot), 1 flag(s)"
    assert "--disable-cuda-graph is deprecated in SGLang 0.5.23" in lines[3]
    assert lines[4] == "    extra_args passed verbatim, unchecked: --api-key ***"
    assert "sk-secret-1" not in out.stdout + out.stderr
    assert lines[-1] == "1 server(s) refused"


# /get_server_info's args as SGLang 0.5.23 reports them (recorded from the lab's stand-in, which
# parses with SGLang's own table): str-declared JSON flags as the argv's text, type=json flags parsed.
RECORDED_SERVER_INFO = {"tp_size": 4, "port": 30000, "json_model_override_args": '{"rope_theta":1000000}',
                        "model_loader_extra_config": '{"enable_multithread_load":true}',
                        "preferred_sampling_params": {"temperature": 0.6}, "api_key": None}


def test_json_text_flags_verify_against_what_sglang_reports():
    from gpugate.spec import build_spec
    spec = build_spec("/m", 30000, {"tp": 4, "json-model-override-args": '{"rope_theta": 1000000}',
                                    "model-loader-extra-config": {"enable_multithread_load": True},
                                    "preferred-sampling-params": '{"temperature": 0.6}'})
    expect = spec.expect_info()
    # the agent's verify: every expected key the server reports must be equal
    wrong = {key: (value, RECORDED_SERVER_INFO[key]) for key, value in expect.items()
             if key in RECORDED_SERVER_INFO and RECORDED_SERVER_INFO[key] != value}
    assert wrong == {}
    assert expect["json_model_override_args"] == '{"rope_theta":1000000}'  # the exact text of the argv
    assert '{"rope_theta":1000000}' in spec.argv
    assert server_info_mismatches(spec.flags, RECORDED_SERVER_INFO) == {}
    # the text SGLang keeps may be spaced otherwise (another writer of the argv): same document
    spaced = dict(RECORDED_SERVER_INFO, json_model_override_args='{"rope_theta": 1000000}')
    assert server_info_mismatches(spec.flags, spaced) == {}
    other = dict(RECORDED_SERVER_INFO, json_model_override_args='{"rope_theta": 500000}')
    assert server_info_mismatches(spec.flags, other) == {
        "json-model-override-args": ({"rope_theta": 1000000}, {"rope_theta": 500000})}


def test_a_json_flag_with_a_secret_key_is_masked_everywhere():
    from gpugate.spec import build_spec
    token = "hf_abcdefSECRET123"
    flags = {"tp": 4, "model-loader-extra-config": '{"hf_token": "%s"}' % token,
             "json-model-override-args": {"rope_theta": 1000000}}
    spec = build_spec("/m", 30000, flags)
    shown = [spec.record(), spec.display_args(), redact_argv(list(spec.argv)),
             redact_argv(["--model-loader-extra-config=" + spec.flags["model-loader-extra-config"]]),
             diff_flags({"tp": 4}, spec.flags).lines(), diff_flags(spec.flags, {"tp": 4}).lines(),
             spec.expect_info(), spec.warnings]
    assert token not in repr(shown)
    assert "--model-loader-extra-config ***" in diff_flags({}, spec.flags).lines()[1]
    assert spec.record()["flags"]["model-loader-extra-config"] == "***"
    # a JSON flag without a secret key still shows (and is verified)
    assert spec.record()["flags"]["json-model-override-args"] == '{"rope_theta":1000000}'
    # the agent masks the value of each flag in secret_flags (argv, journal, server log tails)
    doc = spec.doc()
    assert doc["secret_flags"] == ["--model-loader-extra-config"]
    from gpugate.rules.redact import Redactor, spec_secrets
    log = "server_args=ServerArgs(model_loader_extra_config='%s', tp_size=4)" % spec.flags["model-loader-extra-config"]
    assert token not in Redactor(spec_secrets(doc)).text(log)
    # any case, any depth, any of the words
    for key in ("AWS_SECRET_ACCESS", "password", "Credentials", "authorization", "api_key"):
        assert json_holds_secret({"outer": [{key: "x"}]}), key
    assert not json_holds_secret({"rope_theta": 1, "enable_multithread_load": True})
