"""The lab's pct against pve-container's pct: output formats, error texts, exit codes, exec semantics.

Texts come from proxmox/pve-container src/PVE/CLI/pct.pm (see shared/reference/pct-and-prior-art.md).
"""

from __future__ import annotations

import subprocess

import pytest

from gpugate_lab import container
from gpugate_lab.core import add_container
from gpugate_lab.pct import ParseError, parse_args

STOPPED = 130  # created on pve1 by the module fixture, never started


@pytest.fixture(scope="module")
def stopped_ct(lab):
    add_container(lab.dir, "pve1", STOPPED, start=False)
    return STOPPED


# ---------------------------------------------------------------- pure parsing (no lab)


def test_exec_arguments_after_double_dash_belong_to_the_command():
    assert parse_args("exec", ["129", "--", "ls", "-la", "--", "x"]) == (["129"], {}, ["ls", "-la", "--", "x"])


def test_exec_without_double_dash_fails_on_the_commands_options():
    with pytest.raises(ParseError, match="Unknown option: la"):
        parse_args("exec", ["129", "ls", "-la"])


def test_push_options_take_values():
    assert parse_args("push", ["129", "a", "/b", "--perms", "0600", "--user", "nobody"]) == (
        ["129", "a", "/b"], {"perms": "0600", "user": "nobody"}, [])


def test_config_prints_sorted_keys_and_raw_lxc_lines_last():
    text = "swap: 0\nlxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind\narch: amd64\ndigest: abc\n"
    assert container.format_config(text) == "arch: amd64\nswap: 0\nlxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind\n"


# ---------------------------------------------------------------- errors over SSH




@pytest.mark.lab
@pytest.mark.parametrize("args", [
    ["exec", "999", "--", "true"], ["status", "999"], ["start", "999"], ["stop", "999"], ["config", "999"],
    ["push", "999", "/etc/hostname", "/tmp/x"],
])
def test_unknown_vmid_says_the_config_file_does_not_exist(lab, args):
    result = lab.pct_over_ssh("pve1", *args)
    assert result.returncode == 255
    assert result.stderr == "Configuration file 'nodes/pve1/lxc/999.conf' does not exist\n"
    assert result.stdout == ""


@pytest.mark.lab
def test_exec_on_a_stopped_container_dies_like_pct(lab, stopped_ct):
    result = lab.pct_over_ssh("pve1", "exec", str(stopped_ct), "--", "true")
    assert (result.returncode, result.stderr) == (255, f"container '{stopped_ct}' not running!\n")


@pytest.mark.lab
def test_exec_without_command_dies_with_missing_command(lab):
    result = lab.pct_over_ssh("pve1", "exec", "129")
    assert result.returncode == 255
    assert result.stderr.startswith("missing command at /usr/share/perl5/PVE/CLI/pct.pm line ")


@pytest.mark.lab
def test_exec_without_double_dash_rejects_the_commands_options(lab):
    result = lab.pct_over_ssh("pve1", "exec", "129", "ls", "-la")
    assert result.returncode == 255
    assert result.stderr.splitlines() == [
        "Unknown option: la", "400 unable to parse option", "pct exec <vmid> [<extra-args>] [OPTIONS]"]


@pytest.mark.lab
def test_non_numeric_vmid_fails_parameter_verification(lab):
    result = lab.pct_over_ssh("pve1", "status", "abc")
    assert result.returncode == 255
    assert "vmid: type check ('integer') failed - got 'abc'" in result.stderr


@pytest.mark.lab
def test_power_errors_match_pct(lab, stopped_ct):
    started = lab.pct_over_ssh("pve1", "start", "129")
    stopped = lab.pct_over_ssh("pve1", "stop", str(stopped_ct))
    shut = lab.pct_over_ssh("pve1", "shutdown", str(stopped_ct))
    push = lab.pct_over_ssh("pve1", "push", str(stopped_ct), "/etc/hostname", "/tmp/x")
    pull = lab.pct_over_ssh("pve1", "pull", str(stopped_ct), "/etc/hostname", "/tmp/x")
    assert (started.returncode, started.stderr) == (255, "CT 129 already running\n")
    assert (stopped.returncode, stopped.stderr) == (255, f"CT {stopped_ct} not running\n")
    assert (shut.returncode, shut.stderr) == (255, f"CT {stopped_ct} not running\n")
    assert (push.returncode, push.stderr) == (255, "can only push files to a running CT\n")
    assert pull.returncode == 255 and pull.stderr.startswith("can only pull files from a running VM at ")


# ---------------------------------------------------------------- formats


@pytest.mark.lab
def test_status_prints_one_line(lab, stopped_ct):
    assert lab.pct_over_ssh("pve1", "status", "129").stdout == "status: running\n"
    assert lab.pct_over_ssh("pve1", "status", str(stopped_ct)).stdout == "status: stopped\n"


@pytest.mark.lab
def test_status_verbose_prints_sorted_key_value_lines(lab):
    lines = lab.pct_over_ssh("pve1", "status", "129", "--verbose").stdout.splitlines()
    keys = [line.split(":")[0] for line in lines]
    assert keys == sorted(keys)
    assert "status: running" in lines and "type: lxc" in lines and "name: ct129" in lines


@pytest.mark.lab
def test_list_uses_pcts_fixed_columns(lab, stopped_ct):
    lines = lab.pct_over_ssh("pve1", "list").stdout.splitlines()
    fmt = "%-10s %-10s %-12s %-20s"
    assert lines[0] == fmt % ("VMID", "Status", "Lock", "Name")
    assert fmt % ("129", "running", "", "ct129") in lines
    assert fmt % (str(stopped_ct), "stopped", "", f"ct{stopped_ct}") in lines
    assert [int(line.split()[0]) for line in lines[1:]] == sorted(int(line.split()[0]) for line in lines[1:])


@pytest.mark.lab
def test_config_shows_gpu_passthrough_entries_last(lab):
    lines = lab.pct_over_ssh("pve1", "config", "129").stdout.splitlines()
    plain = [line for line in lines if not line.startswith("lxc.")]
    assert plain == sorted(plain) and "hostname: ct129" in plain
    assert lines[-1].startswith("lxc.mount.entry: /dev/nvidia")


# ---------------------------------------------------------------- exec semantics


@pytest.mark.lab
def test_exec_returns_the_commands_exit_code(lab):
    assert lab.pct_over_ssh("pve1", "exec", "129", "--", "sh", "-c", "exit 7").returncode == 7
    assert lab.pct_over_ssh("pve1", "exec", "129", "--", "sh", "-c", "kill -9 $$").returncode == 128 + 9


@pytest.mark.lab
def test_exec_of_a_missing_program_fails(lab):
    result = lab.pct_over_ssh("pve1", "exec", "129", "--", "no-such-program")
    assert result.returncode == 127
    assert "no-such-program" in result.stderr


@pytest.mark.lab
def test_exec_sets_pcts_path_and_keeps_the_rest_of_the_environment(lab):
    out = lab.ssh("pve1", "FOO=bar pct exec 129 -- sh -c 'echo $PATH; echo $FOO'").stdout
    assert out == "/sbin:/bin:/usr/sbin:/usr/bin\nbar\n"


@pytest.mark.lab
def test_exec_passes_stdin_and_keeps_stderr_apart_without_a_tty(lab):
    result = lab.ssh("pve1", "pct exec 129 -- sh -c 'cat; test -t 0 || echo no-tty >&2'", input="hello\n")
    assert (result.stdout, result.stderr) == ("hello\n", "no-tty\n")


@pytest.mark.lab
def test_exec_with_a_tty_merges_stderr_and_writes_crlf(lab):
    argv = lab.ssh_argv("pve1")
    argv.insert(1, "-tt")
    result = subprocess.run(argv + ["pct exec 129 -- sh -c 'echo out; echo err >&2'"],
                            capture_output=True, stdin=subprocess.DEVNULL, timeout=60)
    assert b"out\r\n" in result.stdout and b"err\r\n" in result.stdout


@pytest.mark.lab
def test_push_and_pull_with_perms_and_owner(lab):
    lab.ssh("pve1", "printf 'payload\\n' > /root/push-src")
    push = lab.pct_over_ssh("pve1", "push", "129", "/root/push-src", "/etc/pushed.conf", "--perms", "0640", "--user", "nobody")
    inside = lab.pct_over_ssh("pve1", "exec", "129", "--", "stat", "-c", "%a %U %s", "/etc/pushed.conf")
    pull = lab.pct_over_ssh("pve1", "pull", "129", "/etc/pushed.conf", "/root/pulled", "--perms", "600")
    host = lab.ssh("pve1", "stat -c '%a' /root/pulled; cat /root/pulled; test -e /etc/pushed.conf || echo absent")
    assert push.returncode == 0, push.stderr
    assert inside.stdout == "640 nobody 8\n"
    assert pull.returncode == 0, pull.stderr
    assert host.stdout == "600\npayload\nabsent\n"


@pytest.mark.lab
def test_push_of_a_missing_file_and_to_a_missing_directory_fail(lab):
    missing = lab.pct_over_ssh("pve1", "push", "129", "/nonexistent", "/tmp/x")
    nodir = lab.pct_over_ssh("pve1", "push", "129", "/etc/hostname", "/no/such/dir/x")
    assert (missing.returncode, missing.stderr) == (255, "failed to open /nonexistent for reading\n")
    assert nodir.returncode == 255
    assert nodir.stderr == "failed to create file: /no/such/dir/x: No such file or directory\n"
