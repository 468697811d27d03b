"""A fake nvidia-ml-py (``import pynvml``) for the GPU probe's tests.

Behaviour comes from the module-level ``CONFIG`` (tests set it on a fresh module object), or from the
JSON in ``$FAKE_NVML_CONFIG`` when this file is imported as ``pynvml`` by a probe subprocess:

``{"driver": "580.159.04", "init_error": "DriverNotLoaded", "init_sleep_s": 0, "v2": true,
   "gpus": [{"uuid": "GPU-0", "name": "NVIDIA H200", "total_mib": 143771, "used_mib": 0,
             "reserved_mib": 615, "error": "GpuIsLost", "processes": [[pid, mib_or_null]]}]}``

Memory follows the real driver: v2 ``used`` excludes reserved memory, v1 ``used`` counts it in;
``"v2": false`` makes the v2 call raise FunctionNotFound, as on drivers before 510.
"""

import json
import os
import time

CONFIG = json.loads(os.environ.get("FAKE_NVML_CONFIG") or "{}")
MIB = 1024 * 1024
nvmlMemory_v2 = 0x02000028
NVML_VALUE_NOT_AVAILABLE_ulonglong = (1 << 64) - 1

ERROR_CODES = {
    "Uninitialized": 1, "InvalidArgument": 2, "NotSupported": 3, "NoPermission": 4,
    "NotFound": 6, "DriverNotLoaded": 9, "LibraryNotFound": 12, "FunctionNotFound": 13,
    "GpuIsLost": 15, "LibRmVersionMismatch": 18, "Unknown": 999,
}
MESSAGES = {
    "DriverNotLoaded": "Driver Not Loaded", "LibraryNotFound": "NVML Shared Library Not Found",
    "FunctionNotFound": "Function Not Found", "GpuIsLost": "GPU is lost",
    "LibRmVersionMismatch": "RM has detected an NVML/RM version mismatch.",
}


class NVMLError(Exception):
    def __init__(self, value):
        super().__init__(value)
        self.value = value

    def __str__(self):
        for name, code in ERROR_CODES.items():
            if code == self.value:
                return MESSAGES.get(name, name)
        return "Unknown Error"


for _name, _code in ERROR_CODES.items():
    globals()["NVMLError_" + _name] = type("NVMLError_" + _name, (NVMLError,), {})


def _raise(name):
    raise globals()["NVMLError_" + name](ERROR_CODES[name])


class _Struct:
    def __init__(self, **fields):
        self.__dict__.update(fields)


CALLS = {"init": 0, "shutdown": 0}


def nvmlInit():
    if CONFIG.get("init_sleep_s"):
        time.sleep(CONFIG["init_sleep_s"])
    if CONFIG.get("init_error"):
        _raise(CONFIG["init_error"])
    CALLS["init"] += 1


def nvmlShutdown():
    CALLS["shutdown"] += 1


def nvmlSystemGetDriverVersion():
    return CONFIG.get("driver", "580.159.04")


def nvmlDeviceGetCount():
    return len(CONFIG.get("gpus", []))


def _gpu(handle):
    gpu = CONFIG["gpus"][handle]
    if gpu.get("error"):
        _raise(gpu["error"])
    return gpu


def nvmlDeviceGetHandleByIndex(index):
    gpu = CONFIG["gpus"][index]
    if gpu.get("error") == "GpuIsLost":
        _raise("GpuIsLost")
    return index


def nvmlDeviceGetUUID(handle):
    return _gpu(handle).get("uuid", "GPU-%d" % handle)


def nvmlDeviceGetName(handle):
    return _gpu(handle).get("name", "NVIDIA H200")


def nvmlDeviceGetMemoryInfo(handle, version=None):
    gpu = _gpu(handle)
    total = gpu.get("total_mib", 143771) * MIB
    used = gpu.get("used_mib", 0) * MIB
    reserved = gpu.get("reserved_mib", 615) * MIB
    if version is not None:
        if CONFIG.get("v2", True) is False:
            _raise("FunctionNotFound")
        return _Struct(version=version, total=total, reserved=reserved, used=used,
                       free=total - reserved - used)
    return _Struct(total=total, used=used + reserved, free=total - reserved - used)


def nvmlDeviceGetComputeRunningProcesses(handle):
    gpu = _gpu(handle)
    if gpu.get("processes_error"):
        _raise(gpu["processes_error"])
    return [
        _Struct(pid=pid, usedGpuMemory=None if mib is None else mib * MIB,
                gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF)
        for pid, mib in gpu.get("processes", [])
    ]


def nvmlDeviceGetGraphicsRunningProcesses(handle):
    _gpu(handle)
    return []
