"""The weight cache and the gated launch through the real pyinfra CLI (issue 22, docs/weight-cache.md):
``weight_cache: true`` runs SGLang's standalone daemons (the lab's stand-in follows SGLang 0.5.23's
weight_cache/daemon.py: a launcher, one child per GPU, a socket and a ``.ready`` per GPU UUID); an
engine-only flag change keeps their pids and the new engine maps them; a change of the key restarts
them; ``present: false`` stops them; and each failure around them ends in the new server verified,
the old one serving again, or a loud NOTHING SERVES, never in a client start against daemons of
another key (SGLang's hard error)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from tests import warm_pyinfra
from tests.conftest import REPO_ROOT, module_lab, poll, pyinfra_exe
from tests.e2e.lab_processes import ct_sh, start_in_container

pytestmark = [pytest.mark.lab]

# the stand-in's phases (lab/gpugate_lab/standin/sglang/_timing.py): a disk load the cache saves
ENV = {"SGLANG_STANDIN_LOAD_S": "0.2", "SGLANG_STANDIN_WEIGHT_LOAD_S": "0.5", "SGLANG_STANDIN_IPC_MAP_S": "0.05"}
SERVER = {"model_path": "/opt/models/lab-model", "port": 30000, "flags": {"tp": 2}, "env": ENV, "weight_cache": True}
FP8 = dict(SERVER, flags={"tp": 2, "kv-cache-dtype": "fp8_e4m3"})
TP4 = dict(SERVER, flags={"tp": 4, "kv-cache-dtype": "fp8_e4m3"})


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    yield from module_lab(tmp_path_factory, "lab-weight-cache", hosts=1, gpus=4)


def fleet(lab, path: Path, server: dict, **data) -> Path:
    document = yaml.safe_load(lab.fleet_path.read_text())
    container = document["hosts"]["pve1"]["containers"][129]
    container["sglang"] = server
    if data:
        container.setdefault("data", {}).update(data)
    path.write_text(yaml.safe_dump(document))
    return path


def pyinfra(lab, path: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    exe = pyinfra_exe()
    return warm_pyinfra.run([exe, "inventory.py", *args], cwd=REPO_ROOT, env=dict(lab.env(), GPUGATE_FLEET=str(path)),
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def processes(lab) -> dict[str, list[int]]:
    """The container's engine mains, daemon launchers and daemon children (pids), from /proc."""
    found: dict[str, list[int]] = {"engine": [], "launcher": [], "daemon": []}
    rows = [(str(pid), str(ppid), cmd) for pid, ppid, cmd, _argv in lab.ps("pve1", 129)]
    launchers = {int(pid) for pid, _, cmd in rows if "sglang.srt.weight_cache.daemon" in cmd}
    for pid, ppid, cmd in rows:
        if "sglang.launch_server" in cmd:
            found["engine"].append(int(pid))
        elif int(pid) in launchers:
            found["launcher"].append(int(pid))
        elif ppid.isdigit() and int(ppid) in launchers and "spawn_main" in cmd:
            found["daemon"].append(int(pid))
    return {kind: sorted(pids) for kind, pids in found.items()}


def wait_for(predicate, timeout_s: float) -> bool:
    return bool(poll(predicate, timeout_s))


def status(lab, path: Path) -> dict:
    run = pyinfra(lab, path, "-y", "runbooks/status.py", "--data", "format=json")
    return json.loads(run.stdout)["servers"][0]


def dry_then_deploy(lab, path: Path, kind: str) -> str:
    """``--dry`` names the restart ``kind``; then the deploy, which must succeed: its output."""
    dry = pyinfra(lab, path, "deploy.py", "--dry")
    assert kind in dry.stdout + dry.stderr, dry.stdout + dry.stderr
    run = pyinfra(lab, path, "-y", "deploy.py")
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout + run.stderr


SEEN: dict[str, dict] = {}  # the module's tests run in order, each on the state the one before left


def test_a_first_start_runs_the_daemons_before_the_engine_and_the_status_shows_them(lab, tmp_path):
    base = fleet(lab, tmp_path / "base.yaml", SERVER)
    first = pyinfra(lab, base, "-y", "deploy.py")
    out = first.stdout + first.stderr
    assert first.returncode == 0, out
    assert "weight cache ready on every GPU" in out, out
    before = processes(lab)
    assert len(before["engine"]) == 1 and len(before["launcher"]) == 1 and len(before["daemon"]) == 2, before
    row = status(lab, base)
    assert row["verdict"] == "serving as desired", row
    assert row["weight_cache"]["running"] and [g["index"] for g in row["weight_cache"]["gpus"]] == [0, 1], row
    assert all(g["pid"] in before["daemon"] and g["used_mib"] for g in row["weight_cache"]["gpus"]), row
    SEEN["base"] = before


def test_the_seeds_fp8_change_is_an_engine_only_restart_on_the_same_daemons(lab, tmp_path):
    before = SEEN["base"]
    out = dry_then_deploy(lab, fleet(lab, tmp_path / "fp8.yaml", FP8),
                          "restart: engine only: the weights stay on GPU 0-1 (the weight cache's key is unchanged)")
    after = processes(lab)
    assert after["launcher"] == before["launcher"] and after["daemon"] == before["daemon"], (before, after)
    assert after["engine"] != before["engine"], (before, after)
    assert "weight cache kept" in out, out
    log = ct_sh(lab, "pve1", 129, "cat /var/log/gpugate/sglang-30000.log").stdout
    assert "Zero-copy: mapped" in log.split("=== gpugate start")[-1], log[-3000:]
    SEEN["fp8"] = after


def test_a_change_of_the_key_restarts_the_daemons_first(lab, tmp_path):
    after = SEEN["fp8"]
    tp4 = fleet(lab, tmp_path / "tp4.yaml", TP4)
    dry_then_deploy(lab, tp4, "restart: engine and weight cache: the weight cache's key changes (--tp-size 2 -> 4)")
    moved = processes(lab)
    assert moved["launcher"] != after["launcher"] and len(moved["daemon"]) == 4, moved
    assert not set(moved["daemon"]) & set(after["daemon"])
    prom = pyinfra(lab, tp4, "-y", "runbooks/status.py", "--data", f"prom={tmp_path / 'gpugate.prom'}")
    assert prom.returncode == 0, prom.stdout + prom.stderr
    text = (tmp_path / "gpugate.prom").read_text()
    assert "gpugate_weight_cache_ready{" in text and text.count("gpugate_weight_cache_used_mib{") == 4, text


def test_present_false_stops_the_engine_and_its_daemons(lab, tmp_path):
    gone = fleet(lab, tmp_path / "gone.yaml", dict(TP4, present=False))
    run = pyinfra(lab, gone, "-y", "deploy.py")
    assert run.returncode == 0, run.stdout + run.stderr
    assert processes(lab) == {"engine": [], "launcher": [], "daemon": []}
    files = ct_sh(lab, "pve1", 129, "ls /tmp | grep sglang_weight_cache || true").stdout
    assert files.strip() == "", files


def test_a_gated_engine_left_waiting_at_its_gate_is_never_adopted(lab, tmp_path):
    # what an agent that died mid-run leaves: the desired command, launched gated, waiting at its gate
    plain = dict(SERVER, weight_cache=False)
    argv = ("/usr/bin/python3 -m sglang.launch_server --model-path /opt/models/lab-model --host 127.0.0.1 "
            "--port 30000 --tp-size 2 --gated-launch-port 45999")
    orphan = start_in_container(lab, "pve1", 129, "env SGLANG_STANDIN_LOAD_S=0.2 " + argv, "orphan-gated")
    assert wait_for(lambda: "OK" in ct_sh(lab, "pve1", 129, "curl -s http://127.0.0.1:45999/health").stdout, 20)
    run = pyinfra(lab, fleet(lab, tmp_path / "plain.yaml", plain), "-y", "deploy.py")
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "already runs" not in out, out
    assert not orphan.alive() and processes(lab)["engine"] and orphan.pid not in processes(lab)["engine"]
