"""The `gpugate` console script: run the deploy and the runbooks, and the local lab.

Example:
    $ gpugate --version
    $ gpugate deploy --dry                      # = pyinfra <project>/inventory.py <project>/deploy.py --dry
    $ gpugate runbook status --limit pve1       # = pyinfra <project>/inventory.py <project>/runbooks/status.py ...
    $ gpugate files                             # where inventory.py, deploy.py and the runbooks are
    $ gpugate lab up --hosts 2
    $ gpugate lab ssh pve1 pct exec 129 -- nvidia-smi
    $ gpugate lab down

`deploy` and `runbook` run pyinfra on the files that ship with gpugate (from a checkout: the
checkout's own; from a wheel: gpugate/project/ in site-packages), in the current directory, so
`./fleet.yaml` (or $GPUGATE_FLEET) is the fleet; every argument after the name goes to pyinfra.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import gpugate
from gpugate import resources

try:  # the local lab is its own package (lab/ in a checkout), out of the product wheel
    from gpugate_lab import core
except ImportError:  # pragma: no cover - an installed wheel without the lab
    core = None  # type: ignore[assignment]

LAB_MISSING = ("the local lab is not installed: it is its own package, in a checkout's lab/ "
               "(`pip install -e lab/`; scripts/bootstrap does it)")

PYINFRA_COMMANDS = ("deploy", "runbook")


class CommandError(Exception):
    """A command line gpugate cannot run; str() says why, in one line."""

READ_ONLY_RUNBOOKS = ("status", "who_holds_gpus")


def _vmids(text: str) -> tuple[tuple[int, ...], dict[int, tuple[int, ...]]]:
    """``--containers``: vmids, each with the GPUs its config passes in when given (``129:0-3``).

    >>> _vmids("129:0-3,130:four")
    Traceback (most recent call last):
    argparse.ArgumentTypeError: '129:0-3,130:four' is not a comma-separated list of vmids, each with its GPUs when given (e.g. 129,130 or 129:0-3,130:4-7)
    >>> _vmids("129:0-1,130:2-3")
    ((129, 130), {129: (0, 1), 130: (2, 3)})
    """
    vmids: list[int] = []
    maps: dict[int, tuple[int, ...]] = {}
    try:
        for part in filter(None, (p.strip() for p in text.split(","))):
            vmid, colon, gpus = part.partition(":")
            vmids.append(int(vmid))
            if colon:
                first, _, last = gpus.partition("-")
                maps[int(vmid)] = tuple(range(int(first), int(last or first) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of vmids, each with its GPUs when "
                                         f"given (e.g. 129,130 or 129:0-3,130:4-7)") from None
    if not vmids or any(v < 100 for v in vmids):
        raise argparse.ArgumentTypeError(f"{text!r}: vmids are integers >= 100, as in Proxmox (e.g. 129,130)")
    return tuple(vmids), maps


def _engines(text: str) -> tuple[str, ...]:
    engines = tuple(part.strip() for part in text.split(",") if part.strip())
    if not engines:
        raise argparse.ArgumentTypeError(f"{text!r} names no engine")
    return engines


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be 1 or more")
    return value


def _gpus(text: str) -> int | str:
    """``--gpus``: a number of simulated GPUs, or ``real`` (this machine's NVIDIA GPUs)."""
    return "real" if text.strip().lower() == "real" else _positive(text)


def _version() -> str:
    try:
        from importlib.metadata import version  # noqa: PLC0415

        pyinfra_version = version("pyinfra")
    except Exception:  # noqa: BLE001 -- the version line must print whatever is installed
        pyinfra_version = "not installed"
    return f"gpugate {gpugate.__version__} (pyinfra {pyinfra_version}, Python {sys.version.split()[0]})"


class _Parser(argparse.ArgumentParser):
    """argparse's errors as one line (its default prints the whole usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _add_dir(parser: argparse.ArgumentParser, top_level: bool) -> None:
    # --dir is accepted before and after the action (`gpugate lab --dir X up`, `gpugate lab up --dir X`);
    # after it, the default is SUPPRESS so that it never overwrites one given before.
    parser.add_argument("--dir", type=Path, metavar="DIR", default=None if top_level else argparse.SUPPRESS,
                        help="the lab's state directory (default: $GPUGATE_LAB_DIR, else /tmp/gpugate-lab)")


def build_parser() -> argparse.ArgumentParser:
    from gpugate.engine import names as engine_names  # noqa: PLC0415 -- the installed engines, named in the help

    parser = _Parser(
        prog="gpugate", description="Declarative, GPU-gated inference-server restarts (the installed engines: "
                    + ", ".join(engine_names()) + ") in Proxmox LXC containers, on pyinfra.",
        epilog="The deploy and the runbooks are pyinfra files: `gpugate files` shows where they are.")
    parser.add_argument("--version", action="version", version=_version(), help="print the version and exit")
    top = parser.add_subparsers(dest="group", required=True, metavar="COMMAND")

    deploy = top.add_parser("deploy", help="apply deploy.py to the fleet (pyinfra arguments follow, e.g. --dry)",
                            description="Runs `pyinfra INVENTORY DEPLOY [PYINFRA_ARGS...]` with the files "
                                        "that ship with gpugate, in the current directory.")
    deploy.add_argument("pyinfra_args", nargs="*", metavar="PYINFRA_ARGS",
                        help="passed to pyinfra as they are: --dry, -y, --limit pve1, --data key=value ...")
    runbook = top.add_parser("runbook", help="run a day-2 runbook: " + ", ".join(resources.runbook_names()),
                             description="Runs `pyinfra INVENTORY runbooks/NAME.py [PYINFRA_ARGS...]`.")
    runbook.add_argument("name", help="one of: " + ", ".join(resources.runbook_names()))
    runbook.add_argument("pyinfra_args", nargs="*", metavar="PYINFRA_ARGS",
                         help="passed to pyinfra as they are: --limit pve1, --data format=json ...")
    top.add_parser("files", help="print where inventory.py, deploy.py, group_data/ and runbooks/ are")
    check = top.add_parser("check", help="check a fleet file's flags against each engine's own flag tables, "
                                         "offline (no host is contacted)",
                           description="Each server's flags against the snapshot of its engine's pinned release, "
                                       "else the newest snapshot (docs/flags.md). Exit 1 if any is refused.")
    check.add_argument("fleet", nargs="?", default=None,
                       help="the fleet file (default $GPUGATE_FLEET, else ./fleet.yaml)")
    check.add_argument("--sglang-version", default=None, metavar="VERSION",
                       help="check every server against this release's snapshot instead")
    discover = top.add_parser("discover", help="each Proxmox host's containers and the GPUs each one's config passes "
                                               "in, read over SSH with pvesh (issue 36)",
                              description="Reads each Proxmox host's container index and configs (pvesh, over the "
                                          "deploy's SSH). Exit 1 if a host did not answer.")
    discover.add_argument("hosts", nargs="*", metavar="HOST", help="Proxmox hosts of the fleet (default: all)")
    discover.add_argument("--fleet", default=None, help="the fleet file (default $GPUGATE_FLEET, else ./fleet.yaml, "
                                                        "else the lab's)")
    discover.add_argument("--format", choices=("table", "json"), default="table",
                          help="table (default) or json: one document, each container's vmid and gpus")
    discover.add_argument("--write", default=None, metavar="FILE", help="also write a fleet draft to FILE")
    discover.add_argument("--force", action="store_true", help="with --write: replace FILE if it exists")

    lab = top.add_parser("lab", help="the local lab of simulated Proxmox GPU hosts")
    if core is None:  # `gpugate lab ...` says how to install it (_lab), whatever follows
        lab.add_argument("rest", nargs=argparse.REMAINDER)
        return parser
    _add_dir(lab, top_level=True)
    sub = lab.add_subparsers(dest="action", required=True, metavar="ACTION")
    up = sub.add_parser("up", help="start the lab, or bring a stopped one back (a running host is left as it is)")
    up.add_argument("--hosts", type=_positive, default=None, metavar="N",
                    help="number of Proxmox hosts pve1..pveN (default: the hosts the lab has, else 1); "
                         "more than the lab has adds hosts, fewer is refused")
    up.add_argument("--gpus", type=_gpus, default=core.DEFAULT_GPUS, metavar="G|real",
                    help=f"simulated GPUs per host (default {core.DEFAULT_GPUS}), or `real`: containers see this "
                         "machine's NVIDIA GPUs (device nodes, driver, nvidia-smi, NVML, the torch env; "
                         "$GPUGATE_TORCH_ENV names it when `python3` is not the one with torch)")
    up.add_argument("--gpu-mib", type=_positive, default=core.DEFAULT_GPU_MIB, metavar="MIB",
                    help=f"memory of each simulated GPU in MiB (default {core.DEFAULT_GPU_MIB}, an H200)")
    up.add_argument("--init", choices=("lab", "systemd"), default=None,
                    help="PID 1 of the containers of the hosts this starts: lab (a small reaping init, the "
                         "default) or systemd (Debian's systemd, for sglang_supervisor: systemd)")
    up.add_argument("--containers", type=_vmids, default=(core.DEFAULT_VMIDS, {}), metavar="VMIDS",
                    help="containers per host, comma-separated vmids (default %s); VMID:FIRST-LAST passes only "
                         "those GPUs into it (devN lines; e.g. 129:0-3,130:4-7)" % ",".join(map(str, core.DEFAULT_VMIDS)))
    up.add_argument("--router", action="store_true",
                    help="also start a real smg on 127.0.0.1 in front of every container's server (a published "
                         "port per container); fleet.yaml gets routers: and each server's router:")
    up.add_argument("--engine", type=_engines, default=None, metavar="ENGINE[,ENGINE]",
                    help="the engine the lab's fleet serves: %s; comma-separated, one per container in turn "
                         "(%s with --containers 129,130); default what the lab had, else the first"
                         % (" or ".join(core.LAB_SERVERS), ",".join(core.LAB_SERVERS)))
    up.add_argument("--sglang-version", default=None, metavar="VERSION",
                    help="the SGLang release the stand-in is: it takes exactly that release's flags (a "
                         "snapshot in gpugate/engine/sglang/flagtables; default the newest); applies to existing containers too")
    _add_dir(up, top_level=False)
    down = sub.add_parser("down", help="stop every lab host (state, keys and the fleet file are kept)")
    _add_dir(down, top_level=False)
    st = sub.add_parser("status", help="hosts, SSH ports, containers, GPU memory")
    st.add_argument("--json", action="store_true", help="print the status as one JSON document")
    _add_dir(st, top_level=False)
    fault = sub.add_parser("fault", help="inject (or --clear) a fault into a container")
    fault.add_argument("--host", required=True, help="the lab host, e.g. pve1")
    fault.add_argument("--vmid", type=int, required=True, help="the container, e.g. 129")
    fault.add_argument("--clear", action="store_true", help="remove the fault (NAME may be `all`)")
    from gpugate_lab import faults  # noqa: PLC0415 -- the lab's own list (core is importable here)

    fault.add_argument("name", help=faults.fault_names())
    _add_dir(fault, top_level=False)
    traffic = sub.add_parser("traffic", help="send requests through a URL (smg's or a server's) for a while; "
                                             "print sent/ok/failed and the TTFT the client saw")
    traffic.add_argument("--url", required=True, help="the router's (or a server's) base URL, e.g. http://127.0.0.1:30080")
    traffic.add_argument("--rate", type=float, required=True, help="requests a second")
    traffic.add_argument("--seconds", type=float, required=True, help="how long to send")
    traffic.add_argument("--stream-share", type=float, default=0.5,
                         help="the share of streamed chat completions, 0..1 (default 0.5; the rest whole answers)")
    traffic.add_argument("--model", default=None, help="the model to name (default: the first of /v1/models)")
    _add_dir(traffic, top_level=False)
    ssh = sub.add_parser("ssh", help="ssh into a lab host (host key checked)")
    ssh.add_argument("host", help="the lab host, e.g. pve1")
    ssh.add_argument("command", nargs=argparse.REMAINDER, help="a command to run there (default: a login shell)")
    _add_dir(ssh, top_level=False)
    return parser


def pyinfra_argv(command: str, args: Sequence[str]) -> list[str]:
    """The pyinfra command line for ``gpugate deploy ARGS`` / ``gpugate runbook NAME ARGS``.

    Example: ``pyinfra_argv("runbook", ["status", "--limit", "pve1"])`` ->
    ``[python, "-m", "pyinfra", ".../inventory.py", ".../runbooks/status.py", "--limit", "pve1"]``
    """
    project = resources.project_dir()
    if command == "deploy":
        target, rest = project / "deploy.py", list(args)
    else:
        if not args or args[0].startswith("-"):
            raise CommandError("which runbook? gpugate runbook NAME [PYINFRA_ARGS...]; NAME is one of: "
                                + ", ".join(resources.runbook_names()))
        name = args[0].removesuffix(".py")
        target, rest = project / "runbooks" / f"{name}.py", list(args[1:])
        if not target.is_file():
            raise CommandError(f"no runbook {args[0]!r}; runbooks: " + ", ".join(resources.runbook_names()))
        if name in READ_ONLY_RUNBOOKS and not {"-y", "--yes", "--dry"} & set(rest):
            # read-only: nothing to confirm, and pyinfra's prompt for an unreachable host would hold the
            # report back (the status reports that host instead)
            rest.insert(0, "-y")
    return [sys.executable, "-m", "pyinfra", str(project / "inventory.py"), str(target), *rest]


def _lab_host(lab_dir: Path, name: str) -> str:
    """``name`` when the lab has that host; a one-line LabError naming the hosts it has otherwise."""
    names = core.existing_hosts(lab_dir)
    if name not in names:
        have = f"its hosts: {', '.join(names)}" if names else "it has no hosts (gpugate lab up)"
        raise core.LabError(f"no lab host {name!r} in {lab_dir}; {have}")
    return name


def _lab(args: argparse.Namespace) -> int:
    if core is None:
        raise CommandError(LAB_MISSING)
    lab_dir = (args.dir or core.default_lab_dir()).resolve()
    if args.action == "up":
        started = time.monotonic()
        binding = None
        if args.gpus == "real":
            from gpugate_lab import realgpu  # noqa: PLC0415

            try:
                binding = realgpu.discover()
            except realgpu.NoDriver as exc:
                raise core.LabError(f"--gpus real: {exc}") from None
        gpus = core.DEFAULT_GPUS if binding else args.gpus
        if args.sglang_version or not (lab_dir / "sglang-version").exists():
            from gpugate_lab import container_files  # noqa: PLC0415

            try:
                container_files.set_sglang_version(lab_dir, args.sglang_version)
            except LookupError as exc:
                raise core.LabError(f"--sglang-version: {exc.args[0]}") from None
        state = core.up(lab_dir, hosts=args.hosts, gpus=gpus, gpu_mib=args.gpu_mib, vmids=args.containers[0],
                        gpu_binding=binding, init=args.init, router=args.router, engines=args.engine,
                        gpu_maps=args.containers[1] or None)
        sys.stdout.write(core.format_status(state))
        for note in state.get("notes") or []:
            print(note)
        print(f"fleet file: {state['fleet']}")
        print(f"lab up in {time.monotonic() - started:.2f}s")
        return 0
    if args.action == "down":
        stopped = core.down(lab_dir)
        print(f"stopped: {', '.join(stopped) if stopped else 'nothing was running'}")
        return 0
    if args.action == "status":
        state = core.status(lab_dir)
        print(json.dumps(state, indent=2) if args.json else core.format_status(state), end="\n" if args.json else "")
        return 0
    if args.action == "fault":
        from gpugate_lab import faults  # noqa: PLC0415 -- only this action needs the fault machinery

        try:  # a misspelt fault is named (with the likely one) before the host is looked up
            faults.parse_fault(args.name, args.clear)
        except ValueError as exc:
            known = [name.partition("=")[0] for name in faults.FAULT_NAMES]
            key = args.name.partition("=")[0]
            close = [] if key in known else difflib.get_close_matches(key, known, 1)
            raise ValueError(f"{exc}" + (f" (did you mean {close[0]}?)" if close else "")) from None
        _lab_host(lab_dir, args.host)
        print(faults.apply_fault(lab_dir, args.host, args.vmid, args.name, clear=args.clear))
        return 0
    if args.action == "traffic":
        from gpugate_lab import traffic  # noqa: PLC0415 -- the openai client, only for this action

        if args.rate <= 0 or args.seconds <= 0 or not 0 <= args.stream_share <= 1:
            raise ValueError(f"--rate and --seconds must be > 0 and --stream-share within 0..1 (got --rate "
                             f"{args.rate:g}, --seconds {args.seconds:g}, --stream-share {args.stream_share:g})")
        return traffic.main(args.url, args.rate, args.seconds, args.stream_share, args.model)
    if args.action == "ssh":
        argv_ssh = core.ssh_argv(lab_dir, _lab_host(lab_dir, args.host))
        if sys.stdin.isatty() and not args.command:
            argv_ssh.insert(1, "-t")
        os.execvp(argv_ssh[0], argv_ssh + args.command)
    return 1


def _check(path: str, version: str | None) -> int:
    """`gpugate check fleet.yaml`: one line per server, then its problems and warnings (issue 13)."""
    from gpugate.engine import get as engine  # noqa: PLC0415
    from gpugate.fleet import container_host_data, load_fleet  # noqa: PLC0415
    from gpugate.settings import resolved  # noqa: PLC0415

    fleet = load_fleet(path)  # a fleet file that does not load is one error line (main)
    refused = 0
    for pve in fleet.hosts:
        for container in pve.containers:
            if container.sglang is None:
                continue
            server = resolved(container_host_data(pve, container))
            if not server["sglang_present"]:
                continue
            ok, lines = engine(server["engine"]).check_report(server["sglang_flags"], version or server["sglang_version"],
                                                 server["sglang_extra_args"])
            where = f"{pve.name} {container.vmid} :{server['sglang_port']}"
            print(f"{where}: {lines[0]}")
            for line in lines[1:]:
                print(f"    {line}")
            refused += not ok
    print(f"{refused} server(s) refused" if refused else "every server's flags are valid")
    return 1 if refused else 0


def _default_fleet() -> str:
    """The fleet file inventory.py reads: $GPUGATE_FLEET, else ./fleet.yaml, else the lab's."""
    lab = Path(os.environ.get("GPUGATE_LAB_DIR") or "/tmp/gpugate-lab") / "fleet.yaml"
    return os.environ.get("GPUGATE_FLEET") or ("fleet.yaml" if Path("fleet.yaml").exists() else str(lab))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in PYINFRA_COMMANDS and not {"-h", "--help"} & set(argv[1:2]):
            # Everything after the command is pyinfra's; argparse would take its options for ours.
            command = pyinfra_argv(argv[0], argv[1:])
            os.execv(command[0], command)
        args = build_parser().parse_args(argv)
        if args.group == "files":
            project = resources.project_dir()
            print(f"{'project:':<14}{project}")
            for name in ("inventory.py", "deploy.py", "group_data", "runbooks"):
                print(f"{name + ':':<14}{project / name}")
            print(f"{'templates:':<14}{resources.resource('templates')}")
            return 0
        if args.group == "discover":
            from gpugate import discover  # noqa: PLC0415

            return discover.run(args.fleet or _default_fleet(), args.hosts, args.format, args.write, args.force)
        if args.group == "check":
            return _check(args.fleet or os.environ.get("GPUGATE_FLEET") or "fleet.yaml", args.sglang_version)
        return _lab(args)
    except (CommandError, ValueError, OSError, *((core.LabError,) if core is not None else ())) as exc:
        # A mistyped command gets one line, never a traceback.
        print(f"gpugate: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
