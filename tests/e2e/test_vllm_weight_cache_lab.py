"""vLLM's weight cache through the real pyinfra CLI (issue 33, docs/weight-cache.md "vLLM"):
``weight_cache: true`` runs ``vllm preload`` (the lab's stand-in follows vLLM 0.33.0's preload.py and
weight_cache/daemon.py: a launcher, one daemon per GPU behind a socket named by the GPU's UUID) before
an engine started with ``--load-format ipc_cache``; a change outside vLLM's WeightCacheKey (prefix
caching) restarts the engine only, on the same daemons; the KV cache dtype is IN vLLM's key (unlike
SGLang's), so the fp8 change restarts the daemons (as any change of the key does); ``present: false`` stops
both. One lab, in order."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.conftest import module_lab
from tests.e2e.lab_processes import ct_sh
from tests.e2e.test_weight_cache_lab import dry_then_deploy, pyinfra  # the same runs, whatever the engine

pytestmark = [pytest.mark.lab]

ENV = {"VLLM_STANDIN_LOAD_S": "0.2", "VLLM_STANDIN_WEIGHT_LOAD_S": "0.5"}
SERVER = {"model_path": "/opt/models/lab-model", "port": 8000, "env": ENV, "weight_cache": True,
          "flags": {"tensor-parallel-size": 2, "gpu-memory-utilization": 0.8}}
NO_PREFIX = dict(SERVER, flags=dict(SERVER["flags"], **{"enable-prefix-caching": False}))
FP8 = dict(NO_PREFIX, flags=dict(NO_PREFIX["flags"], **{"kv-cache-dtype": "fp8"}))


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    yield from module_lab(tmp_path_factory, "lab-vllm-cache", hosts=1, gpus=2, engines=("vllm",))


def fleet(lab, path: Path, server: dict) -> Path:
    document = yaml.safe_load(lab.fleet_path.read_text())
    document["hosts"]["pve1"]["containers"][129]["vllm"] = server
    path.write_text(yaml.safe_dump(document))
    return path


def processes(lab) -> dict[str, list[int]]:
    """The API server, the preload launcher and its daemons (pids), from the container's /proc."""
    rows = [(str(pid), str(ppid), cmd) for pid, ppid, cmd, _argv in lab.ps("pve1", 129)]
    launchers = {int(pid) for pid, _, cmd in rows if "vllm.entrypoints.cli.main preload" in cmd}
    found: dict[str, list[int]] = {"engine": [], "launcher": sorted(launchers), "daemon": []}
    for pid, ppid, cmd in rows:
        if "vllm.entrypoints.cli.main serve" in cmd:
            found["engine"].append(int(pid))
        elif ppid.isdigit() and int(ppid) in launchers and "spawn_main" in cmd:
            found["daemon"].append(int(pid))
    return {kind: sorted(pids) for kind, pids in found.items()}


def engine_log(lab) -> str:
    return ct_sh(lab, "pve1", 129, "cat /var/log/gpugate/sglang-8000.log").stdout.split("=== gpugate start")[-1]


def test_vllm_weight_cache_first_start_engine_only_restart_key_changes_and_stop(lab, tmp_path):
    first = pyinfra(lab, fleet(lab, tmp_path / "base.yaml", SERVER), "-y", "deploy.py")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "weight cache ready on every GPU" in first.stdout + first.stderr
    base = processes(lab)
    assert len(base["engine"]) == 1 and len(base["launcher"]) == 1 and len(base["daemon"]) == 2, base
    assert "Mapped 1 tensors from the weight cache daemon (zero_copy mode)" in engine_log(lab)

    # prefix caching is no part of vLLM's WeightCacheKey: the engine only, on the same daemons
    out = dry_then_deploy(lab, fleet(lab, tmp_path / "noprefix.yaml", NO_PREFIX),
                          "restart: engine only: the weights stay on GPU 0-1 (the weight cache's key is unchanged)")
    kept = processes(lab)
    assert kept["launcher"] == base["launcher"] and kept["daemon"] == base["daemon"], (base, kept)
    assert kept["engine"] != base["engine"] and "weight cache kept" in out, out
    assert "Mapped 1 tensors" in engine_log(lab)

    # the KV cache dtype IS in vLLM's key (fp8 KV scales live in the attention layers): daemons restart
    out = dry_then_deploy(lab, fleet(lab, tmp_path / "fp8.yaml", FP8), "restart: engine and weight cache: the weight "
                          "cache's key changes (--kv-cache-dtype (not set) -> fp8)")
    fp8 = processes(lab)
    assert fp8["launcher"] != kept["launcher"] and not set(fp8["daemon"]) & set(kept["daemon"]), (kept, fp8)
    assert "KV cache" in out and "Mapped 1 tensors" in engine_log(lab), out

    gone = pyinfra(lab, fleet(lab, tmp_path / "absent.yaml", dict(FP8, present=False)), "-y", "deploy.py")
    assert gone.returncode == 0, gone.stdout + gone.stderr
    assert processes(lab) == {"engine": [], "launcher": [], "daemon": []}
