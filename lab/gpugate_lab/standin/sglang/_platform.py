"""The stand-in's ``current_platform`` (SGLang: ``sglang/srt/platforms/cuda.py``): which physical GPU
a process's device index names, its UUID, its compute capability, and the torch version.

SGLang asks torch: ``get_device_uuid(i)`` is ``str(torch.cuda.get_device_properties(i).uuid)``, the
device's UUID in the 8-4-4-4-12 form **without** NVML's ``GPU-`` prefix (torch's ``_CUuuid.__str__``);
``i`` counts the devices ``CUDA_VISIBLE_DEVICES`` leaves visible (indices or ``GPU-`` UUIDs, in its
order). ``compute_env_stamp`` (weight_cache/protocol.py) takes ``get_device_capability()`` of device 0
and ``torch.__version__``.

In a simulated lab the same answers come from the simulated driver's config (gpusim): the UUIDs
nvidia-smi and NVML report; the compute capability nvidia-smi's ``compute_cap`` and NVML's
``nvmlDeviceGetCudaComputeCapability`` report (by the GPU's name: gpusim.compute_capability; override
``$SGLANG_STANDIN_DEVICE_CAPABILITY``); and ``TORCH_VERSION`` (override ``$SGLANG_STANDIN_TORCH_VERSION``),
the torch SGLang 0.5.23 pins (``Requires-Dist: torch==2.14.1``) as its CUDA 13 wheel names itself
(``2.14.1+cu130``; an assumption of the lab: the suffix is the wheel's CUDA build). In real mode
(``gpugate lab up --gpus real``) torch answers. Stdlib only in sim mode.
"""

import os

from sglang import _real
from sglang._sim import common, gpusim

TORCH_VERSION = "2.14.1+cu130"


def compute_capability(config):
    """``major.minor`` of the simulated GPUs (the simulated driver's, as nvidia-smi's ``compute_cap``
    reports it), or ``$SGLANG_STANDIN_DEVICE_CAPABILITY``."""
    return os.environ.get("SGLANG_STANDIN_DEVICE_CAPABILITY") or gpusim.compute_capability(config)


_config = common.load_gpu_config
visible_devices = common.visible_devices
physical_gpu = common.physical_gpu


def _torch():
    import torch  # noqa: PLC0415 -- real mode only

    return torch


def device_type():
    """``cuda`` (real GPUs), ``cpu`` (real mode on CPU torch) or ``sim`` (the simulated driver)."""
    mode = _real.lab_mode()
    return "sim" if not mode else str(mode.get("device") or "cuda")


def get_device_uuid(index):
    """SGLang's ``current_platform.get_device_uuid(index)``: torch's form, no ``GPU-`` prefix."""
    kind = device_type()
    if kind == "cpu":  # SGLang's CpuPlatform: the machine's architecture
        import platform  # noqa: PLC0415

        return platform.machine()
    if kind == "cuda":
        return str(_torch().cuda.get_device_properties(int(index)).uuid)
    config = _config()
    uuid = str(config["uuids"][physical_gpu(index, config)])
    return uuid[len("GPU-"):] if uuid.startswith("GPU-") else uuid


def get_device_capability(index=0):
    kind = device_type()
    if kind == "cpu":
        return ""
    if kind == "cuda":
        major, minor = _torch().cuda.get_device_capability(int(index))
        return "%d.%d" % (major, minor)
    return compute_capability(_config())


def torch_version():
    if device_type() != "sim":
        return str(_torch().__version__)
    return os.environ.get("SGLANG_STANDIN_TORCH_VERSION") or TORCH_VERSION
