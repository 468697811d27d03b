"""GpuState / HostGpuProcesses: the one-command probe runs as a container would run it, and its
output (or the lack of it) becomes a typed result that never reads as "idle" by mistake."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpugate.facts.gpu import GpuState, HostGpuProcesses
from gpugate.gate import evaluate
from gpugate.remote import build_probe_command, build_wait_command, parse_probe_output
from tests.conftest import pyinfra_exe

FAKE_NVML = Path(__file__).with_name("fake_nvml.py")
CONTAINER_PATH = "/sbin:/bin:/usr/sbin:/usr/bin"
H200 = {"uuid": "GPU-aaa", "name": "NVIDIA H200", "total_mib": 143771, "used_mib": 0,
        "reserved_mib": 615}


@pytest.fixture
def fake_pynvml_dir(tmp_path):
    directory = tmp_path / "site"
    directory.mkdir()
    shutil.copy(FAKE_NVML, directory / "pynvml.py")
    return directory


def run_in_container_shell(command: str, env: dict, own_pid_namespace: bool = True):
    """As `pct exec VMID -- sh -c CMD` runs it: PATH of a container, nothing else needed, and (like
    a container) its own pid namespace and /proc, so GPU processes of labs that other tests run on
    this machine are not seen."""
    prefix = ["unshare", "--pid", "--fork", "--mount-proc"] if own_pid_namespace else []
    return subprocess.run([*prefix, "/bin/sh", "-c", command], capture_output=True, text=True,
                          timeout=60, env={"PATH": CONTAINER_PATH, **env})


def test_fact_command_runs_with_a_container_path_and_prints_one_document(fake_pynvml_dir):
    config = {"gpus": [H200, {**H200, "uuid": "GPU-bbb", "used_mib": 20480}]}
    result = run_in_container_shell(GpuState().command(), {
        "PYTHONPATH": str(fake_pynvml_dir), "FAKE_NVML_CONFIG": json.dumps(config)})
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.strip().splitlines()) == 1
    state = GpuState().process(result.stdout.splitlines())
    assert state["source"] == "nvml" and state["memory_api"] == "v2"
    assert [g["used_mib"] for g in state["gpus"]] == [0, 20480]
    assert state["probe_pid"] > 0


def test_fact_command_without_python3_reads_as_an_error(tmp_path):
    result = subprocess.run(["/bin/sh", "-c", GpuState().command()], capture_output=True,
                            text=True, env={"PATH": str(tmp_path)}, timeout=30)
    assert result.returncode == 0
    state = GpuState().process(result.stdout.splitlines())
    assert state["source"] == "none"
    assert state["errors"][0]["kind"] == "NoPython"
    assert evaluate(state).permanent is True


@pytest.mark.parametrize("lines,kind", [
    ([], "UnreadableOutput"),
    (["sh: 1: python3: Permission denied"], "UnreadableOutput"),
    (['{"sglang": {}}'], "MissingSection"),
    (['{"gpu": {"schema": 1, "error": "SyntaxError: bad"}}'], "ProbeFailed"),
])
def test_unreadable_output_is_an_error_never_idle(lines, kind):
    state = GpuState().process(lines)
    assert state["source"] == "none" and state["errors"][0]["kind"] == kind
    assert evaluate(state).passed is False


def test_default_is_an_error_never_idle():
    state = GpuState.default()
    assert state["errors"][0]["kind"] == "NoOutput"
    assert evaluate(state).passed is False


def test_output_through_a_pty_with_noise_first_still_parses():
    document = {"gpu": {"schema": 1, "source": "nvml", "memory_api": "v2", "errors": [],
                        "gpus": [{"index": 0, "used_mib": 0, "processes": []}], "holders": []}}
    lines = ["Welcome to ct129\r", json.dumps(document) + "\r"]
    assert GpuState().process(lines)["gpus"][0]["used_mib"] == 0


def test_host_fact_lists_processes_with_their_container(fake_pynvml_dir):
    from gpugate.agent.gpu_probe import vmid_from_cgroup

    child = subprocess.Popen(["sleep", "30"])
    try:
        config = {"gpus": [{**H200, "used_mib": 1000, "processes": [[child.pid, 1000]]}]}
        result = run_in_container_shell(HostGpuProcesses().command(), {
            "PYTHONPATH": str(fake_pynvml_dir), "FAKE_NVML_CONFIG": json.dumps(config)},
            own_pid_namespace=False)
    finally:
        child.kill()
        child.wait()
    processes = HostGpuProcesses().process(result.stdout.splitlines())
    assert processes["source"] == "nvml"
    # listed by the (fake) driver, no device fd; its container is whatever this machine says
    (listed,) = [p for p in processes["processes"] if p["pid"] == child.pid]
    assert listed["used_mib"] == 1000 and listed["listed_only"] is True
    assert listed["cmdline"] == "sleep 30"
    assert listed["vmid"] == vmid_from_cgroup(Path(f"/proc/{os.getpid()}/cgroup").read_text())


def test_combined_sections_are_one_document_and_a_failing_section_is_isolated(tmp_path, monkeypatch):
    import gpugate.remote as remote

    (tmp_path / "broken_probe.py").write_text("def collect():\n    raise RuntimeError('boom')\n")
    (tmp_path / "gpu_probe.py").write_text(remote.module_source("gpu"))
    monkeypatch.setattr(remote, "REMOTE_DIR", tmp_path)
    command = build_probe_command({"gpu": {}, "broken": {}})
    result = run_in_container_shell(command, {})
    document = parse_probe_output(result.stdout.splitlines())
    assert set(document) == {"gpu", "broken"}
    assert document["broken"]["error"] == "RuntimeError: boom"
    assert document["gpu"]["schema"] == 1


def test_unknown_section_is_refused_at_build_time():
    with pytest.raises(ValueError, match="no probe section"):
        build_probe_command({"nope": {}})


def test_wait_command_returns_as_soon_as_idle(fake_pynvml_dir):
    result = run_in_container_shell(build_wait_command(64, 30, 0.05), {
        "PYTHONPATH": str(fake_pynvml_dir), "FAKE_NVML_CONFIG": json.dumps({"gpus": [H200]})})
    document = parse_probe_output(result.stdout.splitlines())
    assert document["wait"]["passed"] is True and document["wait"]["polls"] == 1
    assert document["gpu"]["gpus"][0]["used_mib"] == 0


def test_wait_command_times_out_with_the_last_reading(fake_pynvml_dir):
    config = {"gpus": [{**H200, "used_mib": 4096}]}
    result = run_in_container_shell(build_wait_command(64, 0.3, 0.05), {
        "PYTHONPATH": str(fake_pynvml_dir), "FAKE_NVML_CONFIG": json.dumps(config)})
    document = parse_probe_output(result.stdout.splitlines())
    assert document["wait"]["timed_out"] is True and document["wait"]["polls"] >= 2
    assert document["gpu"]["gpus"][0]["used_mib"] == 4096


def test_pyinfra_cli_reads_the_fact(fake_pynvml_dir, tmp_path):
    pyinfra = pyinfra_exe()
    env = {**os.environ, "PYTHONPATH": str(fake_pynvml_dir),
           "FAKE_NVML_CONFIG": json.dumps({"gpus": [H200]})}
    result = subprocess.run([str(pyinfra), "@local", "fact", "gpugate.facts.gpu.GpuState"],
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    output = result.stdout + result.stderr  # pyinfra prints facts on stderr
    assert '"used_mib": 0' in output and '"source": "nvml"' in output
