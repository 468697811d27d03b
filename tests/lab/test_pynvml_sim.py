"""The lab's pynvml against the real nvidia-ml-py: same names, signatures, constants, structs, errors,
and the behaviour of a real driver (v1 used includes reserved, v2 does not, only own processes)."""

from __future__ import annotations

import importlib.util
import inspect
import json
import subprocess
import sys
import textwrap

import pynvml as real  # nvidia-ml-py, the binding the probe uses on real machines
import pytest
from gpusim_helpers import RESERVED_MIB, SYSTEM_PYTHON, TOTAL_MIB, container_env, hold, installed, sim  # noqa: F401

from gpugate_lab import container_files

MIB = 1024 * 1024
API = ["nvmlInit", "nvmlInitWithFlags", "nvmlShutdown", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex",
       "nvmlDeviceGetHandleByUUID", "nvmlDeviceGetIndex", "nvmlDeviceGetUUID", "nvmlDeviceGetName",
       "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses",
       "nvmlSystemGetDriverVersion", "nvmlSystemGetNVMLVersion", "nvmlSystemGetCudaDriverVersion",
       "nvmlErrorString", "nvmlDeviceGetMigMode", "nvmlSystemGetProcessName", "nvmlExceptionClass",
       "nvmlDeviceGetCudaComputeCapability"]


@pytest.fixture
def nvml(sim):
    """The sim module loaded from its file under its own name (the real pynvml stays importable)."""
    path = container_files.LAB_DIR / "pynvml_sim" / "pynvml.py"
    spec = importlib.util.spec_from_file_location("pynvml_lab_sim", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["pynvml_lab_sim"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("pynvml_lab_sim", None)


@pytest.mark.parametrize("name", API)
def test_functions_have_the_real_signatures(nvml, name):
    real_params = list(inspect.signature(getattr(real, name)).parameters)
    sim_params = list(inspect.signature(getattr(nvml, name)).parameters)
    if real_params in (["args", "kwargs"],):  # decorated with convertStrBytes: compare the wrapped one
        real_params = list(inspect.signature(inspect.unwrap(getattr(real, name))).parameters)
    assert sim_params == real_params


def test_constants_and_error_classes_match(nvml):
    real_codes = {k: getattr(real, k) for k in dir(real) if k.startswith("NVML_ERROR_")}
    assert {k: getattr(nvml, k) for k in real_codes if hasattr(nvml, k)} == real_codes
    assert nvml.nvmlMemory_v2 == real.nvmlMemory_v2 == 0x02000028
    assert nvml.NVML_SUCCESS == real.NVML_SUCCESS
    real_classes = {k for k in dir(real) if k.startswith("NVMLError_")}
    assert real_classes <= {k for k in dir(nvml) if k.startswith("NVMLError_")}
    assert nvml.NVMLError(9).__class__ is nvml.NVMLError_DriverNotLoaded
    assert issubclass(nvml.NVMLError_GpuIsLost, nvml.NVMLError) and nvml.NVMLError_GpuIsLost().value == 15
    assert str(nvml.NVMLError_LibraryNotFound()) == str(real.NVMLError_LibraryNotFound())


def test_struct_fields_match(nvml):
    for name in ["c_nvmlMemory_t", "c_nvmlMemory_v2_t", "c_nvmlProcessInfo_v2_t"]:
        assert [f[0] for f in getattr(nvml, name)._fields_] == [f[0] for f in getattr(real, name)._fields_]


def test_v1_used_includes_reserved_and_v2_does_not(nvml):
    nvml.nvmlInit()
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    v1 = nvml.nvmlDeviceGetMemoryInfo(h)
    assert (v1.total, v1.used, v1.free) == (TOTAL_MIB * MIB, RESERVED_MIB * MIB, (TOTAL_MIB - RESERVED_MIB) * MIB)
    assert not hasattr(v1, "reserved")
    v2 = nvml.nvmlDeviceGetMemoryInfo(h, version=nvml.nvmlMemory_v2)
    assert (v2.version, v2.total, v2.reserved, v2.used, v2.free) == (
        0x02000028, TOTAL_MIB * MIB, RESERVED_MIB * MIB, 0, (TOTAL_MIB - RESERVED_MIB) * MIB)
    with pytest.raises(nvml.NVMLError_FunctionNotFound):
        nvml.nvmlDeviceGetMemoryInfo(h, version=2)
    nvml.nvmlShutdown()


def test_devices_and_processes(nvml, sim):
    nvml.nvmlInit()
    config = json.loads((sim.gpu_dir / "config.json").read_text())
    assert nvml.nvmlDeviceGetCount() == 4
    h = nvml.nvmlDeviceGetHandleByIndex(3)
    assert nvml.nvmlDeviceGetUUID(h) == config["uuids"][3] and isinstance(nvml.nvmlDeviceGetUUID(h), str)
    assert nvml.nvmlDeviceGetName(h) == "NVIDIA RTX PRO 6000 Blackwell Server Edition"
    assert nvml.nvmlDeviceGetIndex(nvml.nvmlDeviceGetHandleByUUID(config["uuids"][2])) == 2
    assert nvml.nvmlSystemGetDriverVersion() == "580.159.04"
    assert nvml.nvmlDeviceGetComputeRunningProcesses(h) == []
    proc = hold(sim, gpu="3", mib=1500)
    try:
        (p,) = nvml.nvmlDeviceGetComputeRunningProcesses(h)
        assert (p.pid, p.usedGpuMemory) == (proc.pid, 1500 * MIB)
        assert {"gpuInstanceId", "computeInstanceId"} <= set(vars(p))
        assert nvml.nvmlDeviceGetMemoryInfo(h, version=nvml.nvmlMemory_v2).used == 1500 * MIB
    finally:
        proc.kill()
        proc.wait()
    with pytest.raises(nvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceGetHandleByIndex(4)
    nvml.nvmlShutdown()


def test_calls_before_init_raise_uninitialized(nvml):
    with pytest.raises(nvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()


def test_missing_driver_raises_driver_not_loaded(nvml, monkeypatch):
    monkeypatch.setenv("GPUGATE_SIM_DIR", "/nonexistent/gpugate-sim")
    with pytest.raises(nvml.NVMLError_DriverNotLoaded) as info:
        nvml.nvmlInit()
    assert isinstance(info.value, nvml.NVMLError) and str(info.value) == "Driver Not Loaded"


def test_installed_copy_runs_on_the_system_python(sim, installed):
    code = textwrap.dedent("""
        import pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        print(pynvml.__file__, pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2).used,
              pynvml.nvmlDeviceGetMemoryInfo(h).used)
    """)
    out = subprocess.run([SYSTEM_PYTHON, "-c", code], env=container_env(sim, installed), capture_output=True,
                         text=True, cwd="/")
    assert out.returncode == 0, out.stderr
    path, v2_used, v1_used = out.stdout.split()
    assert path.startswith(str(installed)) and int(v2_used) == 0 and int(v1_used) == RESERVED_MIB * MIB


def test_compute_capability_follows_the_gpus_name(nvml, sim):
    nvml.nvmlInit()
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(0)
        assert nvml.nvmlDeviceGetCudaComputeCapability(handle) == (12, 0)  # the default RTX PRO 6000 Blackwell
    finally:
        nvml.nvmlShutdown()
