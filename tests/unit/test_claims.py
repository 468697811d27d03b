"""GPU claims per Proxmox host: the plan-time overlap check, and the host-side lock holder run as the
real program (its own process, real flocks, a real child it waits for) with a local lock directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpugate import host_gpu_lock
from gpugate.claims import gpu_ranges, overlapping_claims, servers_of_inventory
from gpugate.remote import pack

# ---------------------------------------------------------------- plan time


def test_two_servers_of_one_host_on_shared_gpus_are_both_named():
    lines = overlapping_claims([("pve1", 129, 30000, tuple(range(8))), ("pve1", 130, 30000, tuple(range(8))),
                                ("pve2", 129, 30000, tuple(range(8)))])
    assert lines == ["pve1: ct 129 :30000 (GPU 0-7) and ct 130 :30000 (GPU 0-7) claim the same GPU 0-7"]


def test_disjoint_halves_and_other_hosts_do_not_overlap():
    assert overlapping_claims([("pve1", 129, 30000, (0, 1, 2, 3)), ("pve1", 130, 30000, (4, 5, 6, 7)),
                               ("pve2", 131, 30000, (0, 1, 2, 3))]) == []


claims = st.lists(st.tuples(st.sampled_from(["pve1", "pve2"]), st.integers(100, 105), st.sampled_from([30000, 30001]),
                            st.lists(st.integers(0, 7), max_size=8).map(tuple)), max_size=6)


@given(claims)
def test_one_line_per_overlapping_pair_naming_both(servers):
    lines = overlapping_claims(servers)
    pairs = [(a, b) for i, a in enumerate(servers) for b in servers[i + 1:]
             if a[0] == b[0] and set(a[3]) & set(b[3])]
    assert len(lines) == len(pairs)
    for line, (a, b) in zip(lines, pairs):
        assert line.startswith(f"{a[0]}: ct {a[1]} :{a[2]} ") and f" and ct {b[1]} :{b[2]} " in line
        assert line.endswith(f"claim the same GPU {gpu_ranges(set(a[3]) & set(b[3]))}")


def test_servers_of_inventory_reads_host_data_and_skips_absent_servers():
    def gpu_set(flags, env):  # what gpugate.spec.gpu_set does for tp and base-gpu-id
        return range(flags.get("base-gpu-id", 0), flags.get("base-gpu-id", 0) + flags.get("tp-size", 1))

    hosts = [("@pct/pve1:129", {"pve_host": "pve1", "pct_vmid": 129, "sglang_flags": {"tp-size": 4}}),
             ("@pct/pve1:130", {"pve_host": "pve1", "pct_vmid": 130, "sglang_port": 30001,
                                "sglang_flags": {"tp-size": 4, "base-gpu-id": 4}}),
             ("@pct/pve1:131", {"pve_host": "pve1", "pct_vmid": 131, "sglang_present": "no"}),
             ("@pct/@local:132", {"pct_vmid": 132, "pct_local": True, "sglang_flags": {"tp-size": 2}})]
    assert servers_of_inventory(hosts, gpu_set) == [("pve1", 129, 30000, (0, 1, 2, 3)),
                                                    ("pve1", 130, 30001, (4, 5, 6, 7)), ("@local", 132, 30000, (0, 1))]


# ---------------------------------------------------------------- the holder on the Proxmox host


class Holders:
    """Run the real holder program (packed, as the connector sends it) with `pct` standing for a
    command that returns when its run's file appears: `sh -c 'until [ -e FILE ]...' FILE exec ...`."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.lock_dir = tmp / "locks"
        self.program = pack(Path(host_gpu_lock.__file__).read_text())

    def take(self, vmid: int, gpus, run: str, wait_s: float = 0) -> dict:
        done = self.tmp / f"{run}.done"
        args = {"vmid": vmid, "gpus": list(gpus), "run": run, "wait_s": wait_s, "lock_dir": str(self.lock_dir),
                "command": "true", "path": "/usr/bin:/bin", "clear_env": False, "grace_s": 30,
                "pct": ["sh", "-c", 'until [ -e "$0" ]; do sleep 0.02; done', str(done)]}
        started = time.monotonic()
        out = subprocess.run([sys.executable, "-c", self.program, json.dumps(args)], capture_output=True,
                             text=True, timeout=30, check=True)
        answer = json.loads(out.stdout.strip().splitlines()[-1])
        answer["took_s"] = time.monotonic() - started
        return answer

    def end(self, run: str) -> None:
        (self.tmp / f"{run}.done").touch()

    def released(self) -> list[dict]:
        log = self.lock_dir / "holders.log"
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


@pytest.fixture
def holders(tmp_path):
    h = Holders(tmp_path)
    yield h
    for run in ("r1", "r2", "r3"):  # end every holder a test left (its wait returns)
        h.end(run)


def wait_for(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_second_transition_on_shared_gpus_is_refused_naming_the_first(holders):
    first = holders.take(129, [3, 0, 1, 2], "r1")
    assert first["ok"] and first["took_s"] < 5  # the command returns; the holder lives on
    os.kill(first["pid"], 0)
    record = json.loads((holders.lock_dir / "gpu-2.lock").read_text())
    assert record["vmid"] == 129 and record["run"] == "r1" and record["gpus"] == [0, 1, 2, 3]
    assert record["pid"] == first["pid"]

    second = holders.take(130, [2, 3, 4, 5], "r2")
    assert second["ok"] is False and second["gpu"] == 2 and second["owner"]["vmid"] == 129
    # what it had taken before meeting the busy GPU is free again: a disjoint transition goes ahead
    third = holders.take(131, [4, 5, 6, 7], "r3")
    assert third["ok"]

    holders.end("r1")  # the first run ended: its agent's wait returned
    wait_for(lambda: [line["run"] for line in holders.released()] == ["r1"])
    assert holders.take(130, [0, 1, 2, 3], "r2")["ok"]


def test_a_waiting_transition_gets_the_gpus_when_the_first_ends(holders):
    assert holders.take(129, [0, 1], "r1")["ok"]
    subprocess.Popen([sys.executable, "-c", "import time,pathlib,sys; time.sleep(0.5); pathlib.Path(sys.argv[1]).touch()",
                      str(holders.tmp / "r1.done")])
    second = holders.take(130, [1], "r2", wait_s=10)
    assert second["ok"] and 0.3 < second["took_s"] < 9


def test_a_dead_holder_frees_its_gpus(holders):
    first = holders.take(129, [0], "r1")
    os.kill(first["pid"], 9)
    wait_for(lambda: holders.take(130, [0], "r2")["ok"])


def test_the_lab_fleet_claims_no_gpu_twice_and_the_old_one_did(tmp_path):
    from gpugate.fleet import fleet_to_inventory, load_fleet
    from gpugate_lab.core import fleet_document, render_fleet_yaml

    path = tmp_path / "fleet.yaml"
    path.write_text(render_fleet_yaml(fleet_document(tmp_path, [("pve1", 2201)], {"pve1": [129, 130, 131]})))
    members = fleet_to_inventory(load_fleet(path))["pve_pve1"][0]
    servers = servers_of_inventory(members)  # gpugate.spec.gpu_set
    assert [(vmid, gpus) for _host, vmid, _port, gpus in servers] == [(129, (0, 1)), (130, (2, 3)), (131, (4, 5))]
    assert overlapping_claims(servers) == []
    old = [(name, dict(data, sglang_flags={"tp": 8})) for name, data in members[:2]]  # before: tp 8 everywhere
    assert overlapping_claims(servers_of_inventory(old)) == [
        "pve1: ct 129 :30000 (GPU 0-7) and ct 130 :30000 (GPU 0-7) claim the same GPU 0-7"]


# ---------------------------------------------------------------- the locks and the hand-off in one round trip


def hand_off(holders: Holders, vmid: int, gpus, run: str, start: str, document: bytes) -> tuple[dict, str]:
    """The holder with ``start`` (PctConnector.hand_off_holding_gpu_locks): `pct` runs its command with sh
    (``shift``: past exec VMID --), the wait command returns when the run's file appears."""
    done = holders.tmp / f"{run}.done"
    args = {"vmid": vmid, "gpus": list(gpus), "run": run, "wait_s": 0, "lock_dir": str(holders.lock_dir),
            "command": f'touch "{done}.waiting"; until [ -e "{done}" ]; do sleep 0.02; done', "path": "/usr/bin:/bin",
            "clear_env": False, "grace_s": 30, "pct": ["sh", "-c", 'shift 3; exec "$@"', "pct"],
            "start": {"command": start}}
    out = subprocess.run([sys.executable, "-S", "-c", holders.program, json.dumps(args)], input=document,
                         capture_output=True, timeout=30, check=True)
    return json.loads(out.stdout.decode().strip().splitlines()[-1]), out.stderr.decode()


def test_the_hand_off_runs_once_the_locks_are_held_with_the_claims_window(holders):
    # the "start" answers what the lock files say while it runs, and the document it was given
    probe = (f'cat > "{holders.tmp}/doc.json"; cat "{holders.lock_dir}/gpu-1.lock"; sleep 0.2; '
             f'test -e "{holders.tmp}/r1.done.waiting" && echo wait-began-early; echo pct-said >&2; exit 3')
    answer, stderr = hand_off(holders, 129, [1, 0], "r1", probe, b'{"run": "r1", "desired": null}')
    assert answer["ok"] and answer["start"]["rc"] == 3 and stderr == "pct-said\n"
    record = json.loads(answer["start"]["stdout"].splitlines()[0])
    assert record["run"] == "r1" and record["gpus"] == [0, 1] and record["pid"] == answer["pid"]
    assert "wait-began-early" not in answer["start"]["stdout"]  # the holder's wait follows the hand-off
    doc = json.loads((holders.tmp / "doc.json").read_text())
    assert doc["run"] == "r1" and doc["desired"] is None
    assert abs(doc["claim_until"] - answer["handoff_until"]) < 1e-6  # the agent refuses a hand-off after it
    holders.end("r1")  # the run ended: the holder's wait (begun after the hand-off) returns
    wait_for(lambda: [line["run"] for line in holders.released()] == ["r1"])


def test_a_busy_claim_runs_no_hand_off(holders):
    assert holders.take(129, [0, 1], "r1")["ok"]
    answer, _ = hand_off(holders, 130, [1], "r2", f'touch "{holders.tmp}/ran"', b"{}")
    assert answer["ok"] is False and answer["gpu"] == 1 and answer["owner"]["run"] == "r1"
    assert "start" not in answer and not (holders.tmp / "ran").exists()
