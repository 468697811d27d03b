"""The lab's nvidia-smi: the query forms and output formats real tools parse, and its errors."""

from __future__ import annotations

import json
import subprocess

from gpusim_helpers import (GPU_COUNT, RESERVED_MIB, SYSTEM_PYTHON, TOTAL_MIB, container_env, hold,  # noqa: F401
                            installed, sim)

from gpugate_lab import nvidia_smi


def smi(*args: str):
    return nvidia_smi.run(list(args))


def test_installed_nvidia_smi_lists_every_gpu_at_zero(sim, installed):
    out = subprocess.run([str(installed / "bin" / "nvidia-smi"), "--query-gpu=index,memory.used",
                          "--format=csv,noheader"], env=container_env(sim, installed), capture_output=True,
                         text=True, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"{i}, 0 MiB" for i in range(GPU_COUNT)]
    assert (installed / "bin" / "nvidia-smi").read_text().startswith("#!/usr/bin/python3\n")


def test_headers_keep_units_and_nounits_drops_them_from_values(sim):
    code, out = smi("--query-gpu=index,name,memory.used,memory.total,memory.reserved,memory.free",
                    "--format=csv,nounits")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == ("index, name, memory.used [MiB], memory.total [MiB], memory.reserved [MiB], "
                        "memory.free [MiB]")
    name = json.loads((sim.gpu_dir / "config.json").read_text())["name"]
    assert lines[1] == f"0, {name}, 0, {TOTAL_MIB}, {RESERVED_MIB}, {TOTAL_MIB - RESERVED_MIB}"
    assert len(lines) == GPU_COUNT + 1


def test_memory_used_follows_allocations(sim):
    proc = hold(sim, gpu="2", mib=4321)
    try:
        code, out = smi("--query-gpu=index,memory.used", "--format=csv,noheader,nounits")
        assert out.splitlines() == ["0, 0", "1, 0", "2, 4321", "3, 0"]
    finally:
        proc.kill()
        proc.wait()


def test_compute_apps_are_empty_when_idle_and_list_holders(sim):
    assert smi("--query-compute-apps=pid,used_memory", "--format=csv") == (0, "")
    proc = hold(sim, gpu="1", mib=777)
    try:
        code, out = smi("--query-compute-apps=pid,gpu_uuid,used_gpu_memory,process_name", "--format=csv")
        uuid = json.loads((sim.gpu_dir / "config.json").read_text())["uuids"][1]
        header, row = out.splitlines()
        assert header == "pid, gpu_uuid, used_gpu_memory [MiB], process_name"
        pid, gpu_uuid, used, name = row.split(", ")
        assert (int(pid), gpu_uuid, used) == (proc.pid, uuid, "777 MiB")
        assert "python" in name
    finally:
        proc.kill()
        proc.wait()


def test_unknown_field_aborts_the_whole_query(sim):
    code, out = smi("--query-gpu=index,memory.bogus", "--format=csv,noheader")
    assert code == 2
    assert out.startswith('Field "memory.bogus" is not a valid field to query.')
    assert "0, " not in out


def test_select_gpus_by_index_or_uuid(sim):
    uuids = json.loads((sim.gpu_dir / "config.json").read_text())["uuids"]
    assert smi("-i", "1,3", "--query-gpu=index", "--format=csv,noheader") == (0, "1\n3\n")
    assert smi(f"--id={uuids[2]}", "--query-gpu=uuid", "--format=csv,noheader") == (0, uuids[2] + "\n")
    code, out = smi("-i", "9", "--query-gpu=index", "--format=csv")
    assert code == 6 and "No devices were found" in out


def test_list_gpus(sim):
    code, out = smi("-L")
    uuids = json.loads((sim.gpu_dir / "config.json").read_text())["uuids"]
    assert code == 0
    assert out.splitlines()[0] == f"GPU 0: NVIDIA RTX PRO 6000 Blackwell Server Edition (UUID: {uuids[0]})"
    assert len(out.splitlines()) == GPU_COUNT


def test_bare_table_shows_memory_and_processes(sim):
    code, out = smi()
    assert code == 0
    assert f"0MiB / {TOTAL_MIB}MiB" in out and "No running processes found" in out
    proc = hold(sim, gpu="0", mib=2048)
    try:
        code, out = smi()
        assert f"2048MiB / {TOTAL_MIB}MiB" in out and str(proc.pid) in out
    finally:
        proc.kill()
        proc.wait()


def test_missing_driver_exits_9_with_the_real_message(sim, installed):
    env = container_env(sim, installed, GPUGATE_SIM_DIR="/nonexistent/gpugate-sim")
    out = subprocess.run([SYSTEM_PYTHON, str(installed / "bin" / "nvidia-smi"), "--query-gpu=index",
                          "--format=csv"], env=env, capture_output=True, text=True, cwd="/")
    assert out.returncode == 9
    assert out.stdout.startswith("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")


def test_query_without_format_is_refused(sim):
    code, out = smi("--query-gpu=index")
    assert code == 2 and "--format" in out


def test_compute_cap_as_the_real_tool_reports_it(sim):
    code, out = smi("--query-gpu=index,compute_cap", "--format=csv")
    assert code == 0
    assert out.splitlines()[:2] == ["index, compute_cap", "0, 12.0"]
