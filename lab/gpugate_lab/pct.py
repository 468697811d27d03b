"""The lab's ``pct``: Proxmox's container tool, for lab containers (runs on a lab host; stdlib only).

Output formats, error texts and exit codes follow pve-container's src/PVE/CLI/pct.pm: pct's own errors
are Perl ``die``s (exit 255, message on stderr), so they look like command exit codes; ``exec`` returns
the command's status (128+signal when killed) as lxc-attach does.

Example (on a lab host):
    $ pct exec 129 -- hostname
    ct129
    $ pct exec 999 -- true
    Configuration file 'nodes/pve1/lxc/999.conf' does not exist
"""

from __future__ import annotations

import _signal as signal  # the C module: `signal`'s enums (enum, functools, collections) cost every command
import grp  # grp and pwd up front: push/pull resolve names after setns, where the host's stdlib may be hidden
import os
import pwd
import sys
import warnings  # noqa: F401 -- os.execvpe imports it, after setns, where the host's stdlib may be hidden

from gpugate_lab import container, nsutil

# Every remote command of every tool in the lab is one `pct exec`: its imports are kept to what exec
# needs (no pathlib, json, socket or signal enums: ~20-30 ms of CPU a command). The other commands
# import pathlib where they use it (Pct.host_path).

DIE = 255
EXEC_PATH = "/sbin:/bin:/usr/sbin:/usr/bin"
PCT_PM = "/usr/share/perl5/PVE/CLI/pct.pm"
USAGES = {
    "exec": "pct exec <vmid> [<extra-args>] [OPTIONS]",
    "status": "pct status <vmid> [OPTIONS]",
    "start": "pct start <vmid> [OPTIONS]",
    "stop": "pct stop <vmid> [OPTIONS]",
    "shutdown": "pct shutdown <vmid> [OPTIONS]",
    "list": "pct list",
    "push": "pct push <vmid> <file> <destination> [OPTIONS]",
    "pull": "pct pull <vmid> <path> <destination> [OPTIONS]",
    "config": "pct config <vmid> [OPTIONS]",
}
OPTIONS = {  # name -> takes a value ("bool": optional 0/1)
    "exec": {"keep-env": "bool"},
    "status": {"verbose": "bool"},
    "start": {"skiplock": "bool", "debug": "bool"},
    "stop": {"skiplock": "bool", "overrule-shutdown": "bool"},
    "shutdown": {"timeout": "int", "forceStop": "bool"},
    "list": {},
    "push": {"perms": "str", "user": "str", "group": "str"},
    "pull": {"perms": "str", "user": "str", "group": "str"},
    "config": {"current": "bool", "snapshot": "str"},
}
POSITIONALS = {"exec": 1, "status": 1, "start": 1, "stop": 1, "shutdown": 1, "list": 0, "push": 3, "pull": 3, "config": 1}


class Die(Exception):
    """A pct error: message printed to stderr, exit 255 (Perl die)."""


def perl_die(message: str, line: int) -> Die:
    """A die without trailing newline: Perl appends the source location."""
    return Die(f"{message} at {PCT_PM} line {line}.")


class ParseError(Exception):
    pass


def parse_args(cmd: str, args: list[str]) -> tuple[list[str], dict[str, str], list[str]]:
    """PVE CLIHandler-like parsing: (positionals, options, extra-args after `--`).

    Example: parse_args("exec", ["129", "--", "ls", "-l"]) == (["129"], {}, ["ls", "-l"])
    """
    positionals: list[str] = []
    options: dict[str, str] = {}
    extra: list[str] = []
    spec = OPTIONS[cmd]
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            extra = args[i + 1:]
            break
        if arg.startswith("-") and len(arg) > 1 and not arg.lstrip("-").isdigit():
            name, _, inline = arg.lstrip("-").partition("=")
            if name not in spec:
                raise ParseError(f"Unknown option: {name}")
            kind = spec[name]
            if inline:
                options[name] = inline
            elif kind == "bool":
                if i + 1 < len(args) and args[i + 1] in ("0", "1", "true", "false", "yes", "no", "on", "off"):
                    options[name] = args[i + 1]
                    i += 1
                else:
                    options[name] = "1"
            else:
                if i + 1 >= len(args):
                    raise ParseError(f"Option {name} requires an argument")
                options[name] = args[i + 1]
                i += 1
        elif cmd == "exec" and len(positionals) >= 1:
            extra.append(arg)  # without `--`, words become extra-args until an option shows up
        else:
            positionals.append(arg)
        i += 1
    return positionals, options, extra


def truthy(value: str | None) -> bool:
    return (value or "0").lower() in ("1", "true", "yes", "on")


class Pct:
    """pct bound to one lab host directory ($LAB/hosts/<name>)."""

    def __init__(self, host_dir: str | os.PathLike):
        self.host_dir = os.fspath(host_dir)
        self.node = os.path.basename(os.path.normpath(self.host_dir))
        self.cgroup_base = container.host_cgroup_base_inside(self.host_dir)

    @property
    def host_path(self) -> "Path":
        from pathlib import Path

        return Path(self.host_dir)

    # ------------------------------------------------------------ shared checks
    def vmid(self, raw: str, cmd: str) -> int:
        if not raw.isdigit():
            raise ParseError(f"400 Parameter verification failed.\nvmid: type check ('integer') failed - got '{raw}'")
        vmid = int(raw)
        if vmid < 100:
            raise ParseError("400 Parameter verification failed.\nvmid: value must have a minimum value of 100")
        return vmid

    def load_config(self, vmid: int) -> str:
        path = os.path.join(self.host_dir, "ct", str(vmid), "config")
        try:
            with open(path) as handle:
                return handle.read()
        except OSError:
            raise Die(f"Configuration file 'nodes/{self.node}/lxc/{vmid}.conf' does not exist") from None

    def init_pid(self, vmid: int) -> int | None:
        return container.find_init(self.host_dir, vmid, self.cgroup_base)

    # ------------------------------------------------------------ commands
    def cmd_list(self) -> int:
        rows = []
        for vmid in container.list_vmids(self.host_dir):
            state = "running" if self.init_pid(vmid) else "stopped"
            rows.append((str(vmid), state, "", container.container_hostname(self.host_dir, vmid)))
        if not rows:
            return 0  # pct list prints nothing at all when there is no container
        fmt = "%-10s %-10s %-12s %-20s\n"
        sys.stdout.write(fmt % ("VMID", "Status", "Lock", "Name"))
        for row in rows:
            sys.stdout.write(fmt % row)
        return 0

    def cmd_status(self, vmid: int, verbose: bool) -> int:
        text = self.load_config(vmid)
        pid = self.init_pid(vmid)
        state = "running" if pid else "stopped"
        if not verbose:
            print(f"status: {state}")
            return 0
        plain, _ = container.parse_config(text)
        stat = {
            "cpus": plain.get("cores", "1"),
            "maxdisk": 536870912000,
            "maxmem": int(plain.get("memory", "512")) * 1024 * 1024,
            "maxswap": int(plain.get("swap", "0")) * 1024 * 1024,
            "name": plain.get("hostname", f"ct{vmid}"),
            "status": state,
            "type": "lxc",
            "vmid": vmid,
            "uptime": 0,
        }
        if pid:
            stat["pid"] = pid
            stat["uptime"] = _uptime_of(pid)
        for key in sorted(stat):
            print(f"{key}: {stat[key]}")
        return 0

    def cmd_config(self, vmid: int) -> int:
        sys.stdout.write(container.format_config(self.load_config(vmid)))
        return 0

    def cmd_start(self, vmid: int) -> int:
        self.load_config(vmid)
        try:
            container.start_container(self.host_path, vmid, self.cgroup_base)
        except container.ContainerError as exc:
            raise Die(str(exc)) from None
        return 0

    def cmd_stop(self, vmid: int) -> int:
        self.load_config(vmid)
        try:
            container.stop_container(self.host_path, vmid, self.cgroup_base)
        except container.ContainerError as exc:
            raise Die(str(exc)) from None
        return 0

    def cmd_shutdown(self, vmid: int, timeout: int, force: bool) -> int:
        self.load_config(vmid)
        try:
            container.shutdown_container(self.host_path, vmid, self.cgroup_base, timeout, force)
        except container.ContainerError as exc:
            raise Die(str(exc)) from None
        return 0

    def cmd_exec(self, vmid: int, command: list[str]) -> int:
        self.load_config(vmid)
        pid = self.init_pid(vmid)
        if not pid:
            raise Die(f"container '{vmid}' not running!")
        if not command:
            raise perl_die("missing command", 247)
        use_pty = any(os.isatty(fd) for fd in (0, 1, 2))
        if use_pty:
            # before setns: in the container the host's stdlib may be hidden. Only here: the
            # non-interactive exec (every tool's remote command) does not pay for these imports.
            import pty  # noqa: F401
            import select  # noqa: F401
            import termios  # noqa: F401
            import tty  # noqa: F401
        enter_container(pid, vmid, self.cgroup_base)
        env = dict(os.environ)
        env["PATH"] = EXEC_PATH
        return run_inside(command, env, use_pty)

    def cmd_push(self, vmid: int, src: str, dest: str, opts: dict[str, str]) -> int:
        self.load_config(vmid)
        pid = self.init_pid(vmid)
        if not pid:
            raise Die("can only push files to a running CT")
        perms = _perms(opts.get("perms"))
        try:
            src_fd = os.open(src, os.O_RDONLY)
        except OSError:
            raise Die(f"failed to open {src} for reading") from None
        # As pct does: open the source here, then enter the container's mount namespace in a forked
        # worker and create the destination there (names for --user/--group resolve in the container).
        return _in_mount_ns_worker(pid, lambda: _copy_fd(src_fd, _create_file(dest, perms, opts.get("user"), opts.get("group"))))

    def cmd_pull(self, vmid: int, path: str, dest: str, opts: dict[str, str]) -> int:
        self.load_config(vmid)
        pid = self.init_pid(vmid)
        if not pid:
            raise perl_die("can only pull files from a running VM", 376)
        perms = _perms(opts.get("perms"))
        dest_fd = _create_file(dest, perms, opts.get("user"), opts.get("group"))

        def copy_out() -> None:
            try:
                src_fd = os.open(path, os.O_RDONLY)
            except OSError as exc:
                raise Die(f"failed to open {path}: {exc.strerror}") from None
            _copy_fd(src_fd, dest_fd)

        return _in_mount_ns_worker(pid, copy_out)


# ---------------------------------------------------------------- helpers


def _uptime_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            start_ticks = int(handle.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as handle:
            uptime = float(handle.read().split()[0])
        return max(0, int(uptime - start_ticks / os.sysconf("SC_CLK_TCK")))
    except (OSError, ValueError, IndexError):
        return 0


def _perms(raw: str | None) -> int | None:
    if raw is None:
        return None
    text = raw if raw.startswith("0") else "0" + raw  # pct: octal by default
    try:
        if text.lower().startswith("0x"):
            return int(text, 16)
        return int(text, 8)
    except ValueError:
        raise Die(f"invalid mode: '{text}'") from None


def _create_file(path: str, perms: int | None, user: str | None, group: str | None) -> int:
    """pct's create_file: explicit perms (umask ignored), owner by name or number."""
    uid = gid = None
    if user is not None:
        if user.isdigit():
            uid = int(user)
        else:
            try:
                uid = pwd.getpwnam(user).pw_uid
            except KeyError:
                raise Die(f"failed to get uid for: {user}") from None
    if group is not None:
        if group.isdigit():
            gid = int(group)
        else:
            try:
                gid = grp.getgrnam(group).gr_gid
            except KeyError:
                raise Die(f"failed to get gid for: {group}") from None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0)
        if perms is None:
            umask = os.umask(0)
            os.umask(umask)
            perms = 0o666 & ~umask
    except FileExistsError:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        except OSError as exc:
            raise Die(f"failed to create file: {path}: {exc.strerror}") from None
    except OSError as exc:
        raise Die(f"failed to create file: {path}: {exc.strerror}") from None
    if perms is not None:
        os.fchmod(fd, perms)
    if uid is not None or gid is not None:
        try:
            os.fchown(fd, -1 if uid is None else uid, -1 if gid is None else gid)
        except OSError as exc:
            raise Die(f"failed to change file owner: {exc.strerror}") from None
    return fd


def _copy_fd(src: int, dst: int) -> None:
    while True:
        chunk = os.read(src, 1 << 20)
        if not chunk:
            break
        view = memoryview(chunk)
        while view:
            view = view[os.write(dst, view):]
    os.close(src)
    os.close(dst)


def _in_mount_ns_worker(pid: int, work) -> int:
    """Run work() in a forked child that entered the container's mount namespace (pct's fork_worker)."""
    ns_fd = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY)
    child = os.fork()
    if child == 0:
        code = 0
        try:
            nsutil.setns(ns_fd, nsutil.CLONE_NEWNS)
            os.chdir("/")
            work()
        except Die as exc:
            sys.stderr.write(f"{exc}\n")
            code = DIE
        except BaseException as exc:  # a failed task: report, exit like a die
            sys.stderr.write(f"{exc}\n")
            code = DIE
        sys.stderr.flush()
        os._exit(code)
    os.close(ns_fd)
    _, status = os.waitpid(child, 0)
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else DIE


def enter_container(pid: int, vmid: int, cgroup_base: str | None) -> None:
    """Join the container's cgroup, then its namespaces (children will be in its PID namespace)."""
    fds = {}
    for name in ("cgroup", "ipc", "uts", "net", "pid", "mnt"):
        fds[name] = os.open(f"/proc/{pid}/ns/{name}", os.O_RDONLY)
    if cgroup_base:
        try:
            nsutil.join_cgroup(os.path.join(cgroup_base, "lxc", str(vmid)))
        except OSError:
            pass
    cwd = os.getcwd() if os.path.exists(".") else "/"
    for name, fd in fds.items():
        nsutil.setns(fd, nsutil.NS_FLAGS[name])
        os.close(fd)
    try:
        os.chdir(cwd)  # lxc-attach keeps the working directory when it exists in the container
    except OSError:
        os.chdir("/")


def _exit_code(status: int) -> int:
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def _exec_child(command: list[str], env: dict[str, str]) -> None:
    try:
        os.execvpe(command[0], command, env)
    except FileNotFoundError:
        sys.stderr.write(f"lxc-attach: {command[0]}: No such file or directory\n")
        os._exit(127)
    except PermissionError:
        sys.stderr.write(f"lxc-attach: {command[0]}: Permission denied\n")
        os._exit(126)
    except OSError as exc:
        sys.stderr.write(f"lxc-attach: {command[0]}: {exc.strerror}\n")
        os._exit(1)


def run_inside(command: list[str], env: dict[str, str], use_pty: bool) -> int:
    """Fork the command (in the container's PID namespace), relay signals, return its exit code."""
    if use_pty:
        return _run_with_pty(command, env)
    child = os.fork()
    if child == 0:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        _exec_child(command, env)
    forward = lambda signum, _frame: os.kill(child, signum)  # noqa: E731 -- tiny relay
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, forward)
    while True:
        try:
            _, status = os.waitpid(child, 0)
            return _exit_code(status)
        except InterruptedError:
            continue


def _run_with_pty(command: list[str], env: dict[str, str]) -> int:
    """lxc-attach's behaviour when any std fd is a tty: a pty inside, stderr merged, CRLF."""
    import pty  # already imported by cmd_exec before it entered the container
    import select
    import termios
    import tty

    child, master = pty.fork()
    if child == 0:
        _exec_child(command, env)
    saved = None
    if os.isatty(0):
        try:
            saved = termios.tcgetattr(0)
            tty.setraw(0)
        except termios.error:
            saved = None
    try:
        stdin_open = True
        while True:
            fds = [master] + ([0] if stdin_open else [])
            try:
                ready, _, _ = select.select(fds, [], [])
            except InterruptedError:
                continue
            if master in ready:
                try:
                    data = os.read(master, 65536)
                except OSError:
                    data = b""
                if not data:
                    break
                os.write(1, data)
            if 0 in ready:
                data = os.read(0, 65536)
                if not data:
                    stdin_open = False
                    os.write(master, b"\x04")
                else:
                    os.write(master, data)
    finally:
        if saved is not None:
            termios.tcsetattr(0, termios.TCSADRAIN, saved)
    _, status = os.waitpid(child, 0)
    return _exit_code(status)


def usage_error(cmd: str, message: str) -> int:
    sys.stderr.write(f"{message}\n")
    if "400 " not in message:
        sys.stderr.write("400 unable to parse option\n")
    sys.stderr.write(f"{USAGES[cmd]}\n")
    return DIE


def main(argv: list[str], host_dir: str | None = None) -> int:
    """Entry point; host_dir is baked into the lab host's pct wrapper."""
    hdir = host_dir or os.environ.get("GPUGATE_LAB_HOST_DIR", ".")
    if not argv or argv[0] in ("help", "-h", "--help"):
        sys.stderr.write("USAGE: pct <COMMAND> [ARGS] [OPTIONS]\n" + "".join(f"       {u}\n" for u in USAGES.values()))
        return DIE if not argv else 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in USAGES:
        sys.stderr.write(f"unknown command 'pct {cmd}'\nUSAGE: pct <COMMAND> [ARGS] [OPTIONS]\n")
        return DIE
    pct = Pct(hdir)
    try:
        positionals, opts, extra = parse_args(cmd, rest)
        wanted = POSITIONALS[cmd]
        if len(positionals) < wanted:
            order = ["vmid", "file" if cmd == "push" else "path", "destination"]
            missing = order[len(positionals)]
            raise ParseError(f"400 not enough arguments\n{missing}: property is missing and it is not optional")
        if len(positionals) > wanted:
            raise ParseError("400 too many arguments")
        if cmd == "list":
            return pct.cmd_list()
        vmid = pct.vmid(positionals[0], cmd)
        if cmd == "status":
            return pct.cmd_status(vmid, truthy(opts.get("verbose")))
        if cmd == "config":
            return pct.cmd_config(vmid)
        if cmd == "start":
            return pct.cmd_start(vmid)
        if cmd == "stop":
            return pct.cmd_stop(vmid)
        if cmd == "shutdown":
            return pct.cmd_shutdown(vmid, int(opts.get("timeout", "60")), truthy(opts.get("forceStop")))
        if cmd == "exec":
            return pct.cmd_exec(vmid, extra)
        if cmd == "push":
            return pct.cmd_push(vmid, positionals[1], positionals[2], opts)
        if cmd == "pull":
            return pct.cmd_pull(vmid, positionals[1], positionals[2], opts)
    except ParseError as exc:
        return usage_error(cmd, str(exc))
    except Die as exc:
        sys.stderr.write(f"{exc}\n")
        return DIE
    return DIE


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
