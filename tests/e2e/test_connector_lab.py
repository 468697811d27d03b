"""
The @pct connector end to end against the lab: a real sshd per simulated Proxmox host, the lab's
`pct` over real PID/mount/UTS namespaces. Run: pytest -m lab tests/e2e/test_connector_lab.py

Also a measurement (not a test): python tests/e2e/test_connector_lab.py --bench [N]
"""

from __future__ import annotations

import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from unittest.mock import patch

import gevent
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pyinfra.api import Config, Inventory, State
from pyinfra.api.command import QuoteString, StringCommand
from pyinfra.api.exceptions import ConnectError
from pyinfra.connectors.ssh import SSHConnector

from gpugate.connectors.pct import PctConnector
from tests import warm_pyinfra
from tests.conftest import pyinfra_exe

pytestmark = pytest.mark.lab

RUNNING_VMID = 129
STOPPED_VMID = 130
UNKNOWN_VMID = 999
NEIGHBOUR_VMIDS = (131, 132)  # running too: containers that share pve1's SSH connection


# The lab: our own directory, one host, a running and a stopped container
#


def _lab_core():
    return pytest.importorskip("gpugate_lab.core")


def start_lab(lab_dir: Path) -> dict:
    core = _lab_core()
    state = core.up(lab_dir, hosts=1, gpus=1, vmids=(RUNNING_VMID, STOPPED_VMID, *NEIGHBOUR_VMIDS))
    host = state["hosts"][0]
    statuses = {c["vmid"]: c["status"] for c in host["containers"]}
    for vmid in (RUNNING_VMID, *NEIGHBOUR_VMIDS):
        if statuses.get(vmid) != "running":
            on_host(lab_dir, ["pct", "start", str(vmid)])
    if statuses.get(STOPPED_VMID) == "running":
        on_host(lab_dir, ["pct", "stop", str(STOPPED_VMID)])
    return host


def on_host(lab_dir: Path, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    """Run argv on the lab host pve1 itself (its namespaces), not through the connector."""
    core = _lab_core()
    return subprocess.run(
        core.host_exec_argv(lab_dir, "pve1") + argv, capture_output=True, check=False, **kwargs,
    )


def remove_lab_dir(lab_dir: Path) -> None:
    # The lab's last processes may still write logs for a moment after `down`.
    deadline = time.monotonic() + 5
    while lab_dir.exists() and time.monotonic() < deadline:
        shutil.rmtree(lab_dir, ignore_errors=True)
        time.sleep(0.05)


@pytest.fixture(scope="module")
def lab():
    if os.geteuid() != 0:
        pytest.skip("the lab needs root")
    lab_dir = Path(os.environ.get("GPUGATE_CONNECTOR_LAB_DIR", f"/tmp/lab-connector-e2e-{os.getpid()}"))
    host = start_lab(lab_dir)
    yield lab_dir, host
    _lab_core().down(lab_dir)
    if "GPUGATE_CONNECTOR_LAB_DIR" not in os.environ:
        remove_lab_dir(lab_dir)


def ssh_data(lab_dir: Path, host: dict) -> dict:
    return {
        "ssh_hostname": "127.0.0.1",
        "ssh_port": host["port"],
        "ssh_user": "root",
        "ssh_key": str(lab_dir / "id_ed25519"),
        "ssh_known_hosts_file": str(lab_dir / "known_hosts"),
        "ssh_strict_host_key_checking": "yes",
    }


@pytest.fixture(scope="module")
def inventory_file(lab, tmp_path_factory):
    lab_dir, host = lab
    path = tmp_path_factory.mktemp("inv") / "inventory.py"
    path.write_text(
        textwrap.dedent(
            f"""
            _ssh = {ssh_data(lab_dir, host)!r}
            containers = [
                ("@pct/pve1:{RUNNING_VMID}", dict(_ssh)),
                ("@pct/pve1:{STOPPED_VMID}", dict(_ssh)),
                ("@pct/pve1:{UNKNOWN_VMID}", dict(_ssh)),
            ]
            """,
        ),
    )
    return path


def pyinfra(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return warm_pyinfra.run([pyinfra_exe(), "-y", *args], cwd=cwd or tempfile.gettempdir(), env=os.environ,
                            timeout=120)


def only_running(inventory_file: Path) -> list[str]:
    return [str(inventory_file), "--limit", f"@pct/pve1:{RUNNING_VMID}"]


@pytest.fixture(scope="module")
def container_host(lab):
    """One connected State/host for many commands (hypothesis reuses it)."""
    lab_dir, host = lab
    name = f"@pct/pve1:{RUNNING_VMID}"
    inventory = Inventory(([(name, ssh_data(lab_dir, host))], {}))
    State(inventory, Config())
    target = inventory.get_host(name)
    target.connect(raise_exceptions=True)
    assert isinstance(target.connector, PctConnector)
    assert run_in(target, "mkdir -p /srv/gpugate-e2e/fuzz")[0]
    yield target
    target.disconnect()


def run_in(target, command: str | StringCommand, **kwargs) -> tuple[bool, list[str], list[str]]:
    status, output = target.run_shell_command(command, **kwargs)
    return status, output.stdout_lines, output.stderr_lines


# The CLI: exec, files, deploy
#


def test_exec_runs_in_the_container_not_on_the_host(lab, inventory_file):
    lab_dir, _ = lab
    result = pyinfra(*only_running(inventory_file), "exec", "--", "cat /proc/1/cmdline; echo; hostname")
    assert result.returncode == 0, result.stderr
    host_init = on_host(lab_dir, ["cat", "/proc/1/cmdline"]).stdout.split(b"\0")[0].decode()
    lines = [line.split("] ", 1)[1] for line in result.stderr.splitlines() if line.startswith("[@pct/pve1:129] ")]
    assert lines[0].startswith("/sbin/init")
    assert host_init and not lines[0].startswith(host_init)
    assert f"ct{RUNNING_VMID}" in lines


def test_connect_errors_are_distinct_and_the_running_container_goes_on(inventory_file):
    result = pyinfra(str(inventory_file), "exec", "--", "hostname")
    out = result.stderr
    assert f"[@pct/pve1:{STOPPED_VMID}] pct error: container {STOPPED_VMID} on pve1 is not running" in out
    assert f"[@pct/pve1:{UNKNOWN_VMID}] pct error: no container {UNKNOWN_VMID} on pve1" in out
    assert f"[@pct/pve1:{RUNNING_VMID}] ct{RUNNING_VMID}" in out


def test_no_pct_on_the_host_is_its_own_error(lab, tmp_path):
    lab_dir, host = lab
    data = {**ssh_data(lab_dir, host), "pct_binary": "pct-missing"}
    inv = tmp_path / "inv.py"
    inv.write_text(f"hosts = [('@pct/pve1:{RUNNING_VMID}', {data!r})]\n")
    result = pyinfra(str(inv), "exec", "--", "true")
    assert "pct error: no `pct` command on pve1" in result.stderr


def test_files_put_lands_in_the_container_and_not_on_the_host(lab, inventory_file, tmp_path, container_host):
    lab_dir, _ = lab
    src = tmp_path / "payload.bin"
    src.write_bytes(bytes(range(256)) * 4)
    dest = "/srv/gpugate-e2e/put/payload.bin"
    result = pyinfra(*only_running(inventory_file), "files.put", f"src={src}", f"dest={dest}")
    assert result.returncode == 0, result.stderr
    status, stdout, _ = run_in(container_host, f"od -An -v -tx1 {dest} | tr -d ' \\n'")
    assert status and "".join(stdout) == src.read_bytes().hex()
    assert on_host(lab_dir, ["test", "-e", dest]).returncode == 1
    leftovers = on_host(lab_dir, ["sh", "-c", "ls ${TMPDIR:-/tmp} | grep -c pyinfra-pct || true"])
    assert leftovers.stdout.strip() == b"0"


DEPLOY = """
from io import StringIO
from pyinfra.operations import files, server

files.put(name="config file", src=StringIO("flag = 1\\n"), dest="/srv/gpugate-e2e/deploy/app.conf", mode="640")
files.template(
    name="unit from a template",
    src={template!r},
    dest="/srv/gpugate-e2e/deploy/unit.txt",
    port=30000,
)
"""


def test_deploy_puts_and_templates_then_reports_no_changes(lab, inventory_file, tmp_path, container_host):
    template = tmp_path / "unit.j2"
    template.write_text("host={{ host.name }} port={{ port }}\n")
    deploy = tmp_path / "deploy.py"
    deploy.write_text(DEPLOY.format(template=str(template)))
    first = pyinfra(*only_running(inventory_file), str(deploy))
    assert first.returncode == 0, first.stderr
    assert f"[@pct/pve1:{RUNNING_VMID}] Success" in first.stderr
    status, stdout, _ = run_in(
        container_host,
        "stat -c %a /srv/gpugate-e2e/deploy/app.conf; cat /srv/gpugate-e2e/deploy/unit.txt",
    )
    assert status and stdout == ["640", f"host=@pct/pve1:{RUNNING_VMID} port=30000"]

    second = pyinfra(*only_running(inventory_file), str(deploy))
    assert second.returncode == 0, second.stderr
    assert f"[@pct/pve1:{RUNNING_VMID}] No changes" in second.stderr


def test_server_shell_runs_inside(inventory_file, container_host):
    result = pyinfra(
        *only_running(inventory_file), "server.shell",
        "commands=echo inside-$(hostname) > /srv/gpugate-e2e/shell.txt",
    )
    assert result.returncode == 0, result.stderr
    assert run_in(container_host, "cat /srv/gpugate-e2e/shell.txt")[1] == [f"inside-ct{RUNNING_VMID}"]


# The API: details a user relies on
#


def test_the_container_gets_its_own_path_and_no_host_environment(container_host):
    status, stdout, _ = run_in(container_host, "echo $PATH; env | grep -c '^SSH_' || true")
    assert status
    assert stdout == ["/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "0"]


def test_no_pty_unless_asked_so_stderr_stays_separate(container_host):
    status, stdout, stderr = run_in(container_host, "tty || true; echo err >&2")
    assert stdout == ["not a tty"] and stderr == ["err"]
    status, stdout, _ = run_in(container_host, "tty >/dev/null && echo has-tty", _get_pty=True)
    assert stdout[-1].strip() == "has-tty"


def test_exit_codes_stdin_env_and_chdir(container_host):
    assert run_in(container_host, "exit 3")[0] is False
    assert run_in(container_host, "exit 3", _success_exit_codes=[3])[0] is True
    assert run_in(container_host, "cat", _stdin="line one")[1] == ["line one"]
    assert run_in(container_host, "echo $X; pwd", _env={"X": "a b"}, _chdir="/srv")[1] == ["a b", "/srv"]
    assert run_in(container_host, "id -un", _su_user="nobody", _su_shell="sh")[1] == ["nobody"]


def test_get_file_returns_the_bytes(container_host):
    data = os.urandom(4096)
    assert container_host.put_file(io.BytesIO(data), "/srv/gpugate-e2e/random.bin")
    buffer = io.BytesIO()
    assert container_host.get_file("/srv/gpugate-e2e/random.bin", buffer)
    assert buffer.getvalue() == data


def test_get_file_of_a_missing_file_is_an_error(container_host):
    with pytest.raises(OSError, match="pct pull in container 129"):
        container_host.get_file("/srv/gpugate-e2e/no-such-file", io.BytesIO())


weird_text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
    min_size=1,
    max_size=60,
)
weird_names = weird_text.filter(lambda s: "/" not in s and s not in (".", "..") and len(s.encode()) < 200)
fuzz_settings = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
)


@fuzz_settings
@given(text=weird_text)
def test_any_command_text_arrives_byte_for_byte(container_host, text):
    command = StringCommand("printf", "%s", QuoteString(text), "|", "od", "-An", "-v", "-tx1")
    status, stdout, stderr = run_in(container_host, command)
    assert status, stderr
    assert "".join(stdout).replace(" ", "") == text.encode().hex()


@fuzz_settings
@given(name=weird_names, content=st.binary(max_size=64))
def test_any_file_name_and_content_arrive_byte_for_byte(container_host, name, content):
    # od by the exact (quoted) name: it fails unless the file exists under exactly that name
    path = f"/srv/gpugate-e2e/fuzz/{name}"
    assert container_host.put_file(io.BytesIO(content), path)
    status, stdout, stderr = run_in(
        container_host, StringCommand("od", "-An", "-v", "-tx1", QuoteString(path)),
    )
    assert status, stderr
    assert "".join(stdout).replace(" ", "") == content.hex()


# One SSH connection and one `pct list` per Proxmox host
#


def ssh_connections_to(port: int) -> int:
    """This process's established TCP connections to the lab host's sshd (/proc: its socket
    inodes, matched in the kernel's TCP tables)."""
    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            remote_port = int(fields[2].rsplit(":", 1)[1], 16)
            if remote_port == port and fields[3] == "01" and fields[9] in inodes:  # 01: ESTABLISHED
                count += 1
    return count


def wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def containers_of_pve1(lab, *entries: tuple[int, dict]):
    """One State; an entry with a `name` in its data is that alias (the same vmid twice)."""
    lab_dir, host = lab
    names = [
        (extra.pop("name", f"@pct/pve1:{vmid}"), {**ssh_data(lab_dir, host), "pct_vmid": vmid, **extra})
        for vmid, extra in entries
    ]
    inventory = Inventory((names, {}))
    State(inventory, Config())
    return [inventory.get_host(name) for name, _ in names]


def test_containers_of_one_host_share_one_ssh_connection_and_one_pct_list(lab):
    _, host = lab
    before = ssh_connections_to(host["port"])
    targets = containers_of_pve1(lab, (RUNNING_VMID, {}), *((vmid, {}) for vmid in NEIGHBOUR_VMIDS))
    commands: list[str] = []
    original = SSHConnector.run_shell_command

    def spy(connector, command, *args, **kwargs):
        commands.append(command.get_raw_value())
        return original(connector, command, *args, **kwargs)

    with patch.object(SSHConnector, "run_shell_command", spy):
        for target in targets:
            target.connect(raise_exceptions=True)
    try:
        assert ssh_connections_to(host["port"]) == before + 1
        assert [c.split(" ")[:4] for c in commands] == [["listing=$(", "pct", "list", "2>&1);"]]
        for vmid, target in zip((RUNNING_VMID, *NEIGHBOUR_VMIDS), targets):
            assert run_in(target, "hostname")[1] == [f"ct{vmid}"]
    finally:
        for target in targets:
            target.disconnect()
    assert wait_for(lambda: ssh_connections_to(host["port"]) == before)  # the last one closed it


def test_wrong_ssh_settings_fail_alone_and_do_not_poison_the_shared_connection(lab, tmp_path):
    # the same host and vmid, but a known_hosts without pve1's key (strict checking): refused
    (tmp_path / "empty_known_hosts").write_text("")
    wrong = {"name": "@pct/wrong-known-hosts", "ssh_known_hosts_file": str(tmp_path / "empty_known_hosts")}
    wrong_host, *good = containers_of_pve1(lab, (RUNNING_VMID, wrong), (RUNNING_VMID, {}), (NEIGHBOUR_VMIDS[0], {}))
    gevent.joinall([gevent.spawn(t.connect, show_errors=False) for t in (wrong_host, *good)], raise_error=True)
    try:
        assert not wrong_host.connected
        assert all(t.connected for t in good)
        assert good[0].connector.pve.client is good[1].connector.pve.client
        assert [run_in(t, "hostname")[1] for t in good] == [[f"ct{RUNNING_VMID}"], [f"ct{NEIGHBOUR_VMIDS[0]}"]]
        with pytest.raises(ConnectError, match="No host key for .* found in known_hosts"):
            wrong_host.connect(raise_exceptions=True)
    finally:
        for target in good:
            target.disconnect()


CONCURRENT_CHILD = """
from gevent import monkey; monkey.patch_all()   # as the pyinfra CLI does, before anything else
import io, json, os, sys
import gevent
from pyinfra.api import Config, Inventory, State
from pyinfra.api.connect import connect_all
sys.path.insert(0, {tests!r})
from test_connector_lab import ssh_connections_to

names, port, rounds = {names!r}, {port}, {rounds}
inventory = Inventory((names, {{}}))
state = State(inventory, Config())
connect_all(state)
hosts = [inventory.get_host(name) for name, _ in names]
connections = ssh_connections_to(port)

def work(host):
    vmid = host.data.pct_vmid
    bad = []
    for i in range(rounds):
        payload = f"{{vmid}}-{{i}}-" * 2000
        ok, out = host.run_shell_command(f"hostname; printf %s {{payload}}; echo; echo err-{{vmid}}-{{i}} >&2")
        if not ok or out.stdout_lines != [f"ct{{vmid}}", payload] or out.stderr_lines != [f"err-{{vmid}}-{{i}}"]:
            bad.append(("command", i, out.stdout_lines[:1], out.stderr_lines))
        data = os.urandom(50000) + str(vmid).encode()
        host.put_file(io.BytesIO(data), f"/srv/concurrent-{{i}}.bin")
        back = io.BytesIO()
        host.get_file(f"/srv/concurrent-{{i}}.bin", back)
        if back.getvalue() != data:
            bad.append(("file", i))
    return bad

greenlets = [gevent.spawn(work, host) for host in hosts]
gevent.joinall(greenlets, raise_error=True)
print(json.dumps({{"connected": [h.connected for h in hosts], "connections": connections,
                  "errors": {{h.name: g.value for h, g in zip(hosts, greenlets)}}}}))
for host in hosts:
    host.disconnect()
"""


def test_concurrent_commands_and_files_of_several_containers_over_one_connection(lab):
    # In a child process gevent-patched as the pyinfra CLI is: paramiko's transport and every
    # container's channels (commands, and each container's own SFTP channel) interleave in greenlets.
    lab_dir, host = lab
    names = [(f"@pct/pve1:{vmid}", ssh_data(lab_dir, host)) for vmid in (RUNNING_VMID, *NEIGHBOUR_VMIDS)]
    code = CONCURRENT_CHILD.format(tests=str(Path(__file__).parent), names=names, port=host["port"], rounds=4)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["connected"] == [True, True, True]
    assert report["connections"] == 1
    assert report["errors"] == {name: [] for name, _ in names}


# The measurement (python tests/e2e/test_connector_lab.py --bench [N])
#


def bench(samples: int = 50) -> None:
    from pyinfra.connectors.ssh import SSHConnector  # noqa: F401  (plain @ssh for comparison)

    lab_dir = Path(f"/tmp/lab-connector-bench-{os.getpid()}")
    host = start_lab(lab_dir)
    try:
        data = ssh_data(lab_dir, host)
        inventory = Inventory(([("@ssh/pve1", data), (f"@pct/pve1:{RUNNING_VMID}", data)], {}))
        State(inventory, Config())
        figures = {}
        for name in ("@ssh/pve1", f"@pct/pve1:{RUNNING_VMID}"):
            target = inventory.get_host(name)
            target.connect(raise_exceptions=True)
            for _ in range(5):  # warm up the connection
                target.run_shell_command("true")
            times = []
            for _ in range(samples):
                start = time.perf_counter()
                status, _ = target.run_shell_command("true")
                times.append((time.perf_counter() - start) * 1000)
                assert status
            figures[name] = times
            target.disconnect()
        for name, times in figures.items():
            q = statistics.quantiles(times, n=10)
            print(f"{name:20s} median {statistics.median(times):6.1f} ms  p10 {q[0]:6.1f}  p90 {q[-1]:6.1f}  (n={samples})")

        # connect(): the 3 running containers of pve1, each with its own SSH connection and
        # `pct status` (pct_ssh_share=1) vs sharing one connection and one `pct list`
        vmids = (RUNNING_VMID, *NEIGHBOUR_VMIDS)
        connects: dict[str, list[float]] = {"own connection each": [], "shared": []}
        for _ in range(max(3, samples // 5)):
            for label, share in (("own connection each", 1), ("shared", 4)):
                names = [(f"@pct/pve1:{vmid}", {**data, "pct_ssh_share": share}) for vmid in vmids]
                inventory = Inventory((names, {}))
                State(inventory, Config())
                targets = [inventory.get_host(name) for name, _ in names]
                start = time.perf_counter()
                for target in targets:
                    target.connect(raise_exceptions=True)
                connects[label].append((time.perf_counter() - start) * 1000)
                for target in targets:
                    target.disconnect()
        for label, times in connects.items():
            print(f"connect 3 containers, {label:20s} median {statistics.median(times):6.1f} ms  (n={len(times)})")
    finally:
        _lab_core().down(lab_dir)
        remove_lab_dir(lab_dir)


if __name__ == "__main__" and "--bench" in sys.argv:
    bench(int(sys.argv[sys.argv.index("--bench") + 1]) if len(sys.argv) > sys.argv.index("--bench") + 1 else 50)
