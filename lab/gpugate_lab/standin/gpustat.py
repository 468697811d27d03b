"""``python3 -m gpustat -i 1``: the lab's stand-in of a GPU monitor (gpustat's watch mode; nvitop and
the exporters behave alike). Stdlib only, installed in lab containers as ``gpustat.py``.

What matters about a monitor for a deploy, and what this one does: it calls ``nvmlInit()`` and keeps
the NVML device files open for its whole life (``/dev/nvidiactl``, ``/dev/nvidia-uvm`` and every
``/dev/nvidiaN``, as the real libnvidia-ml does), so ``fuser``/``/proc/*/fd`` count it as a GPU
holder, yet it holds 0 MiB and no CUDA context. It prints the GPUs' memory every interval until it is
killed. A deploy must report it, never kill it, and never wait for it.

Example (in a lab container)::

    python3 -m gpustat -i 1 --no-color
"""

import argparse
import socket
import sys
import time

import pynvml

try:
    import gpugate_gpusim as _sim  # inside a lab container
except ImportError:  # development: the package's own copy
    from gpugate_lab import gpusim as _sim  # type: ignore[no-redef]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="gpustat")
    parser.add_argument("-i", "--interval", "--watch", type=float, nargs="?", const=1.0, default=None)
    parser.add_argument("--no-color", action="store_true")
    args, _ignored = parser.parse_known_args(argv)
    pynvml.nvmlInit()
    _sim.open_device_nodes()  # what libnvidia-ml holds open after nvmlInit
    count = pynvml.nvmlDeviceGetCount()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    while True:
        lines = ["%-20s %s  %s" % (socket.gethostname(), time.strftime("%a %b %d %H:%M:%S %Y"),
                                   pynvml.nvmlSystemGetDriverVersion())]
        for index, handle in enumerate(handles):
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
            lines.append("[%d] %s | %5d / %5d MB |" % (index, pynvml.nvmlDeviceGetName(handle),
                                                        memory.used >> 20, memory.total >> 20))
        sys.stdout.write("\n".join(lines) + "\n")
        sys.stdout.flush()
        if args.interval is None:
            return 0
        time.sleep(max(0.1, args.interval))


if __name__ == "__main__":
    sys.exit(main())
