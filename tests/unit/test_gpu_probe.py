"""The GPU probe (gpugate/agent/gpu_probe.py): every source, every failure, the holder scan.

NVML is a fake ``pynvml`` module (tests/unit/fake_nvml.py), nvidia-smi a function returning canned
CSV, /proc a directory tree built per test: no GPU, no real process is touched.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import time
from pathlib import Path

import pytest

from gpugate.agent import gpu_probe

FAKE_NVML = Path(__file__).with_name("fake_nvml.py")
H200 = {"uuid": "GPU-aaa", "name": "NVIDIA H200", "total_mib": 143771, "used_mib": 0,
        "reserved_mib": 615}


def fake_nvml(**config):
    spec = importlib.util.spec_from_file_location(f"fake_pynvml_{id(config)}", FAKE_NVML)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.CONFIG = config
    return module


def make_proc(root: Path, processes: list[dict]) -> str:
    """A /proc lookalike: <pid>/stat, cmdline, cgroup and fd/<n> symlinks."""
    for process in processes:
        directory = root / str(process["pid"])
        (directory / "fd").mkdir(parents=True)
        comm = process.get("comm", "python3")
        (directory / "stat").write_text(
            f"{process['pid']} ({comm}) {process.get('state', 'S')} {process.get('ppid', 1)} "
            f"{process.get('pgid', process['pid'])} 0 0 -1 4194560 0 0\n")
        argv = process.get("argv", [comm])
        (directory / "cmdline").write_bytes(b"".join(a.encode() + b"\0" for a in argv))
        (directory / "cgroup").write_text(process.get("cgroup", "0::/\n"))
        for number, target in enumerate(process.get("fds", [])):
            os.symlink(target, directory / "fd" / str(number))
    (root / "self").mkdir(parents=True, exist_ok=True)  # not a pid: ignored
    return str(root)


ALL_NODES = ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia0", "/dev/nvidia1"]


def smi(responses: dict):
    """A fake runner: query flag -> (exit code, stdout[, stderr]); unknown queries exit 2."""
    calls = []

    def run(argv, timeout_s):
        calls.append(argv)
        for flag, answer in responses.items():
            if flag in argv:
                code, out = answer[0], answer[1]
                return code, out, answer[2] if len(answer) > 2 else ""
        return 2, "", "Invalid combination of input arguments"

    run.calls = calls
    return run


def no_smi(argv, timeout_s):  # pragma: no cover - must not be called
    raise AssertionError(f"nvidia-smi must not run: {argv}")


def collect(tmp_path, nvml=None, run=no_smi, processes=(), **kwargs):
    loader = (lambda: nvml) if nvml is not None else _missing_pynvml
    return gpu_probe.collect(nvml_loader=loader, run=run, smi_path="/usr/bin/nvidia-smi",
                             proc_root=make_proc(tmp_path / "proc", list(processes)), **kwargs)


def _missing_pynvml():
    raise ModuleNotFoundError("No module named 'pynvml'")


# ---------------------------------------------------------------------------------------- NVML


def test_idle_h200_reads_zero_used_through_nvml_v2(tmp_path):
    doc = collect(tmp_path, fake_nvml(gpus=[H200, {**H200, "uuid": "GPU-bbb"}]))
    assert doc["source"] == "nvml" and doc["memory_api"] == "v2"
    assert doc["driver"] == "580.159.04" and doc["errors"] == []
    assert [(g["index"], g["uuid"], g["used_mib"], g["reserved_mib"], g["total_mib"])
            for g in doc["gpus"]] == [(0, "GPU-aaa", 0, 615, 143771), (1, "GPU-bbb", 0, 615, 143771)]
    assert doc["holders"] == [] and doc["schema"] == 1 and doc["read_at"] > 0


def test_held_gpu_reads_what_is_held_and_attaches_processes_to_holders(tmp_path):
    nvml = fake_nvml(gpus=[{**H200, "used_mib": 86000, "processes": [[31, 86000]]}, H200])
    doc = collect(tmp_path, nvml, processes=[
        {"pid": 31, "comm": "sglang::schedul", "argv": ["sglang::scheduler_TP0"], "fds": ALL_NODES},
        {"pid": 40, "argv": ["bash"], "fds": ["/dev/null", "/tmp/x"]},
    ])
    assert doc["gpus"][0]["used_mib"] == 86000
    assert doc["gpus"][0]["processes"] == [{"pid": 31, "used_mib": 86000, "alive": True}]
    (holder,) = doc["holders"]
    assert holder["pid"] == 31 and holder["cmdline"] == "sglang::scheduler_TP0"
    assert holder["devices"] == sorted(ALL_NODES)
    assert holder["gpus"] == [0] and holder["used_mib"] == 86000


def test_listed_pid_that_does_not_exist_is_marked_dead_not_a_holder(tmp_path):
    nvml = fake_nvml(gpus=[{**H200, "used_mib": 5000, "processes": [[77, 5000]]}])
    doc = collect(tmp_path, nvml)
    assert doc["gpus"][0]["processes"] == [{"pid": 77, "used_mib": 5000, "alive": False}]
    assert doc["holders"] == []


def test_listed_pid_without_readable_fds_still_counts_as_holder(tmp_path):
    nvml = fake_nvml(gpus=[{**H200, "used_mib": 5000, "processes": [[50, None]]}])
    doc = collect(tmp_path, nvml, processes=[{"pid": 50, "argv": ["worker"], "fds": []}])
    assert [(h["pid"], h.get("listed_only"), h["gpus"]) for h in doc["holders"]] == [(50, True, [0])]
    assert doc["gpus"][0]["processes"] == [{"pid": 50, "used_mib": None, "alive": True}]


def test_v2_function_not_found_falls_back_to_v1_with_used_unknown(tmp_path):
    doc = collect(tmp_path, fake_nvml(v2=False, gpus=[H200]))
    gpu = doc["gpus"][0]
    assert doc["source"] == "nvml" and doc["memory_api"] == "v1"
    assert gpu["used_mib"] is None and gpu["used_v1_mib"] == 615 and gpu["reserved_mib"] is None


def test_binding_without_v2_symbol_reads_v1(tmp_path):
    nvml = fake_nvml(gpus=[H200])
    del nvml.nvmlMemory_v2
    doc = collect(tmp_path, nvml)
    assert doc["memory_api"] == "v1" and doc["gpus"][0]["used_mib"] is None


def test_binding_whose_memory_call_takes_no_version_reads_v1(tmp_path):
    nvml = fake_nvml(gpus=[H200])
    original = nvml.nvmlDeviceGetMemoryInfo
    nvml.nvmlDeviceGetMemoryInfo = lambda handle: original(handle)
    doc = collect(tmp_path, nvml)
    assert doc["memory_api"] == "v1" and doc["gpus"][0]["used_v1_mib"] == 615


def test_lost_gpu_is_an_error_of_that_gpu_only(tmp_path):
    doc = collect(tmp_path, fake_nvml(gpus=[H200, {**H200, "error": "GpuIsLost"}]))
    assert doc["source"] == "nvml" and doc["errors"] == []
    assert doc["gpus"][0]["used_mib"] == 0 and doc["gpus"][0]["error"] is None
    assert doc["gpus"][1]["used_mib"] is None
    assert doc["gpus"][1]["error"].startswith("GpuIsLost")


def test_process_list_failure_keeps_the_memory_reading(tmp_path):
    doc = collect(tmp_path, fake_nvml(gpus=[{**H200, "processes_error": "NotSupported"}]))
    gpu = doc["gpus"][0]
    assert gpu["used_mib"] == 0 and gpu["error"] is None
    assert gpu["processes_error"].startswith("NotSupported")


def test_uuid_as_bytes_is_text(tmp_path):
    doc = collect(tmp_path, fake_nvml(gpus=[{**H200, "uuid": b"GPU-bytes"}]))
    assert doc["gpus"][0]["uuid"] == "GPU-bytes"


@pytest.mark.parametrize("kind", ["DriverNotLoaded", "LibRmVersionMismatch"])
def test_driver_errors_are_reported_without_trying_nvidia_smi(tmp_path, kind):
    doc = collect(tmp_path, fake_nvml(init_error=kind, gpus=[H200]), run=no_smi)
    assert doc["source"] == "none" and doc["gpus"] == []
    assert [(e["source"], e["kind"]) for e in doc["errors"]] == [("nvml", kind)]


SMI_OK = {
    "--query-gpu=index,uuid,name,memory.used,memory.total":
        (0, "0, GPU-aaa, NVIDIA H200, 0, 143771\n1, GPU-bbb, NVIDIA H200, 20480, 143771\n"),
    "--query-gpu=index,memory.reserved": (0, "0, 616\n1, 616\n"),
    "--query-compute-apps=pid,gpu_uuid,used_memory": (0, "31, GPU-bbb, 20480\n"),
    "--query-gpu=driver_version": (0, "580.159.04\n580.159.04\n"),
}


@pytest.mark.parametrize("nvml", [None, "LibraryNotFound"], ids=["pynvml-missing", "no-libnvml"])
def test_nvidia_smi_answers_when_nvml_cannot(tmp_path, nvml):
    module = fake_nvml(init_error=nvml, gpus=[H200]) if nvml else None
    doc = collect(tmp_path, module, run=smi(SMI_OK))
    assert doc["source"] == "nvidia-smi" and doc["memory_api"] == "v2"
    assert doc["driver"] == "580.159.04"
    assert [(g["used_mib"], g["reserved_mib"]) for g in doc["gpus"]] == [(0, 616), (20480, 616)]
    assert doc["gpus"][1]["processes"] == [{"pid": 31, "used_mib": 20480, "alive": False}]
    assert doc["errors"][0]["source"] == "nvml"
    assert doc["errors"][0]["kind"] == ("LibraryNotFound" if nvml else "ModuleNotFound")


def test_nvidia_smi_bracketed_values_read_as_unknown(tmp_path):
    responses = {
        **SMI_OK,
        "--query-gpu=index,uuid,name,memory.used,memory.total":
            (0, "0, GPU-aaa, NVIDIA H200, [N/A], 143771\n1, GPU-bbb, NVIDIA H200, 0, [Not Supported]\n"),
        "--query-gpu=index,memory.reserved": (0, "0, [Not Supported]\n1, [Unknown Error]\n"),
        "--query-compute-apps=pid,gpu_uuid,used_memory": (0, "31, GPU-bbb, [N/A]\n"),
    }
    doc = collect(tmp_path, None, run=smi(responses))
    first, second = doc["gpus"]
    assert first["used_mib"] is None and "[N/A]" in first["error"]
    assert second["used_mib"] == 0 and second["total_mib"] is None and second["error"] is None
    assert first["reserved_mib"] is None and second["reserved_mib"] is None
    assert second["processes"][0]["used_mib"] is None


def test_nvidia_smi_without_memory_reserved_is_v1(tmp_path):
    responses = {key: value for key, value in SMI_OK.items() if "reserved" not in key}
    doc = collect(tmp_path, None, run=smi(responses))
    assert doc["memory_api"] == "v1"
    assert [(g["used_mib"], g["used_v1_mib"]) for g in doc["gpus"]] == [(None, 0), (None, 20480)]


def test_nvidia_smi_with_no_processes_prints_nothing(tmp_path):
    doc = collect(tmp_path, None, run=smi({**SMI_OK,
                                           "--query-compute-apps=pid,gpu_uuid,used_memory": (0, "")}))
    assert [g["processes"] for g in doc["gpus"]] == [[], []]


@pytest.mark.parametrize("code,kind", [(9, "DriverNotLoaded"), (12, "LibraryNotFound"),
                                       (15, "GpuIsLost"), (255, "Unknown"), (None, "Timeout"),
                                       (42, "Exit42")])
def test_nvidia_smi_failure_is_data(tmp_path, code, kind):
    responses = {"--query-gpu=index,uuid,name,memory.used,memory.total":
                 (code, "", "NVIDIA-SMI has failed because it couldn't communicate with the driver")}
    doc = collect(tmp_path, None, run=smi(responses))
    assert doc["source"] == "none" and doc["gpus"] == []
    assert (doc["errors"][-1]["source"], doc["errors"][-1]["kind"]) == ("nvidia-smi", kind)


def test_no_nvidia_smi_anywhere(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_probe, "find_nvidia_smi", lambda: None)
    doc = gpu_probe.collect(nvml_loader=_missing_pynvml, proc_root=make_proc(tmp_path / "p", []))
    assert doc["source"] == "none"
    assert [e["kind"] for e in doc["errors"]] == ["ModuleNotFound", "NotFound"]


def test_hung_nvml_is_bounded_and_falls_back(tmp_path):
    nvml = fake_nvml(init_sleep_s=5, gpus=[H200])
    started = time.monotonic()
    doc = collect(tmp_path, nvml, run=smi(SMI_OK), nvml_timeout_s=0.2)
    assert time.monotonic() - started < 4
    assert doc["errors"][0]["kind"] == "Timeout" and doc["source"] == "nvidia-smi"


def test_nvml_session_stays_initialised_between_polls(tmp_path):
    nvml = fake_nvml(gpus=[H200])
    session = gpu_probe.NvmlSession(lambda: nvml, keep_open=True)
    for _ in range(3):
        collect(tmp_path / str(_), None, session=session)
    assert nvml.CALLS == {"init": 1, "shutdown": 0}


def test_one_shot_read_shuts_nvml_down(tmp_path):
    nvml = fake_nvml(gpus=[H200])
    collect(tmp_path, nvml)
    assert nvml.CALLS == {"init": 1, "shutdown": 1}


# ---------------------------------------------------------------------------------------- /proc


def test_holder_scan_reports_state_and_cmdline_and_leaves_out_probes_and_monitors(tmp_path):
    processes = [
        {"pid": 10, "argv": ["python3", "-m", "sglang.launch_server", "--tp", "2"], "fds": ALL_NODES},
        {"pid": 11, "comm": "python3", "state": "D", "argv": ["stuck"], "fds": ["/dev/nvidia0"]},
        {"pid": 12, "comm": "nvidia-smi", "argv": ["nvidia-smi"], "fds": ["/dev/nvidiactl"]},
        {"pid": 13, "argv": ["python3", "-c", "blob", gpu_probe.PROBE_MARKER], "fds": ALL_NODES},
        {"pid": 14, "argv": ["excluded"], "fds": ALL_NODES},
        {"pid": 15, "comm": "kworker", "argv": [], "fds": ["/dev/nvidia-caps/nvidia-cap1"]},
        {"pid": 16, "comm": "nvidia-persiste", "argv": ["/usr/bin/nvidia-persistenced"],
         "fds": ["/dev/nvidia0"]},
    ]
    root = make_proc(tmp_path / "proc", processes)
    holders = gpu_probe.scan_holders(root, exclude_pids=[14])
    assert [(h["pid"], h["state"], h["cmdline"]) for h in holders] == [
        (10, "S", "python3 -m sglang.launch_server --tp 2"),
        (11, "D", "stuck"),
        (15, "S", "[kworker]"),
    ]
    assert holders[2]["devices"] == ["/dev/nvidia-caps/nvidia-cap1"]


def test_lab_device_paths_seen_from_the_host_match(tmp_path):
    root = make_proc(tmp_path / "proc", [
        {"pid": 5, "argv": ["w"], "fds": ["/tmp/lab/hosts/pve1/gpu/dev/nvidia3"]}])
    assert gpu_probe.scan_holders(root)[0]["devices"] == ["/dev/nvidia3"]


def test_probe_never_counts_itself_or_its_ancestors(tmp_path):
    doc = gpu_probe.collect(nvml_loader=lambda: fake_nvml(gpus=[H200]), run=no_smi)
    own = gpu_probe.ancestors("/proc", os.getpid())
    assert os.getpid() in own and os.getppid() in own
    assert not own & {holder["pid"] for holder in doc["holders"]}


@pytest.mark.parametrize("text,vmid", [
    ("0::/lxc/129/ns/user.slice/session-1.scope\n", 129),
    ("0::/lxc/129\n", 129),
    ("12:devices:/lxc/204/ns\n0::/lxc/204/ns/init.scope\n", 204),
    ("0::/lxc.payload.129/system.slice\n", 129),
    ("0::/lxc.payload/131/\n", 131),
    ("0::/user.slice/user-0.slice/session-3.scope\n", None),
    ("0::/lxc.monitor.129\n", None),
    ("0::/lxc/1290x\n", None),
    ("", None),
])
def test_vmid_from_cgroup(text, vmid):
    assert gpu_probe.vmid_from_cgroup(text) == vmid


def test_host_scope_maps_each_process_to_its_container(tmp_path):
    nvml = fake_nvml(gpus=[{**H200, "used_mib": 30000, "processes": [[4242, 20000], [5000, 10000]]}])
    doc = collect(tmp_path, nvml, scope="host", processes=[
        {"pid": 4242, "argv": ["sglang::scheduler_TP0"], "cgroup": "0::/lxc/129/ns/system.slice\n",
         "fds": ALL_NODES},
        {"pid": 5000, "argv": ["python3", "train.py"], "cgroup": "0::/user.slice\n", "fds": []},
    ])
    assert [(h["pid"], h["vmid"], h["used_mib"]) for h in doc["holders"]] == [
        (4242, 129, 20000), (5000, None, 10000)]


# ---------------------------------------------------------------------------------------- kill


class FakeSignals:
    """Signals applied to a fake /proc: a process exits on SIGTERM unless it ignores it; SIGKILL
    ends anything not in D state."""

    def __init__(self, root: Path, ignores_term=(), uninterruptible=()):
        self.root, self.ignores_term, self.uninterruptible = root, set(ignores_term), set(uninterruptible)
        self.sent = []

    def __call__(self, pid, signum):
        self.sent.append((pid, signum))
        directory = self.root / str(pid)
        if not directory.exists():
            raise ProcessLookupError(pid)
        ends = (signum == signal.SIGTERM and pid not in self.ignores_term) or (
            signum == signal.SIGKILL and pid not in self.uninterruptible)
        if ends:
            stat = (directory / "stat").read_text().replace(" S ", " Z ", 1).replace(" D ", " Z ", 1)
            (directory / "stat").write_text(stat)


def test_end_holders_terms_then_kills_and_reports_d_state_survivors(tmp_path):
    root = tmp_path / "proc"
    make_proc(root, [
        {"pid": 1, "argv": ["/sbin/init"], "fds": ["/dev/nvidiactl"]},
        {"pid": 20, "argv": ["sglang main"], "fds": ALL_NODES},
        {"pid": 21, "argv": ["stubborn"], "fds": ALL_NODES},
        {"pid": 22, "state": "D", "argv": ["stuck"], "fds": ALL_NODES},
        {"pid": 23, "argv": ["bash"], "fds": ["/dev/null"]},
        {"pid": 24, "argv": ["monitor"], "fds": ALL_NODES},
    ])
    signals = FakeSignals(root, ignores_term={21, 22}, uninterruptible={22})
    report = gpu_probe.end_holders(grace_s=0.1, ignore_pids=[24], proc_root=str(root),
                                   poll_s=0.01, settle_s=0.1, send=signals)
    assert report["targets"] == [20, 21, 22]
    assert report["terminated"] == [20] and report["killed"] == [21]
    assert report["survivors"] == [{"pid": 22, "state": "D", "cmdline": "stuck"}]
    assert {pid for pid, _ in signals.sent} == {20, 21, 22}  # never 1, 23 (no GPU) or 24 (ignored)
    assert (21, signal.SIGKILL) in signals.sent and (20, signal.SIGKILL) not in signals.sent
