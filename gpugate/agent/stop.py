"""The stop of a transition (a step of gpugate.agent.transition.Transition, over its Context): drain (SIGTERM, SGLang's
graceful drain, up to its deadline), SIGKILL of what is left of the server's own tree, and a sweep
of stray server parts of this port or holding this server's GPUs. Never a process group, never a
client, a notebook or a monitor.
"""

from __future__ import annotations

import os
import signal
import time

from gpugate.agent.engine import engine
from gpugate.agent import observe, server, state
from gpugate.rules import procfs

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is never imported at run time (~10 ms of every agent command)
    from typing import Dict, Optional, Set, Tuple

    from gpugate.agent.context import Context, Table

DRAIN_POLL_S = 0.02


class Stop(object):
    """The stop's steps over the run's Context (budgets, journal, the children it reaps)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    # ------------------------------------------------------------------ stop
    def server(self, port: int, target: str, drain_timeout_s: float) -> None:
        """Drain (SIGTERM, up to ``drain_timeout_s``), SIGKILL what is left of the server's own
        tree, sweep stray server parts of this port / holding this server's GPUs."""
        ctx = self.ctx
        table = procfs.table()
        own = server.own_pids(table) | set(ctx.gated_tree(table))  # a gated engine of ours waits for this stop
        main, tree = server.find_server(table, port, own)
        snapshot = dict((pid, table[pid]["start_ticks"]) for pid in tree if pid in table)
        spec_gpus = self._gpus_for_port(port)
        began = time.time()
        ctx.event("stop", "begin", target=target, port=port,
                  main=main["pid"] if main else None, tree=len(snapshot))
        if main is not None:
            ctx.touched = True
            self._systemd_stop(port)
            try:
                os.kill(main["pid"], signal.SIGTERM)
            except ProcessLookupError:
                pass
            ctx.event("drain", "begin", target=target, port=port, pid=main["pid"], timeout_s=drain_timeout_s)
            deadline = began + float(drain_timeout_s)
            while procfs.alive(main["pid"], main["start_ticks"]) and time.time() < deadline:
                ctx.reap()
                ctx.progress("drain", target=target, port=port, elapsed_s=round(time.time() - began, 1),
                             alive=sum(1 for pid, t in snapshot.items() if procfs.alive(pid, t)))
                time.sleep(DRAIN_POLL_S)
            drained = not procfs.alive(main["pid"], main["start_ticks"])
            ctx.event("drain", "end", target=target, port=port, drained=drained,
                      elapsed_s=round(time.time() - began, 2))
        # Kill: what is left of the tree (children spawned since the snapshot included).
        table = procfs.table()
        targets: Dict[int, Optional[int]] = dict((pid, ticks) for pid, ticks in snapshot.items() if procfs.alive(pid, ticks))
        if main is not None and procfs.alive(main["pid"], main["start_ticks"]):
            for pid in procfs.descendants(table, main["pid"]):
                if pid in table and pid not in own:
                    targets[pid] = table[pid]["start_ticks"]
        if targets:
            ctx.touched = True
            ctx.event("kill", "begin", target=target, port=port, pids=sorted(targets))
            for pid in targets:
                procfs.kill(pid, targets[pid])
        # Sweep: stray server parts of this port or on this server's GPUs (never clients).
        strays = self._strays(port, spec_gpus, set(targets) | own)
        if strays:
            ctx.touched = True
            ctx.event("sweep", "begin", target=target, port=port,
                      pids=[{"pid": pid, "why": why} for pid, (_, why) in sorted(strays.items())])
            for pid, (ticks, _) in strays.items():
                procfs.kill(pid, ticks)
        waiting = dict(targets)
        waiting.update((pid, ticks) for pid, (ticks, _) in strays.items())
        deadline = time.time() + float(ctx.budget("kill_grace_s"))
        while waiting and time.time() < deadline:
            ctx.reap()
            waiting = dict((pid, t) for pid, t in waiting.items() if procfs.alive(pid, t))
            if waiting:
                ctx.progress("kill", target=target, port=port, waiting=len(waiting))  # the heartbeat
                time.sleep(DRAIN_POLL_S)
        if targets or strays:
            ctx.event("kill", "end", target=target, port=port, killed=sorted(targets),
                      swept=sorted(strays), survivors=sorted(waiting))
        self._remove_pid_file(port)
        ctx.event("stop", "end", target=target, port=port, elapsed_s=round(time.time() - began, 2),
                  stopped=main is not None)
        if waiting:
            table = procfs.table()
            raise state.Failure("processes outlived SIGKILL on :%d: %s" % (port, ", ".join(
                "%d (%s, state %s)" % (pid, " ".join(table.get(pid, {}).get("argv") or [])[:60],
                                       table.get(pid, {}).get("state")) for pid in sorted(waiting))))

    def gpu_holders(self) -> None:
        """``end_gpu_holders``: the GPU holders the operator was shown and agreed to end
        ([{pid, start_ticks}] from observe's container.gpu_holders): SIGTERM, ``kill_grace_s``,
        SIGKILL. A pid that is now another process (start time differs) is left alone."""
        ctx = self.ctx
        wanted = [item if isinstance(item, dict) else {"pid": item} for item in ctx.doc.get("end_gpu_holders") or []]
        if not wanted:
            return
        own = server.own_pids(procfs.table())
        targets = dict((int(item["pid"]), item.get("start_ticks")) for item in wanted
                       if int(item["pid"]) not in own and int(item["pid"]) > 1 and procfs.alive(int(item["pid"]), item.get("start_ticks")))
        targets = dict((pid, ticks if ticks is not None else (procfs.read_stat(pid) or (None,) * 5)[4])
                       for pid, ticks in targets.items())
        ctx.event("end_holders", "begin", pids=sorted(targets))
        ended = procfs.end_processes(targets, float(ctx.budget("kill_grace_s")), DRAIN_POLL_S)
        ctx.event("end_holders", "end", terminated=sorted(ended["terminated"]), killed=sorted(ended["killed"]))

    def _gpus_for_port(self, port: int) -> Set[int] | None:
        for spec in (self.ctx.desired, self.ctx.replaces, self.ctx.rollback):
            if spec and spec.get("port") == port and spec.get("gpus") is not None:
                return set(spec["gpus"])
        return None

    def _strays(self, port: int, gpus: Set[int] | None, skip: Set[int]) -> Dict[int, Tuple[Optional[int], str]]:
        """pid -> (start ticks, why) of server parts outside any live tree we keep: a main of this
        port, a part listening on it, or an orphaned part holding memory on this server's GPUs."""
        table = procfs.table()
        own = server.own_pids(table) | set(self.ctx.gated_tree(table))
        out: Dict[int, Tuple[Optional[int], str]] = {}
        inodes = server.listeners(port)
        holders_on: Dict[int, Set[int]] = {}
        on_devices: Dict[int, Set[int]] = {}
        orphans = [p for p in table.values() if engine.is_worker_argv(p["argv"]) and p["pid"] not in skip
                   and not any(engine.is_main_argv(table[a]["argv"]) for a in procfs.ancestors(table, p["pid"]) if a in table and a != p["pid"])]
        if orphans and (gpus is None or gpus):  # a GPU reading only when an orphaned part might hold ours
            doc = observe.read_gpus(exclude=own)
            for holder in doc.get("holders") or []:
                holders_on[holder["pid"]] = set(holder.get("gpus") or [])
            on_devices = dict((h["pid"], set(int(d[len("/dev/nvidia"):]) for d in h.get("devices") or []
                                             if d[len("/dev/nvidia"):].isdigit())) for h in doc.get("holders") or [])
        else:
            on_devices = {}
        listening = set(server.socket_owners(inodes)) if inodes else set()
        live_mains = dict((p["pid"], engine.argv_port(p["argv"])) for p in table.values()
                          if engine.is_main_argv(p["argv"]) and p["state"] not in ("Z", "X") and p["pid"] not in skip)
        for proc in table.values():
            pid = proc["pid"]
            if pid in skip or pid in own or pid == 1 or proc["state"] in ("Z", "X") or not engine.is_server_part(proc["argv"]):
                continue
            why = None
            if engine.is_main_argv(proc["argv"]) and engine.argv_port(proc["argv"]) == port:
                why = "a server main configured for :%d" % port
            elif pid in listening:
                why = "listens on :%d" % port
            else:
                owner_ports = [live_mains[a] for a in procfs.ancestors(table, pid) if a in live_mains and a != pid]
                if owner_ports and port in owner_ports:
                    why = "a part of the :%d server" % port
                elif not owner_ports and not engine.is_main_argv(proc["argv"]):
                    mem = holders_on.get(pid, set())
                    dev = on_devices.get(pid, set())
                    if gpus is None and (mem or dev):
                        why = "an orphaned server part holding GPUs"
                    elif gpus and (mem & gpus or dev & gpus):
                        why = "an orphaned server part holding GPU(s) %s of this server" % sorted((mem | dev) & gpus)
            if why:
                out[pid] = (proc["start_ticks"], why)
        return out

    @staticmethod
    def _systemd_stop(port: int) -> None:
        if server.pid1_comm() != "systemd" or not os.path.exists(state.paths(port)["unit"]):
            return
        import subprocess

        subprocess.run(["systemctl", "stop", "--no-block", state.paths(port)["unit_name"]], stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)

    @staticmethod
    def _remove_pid_file(port: int) -> None:
        try:
            os.unlink(state.paths(port)["pid"])
        except OSError:
            pass
