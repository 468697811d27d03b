"""`gpugate lab up --gpus real` without a GPU: the binding code against a fake NVIDIA driver.

A fake machine (tmp dir): device nodes that are links to /dev/zero and /dev/null (real character
devices), a libcuda and a libnvidia-ml found through a fake ``ldconfig -p``, an nvidia-smi script, and a
venv whose ``torch`` is a stub. ``realgpu.discover`` reads it; the container paths are then moved to where
a container expects them (/usr/lib/..., /usr/local/nvidia/bin, /opt/fake-torch/.venv), and a lab is
started with that binding. Inside the container: the nodes are the real character devices, the driver's
files and nvidia-smi answer, the stand-in imports from the torch env, the container's python3 has the
env's pynvml, the stand-in is told to run for real; the lab says stuck-memory is unavailable and puts
the foreign holder in another container.

The stand-in's real mode on CPU torch (a real model, a real forward pass) runs when a venv with torch
is found ($GPUGATE_TORCH_ENV, else .venv-gpu in the checkout); it is skipped otherwise.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from pathlib import Path

import pytest

from gpugate_lab import core, faults, realgpu
from tests.conftest import REPO_ROOT, lab_unavailable_reason

FAKE_SMI = """#!/bin/sh
case "$*" in
  *--query-gpu*) echo "0, Fake GPU, GPU-fake-0, 1024, 0" ;;
  *) echo "FAKE NVIDIA-SMI $*" ;;
esac
"""
TORCH_ENV_IN_CT = "/opt/fake-torch/.venv"


def torch_venv() -> Path | None:
    """A venv with CPU torch for the stand-in's real mode (tests/gpu/pack_for_gpu.sh --cpu-venv makes one)."""
    for candidate in (os.environ.get("GPUGATE_TORCH_ENV"), str(REPO_ROOT / ".venv-gpu")):
        if candidate and (Path(candidate) / "bin" / "python3").exists():
            probe = subprocess.run([str(Path(candidate) / "bin" / "python3"), "-c", "import torch"],
                                   capture_output=True, timeout=120)
            if probe.returncode == 0:
                return Path(candidate)
    return None


def make_fake_machine(root: Path) -> dict:
    """Files of a fake NVIDIA machine under root; returns discover()'s arguments."""
    dev = root / "dev"
    (dev / "nvidia-caps").mkdir(parents=True)
    for name, target in (("nvidia0", "/dev/zero"), ("nvidiactl", "/dev/null"), ("nvidia-uvm", "/dev/null")):
        (dev / name).symlink_to(target)
    (dev / "nvidia-caps" / "nvidia-cap1").symlink_to("/dev/null")
    (dev / "nvidia-fake-regular").write_text("")  # not a device: never bound
    lib = root / "lib"
    lib.mkdir()
    (lib / "libcuda.so.580.1").write_text("fake libcuda\n")
    (lib / "libcuda.so.1").symlink_to("libcuda.so.580.1")
    (lib / "libnvidia-ml.so.1").write_text("fake nvml\n")
    (lib / "libcudart.so.12").write_text("toolkit, not driver\n")
    ldconfig = "3 libs found in cache `/etc/ld.so.cache'\n" + "".join(
        f"\t{name} (libc6,x86-64) => {lib / name}\n" for name in ("libcuda.so.1", "libnvidia-ml.so.1", "libcudart.so.12"))
    bin_dir = root / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(FAKE_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    venv = root / "venv"
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(venv.glob("lib/python3*/site-packages"))
    (site / "torch").mkdir()
    (site / "torch" / "__init__.py").write_text("FAKE_TORCH = True\n")
    (site / "pynvml.py").write_text("REAL_NVML_FROM_TORCH_ENV = True\n")
    return {"dev_dir": str(dev), "ldconfig_text": ldconfig,
            "environ": {"PATH": str(bin_dir), "LD_LIBRARY_PATH": "", "GPUGATE_TORCH_ENV": str(venv)}}


def in_container_paths(binding: dict, cpu_torch: Path | None) -> dict:
    """Move the fake machine's container paths to where they lie on a real machine."""
    moved = json.loads(json.dumps(binding))
    for entry in moved["binds"]:
        name = os.path.basename(entry["target"])
        entry["target"] = ("/usr/local/nvidia/bin/" if name == "nvidia-smi" else "/usr/lib/gpugate-fake/") + name
    for link in moved["links"]:
        link["path"] = "/usr/lib/gpugate-fake/" + os.path.basename(link["path"])
    moved["nvidia_smi"] = "/usr/local/nvidia/bin/nvidia-smi"
    env = moved["torch_env"]
    env["source"] = str(cpu_torch) if cpu_torch else env["dir"]
    if cpu_torch:
        env["site_packages"] = realgpu.site_packages_of(cpu_torch)
    env["dir"] = TORCH_ENV_IN_CT
    env["python"] = TORCH_ENV_IN_CT + "/bin/python3"
    moved["device"] = "cpu"  # the stand-in's real mode on this machine's CPU
    return moved


# ---------------------------------------------------------------- discovery (no lab)


def test_discover_reads_devices_driver_libraries_tools_and_the_torch_env(tmp_path):
    binding = realgpu.discover(**make_fake_machine(tmp_path))
    devices = {d["target"]: d["kind"] for d in binding["devices"]}
    assert devices == {"/dev/nvidia0": "device", "/dev/nvidiactl": "device", "/dev/nvidia-uvm": "device",
                       "/dev/nvidia-caps": "dir"}
    bound = {os.path.basename(b["source"]) for b in binding["binds"]}
    assert bound == {"libcuda.so.580.1", "libnvidia-ml.so.1", "nvidia-smi"}  # the toolkit's libcudart is not the driver's
    assert binding["links"] == [{"path": str(tmp_path / "lib" / "libcuda.so.1"), "to": "libcuda.so.580.1"}]
    assert binding["gpus"] == [{"index": 0, "name": "Fake GPU", "uuid": "GPU-fake-0", "total_mib": 1024, "used_mib": 0}]
    env = binding["torch_env"]
    assert env["venv"] and env["dir"] == str(tmp_path / "venv") and env["python"].endswith("/bin/python3")
    assert env["pynvml"].endswith("site-packages/pynvml.py") and env["home"] == "/usr/bin"


def test_no_driver_is_a_clear_error(tmp_path):
    (tmp_path / "dev").mkdir()
    with pytest.raises(realgpu.NoDriver, match="no NVIDIA device nodes"):
        realgpu.discover(dev_dir=str(tmp_path / "dev"), ldconfig_text="", environ={"PATH": ""})
    machine = make_fake_machine(tmp_path / "m")
    with pytest.raises(realgpu.NoDriver, match="libcuda"):
        realgpu.discover(**dict(machine, ldconfig_text=""))


def test_cli_says_so_where_there_is_no_gpu(tmp_path):
    if Path("/dev/nvidiactl").exists():
        pytest.skip("this machine has an NVIDIA driver")
    out = subprocess.run(["python3", "-m", "gpugate.cli", "lab", "--dir", str(tmp_path / "lab"), "up", "--gpus", "real"],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "--gpus real" in out.stderr and "NVIDIA" in out.stderr
    assert not (tmp_path / "lab" / "hosts").exists()  # nothing was made


# ---------------------------------------------------------------- a lab with the fake driver


@pytest.fixture(scope="module")
def real_lab(tmp_path_factory):
    reason = lab_unavailable_reason()
    if reason:
        pytest.skip(reason)
    machine = make_fake_machine(tmp_path_factory.mktemp("fake-nvidia"))
    cpu_torch = torch_venv()
    binding = in_container_paths(realgpu.discover(**machine), cpu_torch)
    # The env's source under /srv, a directory every container has its own of (as /opt/torch/.venv on
    # the H200 machine lies under /opt): the container must take it before its own /srv hides it.
    hidden = Path(f"/srv/gpugate-test-{os.getpid()}-venv")
    hidden.symlink_to(binding["torch_env"]["source"])
    binding["torch_env"]["source"] = str(hidden)
    lab_dir = tmp_path_factory.mktemp("lab-real")
    try:
        state = core.up(lab_dir, hosts=1, gpu_binding=binding)
        yield {"dir": Path(state["dir"]), "state": state, "cpu_torch": cpu_torch}
    finally:
        core.down(lab_dir)
        hidden.unlink()


def ct(lab: dict, script: str, vmid: int = 129, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(core.host_exec_argv(lab["dir"], "pve1") + ["pct", "exec", str(vmid), "--", "sh", "-c", script],
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.mark.lab
def test_containers_get_the_real_device_nodes_not_the_simulated_files(real_lab):
    out = ct(real_lab, "for f in /dev/nvidia*; do test -c $f && echo chr $f || echo other $f; done; "
                       "ls /dev/nvidia-caps; head -c 4 /dev/nvidia0 | od -An -tx1")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")
    assert "chr /dev/nvidia0" in lines and "chr /dev/nvidiactl" in lines and "chr /dev/nvidia-uvm" in lines
    assert "other /dev/nvidia-caps" in lines and "nvidia-cap1" in lines
    assert not any(line.startswith("chr /dev/nvidia1") or "nvidia-fake-regular" in line for line in lines)
    assert "00 00 00 00" in out.stdout  # the bound node is the machine's character device (/dev/zero here)


@pytest.mark.lab
def test_driver_files_nvidia_smi_and_nvml_are_the_machines(real_lab):
    out = ct(real_lab, "cat /usr/lib/gpugate-fake/libcuda.so.1 /usr/lib/gpugate-fake/libnvidia-ml.so.1; "
                       "nvidia-smi -L; python3 -c 'import pynvml; print(pynvml.__file__, "
                       "getattr(pynvml, \"REAL_NVML_FROM_TORCH_ENV\", False))'; cat /run/gpugate-lab/gpu.json")
    assert out.returncode == 0, out.stderr
    assert "fake libcuda\nfake nvml\n" in out.stdout
    assert "FAKE NVIDIA-SMI -L" in out.stdout  # not the lab's simulated nvidia-smi
    assert "dist-packages/pynvml.py True" in out.stdout  # the env's nvidia-ml-py, not the lab's simulation
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"mode": "real", "device": "cpu"}
    host = subprocess.run(core.host_exec_argv(real_lab["dir"], "pve1") + ["nvidia-smi", "-q"],
                          capture_output=True, text=True, timeout=60)
    assert "FAKE NVIDIA-SMI -q" in host.stdout  # the lab host runs the machine's nvidia-smi too


@pytest.mark.lab
def test_the_stand_in_runs_from_the_torch_env_and_the_fleet_names_it(real_lab):
    python = TORCH_ENV_IN_CT + "/bin/python3"
    out = ct(real_lab, f"{python} -c 'import sglang, sglang._real, torch; print(sglang.STANDIN, torch.__file__)'")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("True " + TORCH_ENV_IN_CT)
    fleet = (real_lab["dir"] / "fleet.yaml").read_text()
    assert f'python: "{python}"' in fleet and "flags: {tp: 1}" in fleet
    status = core.status(real_lab["dir"])
    assert status["hosts"][0]["gpu_mode"] == "real"
    assert status["hosts"][0]["gpus"] == [{"index": 0, "used_mib": 0, "total_mib": 1024}]


@pytest.mark.lab
def test_a_running_lab_keeps_its_gpu_mode(real_lab):
    with pytest.raises(core.LabError, match="real GPUs.*lab down"):
        core.up(real_lab["dir"], hosts=1)


@pytest.mark.lab
def test_stuck_memory_is_unavailable_on_real_gpus(real_lab):
    with pytest.raises(faults.FaultUnavailable, match="stuck-memory is unavailable in a real-GPU lab"):
        faults.apply_fault(real_lab["dir"], "pve1", 129, "stuck-memory")
    assert "stuck-memory" not in faults.read_faults(real_lab["dir"], "pve1", 129)


@pytest.mark.lab
@pytest.mark.slow
def test_real_stand_in_on_cpu_loads_a_model_and_generates(real_lab):
    """The real-mode code path (a real model, real memory, a forward pass) on this machine's CPU."""
    if not real_lab["cpu_torch"]:
        pytest.skip("no venv with torch (GPUGATE_TORCH_ENV or .venv-gpu)")
    python = TORCH_ENV_IN_CT + "/bin/python3"
    start = (f"{python} -m sglang.launch_server --model-path /opt/models/lab-model --port 30007 "
             "--mem-fraction-static 0.5 > /tmp/standin.log 2>&1 &")
    assert ct(real_lab, start).returncode == 0
    generate = ("python3 -c 'import json, urllib.request as u; "
                "r = u.Request(\"http://127.0.0.1:30007/generate\", data=json.dumps({\"text\": \"Paris is\", "
                "\"sampling_params\": {\"max_new_tokens\": 3}}).encode()); print(u.urlopen(r, timeout=60).read().decode())'")
    deadline = time.monotonic() + 180
    answer = None
    while time.monotonic() < deadline:
        health = ct(real_lab, "python3 -c 'import urllib.request as u; print(u.urlopen(\"http://127.0.0.1:30007/health\").status)' 2>/dev/null")
        if health.stdout.strip() == "200":
            answer = ct(real_lab, generate)
            break
        time.sleep(1)
    log = ct(real_lab, "cat /tmp/standin.log").stdout
    try:
        assert answer is not None and answer.returncode == 0, log[-3000:]
        meta = json.loads(answer.stdout)["meta_info"]
        assert meta["device"] == "cpu" and meta["completion_tokens"] == 3 and meta["forward_s"] > 0
        assert "LlamaForCausalLM (transformers, random init)" in log or "TinyLM" in log
        assert "KV Cache is allocated" in log
        # mem_fraction_static 0.5 of the 512 MiB "device", less what is kept for activations: the pool
        rss = ct(real_lab, "for p in $(pgrep -f '^sglang::scheduler'); do grep VmRSS /proc/$p/status; done").stdout
        assert rss.strip(), "no scheduler process"
    finally:
        ct(real_lab, "pkill -TERM -f '[s]glang.launch_server --model-path /opt/models/lab-model --port 30007'")


@pytest.mark.lab
@pytest.mark.slow
def test_foreign_holder_runs_in_another_container(real_lab):
    if not real_lab["cpu_torch"]:
        pytest.skip("no venv with torch (GPUGATE_TORCH_ENV or .venv-gpu)")
    said = faults.apply_fault(real_lab["dir"], "pve1", 129, "foreign-holder")
    try:
        assert "holding 4096 MiB" in said and "container 990" in said
        holder = "import signal, sys, torch"  # the holder's own code (its cmdline)
        assert holder in ct(real_lab, "ps -eo args", vmid=faults.NEIGHBOUR_VMID).stdout
        assert holder not in ct(real_lab, "ps -eo args").stdout  # container 129 cannot see it
    finally:
        cleared = faults.apply_fault(real_lab["dir"], "pve1", 129, "foreign-holder", clear=True)
    assert "foreign holder killed" in cleared
    time.sleep(0.5)
    assert holder not in ct(real_lab, "ps -eo args", vmid=faults.NEIGHBOUR_VMID).stdout
