"""The stop of a transition (a mixin of gpugate.agent.transition.Transition): drain (SIGTERM, SGLang's
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

DRAIN_POLL_S = 0.02


class StopSteps:
    """The stop's steps; the Transition holds the state they use (budgets, journal, children)."""

    # ------------------------------------------------------------------ stop
    def _stop(self, port, target, drain_timeout_s):
        """Drain (SIGTERM, up to ``drain_timeout_s``), SIGKILL what is left of the server's own
        tree, sweep stray server parts of this port / holding this server's GPUs."""
        table = procfs.table()
        own = server.own_pids(table) | set(self._gated_tree(table))  # a gated engine of ours waits for this stop
        main, tree = server.find_server(table, port, own)
        snapshot = dict((pid, table[pid]["start_ticks"]) for pid in tree if pid in table)
        spec_gpus = self._gpus_for_port(port)
        began = time.time()
        self.event("stop", "begin", target=target, port=port,
                   main=main["pid"] if main else None, tree=len(snapshot))
        if main is not None:
            self.touched = True
            self._systemd_stop(port)
            try:
                os.kill(main["pid"], signal.SIGTERM)
            except ProcessLookupError:
                pass
            self.event("drain", "begin", target=target, port=port, pid=main["pid"], timeout_s=drain_timeout_s)
            deadline = began + float(drain_timeout_s)
            while procfs.alive(main["pid"], main["start_ticks"]) and time.time() < deadline:
                self._reap()
                self.progress("drain", target=target, port=port, elapsed_s=round(time.time() - began, 1),
                              alive=sum(1 for pid, t in snapshot.items() if procfs.alive(pid, t)))
                time.sleep(DRAIN_POLL_S)
            drained = not procfs.alive(main["pid"], main["start_ticks"])
            self.event("drain", "end", target=target, port=port, drained=drained,
                       elapsed_s=round(time.time() - began, 2))
        # Kill: what is left of the tree (children spawned since the snapshot included).
        table = procfs.table()
        targets = dict((pid, ticks) for pid, ticks in snapshot.items() if procfs.alive(pid, ticks))
        if main is not None and procfs.alive(main["pid"], main["start_ticks"]):
            for pid in procfs.descendants(table, main["pid"]):
                if pid in table and pid not in own:
                    targets[pid] = table[pid]["start_ticks"]
        if targets:
            self.touched = True
            self.event("kill", "begin", target=target, port=port, pids=sorted(targets))
            for pid in targets:
                procfs.kill(pid, targets[pid])
        # Sweep: stray server parts of this port or on this server's GPUs (never clients).
        strays = self._strays(port, spec_gpus, set(targets) | own)
        if strays:
            self.touched = True
            self.event("sweep", "begin", target=target, port=port,
                       pids=[{"pid": pid, "why": why} for pid, (_, why) in sorted(strays.items())])
            for pid, (ticks, _) in strays.items():
                procfs.kill(pid, ticks)
        waiting = dict(targets)
        waiting.update((pid, ticks) for pid, (ticks, _) in strays.items())
        deadline = time.time() + float(self.budgets["kill_grace_s"])
        while waiting and time.time() < deadline:
            self._reap()
            waiting = dict((pid, t) for pid, t in waiting.items() if procfs.alive(pid, t))
            if waiting:
                self.progress("kill", target=target, port=port, waiting=len(waiting))  # the heartbeat
                time.sleep(DRAIN_POLL_S)
        if targets or strays:
            self.event("kill", "end", target=target, port=port, killed=sorted(targets),
                       swept=sorted(strays), survivors=sorted(waiting))
        self._remove_pid_file(port)
        self.event("stop", "end", target=target, port=port, elapsed_s=round(time.time() - began, 2),
                   stopped=main is not None)
        if waiting:
            table = procfs.table()
            raise state.Failure("processes outlived SIGKILL on :%d: %s" % (port, ", ".join(
                "%d (%s, state %s)" % (pid, " ".join(table.get(pid, {}).get("argv") or [])[:60],
                                       table.get(pid, {}).get("state")) for pid in sorted(waiting))))

    def _end_gpu_holders(self):
        """``end_gpu_holders``: the GPU holders the operator was shown and agreed to end
        ([{pid, start_ticks}] from observe's container.gpu_holders): SIGTERM, ``kill_grace_s``,
        SIGKILL. A pid that is now another process (start time differs) is left alone."""
        wanted = [item if isinstance(item, dict) else {"pid": item} for item in self.doc.get("end_gpu_holders") or []]
        if not wanted:
            return
        own = server.own_pids(procfs.table())
        targets = dict((int(item["pid"]), item.get("start_ticks")) for item in wanted
                       if int(item["pid"]) not in own and int(item["pid"]) > 1 and procfs.alive(int(item["pid"]), item.get("start_ticks")))
        targets = dict((pid, ticks if ticks is not None else (procfs.read_stat(pid) or (None,) * 5)[4])
                       for pid, ticks in targets.items())
        self.event("end_holders", "begin", pids=sorted(targets))
        ended = procfs.end_processes(targets, float(self.budgets["kill_grace_s"]), DRAIN_POLL_S)
        self.event("end_holders", "end", terminated=sorted(ended["terminated"]), killed=sorted(ended["killed"]))

    def _gpus_for_port(self, port):
        for spec in (self.desired, self.replaces, self.rollback):
            if spec and spec.get("port") == port and spec.get("gpus") is not None:
                return set(spec["gpus"])
        return None

    def _strays(self, port, gpus, skip):
        """pid -> (start ticks, why) of server parts outside any live tree we keep: a main of this
        port, a part listening on it, or an orphaned part holding memory on this server's GPUs."""
        table = procfs.table()
        own = server.own_pids(table) | set(self._gated_tree(table))
        out = {}
        inodes = server.listeners(port)
        holders_on = {}
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

    def _systemd_stop(self, port):
        if server.pid1_comm() != "systemd" or not os.path.exists(state.paths(port)["unit"]):
            return
        import subprocess

        subprocess.run(["systemctl", "stop", "--no-block", state.paths(port)["unit_name"]], stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)

    def _remove_pid_file(self, port):
        try:
            os.unlink(state.paths(port)["pid"])
        except OSError:
            pass

    def _reap(self):
        for pid, child in list(self.children.items()):
            if child.poll() is not None:
                self.children.pop(pid, None)
                self.exit_codes[pid] = child.returncode
