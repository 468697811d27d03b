"""What an adversarial pass broke around the weight cache and the gated launch (docs/reliability.md,
issue 22), each a reproduction through the real pyinfra CLI that failed before its fix: a secret of
the daemons' command in the status JSON (F1), an env var the spec drops left in a server started
ungated (F5, not the cache's own), a SIGSTOPped daemon kept for an engine-only change (F2), a port
change refused for the server's own daemons, a .ready naming a live process that is no daemon."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import module_lab
from tests.e2e.lab_processes import ct_sh
from tests.e2e.test_weight_cache_lab import ENV, fleet, processes, pyinfra, status

pytestmark = [pytest.mark.lab]

SERVER = {"model_path": "/opt/models/lab-model", "port": 30000, "flags": {"tp": 2}, "env": ENV, "weight_cache": True}


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    yield from module_lab(tmp_path_factory, "lab-weight-cache-edges", hosts=1, gpus=4)


def reset(lab, tmp_path: Path) -> None:
    gone = fleet(lab, tmp_path / "gone.yaml", dict(SERVER, present=False))
    pyinfra(lab, gone, "-y", "deploy.py")
    ct_sh(lab, "pve1", 129, "rm -f /tmp/sglang_weight_cache_*")


def deploy(lab, path: Path, *extra: str, timeout: float = 180):
    run = pyinfra(lab, path, "-y", "deploy.py", *extra, timeout=timeout)
    return run, run.stdout + run.stderr


def test_the_status_json_never_shows_the_model_loaders_token(lab, tmp_path):
    """F1: model-loader-extra-config is a WEIGHT_FLAG, so it is in the daemon's argv; the JSON
    status prints the record's key inputs (the unredacted argv) to stdout."""
    reset(lab, tmp_path)
    spec = dict(SERVER, flags={"tp": 2, "model-loader-extra-config": '{"token": "LOADERSECRET42"}'})
    path = fleet(lab, tmp_path / "secret.yaml", spec)
    run, out = deploy(lab, path)
    assert run.returncode == 0, out
    assert "LOADERSECRET42" not in out
    st = pyinfra(lab, path, "-y", "runbooks/status.py", "--data", "format=json")
    assert "LOADERSECRET42" not in st.stdout + st.stderr, json.loads(st.stdout)["servers"][0]["weight_cache"]["key"]


def test_removing_an_env_var_restarts_a_server_that_was_started_ungated(lab, tmp_path):
    """F5: the agent's _running_exactly checks only that the desired env vars are set, not that a
    removed one is gone: with an argv that matches (gated_launch false, a rollback's start, systemd),
    the deploy adopts the old server, says verified and exits 0; the status says drifted."""
    reset(lab, tmp_path)
    with_var = dict(SERVER, weight_cache=False, gated_launch=False, env=dict(ENV, NCCL_P2P_DISABLE="1"))
    run, out = deploy(lab, fleet(lab, tmp_path / "with.yaml", with_var))
    assert run.returncode == 0, out
    without = fleet(lab, tmp_path / "without.yaml", dict(with_var, env=ENV))
    run, out = deploy(lab, without)
    assert run.returncode == 0, out
    row = status(lab, without)
    assert row["verdict"] == "serving as desired", (row["verdict"], out[-1500:])


def test_a_stopped_daemon_is_not_kept_for_an_engine_only_change(lab, tmp_path):
    """F2: a SIGSTOPped daemon child (a hung daemon) passes for ready: the status shows it as the
    cache, --dry says engine only, the new engine times out on its socket, and the rollback keeps
    the same daemon: NOTHING SERVES, where the old server was serving."""
    reset(lab, tmp_path)
    run, out = deploy(lab, fleet(lab, tmp_path / "base.yaml", SERVER))
    assert run.returncode == 0, out
    daemon = processes(lab)["daemon"][0]
    ct_sh(lab, "pve1", 129, f"kill -STOP {daemon}")
    fp8 = fleet(lab, tmp_path / "fp8.yaml", dict(SERVER, flags={"tp": 2, "kv-cache-dtype": "fp8_e4m3"}))
    dry = pyinfra(lab, fp8, "deploy.py", "--dry")
    run, out = deploy(lab, fp8)
    ct_sh(lab, "pve1", 129, f"kill -CONT {daemon} 2>/dev/null || true")
    assert "NOTHING SERVES" not in out, out[-3000:]
    assert "engine only" not in dry.stdout, dry.stdout


def test_a_port_change_with_a_weight_cache_is_not_refused_for_its_own_daemons(lab, tmp_path):
    """F5: the replaced server's daemons are its own (observe labels every port's daemons)."""
    reset(lab, tmp_path)
    run, out = deploy(lab, fleet(lab, tmp_path / "a.yaml", SERVER))
    assert run.returncode == 0, out
    run, out = deploy(lab, fleet(lab, tmp_path / "b.yaml", dict(SERVER, port=30001)))
    assert run.returncode == 0 and "REFUSED" not in out, out
    assert "port change" in out and "weight cache ready on every GPU" in out, out
    reset(lab, tmp_path)
    pyinfra(lab, fleet(lab, tmp_path / "gone1.yaml", dict(SERVER, port=30001, present=False)), "-y", "deploy.py")


def test_a_ready_file_naming_a_live_process_that_is_no_daemon_is_cleaned_not_obeyed(lab, tmp_path):
    """F6: a stale .ready with pid=1 (alive, no daemon) and a socket file: SGLang's launcher would
    refuse them as "already running"; the agent removes them first."""
    reset(lab, tmp_path)
    uuid = ct_sh(lab, "pve1", 129, "nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1").stdout.strip()
    name = "/tmp/sglang_weight_cache_" + uuid.removeprefix("GPU-")
    ct_sh(lab, "pve1", 129, f"printf 'pid=1\\nconfig={{}}\\n' > {name}.ready && python3 -c "
                            f"\"import socket; s=socket.socket(socket.AF_UNIX); s.bind('{name}.sock')\"")
    run, out = deploy(lab, fleet(lab, tmp_path / "a.yaml", SERVER))
    assert run.returncode == 0 and "already running" not in out, out
