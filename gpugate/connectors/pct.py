"""
The ``@pct`` connector: run pyinfra inside a Proxmox VE LXC container.

Every command goes through ``pct exec <vmid> -- env -i PATH=... sh -c '<command>'`` on the
Proxmox host (over pyinfra's SSH connector, or locally with ``@local``), and every file through
``pct push`` / ``pct pull`` and a temporary file in the Proxmox host's temp dir that is always
removed. pyinfra's ``_sudo``/``_su_user``/``_env``/``_chdir`` apply *inside* the container;
``sudo`` for ``pct`` itself on the host is separate (host data ``pct_sudo``). The containers of
one Proxmox host share one SSH connection (up to ``pct_ssh_share``, default 4) and one ``pct list``
at connect in a run.

.. code:: shell

    # container 129 on the Proxmox host pve1 (reached over SSH as usual)
    pyinfra @pct/pve1:129 exec -- cat /proc/1/cmdline

    # pyinfra running on the Proxmox host itself (no SSH)
    pyinfra @pct/@local:129 exec -- hostname

.. code:: python

    # inventory.py: names carry host and vmid, or give them as host data
    containers = [
        "@pct/pve1:129",
        ("@pct/sglang-a", {"ssh_hostname": "pve2", "pct_vmid": 131, "ssh_user": "ops"}),
    ]
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal
from weakref import WeakKeyDictionary

from gevent.event import AsyncResult, Event
from paramiko import SSHException

from typing_extensions import TypedDict, Unpack, override

from pyinfra import logger
from pyinfra.api.command import QuoteString, StringCommand
from pyinfra.api.exceptions import ConnectError, InventoryError
from pyinfra.api.output import echo
from pyinfra.connectors.base import BaseConnector, DataMeta
from pyinfra.connectors.local import LocalConnector
from pyinfra.connectors.ssh import SSHConnector
from pyinfra.connectors.sshuserclient import SSHClient
from pyinfra.connectors.util import (
    CommandOutput,
    OutputLine,
    extract_control_arguments,
    make_unix_command_for_host,
)

from gpugate.settings import SETTINGS

if TYPE_CHECKING:
    from pyinfra.api.arguments import ConnectorArguments
    from pyinfra.api.host import Host
    from pyinfra.api.state import State

# Proxmox VE's `pve-vmid` format: 100 - 999999999.
MIN_VMID = 100
MAX_VMID = 999_999_999

# The PATH lxc-attach gives a command when the environment is cleared (lxc/lxc src/lxc/attach.c),
# i.e. what a shell inside the container normally has; pct's own PATH lacks /usr/local/bin.
CONTAINER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# Where the temporary file for push/pull lives: the Proxmox host's own temp dir, 0600, unique.
HOST_MKTEMP = 'mktemp "${TMPDIR:-/tmp}/pyinfra-pct.XXXXXXXXXX"'

STATUS_CHECK_MARKER = "pct-status-exit:"
LIST_CHECK_MARKER = "pct-list-exit:"

# Containers of one Proxmox host that share one SSH connection (the pct_ssh_share setting). Each
# uses at most two SSH sessions at once (a command's channel and its SFTP channel), and sshd allows
# 10 per connection by default (MaxSessions), so 4 containers stay below it.
DEFAULT_CONTAINERS_PER_CONNECTION = SETTINGS["pct_ssh_share"].default


class PctConnectorData(TypedDict):
    pct_vmid: int
    pct_local: bool
    pct_binary: str
    pct_sudo: bool
    pct_clear_env: bool
    pct_ssh_share: int
    pct_connect_check: bool


connector_data_meta: dict[str, DataMeta] = {
    "pct_vmid": DataMeta("The container's vmid (set by the name @pct/<host>:<vmid>)"),
    "pct_local": DataMeta(
        "Run pct on this machine instead of over SSH (set by the name @pct/@local:<vmid>)",
        False,
    ),
    # the settings' own rows (gpugate.settings): one doc and one default each
    **{key: DataMeta(SETTINGS[key].doc[:1].upper() + SETTINGS[key].doc[1:], SETTINGS[key].default)
       for key in ("pct_binary", "pct_sudo", "pct_clear_env", "pct_ssh_share", "pct_connect_check")},
}


# Pure helpers: names, command strings, pct's error texts
#


def parse_vmid(text: object, where: str) -> int:
    """
    A Proxmox vmid from a name part or host data value, or InventoryError naming it.

    >>> parse_vmid("129", "@pct/pve1:129")
    129
    """
    if isinstance(text, bool):
        raise InventoryError(f"Invalid vmid {text!r} in {where}: not an integer")
    try:
        vmid = int(str(text).strip()) if not isinstance(text, int) else text
    except ValueError:
        raise InventoryError(f"Invalid vmid {text!r} in {where}: not an integer") from None
    if not MIN_VMID <= vmid <= MAX_VMID:
        raise InventoryError(
            f"Invalid vmid {vmid} in {where}: Proxmox vmids are {MIN_VMID}-{MAX_VMID}",
        )
    return vmid


def parse_share(value: object, host_name: str) -> int:
    """pct_ssh_share: how many containers share one SSH connection (an integer >= 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).strip().isdigit():
        raise InventoryError(f"Invalid pct_ssh_share {value!r} of {host_name}: an integer >= 1")
    share = int(value)
    if share < 1:
        raise InventoryError(f"Invalid pct_ssh_share {value!r} of {host_name}: an integer >= 1")
    return share


def pct_prefix(binary: str, sudo: bool) -> list[str | QuoteString]:
    """`pct` as the host runs it: `sudo -n` (never prompt) when the SSH user is not root."""
    bits: list[str | QuoteString] = ["sudo", "-n"] if sudo else []
    bits.append(QuoteString(binary))
    return bits


def make_pct_exec_command(
    vmid: int,
    inner_command: StringCommand,
    binary: str = "pct",
    sudo: bool = False,
    clear_env: bool = True,
) -> StringCommand:
    """
    The host-side command that runs ``inner_command`` (already wrapped by pyinfra's
    ``make_unix_command``, so ``sh -c '...'`` with sudo/su/env/chdir) inside the container.

    >>> inner = StringCommand("sh", "-c", QuoteString("id -u"))
    >>> print(make_pct_exec_command(129, inner, sudo=True, clear_env=False).get_raw_value())
    sudo -n pct exec 129 -- sh -c 'sh -c '"'"'id -u'"'"''
    """
    bits: list = [*pct_prefix(binary, sudo), "exec", str(vmid), "--"]
    if clear_env:
        # Real `pct exec` keeps pct's environment (--keep-env defaults to 1: the SSH session's
        # variables and PATH=/sbin:/bin:/usr/sbin:/usr/bin), and older nodes reject
        # `--keep-env 0`; `env -i` gives the same clean start on every pve-container version.
        bits.extend(["env", "-i", f"PATH={CONTAINER_PATH}", "HOME=/root", "container=lxc"])
    bits.extend(["sh", "-c", QuoteString(inner_command)])
    return StringCommand(*bits)


def make_pct_push_command(
    vmid: int,
    host_temp_filename: str,
    remote_filename: str,
    binary: str = "pct",
    sudo: bool = False,
    owner: str | None = None,
) -> StringCommand:
    """
    `pct push` the host temp file into the container, then remove it, keeping push's status.

    One round trip: the removal runs whatever push did (the caller's ``finally`` covers the
    case where this command never ran).
    """
    bits: list = [
        *pct_prefix(binary, sudo),
        "push",
        str(vmid),
        QuoteString(host_temp_filename),
        QuoteString(remote_filename),
    ]
    if owner:
        bits.extend(["--user", QuoteString(owner)])
    bits.extend([";", "status=$?;", "rm", "-f", QuoteString(host_temp_filename), ";"])
    bits.extend(["exit", "$status"])
    return StringCommand(*bits)


def make_pct_pull_command(
    vmid: int,
    remote_filename: str,
    binary: str = "pct",
    sudo: bool = False,
) -> StringCommand:
    """
    Make a host temp file, print its path (first stdout line), then `pct pull` into it.

    The file exists (mode 0600, owned by the SSH user) before pct writes it: pct opens an
    existing file with O_TRUNC and keeps its mode and owner, so the SSH user can read it even
    when pct ran under sudo, and nobody else can.
    """
    return StringCommand(
        "temp=$(" + HOST_MKTEMP + ")",
        "&&",
        "echo",
        '"$temp"',
        "&&",
        *pct_prefix(binary, sudo),
        "pull",
        str(vmid),
        QuoteString(remote_filename),
        '"$temp"',
    )


def make_status_check_command(vmid: int, binary: str = "pct", sudo: bool = False) -> StringCommand:
    """
    One read-only command on the host for connect(): pct's status of the container.

    Output lines are prefixed so that pyinfra never mistakes them for its own prompts (a
    "sudo: a password is required" line would make it ask for a password); always exit 0.
    """
    return StringCommand(
        "out=$(",
        *pct_prefix(binary, sudo),
        "status",
        str(vmid),
        "2>&1);",
        "code=$?;",
        f'echo "{STATUS_CHECK_MARKER} $code";',
        "printf '%s\\n' \"$out\" | sed 's/^/| /'",
    )


PctFailureKind = Literal["no-pct", "unknown-vmid", "not-running", "sudo", "missing-command", "link-lost"]

# The failures that connect's check is there for: no container to run in (the others are the command's
# own, or the link's)
UNAVAILABLE_KINDS = ("no-pct", "unknown-vmid", "not-running", "sudo")


@dataclass(frozen=True)
class PctFailure:
    """An error of `pct` (or of sudo for it) on the host, as opposed to the command's own."""

    kind: PctFailureKind
    detail: str  # pct's own line

    def describe(self, pve_host: str, vmid: int) -> str:
        what = {
            "no-pct": f"no `pct` command on {pve_host} (not a Proxmox VE host, or not on PATH?)",
            "unknown-vmid": f"no container {vmid} on {pve_host}",
            "not-running": f"container {vmid} on {pve_host} is not running",
            "sudo": f"cannot run pct with sudo on {pve_host} (needs NOPASSWD for pct)",
            "missing-command": f"pct exec on {pve_host} got no command for container {vmid}",
            "link-lost": f"the SSH connection to the Proxmox host {pve_host} was lost",
        }[self.kind]
        return f"pct error: {what}: {self.detail}"


def classify_pct_error(
    lines: list[str],
    vmid: int,
    binary: str = "pct",
) -> PctFailure | None:
    """
    Tell pct's own failures apart from the command's: pct dies with its own text (and an exit
    code, 255 or errno, that a command could also return), so match its texts on stderr.

    >>> classify_pct_error(["container '129' not running!"], 129).kind
    'not-running'
    >>> classify_pct_error(["grep: x: No such file or directory"], 129) is None
    True
    """
    v = re.escape(str(vmid))
    b = re.escape(binary)
    patterns: list[tuple[PctFailureKind, str]] = [
        ("no-pct", rf"(^|: ){b}: (command )?not found$"),
        ("no-pct", rf"^sudo: {b}: command not found$"),
        ("unknown-vmid", rf"^Configuration file '[^']*\b{v}\.conf' does not exist$"),
        ("not-running", rf"^(Error: )?container '{v}' not running!?$"),
        ("not-running", r"^can only (push files to|pull files from) a running (CT|VM)$"),
        ("not-running", rf"^lxc-attach: {v}: .*([Ff]ailed to get init pid|not running)"),
        ("sudo", r"^sudo: (a password is required|a terminal is required.*)$"),
        ("sudo", r"^sudo: .*(not allowed to execute|is not in the sudoers file)"),
        ("sudo", rf"^Sorry, user \S+ is not allowed to execute .*{b}"),
        ("missing-command", r"^missing command\b"),
    ]
    for line in lines:
        text = line.strip()
        for kind, pattern in patterns:
            if re.search(pattern, text):
                return PctFailure(kind, text)
    return None


def _parse_marked_output(lines: list[str], marker: str) -> tuple[int | None, list[str]]:
    """The exit code after ``marker`` and the ``| ``-prefixed output lines (blank ones dropped)."""
    code: int | None = None
    output: list[str] = []
    for line in lines:
        if line.startswith(marker):
            try:
                code = int(line[len(marker) :].strip())
            except ValueError:
                code = None
        elif line.startswith("| "):
            output.append(line[2:])
        elif line == "|":
            output.append("")
    return code, [line for line in output if line]


def parse_status_check(lines: list[str]) -> tuple[int | None, list[str]]:
    """The exit code and pct's output lines from make_status_check_command's output."""
    return _parse_marked_output(lines, STATUS_CHECK_MARKER)


def make_list_command(binary: str = "pct", sudo: bool = False) -> StringCommand:
    """
    One read-only command on the host for every container of it: ``pct list``, prefixed and
    always exit 0 like make_status_check_command.

    >>> print(make_list_command(sudo=True).get_raw_value())
    listing=$( sudo -n pct list 2>&1); code=$?; echo "pct-list-exit: $code"; printf '%s\\n' "$listing" | sed 's/^/| /'
    """
    return StringCommand(
        "listing=$(",
        *pct_prefix(binary, sudo),
        "list",
        "2>&1);",
        "code=$?;",
        f'echo "{LIST_CHECK_MARKER} $code";',
        "printf '%s\\n' \"$listing\" | sed 's/^/| /'",
    )


ContainerStatuses = dict[int, str]


def parse_container_listing(lines: list[str]) -> ContainerStatuses | None:
    """
    {vmid: status} from make_list_command's output, or None when it cannot be read (pct failed,
    or the output is not pct's table): the caller then asks ``pct status`` per container.

    pct list prints ``VMID Status Lock Name`` (``%-10s %-10s %-12s %-20s``); Lock and Name may be
    empty, but VMID and Status never are, so they are the first two fields. It prints nothing at
    all when the host has no container.

    >>> parse_container_listing(["pct-list-exit: 0", "| VMID       Status     Lock         Name",
    ...                          "| 129        running                   ct129",
    ...                          "| 130        stopped    backup"])
    {129: 'running', 130: 'stopped'}
    >>> parse_container_listing(["pct-list-exit: 0", "|"])
    {}
    """
    code, output = _parse_marked_output(lines, LIST_CHECK_MARKER)
    if code != 0:
        return None
    rows = strip_host_noise(output)
    if not rows:
        return {}
    header, *body = rows
    if header.split()[:2] != ["VMID", "Status"]:
        return None
    statuses: ContainerStatuses = {}
    for row in body:
        fields = row.split()
        if len(fields) < 2 or not fields[0].isdigit():
            return None
        statuses[int(fields[0])] = fields[1]
    return statuses


def status_check_error(lines: list[str], pve_host: str, vmid: int, binary: str) -> str | None:
    """
    None when the container is running, else the ConnectError message (names host and vmid).

    >>> status_check_error(["pct-status-exit: 0", "| status: stopped"], "pve1", 129, "pct")
    'pct error: container 129 on pve1 is not running: status: stopped'
    """
    code, output = parse_status_check(lines)
    if code is None:
        return f"pct error: could not check container {vmid} on {pve_host}: {' / '.join(lines)}"
    if code == 0:
        statuses = [line.split(":", 1)[1].strip() for line in output if line.startswith("status:")]
        if statuses and statuses[-1] == "running":
            return None
        if statuses:
            return PctFailure("not-running", f"status: {statuses[-1]}").describe(pve_host, vmid)
    failure = classify_pct_error(output, vmid, binary)
    if failure is None and code == 127:
        failure = PctFailure("no-pct", output[-1] if output else "exit code 127")
    if failure is not None:
        return failure.describe(pve_host, vmid)
    detail = " / ".join(output) or "no output"
    return f"pct error: `pct status {vmid}` on {pve_host} failed (exit {code}): {detail}"


def strip_host_noise(lines: list[str]) -> list[str]:
    """The host's output lines without blank ones and sudo's warning about an unresolvable host
    name (misconfigured hosts print it on every sudo; it is no failure)."""
    return [line for line in lines if line.strip() and not line.startswith("sudo: unable to resolve")]


def strict_host_key_policy(host_data: object) -> str:
    """
    The host key policy for the Proxmox host: what the user set (host data
    ``ssh_strict_host_key_checking``, e.g. ``accept-new``), else ``yes``: the key must already be
    in known_hosts. (pyinfra's own default, accept-new, trusts an unknown key silently; its
    StrictHostKeyChecking from an ssh_config_file applies only when this is None, which would
    otherwise mean an interactive prompt, so gpugate never leaves it None.)

    >>> strict_host_key_policy({}), strict_host_key_policy({"ssh_strict_host_key_checking": "accept-new"})
    ('yes', 'accept-new')
    """
    explicit = host_data.get("ssh_strict_host_key_checking")  # type: ignore[attr-defined]
    return "yes" if explicit in (None, "") else str(explicit)


def unknown_host_key_error(error: "ConnectError", data: object) -> "ConnectError":
    """The ConnectError for a Proxmox host whose key is not in known_hosts, saying what to do;
    any other error as it is."""
    if "No host key for" not in str(error):
        return error
    known_hosts = data.get("ssh_known_hosts_file") or "~/.ssh/known_hosts"  # type: ignore[attr-defined]
    return ConnectError(
        f"{error} -- the Proxmox host's key is not in {known_hosts}, and gpugate does not trust an "
        "unknown host key: add it after checking its fingerprint (ssh-keyscan, or one interactive "
        "`ssh` to the host), or relax the check explicitly with ssh: {strict_host_key_checking: "
        "accept-new} in fleet.yaml (--data ssh_strict_host_key_checking=accept-new)",
    )


# Sharing per Proxmox host: one SSH connection and one `pct list` for its containers
#
# pyinfra runs every inventory host in its own greenlet and gives each its own connector, so
# 32 containers on 8 Proxmox hosts would cost 32 SSH handshakes and 32 `pct status` checks. The
# containers of one host (same SSH settings, same pyinfra State) share instead: one paramiko
# client (paramiko multiplexes channels on one transport, each container opening its own) and one
# container listing taken at connect. Both are refcounted and go when the last container
# disconnects. The locks are gevent's, as pyinfra's own concurrency is.


@dataclass(eq=False)
class SharedSSHClient:
    """One SSH connection to a Proxmox host and the container hosts that use it."""

    ready: Event = field(default_factory=Event)  # set when connected, or when connecting failed
    client: SSHClient | None = None  # pyinfra's paramiko SSHClient
    error: ConnectError | None = None
    users: int = 0

    def can_take(self, per_connection: int) -> bool:
        if self.users >= per_connection or self.error is not None:
            return False
        if not self.ready.is_set():
            return True  # still connecting: wait for it rather than open another
        transport = self.client.get_transport() if self.client is not None else None
        # a dropped connection (network, sshd restarted) is never handed out again
        return self.client is not None and (transport is None or transport.is_active())


@dataclass(eq=False)
class SharedListing:
    """One `pct list` of a Proxmox host, read by the first container to connect."""

    result: AsyncResult = field(default_factory=AsyncResult)  # ContainerStatuses | None
    users: int = 0


_shared_clients: "WeakKeyDictionary[State, dict[tuple, list[SharedSSHClient]]]" = WeakKeyDictionary()
_shared_listings: "WeakKeyDictionary[State, dict[tuple, SharedListing]]" = WeakKeyDictionary()


def ssh_settings_key(connector: SSHConnector) -> tuple:
    """
    Everything that decides where and how pyinfra's SSH connector connects (host, port, user,
    key, password, known_hosts, host key policy, ssh config, paramiko arguments, retries and
    the connect timeout): containers share a connection only when all of it is equal.
    """
    data: Mapping[str, object] = connector.data  # read by the names in data_meta: a plain mapping here
    settings = [("hostname", data["ssh_hostname"] or connector.host.name)]
    settings += [(name, repr(data[name])) for name in sorted(connector.data_meta) if name != "ssh_hostname"]
    settings.append(("connect_timeout", repr(connector.state.config.CONNECT_TIMEOUT)))
    return tuple(settings)


class SharedSSHConnector(SSHConnector):
    """
    pyinfra's SSH connector to a Proxmox host whose connection is shared with the other
    containers of that host in the same State (up to ``per_connection`` per connection).

    Each container keeps its own connector object (its host, data, output prefix, and its own
    SFTP channel); only the paramiko client is shared. When connecting fails, every container
    waiting on that connection fails with the same ConnectError; the next connect tries afresh.
    """

    shared: SharedSSHClient | None = None

    def __init__(self, state: "State", host: "Host", per_connection: int):
        super().__init__(state, host)
        # pyinfra's own default is accept-new: an unknown host key (an empty known_hosts) would
        # be trusted silently. gpugate checks strictly unless the user relaxes it explicitly
        # (ssh_strict_host_key_checking: accept-new).
        self.data["ssh_strict_host_key_checking"] = strict_host_key_policy(host.data)
        self.per_connection = per_connection
        self.settings_key = ssh_settings_key(self)
        self._transfer = None

    def _pool(self) -> list[SharedSSHClient]:
        return _shared_clients.setdefault(self.state, {}).setdefault(self.settings_key, [])

    @override
    def connect(self) -> None:
        pool = self._pool()
        shared = next((s for s in pool if s.can_take(self.per_connection)), None)
        if shared is not None:
            shared.users += 1
            shared.ready.wait()
            if shared.error is not None:
                shared.users -= 1
                raise ConnectError(*shared.error.args)
            self.client = shared.client
            self.shared = shared
            return

        shared = SharedSSHClient(users=1)
        pool.append(shared)  # before connecting: the other containers wait on this one
        try:
            try:
                super().connect()
            except ConnectError as error:
                raise unknown_host_key_error(error, self.data) from None
        except BaseException as error:
            shared.error = error if isinstance(error, ConnectError) else ConnectError(str(error))
            if shared in pool:
                pool.remove(shared)
            raise
        else:
            shared.client = self.client
            self.shared = shared
        finally:
            shared.ready.set()

    @override
    def disconnect(self) -> None:
        if self._transfer is not None:
            transfer, self._transfer = self._transfer, None
            try:
                transfer.close()
            except Exception:  # noqa: BLE001 - a dead connection cannot close its channel
                pass
        shared, self.shared = self.shared, None
        if shared is None:
            return
        shared.users -= 1
        if shared.users > 0:
            return
        pool = _shared_clients.get(self.state, {}).get(self.settings_key, [])
        if shared in pool:
            pool.remove(shared)
        if shared.client is not None:
            shared.client.close()

    @override
    def get_file_transfer_connection(self):
        # pyinfra memoizes this per connector object; kept here so that disconnect() closes this
        # container's own SFTP channel and leaves the other containers' alone.
        if self._transfer is None:
            self._transfer = SSHConnector.get_file_transfer_connection.__wrapped__(self)
        return self._transfer


# The connector
#


class PctConnector(BaseConnector):
    """
    Run commands and transfer files inside a Proxmox VE LXC container with ``pct``.

    .. code:: shell

        pyinfra @pct/pve1:129 exec -- hostname          # over SSH to pve1
        pyinfra @pct/@local:129 exec -- hostname        # on the Proxmox host itself

    Host data: ``pct_vmid``, ``pct_binary`` (``pct``), ``pct_sudo`` (default: when
    ``ssh_user`` is set and not ``root``), ``pct_clear_env`` (True), ``pct_local``; plus all
    of the ``@ssh`` connector's ``ssh_*`` data for reaching the Proxmox host.
    """

    handles_execution = True

    data_cls = PctConnectorData
    data_meta = connector_data_meta
    data: PctConnectorData

    pve: SSHConnector | LocalConnector

    def __init__(self, state: "State", host: "Host"):
        super().__init__(state, host)
        if self.data["pct_vmid"] is None:
            raise InventoryError(
                f"No vmid for {host.name}: name it @pct/<proxmox-host>:<vmid> "
                "or give host data pct_vmid",
            )
        self.vmid = parse_vmid(self.data["pct_vmid"], f"pct_vmid of {host.name}")
        per_connection = parse_share(self.data["pct_ssh_share"], host.name)
        self.pve = (
            LocalConnector(state, host)
            if self.data["pct_local"]
            else SharedSSHConnector(state, host, per_connection)
        )
        self._listing: SharedListing | None = None
        # why the last command did not run in the container (pct's own error, a lost link), as
        # data: the operations read it, never the text line that says it
        self.last_failure: PctFailure | None = None
        # pct_connect_check false: connect ran no check, the first command is it. ``unavailable``:
        # what connect would have raised, once a command met a stopped or missing container
        self._unchecked = False
        self.unavailable: str | None = None

    @override
    @staticmethod
    def make_names_data(name=None):
        if name is None:
            # Bare `@pct`: everything (ssh_hostname, pct_vmid) comes from host data.
            yield "@pct", {}, ["@pct"]
            return

        pve_host, sep, vmid_text = name.rpartition(":")
        if not sep:
            # `@pct/<alias>`: an alias, the vmid comes from host data (pct_vmid).
            yield f"@pct/{name}", {"ssh_hostname": name}, ["@pct"]
            return
        if not pve_host:
            raise InventoryError(f"No Proxmox host in @pct/{name} (expected @pct/<host>:<vmid>)")
        if not vmid_text:
            raise InventoryError(f"No vmid in @pct/{name} (expected @pct/<host>:<vmid>)")

        vmid = parse_vmid(vmid_text, f"@pct/{name}")
        if pve_host == "@local":
            yield f"@pct/@local:{vmid}", {"pct_local": True, "pct_vmid": vmid}, ["@pct"]
        else:
            yield f"@pct/{pve_host}:{vmid}", {"ssh_hostname": pve_host, "pct_vmid": vmid}, ["@pct"]

    # Settings derived from host data

    @property
    def pve_host_name(self) -> str:
        """The Proxmox host as the user named it (`pve1` in @pct/pve1:129), for messages."""
        if self.data["pct_local"]:
            return "localhost"
        named_host, sep, _ = self.host.name.removeprefix("@pct/").rpartition(":")
        if self.host.name.startswith("@pct/") and sep and named_host:
            return named_host
        return self.host.data.get("ssh_hostname") or self.host.name

    @property
    def use_sudo(self) -> bool:
        if self.data["pct_sudo"] is not None:
            return bool(self.data["pct_sudo"])
        if self.data["pct_local"]:
            return os.geteuid() != 0
        ssh_user = self.host.data.get("ssh_user")
        return bool(ssh_user) and ssh_user != "root"

    @property
    def binary(self) -> str:
        return self.data["pct_binary"] or "pct"

    def _pct_failure(self, status: bool, output: CommandOutput) -> PctFailure | None:
        failure = classify_pct_error(output.stderr_lines, self.vmid, self.binary)
        if failure is None and not status and not self._link_alive():
            # the link to the Proxmox host went away: the command may never have reached the container
            failure = PctFailure("link-lost", "no answer: the connection is closed")
        return failure

    def _lost_link(self, error: BaseException) -> bool:
        """Whether a command's exception is the link to the Proxmox host going away: the transport
        is down, or paramiko refused the command's channel (``Channel is not open``, EOF), which it
        does in the moment after the peer vanished, before its transport thread notices."""
        return not self._link_alive() or isinstance(error, (SSHException, EOFError, ConnectionError))

    def _link_alive(self) -> bool:
        client = getattr(self.pve, "client", None)
        if client is None:  # @local: no link to lose
            return True
        transport = client.get_transport()
        return bool(transport is not None and transport.is_active())

    def _with_failure_line(self, output: CommandOutput, failure: PctFailure) -> CommandOutput:
        message = failure.describe(self.pve_host_name, self.vmid)
        logger.debug("%s%s", self.host.print_prefix, message)
        return CommandOutput([*output.combined_lines, OutputLine("stderr", message)])

    # Connection

    @property
    def proxmox_host_key(self) -> tuple:
        """Which Proxmox host (as reached: SSH settings, or this machine) the container is on."""
        if isinstance(self.pve, SharedSSHConnector):
            return self.pve.settings_key
        return ("@local",)

    @property
    def connect_check(self) -> bool:
        """Whether connect checks that the container runs (``pct_connect_check``, default true)."""
        return bool(SETTINGS["pct_connect_check"].convert(self.data["pct_connect_check"]))

    @override
    def connect(self) -> None:
        self.pve.connect()
        if not self.connect_check:
            # One round trip less: `pct exec` says itself that a container is stopped or missing, and
            # the first command that meets it gets connect's own message (self.unavailable)
            self._unchecked, self.unavailable = True, None
            return
        try:
            self._check_container_running()
        except BaseException:
            self._release_listing()
            self.pve.disconnect()
            raise

    def _check_container_running(self) -> None:
        # Read-only (connect also runs under --dry). The host's one shared `pct list` answers for
        # every container it shows running; any other container (stopped, unknown vmid, no pct,
        # a listing that cannot be read or is stale) gets its own `pct status`, which says why.
        statuses = self._shared_container_statuses()
        if statuses is not None and statuses.get(self.vmid) == "running":
            return
        message = self._status_check_message()
        if message:
            raise ConnectError(message)

    def _status_check_message(self) -> str | None:
        """The container's own `pct status`: None when it runs, else why not (connect's message)."""
        check = make_status_check_command(self.vmid, self.binary, self.use_sudo)
        status, output = self.pve.run_shell_command(check)
        if not status:
            return (f"pct error: could not check container {self.vmid} on {self.pve_host_name}: "
                    f"{output.stderr or output.stdout}")
        return status_check_error(output.stdout_lines, self.pve_host_name, self.vmid, self.binary)

    def _shared_container_statuses(self) -> ContainerStatuses | None:
        """The host's `pct list`, read once per Proxmox host by its first container to connect."""
        listings = _shared_listings.setdefault(self.state, {})
        key = (self.proxmox_host_key, self.binary, self.use_sudo)
        listing = listings.get(key)
        if listing is None:
            listing = listings[key] = SharedListing()
            listing.users += 1
            self._listing = listing
            statuses: ContainerStatuses | None = None
            try:
                status, output = self.pve.run_shell_command(make_list_command(self.binary, self.use_sudo))
                if status:
                    statuses = parse_container_listing(output.stdout_lines)
            except Exception as error:  # noqa: BLE001 - the per-container check reports it
                logger.debug("%spct list failed: %s", self.host.print_prefix, error)
            finally:
                listing.result.set(statuses)
            return statuses
        listing.users += 1
        self._listing = listing
        return listing.result.get()

    def _release_listing(self) -> None:
        listing, self._listing = self._listing, None
        if listing is None:
            return
        listing.users -= 1
        if listing.users <= 0:
            listings = _shared_listings.get(self.state, {})
            for key, value in list(listings.items()):
                if value is listing:
                    del listings[key]

    @override
    def disconnect(self) -> None:
        self._release_listing()
        self.pve.disconnect()

    # Commands

    @override
    def run_shell_command(
        self,
        command: StringCommand,
        print_output: bool = False,
        print_input: bool = False,
        **arguments: Unpack["ConnectorArguments"],
    ) -> tuple[bool, CommandOutput]:
        """
        Run ``command`` inside the container: pyinfra's sudo/su/env/chdir/shell wrapping is
        applied inside; _timeout, _stdin, _get_pty (off unless asked: a tty on any std fd
        makes lxc-attach merge stderr and send CRLF) and _success_exit_codes go to the host
        connection. A failure of pct itself returns False with a line saying so.
        """
        control_arguments = extract_control_arguments(arguments)
        inner_command = make_unix_command_for_host(self.state, self.host, command, **arguments)
        pct_command = make_pct_exec_command(
            self.vmid,
            inner_command,
            binary=self.binary,
            sudo=self.use_sudo,
            clear_env=self.data["pct_clear_env"],
        )
        self.last_failure = None
        try:
            status, output = self.pve.run_shell_command(
                pct_command,
                print_output=print_output,
                print_input=print_input,
                **control_arguments,
            )
        except Exception as error:
            if self._lost_link(error):
                self.last_failure = PctFailure("link-lost", "the connection dropped during the command")
            raise
        failure = self._pct_failure(status, output)
        if failure is not None:
            # Even when the caller accepts pct's exit code (255) as success: the command never ran.
            self.last_failure = failure
            if self._unchecked and failure.kind in UNAVAILABLE_KINDS:
                return False, self._unavailable_output(output, failure)
            return False, self._with_failure_line(output, failure)
        self._unchecked = False  # pct ran it: the container runs
        return status, output

    def _unavailable_output(self, output: CommandOutput, failure: PctFailure) -> CommandOutput:
        """The first command of an unchecked connect met no container: what connect would have
        said (its own `pct status`, on this path only), kept in ``self.unavailable``."""
        if self.unavailable is None:
            try:
                message = self._status_check_message()
            except Exception:  # noqa: BLE001 -- the link went: pct exec's own line says enough
                message = None
            self.unavailable = message or failure.describe(self.pve_host_name, self.vmid)
        logger.debug("%s%s", self.host.print_prefix, self.unavailable)
        return CommandOutput([*output.combined_lines, OutputLine("stderr", self.unavailable)])

    # The Proxmox host itself

    def run_on_proxmox_host(
        self,
        command: StringCommand,
        **arguments: Unpack["ConnectorArguments"],
    ) -> tuple[bool, CommandOutput]:
        """
        Run ``command`` on the Proxmox host (not in the container), as pct runs there: with
        ``sudo -n`` when pct needs it; ``_stdin``, ``_timeout`` and the other control arguments go
        to the host connection. For host-wide readings (every container's GPU processes) and
        host programs (gpugate.claims' GPU lock holder). A link to the Proxmox host that went away
        during it is ``last_failure`` (``link-lost``), as for any command.

        .. code:: python

            ok, output = host.connector.run_on_proxmox_host(StringCommand(HostGpuProcesses().command()))
        """
        if self.use_sudo:
            arguments["_sudo"] = True
        self.last_failure = None
        try:
            status, output = self.pve.run_shell_command(command, **arguments)
        except Exception as error:
            if self._lost_link(error):
                self.last_failure = PctFailure("link-lost", "the connection dropped during the command")
            raise
        if not status and not self._link_alive():
            self.last_failure = PctFailure("link-lost", "no answer: the connection is closed")
        return status, output

    # A container command that a host program runs (gpugate.claims: the GPU lock holder runs the
    # hand-off's `pct exec` itself, so the locks and the hand-off are one round trip)

    @property
    def pct_argv(self) -> list[str]:
        """`pct` as the host runs it, as an argv (no shell): ``sudo -n`` first when pct needs it."""
        return ["sudo", "-n", self.binary] if self.use_sudo else [self.binary]

    def container_command(
        self,
        command: StringCommand,
        **arguments: Unpack["ConnectorArguments"],
    ) -> StringCommand:
        """
        ``command`` as :meth:`run_shell_command` runs it inside the container (pyinfra's
        sudo/su/env/chdir and shell wrapping; the control arguments are the host connection's),
        for a host program that runs ``pct exec <vmid> -- sh -c '<it>'`` itself.
        """
        inner_arguments = dict(arguments)
        extract_control_arguments(inner_arguments)  # type: ignore[arg-type]
        return make_unix_command_for_host(self.state, self.host, command, **inner_arguments)

    def container_result(
        self,
        status: bool,
        output: CommandOutput,
        failure: PctFailure | None = None,
    ) -> tuple[bool, CommandOutput]:
        """
        A container command's ``(status, output)`` that a host program passed on: pct's own
        failures (or ``failure``, known already: the link went) made data exactly as
        :meth:`run_shell_command` makes them: ``last_failure`` and a ``pct error: ...`` line.
        """
        failure = failure or self._pct_failure(status, output)
        if failure is None:
            return status, output
        self.last_failure = failure
        return False, self._with_failure_line(output, failure)

    # Files

    def _make_host_temp_file(self, print_output: bool, print_input: bool) -> str:
        status, output = self.pve.run_shell_command(
            StringCommand(HOST_MKTEMP),
            print_output=print_output,
            print_input=print_input,
        )
        if not status or not output.stdout_lines:
            raise OSError(
                f"Could not create a temp file on {self.pve_host_name}: {output.stderr}",
            )
        return output.stdout_lines[0]

    def _remove_host_file(self, filename: str, print_output: bool, print_input: bool) -> None:
        status, output = self.pve.run_shell_command(
            StringCommand("rm", "-f", QuoteString(filename)),
            print_output=print_output,
            print_input=print_input,
        )
        if not status:
            logger.warning(
                f"{self.host.print_prefix}could not remove temp file {filename} on "
                f"{self.pve_host_name}: {output.stderr}",
            )

    def _raise_for_transfer(self, action: str, status: bool, output: CommandOutput) -> None:
        failure = self._pct_failure(status, output)
        if failure is not None:
            raise OSError(failure.describe(self.pve_host_name, self.vmid))
        # pct push/pull print nothing when they work; their worker's errors may not set the
        # exit code, so any (non-noise) stderr line is a failure too.
        errors = strip_host_noise(output.stderr_lines)
        if not status or errors:
            detail = "\n".join(errors) or output.stdout or "failed"
            raise OSError(f"pct {action} in container {self.vmid} on {self.pve_host_name}: {detail}")

    @override
    def put_file(
        self,
        filename_or_io,
        remote_filename: str,
        remote_temp_filename=None,  # a path in the *container's* temp dir: unused, see below
        print_output: bool = False,
        print_input: bool = False,
        **arguments: Unpack["ConnectorArguments"],
    ) -> bool:
        """
        Upload to a fresh 0600 temp file in the Proxmox host's temp dir, ``pct push`` it into
        the container and remove it (also when anything fails). Binary safe. pct writes as the
        container's root; with _su_user/_sudo_user the file is given to that user.
        """
        owner = arguments.get("_su_user") or arguments.get("_sudo_user")
        host_temp = self._make_host_temp_file(print_output, print_input)
        removed = False
        try:
            if not self.pve.put_file(filename_or_io, host_temp):
                raise OSError(f"Failed to copy file to {self.pve_host_name}:{host_temp}")
            status, output = self.pve.run_shell_command(
                make_pct_push_command(
                    self.vmid,
                    host_temp,
                    remote_filename,
                    binary=self.binary,
                    sudo=self.use_sudo,
                    owner=owner,
                ),
                print_output=print_output,
                print_input=print_input,
            )
            removed = True  # the push command removes the temp file whatever push did
            self._raise_for_transfer("push", status, output)
        finally:
            if not removed:
                self._remove_host_file(host_temp, print_output, print_input)

        if print_output:
            echo(f"{self.host.print_prefix}file uploaded to container: {remote_filename}", err=True)
        return True

    @override
    def get_file(
        self,
        remote_filename: str,
        filename_or_io,
        remote_temp_filename=None,  # a path in the *container's* temp dir: unused
        print_output: bool = False,
        print_input: bool = False,
        **arguments: Unpack["ConnectorArguments"],
    ) -> bool:
        """
        ``pct pull`` into a fresh 0600 temp file in the Proxmox host's temp dir, download it,
        and remove it (also when anything fails). Binary safe.
        """
        host_temp: str | None = None
        try:
            status, output = self.pve.run_shell_command(
                make_pct_pull_command(self.vmid, remote_filename, self.binary, self.use_sudo),
                print_output=print_output,
                print_input=print_input,
            )
            if output.stdout_lines:
                host_temp = output.stdout_lines[0]
            self._raise_for_transfer("pull", status, output)
            if host_temp is None:
                raise OSError(f"Could not create a temp file on {self.pve_host_name}")
            if not self.pve.get_file(host_temp, filename_or_io):
                raise OSError(f"Failed to copy file from {self.pve_host_name}:{host_temp}")
        finally:
            if host_temp is not None:
                self._remove_host_file(host_temp, print_output, print_input)

        if print_output:
            echo(
                f"{self.host.print_prefix}file downloaded from container: {remote_filename}",
                err=True,
            )
        return True
