"""The `gpugate` console script: the local lab (`gpugate lab up|down|status|fault|ssh`).

Example:
    $ gpugate lab up --hosts 2
    $ gpugate lab ssh pve1 pct exec 129 -- nvidia-smi
    $ gpugate lab down
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from gpugate.lab import core


def _vmids(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpugate", description="gated SGLang restarts; the local lab")
    top = parser.add_subparsers(dest="group", required=True)
    lab = top.add_parser("lab", help="the local lab of simulated Proxmox GPU hosts")
    lab.add_argument("--dir", type=Path, default=None, help="state dir (default $GPUGATE_LAB_DIR or /tmp/gpugate-lab)")
    sub = lab.add_subparsers(dest="action", required=True)
    up = sub.add_parser("up", help="start the lab (a lab already up is left as it is)")
    up.add_argument("--hosts", type=int, default=1)
    up.add_argument("--gpus", type=int, default=core.DEFAULT_GPUS)
    up.add_argument("--gpu-mib", type=int, default=core.DEFAULT_GPU_MIB)
    up.add_argument("--containers", type=_vmids, default=core.DEFAULT_VMIDS, help="vmids per host, e.g. 129,130")
    up.add_argument("--dir", type=Path, default=None, dest="dir_late")
    sub.add_parser("down", help="stop every lab host (state is kept)").add_argument("--dir", type=Path, default=None, dest="dir_late")
    st = sub.add_parser("status", help="hosts, SSH ports, containers, GPU memory")
    st.add_argument("--json", action="store_true")
    st.add_argument("--dir", type=Path, default=None, dest="dir_late")
    fault = sub.add_parser("fault", help="inject (or --clear) a fault into a container")
    fault.add_argument("--host", required=True)
    fault.add_argument("--vmid", type=int, required=True)
    fault.add_argument("--clear", action="store_true")
    fault.add_argument("name", help="ignore-sigterm, orphan-worker, stuck-memory, foreign-holder, "
                                    "crash-on-start, never-healthy, slow-start=SECONDS")
    fault.add_argument("--dir", type=Path, default=None, dest="dir_late")
    ssh = sub.add_parser("ssh", help="ssh into a lab host (host key checked)")
    ssh.add_argument("host")
    ssh.add_argument("command", nargs=argparse.REMAINDER)
    ssh.add_argument("--dir", type=Path, default=None, dest="dir_late")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    lab_dir = (getattr(args, "dir_late", None) or args.dir or core.default_lab_dir()).resolve()
    try:
        if args.action == "up":
            started = time.monotonic()
            state = core.up(lab_dir, hosts=args.hosts, gpus=args.gpus, gpu_mib=args.gpu_mib, vmids=args.containers)
            sys.stdout.write(core.format_status(state))
            print(f"fleet file: {state['fleet']}")
            print(f"lab up in {time.monotonic() - started:.2f}s")
            return 0
        if args.action == "down":
            stopped = core.down(lab_dir)
            print(f"stopped: {', '.join(stopped) if stopped else 'nothing was running'}")
            return 0
        if args.action == "status":
            state = core.status(lab_dir)
            print(json.dumps(state, indent=2) if args.json else core.format_status(state), end="" if not args.json else "\n")
            return 0
        if args.action == "fault":
            try:
                from gpugate.lab import faults  # noqa: PLC0415 -- optional until it lands
            except ImportError:
                print("gpugate.lab.faults is not available in this checkout", file=sys.stderr)
                return 2
            print(faults.apply_fault(lab_dir, args.host, args.vmid, args.name, clear=args.clear))
            return 0
        if args.action == "ssh":
            argv_ssh = core.ssh_argv(lab_dir, args.host)
            if sys.stdin.isatty() and not args.command:
                argv_ssh.insert(1, "-t")
            os.execvp(argv_ssh[0], argv_ssh + args.command)
    except core.LabError as exc:
        print(f"gpugate: {exc}", file=sys.stderr)
        return 1
    return 1


if __name__ == "__main__":
    sys.exit(main())
