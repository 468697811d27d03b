"""
The @pct connector without a network: the exact command strings it sends to the Proxmox host,
its names and host data, pct's errors told apart from the command's, and the temp file on the
host always removed. The SSH connector's methods are patched, as pyinfra's own
tests/test_connectors/test_dockerssh.py does.
"""

from __future__ import annotations

import io
import json
import shlex
from unittest.mock import patch

import gevent
import pytest
from paramiko import SSHException
from hypothesis import given, settings
from hypothesis import strategies as st
from pyinfra.api import Config, Inventory, State
from pyinfra.api.command import QuoteString, StringCommand
from pyinfra.api.exceptions import ConnectError, InventoryError
from pyinfra.connectors.util import CommandOutput, OutputLine

from gpugate.claims import hand_off_holding_gpu_locks
from gpugate.connectors.pct import (
    CONTAINER_PATH,
    PctConnector,
    classify_pct_error,
    make_pct_exec_command,
    parse_container_listing,
    parse_vmid,
    status_check_error,
)

ENV = f"env -i PATH={CONTAINER_PATH} HOME=/root container=lxc"


def out(stdout: list[str] | tuple = (), stderr: list[str] | tuple = ()) -> CommandOutput:
    return CommandOutput(
        [OutputLine("stdout", line) for line in stdout] + [OutputLine("stderr", line) for line in stderr],
    )


def listing_answer(code: int, *rows: tuple[int, str], lines: tuple[str, ...] = ()) -> CommandOutput:
    """What make_list_command prints: pct list's table (as pct formats it), prefixed."""
    table = [f"{vmid:<10} {status:<10} {'':<12} {f'ct{vmid}':<20}" for vmid, status in rows]
    if rows:
        table.insert(0, f"{'VMID':<10} {'Status':<10} {'Lock':<12} {'Name':<20}")
    return out([f"pct-list-exit: {code}", *(f"| {line}" for line in [*lines, *table])])


class FakeHostShell:
    """Records what the connector runs on the Proxmox host; answers from a list of rules."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []
        self.rules: list[tuple[str, bool, CommandOutput]] = []

    def answer(self, prefix: str, status: bool = True, output: CommandOutput | None = None):
        self.rules.append((prefix, status, output or out()))

    def __call__(self, connector, command, print_output=False, print_input=False, **arguments):
        text = command.get_raw_value() if isinstance(command, StringCommand) else str(command)
        self.calls.append((text, arguments))
        for prefix, status, output in self.rules:
            if text.startswith(prefix):
                return status, output
        if text.startswith("mktemp "):
            return True, out(["/tmp/pyinfra-pct.AbCdEf"])
        if text.startswith("listing=$("):  # connect's `pct list`: container 129 running
            return True, listing_answer(0, (129, "running"))
        if text.startswith("out=$("):  # the per-container status check: a running container
            return True, out(["pct-status-exit: 0", "| status: running"])
        return True, out()

    def as_method(self):
        def run_shell_command(connector, *args, **kwargs):
            return self(connector, *args, **kwargs)

        return run_shell_command

    @property
    def commands(self) -> list[str]:
        return [text for text, _ in self.calls]


@pytest.fixture
def shell():
    fake = FakeHostShell()
    with (
        patch("pyinfra.connectors.ssh.SSHConnector.connect"),
        patch("pyinfra.connectors.ssh.SSHConnector.run_shell_command", fake.as_method()),
    ):
        yield fake


def make_host(name: str = "@pct/pve1:129", **data):
    inventory = Inventory(([(name, data)] if data else [name], {}))
    State(inventory, Config())
    host = inventory.get_host(name)
    return host


def expected_exec(inner: str, prefix: str = "pct exec 129 --") -> str:
    return f"{prefix} {ENV} sh -c {shlex.quote(inner)}"


# Names and host data


def test_name_with_host_and_vmid_targets_that_container():
    host = make_host("@pct/pve1:129")
    assert host.data.ssh_hostname == "pve1"
    assert host.data.pct_vmid == 129
    assert "@pct" in host.groups
    assert host.connector.vmid == 129


def test_local_name_runs_pct_without_ssh():
    from pyinfra.connectors.local import LocalConnector

    host = make_host("@pct/@local:131")
    assert host.data.pct_local is True
    assert isinstance(host.connector.pve, LocalConnector)


def test_alias_name_takes_host_and_vmid_from_host_data():
    host = make_host("@pct/sglang-a", ssh_hostname="pve2", pct_vmid=140)
    assert host.connector.vmid == 140
    assert host.connector.pve_host_name == "pve2"


@pytest.mark.parametrize(
    "name, message",
    [
        ("@pct/pve1:abc", "Invalid vmid 'abc' in @pct/pve1:abc"),
        ("@pct/pve1:99", "Invalid vmid 99 in @pct/pve1:99"),
        ("@pct/pve1:", "No vmid in @pct/pve1:"),
        ("@pct/:129", "No Proxmox host in @pct/:129"),
    ],
)
def test_bad_names_are_inventory_errors_naming_them(name, message):
    with pytest.raises(InventoryError, match=message):
        Inventory(([name], {}))


def test_missing_or_bad_vmid_in_host_data_is_an_inventory_error():
    with pytest.raises(InventoryError, match="No vmid for @pct/ct-a"):
        make_host("@pct/ct-a", ssh_hostname="pve1")
    with pytest.raises(InventoryError, match="Invalid vmid 42 in pct_vmid of @pct/ct-b"):
        make_host("@pct/ct-b", ssh_hostname="pve1", pct_vmid=42)


def test_parse_vmid_rejects_bools_and_accepts_the_proxmox_range():
    assert parse_vmid("999999999", "x") == 999999999
    with pytest.raises(InventoryError):
        parse_vmid(True, "x")
    with pytest.raises(InventoryError):
        parse_vmid("1000000000", "x")


# Commands: the exact strings


def test_plain_command_runs_in_the_container_with_its_own_path(shell):
    host = make_host()
    host.connect()
    status, _ = host.run_shell_command("echo hi")
    assert status is True
    assert shell.commands[-1] == (
        "pct exec 129 -- env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "
        "HOME=/root container=lxc sh -c 'sh -c '\"'\"'echo hi'\"'\"''"
    )
    assert shell.calls[-1][1] == {}  # no pty, no stdin, no sudo on the host


def test_sudo_applies_inside_the_container(shell):
    host = make_host()
    host.connect()
    host.run_shell_command("id -u", _sudo=True, _sudo_user="sglang")
    assert shell.commands[-1] == expected_exec("sudo -H -n -u sglang sh -c 'id -u'")
    assert "_sudo" not in shell.calls[-1][1]


def test_su_user_env_and_chdir_apply_inside_the_container(shell):
    host = make_host()
    host.connect()
    host.run_shell_command("pwd", _su_user="bob", _env={"A": "x y"}, _chdir="/srv/a b")
    inner = "su bob -c " + shlex.quote(
        "sh -c " + shlex.quote("cd '/srv/a b' && export 'A=x y' && pwd"),
    )
    assert shell.commands[-1] == expected_exec(inner)


def test_shell_executable_is_used_inside(shell):
    host = make_host()
    host.connect()
    host.run_shell_command("echo $0", _shell_executable="bash")
    assert shell.commands[-1] == expected_exec("bash -c 'echo $0'")


def test_pty_stdin_timeout_and_exit_codes_go_to_the_host_connection(shell):
    host = make_host()
    host.connect()
    host.run_shell_command(
        "cat", _get_pty=True, _stdin="data", _timeout=5, _success_exit_codes=[0, 3],
    )
    command, arguments = shell.calls[-1]
    assert command == expected_exec("sh -c cat")
    assert arguments == {
        "_get_pty": True,
        "_stdin": "data",
        "_timeout": 5,
        "_success_exit_codes": [0, 3],
    }


def test_pct_itself_runs_with_sudo_when_ssh_user_is_not_root(shell):
    host = make_host("@pct/pve1:129", ssh_user="ops")
    host.connect()
    host.run_shell_command("true", _sudo=True)
    assert shell.commands[-1] == expected_exec(
        "sudo -H -n sh -c true", prefix="sudo -n pct exec 129 --",
    )


def test_pct_sudo_binary_and_env_settings(shell):
    host = make_host(
        "@pct/pve1:129", ssh_user="root", pct_sudo=True, pct_binary="/usr/sbin/pct",
        pct_clear_env=False,
    )
    host.connect()
    host.run_shell_command("true")
    assert shell.commands[-1] == "sudo -n /usr/sbin/pct exec 129 -- sh -c 'sh -c true'"


def test_root_ssh_user_needs_no_sudo(shell):
    host = make_host("@pct/pve1:129", ssh_user="root")
    host.connect()
    host.run_shell_command("true")
    assert shell.commands[-1].startswith("pct exec 129 -- ")


@settings(max_examples=50, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00")))
def test_any_command_text_reaches_the_container_shell_unchanged(command):
    # What the host shell hands to the container's `sh -c` is, after one more parse by the
    # inner `sh -c`, the command itself: two levels of shlex quoting, nothing lost.
    inner = StringCommand("sh", "-c", QuoteString(command))
    host_argv = shlex.split(make_pct_exec_command(129, inner).get_raw_value())
    assert host_argv[:4] == ["pct", "exec", "129", "--"]
    assert host_argv[-3:-1] == ["sh", "-c"]
    assert shlex.split(host_argv[-1]) == ["sh", "-c", command]


# pct's own errors vs the command's


def test_stopped_container_is_reported_as_a_pct_error_not_a_command_failure(shell):
    shell.answer("pct exec", False, out(stderr=["container '129' not running!"]))
    host = make_host()
    host.connect()
    status, output = host.run_shell_command("true", _success_exit_codes=[0, 255])
    assert status is False
    assert output.stderr_lines[-1] == (
        "pct error: container 129 on pve1 is not running: container '129' not running!"
    )


def test_the_commands_own_failure_is_left_as_it_is(shell):
    shell.answer("pct exec", False, out(stderr=["grep: /x: No such file or directory"]))
    host = make_host()
    host.connect()
    status, output = host.run_shell_command("grep a /x")
    assert status is False
    assert output.stderr_lines == ["grep: /x: No such file or directory"]


@pytest.mark.parametrize(
    "line, kind",
    [
        ("sh: 1: pct: not found", "no-pct"),
        ("bash: line 1: pct: command not found", "no-pct"),
        ("sudo: pct: command not found", "no-pct"),
        ("Configuration file 'nodes/pve1/lxc/129.conf' does not exist", "unknown-vmid"),
        ("Error: container '129' not running!", "not-running"),
        ("can only push files to a running CT", "not-running"),
        ("sudo: a password is required", "sudo"),
        ("missing command at /usr/share/perl5/PVE/CLI/pct.pm line 190.", "missing-command"),
    ],
)
def test_pct_error_texts_are_recognised(line, kind):
    failure = classify_pct_error(["some earlier line", line], 129)
    assert failure is not None and failure.kind == kind


def test_other_containers_errors_are_not_ours():
    assert classify_pct_error(["container '130' not running!"], 129) is None


# connect(): one read-only check, distinct errors


def status_answer(code: int, *lines: str) -> CommandOutput:
    return out([f"pct-status-exit: {code}", *(f"| {line}" for line in lines)])


LIST_COMMAND = (
    "listing=$( sudo -n pct list 2>&1); code=$?; echo \"pct-list-exit: $code\"; "
    "printf '%s\\n' \"$listing\" | sed 's/^/| /'"
)
STATUS_COMMAND = (
    "out=$( pct status 129 2>&1); code=$?; echo \"pct-status-exit: $code\"; "
    "printf '%s\\n' \"$out\" | sed 's/^/| /'"
)


def test_connect_checks_the_container_with_one_read_only_command(shell):
    host = make_host("@pct/pve1:129", ssh_user="ops")
    host.connect(raise_exceptions=True)
    assert host.connected
    assert shell.commands == [LIST_COMMAND]


@pytest.mark.parametrize(
    "listing, answer, message",
    [
        (
            listing_answer(0, (129, "stopped")),
            status_answer(0, "status: stopped"),
            "container 129 on pve1 is not running: status: stopped",
        ),
        (
            listing_answer(0, (130, "running")),
            status_answer(2, "Configuration file 'nodes/pve1/lxc/129.conf' does not exist"),
            "no container 129 on pve1",
        ),
        (
            listing_answer(127, lines=("sh: 1: pct: not found",)),
            status_answer(127, "sh: 1: pct: not found"),
            "no `pct` command on pve1",
        ),
        (
            listing_answer(1, lines=("sudo: a password is required",)),
            status_answer(1, "sudo: a password is required"),
            "cannot run pct with sudo on pve1",
        ),
    ],
)
def test_connect_errors_name_host_and_vmid(shell, listing, answer, message):
    # a container the host's listing does not show running gets its own `pct status`, which says why
    shell.answer("listing=$(", True, listing)
    shell.answer("out=$(", True, answer)
    host = make_host()
    with pytest.raises(ConnectError, match=message):
        host.connect(raise_exceptions=True)
    assert not host.connected
    assert shell.commands[-1] == STATUS_COMMAND


def test_status_check_error_on_unexpected_output_says_what_pct_printed():
    message = status_check_error(["pct-status-exit: 13", "| something odd"], "pve1", 129, "pct")
    assert message == "pct error: `pct status 129` on pve1 failed (exit 13): something odd"


# Files: pct push/pull through a temp file on the host, always removed


@pytest.fixture
def connected_host(shell):
    host = make_host()
    host.connect(raise_exceptions=True)
    shell.calls.clear()
    return host


def test_put_file_pushes_through_a_host_temp_file_removed_in_the_same_command(shell, connected_host):
    with patch("pyinfra.connectors.ssh.SSHConnector.put_file", return_value=True) as sftp_put:
        assert connected_host.put_file(io.BytesIO(b"\x00\xff"), "/etc/a b.conf") is True
    sftp_put.assert_called_once()
    assert sftp_put.call_args.args[1] == "/tmp/pyinfra-pct.AbCdEf"
    assert shell.commands == [
        'mktemp "${TMPDIR:-/tmp}/pyinfra-pct.XXXXXXXXXX"',
        "pct push 129 /tmp/pyinfra-pct.AbCdEf '/etc/a b.conf' ; status=$?; "
        "rm -f /tmp/pyinfra-pct.AbCdEf ; exit $status",
    ]


def test_put_file_as_su_user_gives_the_file_to_that_user(shell, connected_host):
    with patch("pyinfra.connectors.ssh.SSHConnector.put_file", return_value=True):
        connected_host.put_file(io.BytesIO(b"x"), "/home/bob/f", _su_user="bob")
    assert "pct push 129 /tmp/pyinfra-pct.AbCdEf /home/bob/f --user bob ;" in shell.commands[-1]


def test_put_file_removes_the_temp_file_when_the_upload_fails(shell, connected_host):
    with patch("pyinfra.connectors.ssh.SSHConnector.put_file", side_effect=OSError("sftp broke")):
        with pytest.raises(OSError, match="sftp broke"):
            connected_host.put_file(io.BytesIO(b"x"), "/etc/x")
    assert shell.commands[-1] == "rm -f /tmp/pyinfra-pct.AbCdEf"


def test_put_file_failure_of_push_is_an_error_and_leaves_no_temp_file(shell, connected_host):
    # pct push's worker can fail with exit 0: its stderr line counts.
    shell.answer("pct push", True, out(stderr=["failed to create file: /nodir/x: No such file"]))
    with patch("pyinfra.connectors.ssh.SSHConnector.put_file", return_value=True):
        with pytest.raises(OSError, match="pct push in container 129 on pve1: failed to create"):
            connected_host.put_file(io.BytesIO(b"x"), "/nodir/x")
    # the push command itself removed the temp file; no second rm needed
    assert shell.commands[-1].startswith("pct push") and "rm -f /tmp/pyinfra-pct.AbCdEf" in shell.commands[-1]


def test_put_file_into_a_stopped_container_says_so(shell, connected_host):
    shell.answer("pct push", False, out(stderr=["can only push files to a running CT"]))
    with patch("pyinfra.connectors.ssh.SSHConnector.put_file", return_value=True):
        with pytest.raises(OSError, match="container 129 on pve1 is not running"):
            connected_host.put_file(io.BytesIO(b"x"), "/etc/x")


def test_get_file_pulls_into_a_host_temp_file_then_removes_it(shell, connected_host):
    shell.answer("temp=$(", True, out(["/tmp/pyinfra-pct.PuLlEd"]))
    with patch("pyinfra.connectors.ssh.SSHConnector.get_file", return_value=True) as sftp_get:
        assert connected_host.get_file("/etc/it's", "local-copy") is True
    sftp_get.assert_called_once_with("/tmp/pyinfra-pct.PuLlEd", "local-copy")
    assert shell.commands == [
        'temp=$(mktemp "${TMPDIR:-/tmp}/pyinfra-pct.XXXXXXXXXX") && echo "$temp" && '
        "pct pull 129 '/etc/it'\"'\"'s' \"$temp\"",
        "rm -f /tmp/pyinfra-pct.PuLlEd",
    ]


def test_get_file_removes_the_temp_file_when_the_download_fails(shell, connected_host):
    shell.answer("temp=$(", True, out(["/tmp/pyinfra-pct.PuLlEd"]))
    with patch("pyinfra.connectors.ssh.SSHConnector.get_file", side_effect=OSError("sftp broke")):
        with pytest.raises(OSError, match="sftp broke"):
            connected_host.get_file("/etc/x", io.BytesIO())
    assert shell.commands[-1] == "rm -f /tmp/pyinfra-pct.PuLlEd"


def test_get_file_of_a_missing_file_fails_and_removes_the_temp_file(shell, connected_host):
    shell.answer(
        "temp=$(", False, out(["/tmp/pyinfra-pct.PuLlEd"], ["failed to open /etc/nope: No such file"]),
    )
    with patch("pyinfra.connectors.ssh.SSHConnector.get_file") as sftp_get:
        with pytest.raises(OSError, match="pct pull in container 129 on pve1: failed to open"):
            connected_host.get_file("/etc/nope", io.BytesIO())
    sftp_get.assert_not_called()
    assert shell.commands[-1] == "rm -f /tmp/pyinfra-pct.PuLlEd"


# @local: the same commands, run on this machine


def test_local_variant_runs_the_same_commands_locally():
    fake = FakeHostShell()
    with patch("pyinfra.connectors.local.LocalConnector.run_shell_command", fake.as_method()):
        host = make_host("@pct/@local:129", pct_sudo=False)
        host.connect(raise_exceptions=True)
        host.run_shell_command("hostname")
    assert fake.commands[-1] == expected_exec("sh -c hostname")


def test_messages_name_the_host_as_the_user_named_it(shell):
    # the lab (and ssh configs) point every name at 127.0.0.1; errors still say pve1
    shell.answer("listing=$(", True, listing_answer(0, (129, "stopped")))
    shell.answer("out=$(", True, status_answer(0, "status: stopped"))
    host = make_host("@pct/pve1:129", ssh_hostname="127.0.0.1")
    with pytest.raises(ConnectError, match="container 129 on pve1 is not running"):
        host.connect(raise_exceptions=True)


# One SSH connection and one `pct list` per Proxmox host, shared by its containers


class FakeClient:
    """Stands for the paramiko client pyinfra's SSH connector makes (one per real connect)."""

    def __init__(self, settings: tuple):
        self.settings = settings
        self.closed = False
        self.active = True

    def get_transport(self):
        client = self

        class Transport:
            def is_active(self):
                return client.active and not client.closed

        return Transport()

    def close(self):
        self.closed = True


class FakeSSH:
    """Patches pyinfra's SSH connector: records every real connect; a port can be made to fail."""

    def __init__(self):
        self.shell = FakeHostShell()
        self.clients: list[FakeClient] = []
        self.failing_ports: set[int] = set()

    def connect(self, connector):
        gevent.sleep(0.01)  # a handshake takes time: the other containers' greenlets run meanwhile
        port = connector.data["ssh_port"]
        if port in self.failing_ports:
            raise ConnectError(f"Could not connect ([Errno 111] Connection refused: port {port})")
        connector.client = FakeClient(connector.settings_key)
        self.clients.append(connector.client)

    def run_shell_command(self, connector, *args, **kwargs):
        gevent.sleep(0.005)  # one round trip: a command from another greenlet may run meanwhile
        return self.shell(connector, *args, **kwargs)

    def count(self, prefix: str) -> int:
        return sum(1 for command in self.shell.commands if command.startswith(prefix))


@pytest.fixture
def ssh():
    fake = FakeSSH()
    with (
        patch("pyinfra.connectors.ssh.SSHConnector.connect", lambda self: fake.connect(self)),
        patch(
            "pyinfra.connectors.ssh.SSHConnector.run_shell_command",
            lambda self, *a, **k: fake.run_shell_command(self, *a, **k),
        ),
    ):
        yield fake


def make_fleet(*hosts: tuple[str, dict]):
    inventory = Inventory((list(hosts), {}))
    State(inventory, Config())
    return [inventory.get_host(name) for name, _ in hosts]


def connect_concurrently(hosts) -> None:
    """As pyinfra's connect_all does: one greenlet per host."""
    gevent.joinall([gevent.spawn(host.connect) for host in hosts], raise_error=True)


def test_containers_of_one_host_share_one_ssh_connection_and_one_pct_list(ssh):
    ssh.shell.answer("listing=$(", True, listing_answer(0, *[(v, "running") for v in (129, 130, 131, 132)]))
    hosts = make_fleet(*[(f"@pct/pve1:{vmid}", {"ssh_port": 22}) for vmid in (129, 130, 131, 132)])
    connect_concurrently(hosts)
    assert all(host.connected for host in hosts)
    assert len(ssh.clients) == 1
    assert {id(host.connector.pve.client) for host in hosts} == {id(ssh.clients[0])}
    assert ssh.shell.commands == [LIST_COMMAND.replace("sudo -n ", "")]


def test_hosts_with_different_ssh_settings_never_share(ssh):
    ssh.shell.answer("listing=$(", True, listing_answer(0, (129, "running"), (130, "running")))
    hosts = make_fleet(
        ("@pct/pve1:129", {"ssh_port": 22}),
        ("@pct/pve1:130", {"ssh_port": 22, "ssh_user": "root"}),
        ("@pct/pve2:129", {"ssh_port": 22}),
        ("@pct/pve-key:129", {"ssh_hostname": "pve1", "pct_vmid": 129, "ssh_known_hosts_file": "/x"}),
    )
    connect_concurrently(hosts)
    assert len(ssh.clients) == 4
    assert ssh.count("listing=$(") == 4


def test_a_host_that_cannot_be_reached_fails_only_its_own_containers(ssh, caplog):
    ssh.failing_ports.add(2222)
    ssh.shell.answer("listing=$(", True, listing_answer(0, (129, "running"), (130, "running")))
    bad = make_fleet(*[(f"@pct/pve1:{vmid}", {"ssh_port": 2222}) for vmid in (129, 130)])
    good = make_fleet(*[(f"@pct/pve1:{vmid}", {"ssh_port": 22}) for vmid in (129, 130)])
    connect_concurrently(bad + good)  # one State each; pyinfra logs the errors
    assert [host.connected for host in bad + good] == [False, False, True, True]
    errors = [r.getMessage() for r in caplog.records if "Could not connect" in r.getMessage()]
    assert len(errors) == 2 and {e.split("]")[0] for e in errors} == {"[@pct/pve1:129", "[@pct/pve1:130"}
    assert len(ssh.clients) == 1  # the failed handshake was tried once for both of its containers
    # the failure is not remembered: the next connect tries again (and now gets through)
    ssh.failing_ports.clear()
    bad[0].connect(raise_exceptions=True)
    assert bad[0].connected and len(ssh.clients) == 2


def test_a_failed_connection_in_the_same_state_does_not_poison_the_others(ssh):
    ssh.failing_ports.add(2222)
    ssh.shell.answer("listing=$(", True, listing_answer(0, (129, "running"), (130, "running")))
    hosts = make_fleet(
        ("@pct/pve1:129", {"ssh_port": 2222}),
        ("@pct/pve1:130", {"ssh_port": 22}),
        ("@pct/pve2:129", {"ssh_port": 22}),
    )
    connect_concurrently(hosts)
    assert [host.connected for host in hosts] == [False, True, True]


def test_four_containers_share_a_connection_by_default_and_pct_ssh_share_changes_it(ssh):
    vmids = range(129, 134)
    ssh.shell.answer("listing=$(", True, listing_answer(0, *[(v, "running") for v in vmids]))
    connect_concurrently(make_fleet(*[(f"@pct/pve1:{v}", {}) for v in vmids]))
    assert len(ssh.clients) == 2  # sshd's MaxSessions (10) allows 4 containers x 2 sessions
    assert ssh.count("listing=$(") == 1  # one listing per Proxmox host, whatever the connections
    ssh.clients.clear()
    connect_concurrently(make_fleet(*[(f"@pct/pve1:{v}", {"pct_ssh_share": 1}) for v in vmids]))
    assert len(ssh.clients) == 5


def test_bad_pct_ssh_share_is_an_inventory_error():
    with pytest.raises(InventoryError, match="Invalid pct_ssh_share 0 of @pct/pve1:129"):
        make_host("@pct/pve1:129", pct_ssh_share=0)


def test_the_last_container_to_disconnect_closes_the_connection_and_forgets_the_listing(ssh):
    ssh.shell.answer("listing=$(", True, listing_answer(0, (129, "running"), (130, "running")))
    first, second = make_fleet(("@pct/pve1:129", {}), ("@pct/pve1:130", {}))
    connect_concurrently([first, second])
    client = ssh.clients[0]
    first.disconnect()
    assert not client.closed
    second.run_shell_command("true")  # the other container goes on over it
    second.disconnect()
    assert client.closed
    first.connect(raise_exceptions=True)  # a new connection, and a fresh listing
    assert len(ssh.clients) == 2 and ssh.count("listing=$(") == 2


def test_a_dropped_connection_is_not_handed_out_again(ssh):
    ssh.shell.answer("listing=$(", True, listing_answer(0, (129, "running"), (130, "running")))
    first, second = make_fleet(("@pct/pve1:129", {}), ("@pct/pve1:130", {}))
    first.connect(raise_exceptions=True)
    ssh.clients[0].active = False  # the network dropped it
    second.connect(raise_exceptions=True)
    assert len(ssh.clients) == 2 and second.connector.pve.client is ssh.clients[1]


def test_a_container_that_fails_its_check_gives_back_its_share(ssh):
    ssh.shell.answer("listing=$(", True, listing_answer(0, (129, "running")))
    ssh.shell.answer("out=$(", True, status_answer(0, "status: stopped"))
    running, stopped = make_fleet(("@pct/pve1:129", {}), ("@pct/pve1:130", {}))
    connect_concurrently([running, stopped])
    assert running.connected and not stopped.connected
    running.disconnect()  # the stopped container holds no share: the connection closes now
    assert ssh.clients[0].closed


def test_only_containers_not_listed_running_get_their_own_pct_status(ssh):
    ssh.shell.answer("listing=$(", True, listing_answer(0, (129, "running"), (130, "stopped")))
    ssh.shell.answer("out=$( pct status 130", True, status_answer(0, "status: stopped"))
    hosts = make_fleet(("@pct/pve1:129", {}), ("@pct/pve1:130", {}), ("@pct/pve1:131", {}))
    ssh.shell.answer("out=$( pct status 131", True, status_answer(0, "status: running"))  # started since
    connect_concurrently(hosts)
    assert [host.connected for host in hosts] == [True, False, True]
    assert sorted(c for c in ssh.shell.commands if c.startswith("out=$(")) == [
        STATUS_COMMAND.replace("129", "130"),
        STATUS_COMMAND.replace("129", "131"),
    ]


def test_an_unreadable_listing_falls_back_to_pct_status_for_each_container(ssh):
    ssh.shell.answer("listing=$(", True, out(["pct-list-exit: 0", "| something that is not a table"]))
    hosts = make_fleet(("@pct/pve1:129", {}), ("@pct/pve1:130", {}))
    connect_concurrently(hosts)
    assert all(host.connected for host in hosts)
    assert ssh.count("listing=$(") == 1 and ssh.count("out=$(") == 2


@pytest.mark.parametrize(
    "lines, statuses",
    [
        (["pct-list-exit: 0", "|"], {}),  # pct list prints nothing when the host has no container
        (
            [
                "pct-list-exit: 0",
                "| sudo: unable to resolve host pve1: Name or service not known",
                "| VMID       Status     Lock         Name                ",
                "| 129        running                                     ",
                "| 1234567890 stopped    backup       a-very-long-container-name",
            ],
            {129: "running", 1234567890: "stopped"},
        ),
        (["pct-list-exit: 255", "| ipcc_send_rec[1] failed: Connection refused"], None),
        (["pct-list-exit: 0", "| VMID Status", "| ??? running"], None),
        (["no marker at all"], None),
    ],
)
def test_parse_container_listing(lines, statuses):
    assert parse_container_listing(lines) == statuses


# The GPU locks and the hand-off in one round trip (gpugate.claims.hand_off_holding_gpu_locks), over the
# connector's host-command path: what it sends to the Proxmox host and how pct's failures come back


def hand_off(host, gpus, run, command, stdin):
    """-> (locked, message, started), the claim's answer, and the claim itself."""
    claim = hand_off_holding_gpu_locks(host.connector, gpus, run, command, stdin)
    return claim.locked, claim.message, claim.started, claim


def holder_answer(stderr: tuple[str, ...] = (), **fields) -> CommandOutput:
    return out([json.dumps(fields)], stderr)


def connected_129(ssh):
    [host] = make_fleet(("@pct/pve1:129", {"ssh_port": 22}))
    host.connect(raise_exceptions=True)
    return host


def test_the_locks_and_the_hand_off_are_one_host_command_whose_start_is_wrapped_as_any_command(ssh):
    host = connected_129(ssh)
    host.run_shell_command("start-command")
    [pct_exec] = [c for c in ssh.shell.commands if c.startswith("pct exec")]
    started_answer = '{"ok": true, "run": "r1", "pid": 9}\n'
    ssh.shell.answer("python3 -S -c", True, holder_answer(ok=True, pid=7, released=[], handoff_until=100.0,
                                                           start={"rc": 0, "stdout": started_answer}))
    before = len(ssh.shell.calls)
    locked, message, started, claim = hand_off(host, [1, 0], "r1", "start-command", '{"run": "r1"}')
    [(text, arguments)] = ssh.shell.calls[before:]  # ONE round trip
    assert locked and message.startswith("holding the locks of GPU 0-1 of pve1 for run r1 (holder pid 7")
    assert started[0] is True and started[1].stdout_lines == [started_answer.strip()]
    assert arguments["_stdin"] == '{"run": "r1"}'
    args = json.loads(shlex.split(text)[-1])
    assert args["gpus"] == [0, 1] and args["run"] == "r1" and args["pct"] == ["pct"]
    # the container runs exactly what run_shell_command would have run there
    assert args["start"]["command"] == shlex.split(pct_exec)[-1]
    assert claim.until == 100.0 and host.connector.last_failure is None


def test_a_stopped_container_at_the_hand_off_is_the_same_pct_error_as_any_command(ssh):
    host = connected_129(ssh)
    ssh.shell.answer("python3 -S -c", True, holder_answer(("container '129' not running!",), ok=True, pid=7,
                                                          released=[], handoff_until=100.0,
                                                          start={"rc": 255, "stdout": ""}))
    locked, _message, (status, output), _claim = hand_off(host, [0], "r1", "start", "{}")
    assert locked and status is False
    assert output.stderr_lines[-1] == "pct error: container 129 on pve1 is not running: container '129' not running!"
    assert host.connector.last_failure.kind == "not-running"


def test_a_busy_claim_runs_no_hand_off_and_says_whose_it_is(ssh):
    host = connected_129(ssh)
    ssh.shell.answer("python3 -S -c", True, holder_answer(ok=False, gpu=3, owner={"vmid": 130, "run": "r0",
                                                                                  "gpus": [3]}, began=True))
    locked, message, started, claim = hand_off(host, [3], "r1", "start", "{}")
    assert (locked, started) == (False, None)
    assert message.startswith("GPU 3 of pve1 is claimed by container 130 (run r0, GPU 3)")
    assert claim.began is True


def test_a_link_lost_during_the_hand_off_may_have_handed_off_and_says_it_is_the_link(ssh):
    host = connected_129(ssh)

    def cut(connector, command, **arguments):  # the SSH connection drops before any answer
        ssh.clients[0].active = False
        return False, out()

    original, ssh.run_shell_command = ssh.run_shell_command, cut
    try:
        locked, _message, (status, output), _claim = hand_off(host, [0], "r1", "start", "{}")
    finally:
        ssh.run_shell_command = original
    assert locked and status is False  # the holder, and so the hand-off, may have run
    assert host.connector.last_failure.kind == "link-lost"
    assert output.stderr_lines[-1].startswith("pct error: the SSH connection to the Proxmox host pve1 was lost")



def test_under_sudo_the_lock_holder_runs_as_root_through_the_host_command_path(ssh):
    """The holder (gpugate.claims) goes through run_on_proxmox_host as any host command: with sudo
    where pct needs it; the pct it runs itself is pct's own argv."""
    [host] = make_fleet(("@pct/pve1:129", {"ssh_port": 22, "ssh_user": "ops"}))
    host.connect(raise_exceptions=True)
    ssh.shell.answer("python3 -S -c", True, holder_answer(ok=True, pid=7, released=[], handoff_until=100.0,
                                                           start={"rc": 0, "stdout": "{}"}))
    before = len(ssh.shell.calls)
    locked, _message, _started, _claim = hand_off(host, [0], "r1", "start", "{}")
    [(text, arguments)] = ssh.shell.calls[before:]
    assert locked and arguments["_sudo"] is True and text.startswith("python3 -S -c ")
    assert json.loads(shlex.split(text)[-1])["pct"] == ["sudo", "-n", "pct"]


def test_the_connector_is_transport_only():
    """pct.py imports nothing of gpugate but the settings' rows: the GPU claims and the agent's
    commands live where the desired state does (gpugate.claims), above it."""
    import ast
    from pathlib import Path

    import gpugate.connectors.pct as pct

    imported = {node.module for node in ast.walk(ast.parse(Path(pct.__file__).read_text()))
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gpugate")}
    imported |= {alias.name for node in ast.walk(ast.parse(Path(pct.__file__).read_text()))
                 if isinstance(node, ast.Import) for alias in node.names if alias.name.startswith("gpugate")}
    assert imported == {"gpugate.settings"}


@pytest.mark.parametrize("error", [SSHException("Channel is not open"), EOFError(), ConnectionResetError(104, "reset")])
def test_a_channel_refused_just_after_the_host_went_away_is_the_link(ssh, error):
    """CI: sshd of a lab host killed mid rolling change; paramiko's transport still looked active for
    a moment and refused the next command's channel ("Channel is not open"): the operator must read
    that the link to the Proxmox host went, not "no answer from the container"."""
    host = connected_129(ssh)

    def refuse(connector, command, **arguments):  # the transport has not noticed yet: still "active"
        raise error

    original, ssh.run_shell_command = ssh.run_shell_command, refuse
    try:
        with pytest.raises(type(error)):
            host.run_shell_command("observe")
    finally:
        ssh.run_shell_command = original
    assert ssh.clients[0].active and host.connector.last_failure.kind == "link-lost"


def test_a_command_timeout_is_not_taken_for_a_lost_link(ssh):
    host = connected_129(ssh)

    def slow(connector, command, **arguments):
        raise TimeoutError("timed out")

    original, ssh.run_shell_command = ssh.run_shell_command, slow
    try:
        with pytest.raises(TimeoutError):
            host.run_shell_command("observe")
    finally:
        ssh.run_shell_command = original
    assert host.connector.last_failure is None

# pct_connect_check false: connect runs no check, the first command is it (a run of deploy.py alone)


def status_answer_stopped() -> CommandOutput:
    return out(["pct-status-exit: 0", "| status: stopped"])


def test_without_the_connect_check_connect_sends_nothing_and_a_running_container_just_runs(shell):
    host = make_host("@pct/pve1:129", pct_connect_check=False)
    host.connect(raise_exceptions=True)
    assert shell.commands == []
    status, _ = host.run_shell_command("hostname")
    assert status and [c.split(" ")[:2] for c in shell.commands] == [["pct", "exec"]]
    assert host.connector.unavailable is None


@pytest.mark.parametrize("stderr, status_output, message", [
    ("container '129' not running!", status_answer_stopped(),
     "pct error: container 129 on pve1 is not running: status: stopped"),
    ("Configuration file 'nodes/pve1/lxc/129.conf' does not exist",
     out(["pct-status-exit: 2", "| Configuration file 'nodes/pve1/lxc/129.conf' does not exist"]),
     "pct error: no container 129 on pve1: Configuration file 'nodes/pve1/lxc/129.conf' does not exist"),
])
def test_without_the_connect_check_the_first_command_says_what_connect_would_have(shell, stderr, status_output,
                                                                                  message):
    shell.answer("pct exec", False, out(stderr=[stderr]))
    shell.answer("out=$(", True, status_output)
    host = make_host("@pct/pve1:129", pct_connect_check=False)
    host.connect(raise_exceptions=True)
    status, output = host.run_shell_command("true")
    assert status is False and output.stderr_lines[-1] == message
    assert host.connector.unavailable == message
    # exactly what connect says with its check on
    checked = make_host("@pct/pve1:129")
    shell.answer("listing=$(", True, listing_answer(0))
    with pytest.raises(ConnectError) as raised:
        checked.connect(raise_exceptions=True)
    assert raised.value.args[0] == message
    # the pct status is asked once; a second command fails with the same line and asks nothing more
    asked = sum(1 for c in shell.commands if c.startswith("out=$("))
    assert host.run_shell_command("true")[1].stderr_lines[-1] == message
    assert sum(1 for c in shell.commands if c.startswith("out=$(")) == asked


def test_without_the_connect_check_a_commands_own_failure_stays_its_own(shell):
    shell.answer("pct exec", False, out(stderr=["grep: /x: No such file or directory"]))
    host = make_host("@pct/pve1:129", pct_connect_check=False)
    host.connect(raise_exceptions=True)
    status, output = host.run_shell_command("grep a /x")
    assert status is False and output.stderr_lines == ["grep: /x: No such file or directory"]
    assert host.connector.unavailable is None and not any(c.startswith("out=$(") for c in shell.commands)
