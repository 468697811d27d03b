"""The lab's ``pynvml``: the subset of nvidia-ml-py that GPU tools use, over the simulated driver.

Stdlib only; installed in lab containers as ``/usr/lib/python3/dist-packages/pynvml.py``. Names,
signatures, constants, struct fields and error classes follow nvidia-ml-py (``pynvml.py`` 12.x/13.x):

- ``nvmlDeviceGetMemoryInfo(handle, version=None)``: v1 struct (total, free, used; used includes the
  reserved memory) unless ``version=nvmlMemory_v2`` (0x02000028): v2 struct (version, total, reserved,
  free, used; used = allocations only). Bytes, as the real one. Any other version fails.
- ``nvmlDeviceGetComputeRunningProcesses``: objects with pid, usedGpuMemory (bytes), gpuInstanceId,
  computeInstanceId; only processes of the caller's PID namespace (or descendants), as drivers >= 535.113.
- ``NVMLError(code)`` returns the per-code subclass (``NVMLError_DriverNotLoaded`` ...).

Example::

    import pynvml
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2).used   # -> 0 on an idle GPU
"""

import sys
import threading

try:
    from gpugate_lab import gpusim as _sim
except ImportError:  # inside a lab container: the stdlib-only copy
    import gpugate_gpusim as _sim  # type: ignore[no-redef]

# ----------------------------------------------------------------------------------------- constants
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_ALREADY_INITIALIZED = 5
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_INSUFFICIENT_POWER = 8
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_IRQ_ISSUE = 11
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_CORRUPTED_INFOROM = 14
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_OPERATING_SYSTEM = 17
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_IN_USE = 19
NVML_ERROR_MEMORY = 20
NVML_ERROR_NO_DATA = 21
NVML_ERROR_VGPU_ECC_NOT_SUPPORTED = 22
NVML_ERROR_INSUFFICIENT_RESOURCES = 23
NVML_ERROR_FREQ_NOT_SUPPORTED = 24
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_ERROR_DEPRECATED = 26
NVML_ERROR_NOT_READY = 27
NVML_ERROR_GPU_NOT_FOUND = 28
NVML_ERROR_INVALID_STATE = 29
NVML_ERROR_RESET_TYPE_NOT_SUPPORTED = 30
NVML_ERROR_UNKNOWN = 999

NVML_DEVICE_UUID_V2_BUFFER_SIZE = 96
NVML_DEVICE_NAME_V2_BUFFER_SIZE = 96
NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE = 80
NVML_SYSTEM_NVML_VERSION_BUFFER_SIZE = 80
NVML_VALUE_NOT_AVAILABLE_uint = 0xFFFFFFFF
NVML_VALUE_NOT_AVAILABLE_ulonglong = 0xFFFFFFFFFFFFFFFF

nvmlMemory_v2 = 0x02000028

_MIB = 1024 * 1024


# -------------------------------------------------------------------------------------------- errors
class NVMLError(Exception):
    _valClassMapping = dict()
    _errcode_to_string = {
        NVML_ERROR_UNINITIALIZED: "Uninitialized",
        NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
        NVML_ERROR_NOT_SUPPORTED: "Not Supported",
        NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
        NVML_ERROR_ALREADY_INITIALIZED: "Already Initialized",
        NVML_ERROR_NOT_FOUND: "Not Found",
        NVML_ERROR_INSUFFICIENT_SIZE: "Insufficient Size",
        NVML_ERROR_INSUFFICIENT_POWER: "Insufficient External Power",
        NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
        NVML_ERROR_TIMEOUT: "Timeout",
        NVML_ERROR_IRQ_ISSUE: "Interrupt Request Issue",
        NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
        NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
        NVML_ERROR_CORRUPTED_INFOROM: "Corrupted infoROM",
        NVML_ERROR_GPU_IS_LOST: "GPU is lost",
        NVML_ERROR_RESET_REQUIRED: "GPU requires restart",
        NVML_ERROR_OPERATING_SYSTEM: "The operating system has blocked the request.",
        NVML_ERROR_LIB_RM_VERSION_MISMATCH: "RM has detected an NVML/RM version mismatch.",
        NVML_ERROR_MEMORY: "Insufficient Memory",
        NVML_ERROR_UNKNOWN: "Unknown Error",
    }

    def __new__(typ, value):
        if typ == NVMLError:
            typ = NVMLError._valClassMapping.get(value, typ)
        obj = Exception.__new__(typ)
        obj.value = value
        return obj

    def __str__(self):
        return NVMLError._errcode_to_string.get(self.value, "NVML Error with code %d" % self.value)

    def __eq__(self, other):
        return self.value == other.value

    def __hash__(self):
        return hash(self.value)


def nvmlExceptionClass(nvmlErrorCode):
    if nvmlErrorCode not in NVMLError._valClassMapping:
        raise ValueError("nvmlErrorCode %s is not valid" % nvmlErrorCode)
    return NVMLError._valClassMapping[nvmlErrorCode]


def _extractNVMLErrorsAsClasses():
    """NVML_ERROR_GPU_IS_LOST -> class NVMLError_GpuIsLost(NVMLError), exactly as nvidia-ml-py names them."""
    this_module = sys.modules[__name__]
    for err_name in [x for x in dir(this_module) if x.startswith("NVML_ERROR_")]:
        # string.capwords(name, "_") without the string module (its import pulls in re: ~10 ms a command)
        words = err_name.replace("NVML_ERROR_", "").split("_")
        class_name = "NVMLError_" + "".join(word.capitalize() for word in words)
        err_val = getattr(this_module, err_name)

        def gen_new(val):
            def new(typ, *args):
                return NVMLError.__new__(typ, val)
            return new

        new_error_class = type(class_name, (NVMLError,), {"__new__": gen_new(err_val)})
        new_error_class.__module__ = __name__
        setattr(this_module, class_name, new_error_class)
        NVMLError._valClassMapping[err_val] = new_error_class


_extractNVMLErrorsAsClasses()


def _nvmlCheckReturn(ret):
    if ret != NVML_SUCCESS:
        raise NVMLError(ret)
    return ret


# ----------------------------------------------------------------------------------------- structs
class _PrintableStructure(object):
    """Plain-Python stand-in for the ctypes structures: same field names, same str() shape."""

    _fields_ = []
    _fmt_ = {}

    def __init__(self, **values):
        for name, _ in self._fields_:
            setattr(self, name, values.get(name, 0))

    def __str__(self):
        result = []
        for key, _ in self._fields_:
            fmt = self._fmt_.get(key, self._fmt_.get("<default>", "%s"))
            result.append(("%s: " + fmt) % (key, getattr(self, key)))
        return self.__class__.__name__ + "(" + ", ".join(result) + ")"

    __repr__ = __str__


class c_nvmlMemory_t(_PrintableStructure):
    _fields_ = [("total", "c_ulonglong"), ("free", "c_ulonglong"), ("used", "c_ulonglong")]
    _fmt_ = {"<default>": "%d B"}


class c_nvmlMemory_v2_t(_PrintableStructure):
    _fields_ = [("version", "c_uint"), ("total", "c_ulonglong"), ("reserved", "c_ulonglong"),
                ("free", "c_ulonglong"), ("used", "c_ulonglong")]
    _fmt_ = {"<default>": "%d B"}


class c_nvmlProcessInfo_v2_t(_PrintableStructure):
    _fields_ = [("pid", "c_uint"), ("usedGpuMemory", "c_ulonglong"), ("gpuInstanceId", "c_uint"),
                ("computeInstanceId", "c_uint")]
    _fmt_ = {"usedGpuMemory": "%d B"}


c_nvmlProcessInfo_v3_t = c_nvmlProcessInfo_v2_t
c_nvmlProcessInfo_t = c_nvmlProcessInfo_v2_t


class nvmlFriendlyObject(object):
    def __init__(self, dictionary):
        for x in dictionary:
            setattr(self, x, dictionary[x])

    def __str__(self):
        return self.__dict__.__str__()


def nvmlStructToFriendlyObject(struct):
    d = {}
    for key, _ in struct._fields_:
        value = getattr(struct, key)
        d[key] = value.decode() if isinstance(value, bytes) else value
    return nvmlFriendlyObject(d)


class c_nvmlDevice_t(object):
    """A device handle (opaque in the real binding)."""

    def __init__(self, index):
        self._index = index

    def __repr__(self):
        return "<c_nvmlDevice_t index=%d>" % self._index

    def __eq__(self, other):
        return isinstance(other, c_nvmlDevice_t) and other._index == self._index

    def __hash__(self):
        return hash(self._index)


# ------------------------------------------------------------------------------------------ library
_lock = threading.Lock()
_nvmlLib_refcount = 0
nvmlLib = None


def _config():
    if _nvmlLib_refcount <= 0:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    try:
        return _sim.load_config()
    except _sim.DriverUnavailable:
        # the driver went away under us (module unloaded, GPU fell off the bus)
        raise NVMLError(NVML_ERROR_GPU_IS_LOST)


def nvmlInitWithFlags(flags):
    global _nvmlLib_refcount
    try:
        _sim.load_config()
    except _sim.DriverUnavailable:
        raise NVMLError(NVML_ERROR_DRIVER_NOT_LOADED)
    with _lock:
        _nvmlLib_refcount += 1
    return None


def nvmlInit():
    nvmlInitWithFlags(0)
    return None


def nvmlShutdown():
    global _nvmlLib_refcount
    if _nvmlLib_refcount <= 0:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    with _lock:
        _nvmlLib_refcount -= 1
    return None


def nvmlErrorString(result):
    return NVMLError._errcode_to_string.get(result, "Unknown Error")


def nvmlSystemGetDriverVersion():
    return str(_config().get("driver_version", _sim.DEFAULT_DRIVER_VERSION))


def nvmlSystemGetNVMLVersion():
    return "13." + str(_config().get("driver_version", _sim.DEFAULT_DRIVER_VERSION))


def nvmlSystemGetCudaDriverVersion():
    major, _, minor = str(_config().get("cuda_version", _sim.DEFAULT_CUDA_VERSION)).partition(".")
    return int(major) * 1000 + int(minor or 0) * 10


nvmlSystemGetCudaDriverVersion_v2 = nvmlSystemGetCudaDriverVersion


def nvmlSystemGetProcessName(pid):
    try:
        with open("/proc/%d/cmdline" % int(pid), "rb") as f:
            return f.read().split(b"\0")[0].decode(errors="replace")
    except OSError:
        raise NVMLError(NVML_ERROR_NOT_FOUND)


def nvmlDeviceGetCount():
    return int(_config()["count"])


def _check_handle(handle):
    config = _config()
    if not isinstance(handle, c_nvmlDevice_t) or not 0 <= handle._index < int(config["count"]):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return config


def nvmlDeviceGetHandleByIndex(index):
    config = _config()
    if not isinstance(index, int) or not 0 <= index < int(config["count"]):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return c_nvmlDevice_t(index)


def nvmlDeviceGetHandleByUUID(uuid):
    if isinstance(uuid, bytes):
        uuid = uuid.decode()
    config = _config()
    if uuid in config["uuids"]:
        return c_nvmlDevice_t(config["uuids"].index(uuid))
    raise NVMLError(NVML_ERROR_NOT_FOUND)


def nvmlDeviceGetIndex(handle):
    _check_handle(handle)
    return handle._index


def nvmlDeviceGetName(handle):
    return str(_check_handle(handle)["name"])


def nvmlDeviceGetUUID(handle):
    return str(_check_handle(handle)["uuids"][handle._index])


def nvmlDeviceGetCudaComputeCapability(handle):
    """(major, minor), as nvidia-ml-py returns it."""
    major, _, minor = _sim.compute_capability(_check_handle(handle)).partition(".")
    return (int(major), int(minor or 0))


def nvmlDeviceGetMemoryInfo(handle, version=None):
    _check_handle(handle)
    mem = _sim.memory_info(handle._index)
    if not version:
        return c_nvmlMemory_t(total=mem.total_mib * _MIB, free=(mem.total_mib - mem.v1_used_mib) * _MIB,
                              used=mem.v1_used_mib * _MIB)
    if version != nvmlMemory_v2:
        # the real binding passes the version through to nvmlDeviceGetMemoryInfo_v2, which refuses it
        raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
    return c_nvmlMemory_v2_t(version=version, total=mem.total_mib * _MIB, reserved=mem.reserved_mib * _MIB,
                             free=mem.free_mib * _MIB, used=mem.used_mib * _MIB)


def nvmlDeviceGetComputeRunningProcesses_v3(handle):
    _check_handle(handle)
    procs = []
    for p in _sim.list_processes(handle._index):
        struct = c_nvmlProcessInfo_v2_t(pid=p["pid"], usedGpuMemory=p["used_mib"] * _MIB,
                                        gpuInstanceId=NVML_VALUE_NOT_AVAILABLE_uint,
                                        computeInstanceId=NVML_VALUE_NOT_AVAILABLE_uint)
        procs.append(nvmlStructToFriendlyObject(struct))
    return procs


nvmlDeviceGetComputeRunningProcesses_v2 = nvmlDeviceGetComputeRunningProcesses_v3


def nvmlDeviceGetComputeRunningProcesses(handle):
    return nvmlDeviceGetComputeRunningProcesses_v3(handle)


def nvmlDeviceGetGraphicsRunningProcesses(handle):
    _check_handle(handle)
    return []


nvmlDeviceGetGraphicsRunningProcesses_v3 = nvmlDeviceGetGraphicsRunningProcesses
nvmlDeviceGetGraphicsRunningProcesses_v2 = nvmlDeviceGetGraphicsRunningProcesses

NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1


def nvmlDeviceGetMigMode(device):
    _check_handle(device)
    return [NVML_DEVICE_MIG_DISABLE, NVML_DEVICE_MIG_DISABLE]
