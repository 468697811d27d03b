"""What the lab installs into a container's /usr overlay: nvidia-smi, pynvml and the SGLang stand-in.

Everything installed is stdlib-only Python run by the container's /usr/bin/python3:

    usr/bin/nvidia-smi                                   (#!/usr/bin/python3; gpugate_nvidia_smi.main)
    usr/lib/python3/dist-packages/pynvml.py              (gpugate/lab/pynvml_sim/pynvml.py)
    usr/lib/python3/dist-packages/gpugate_gpusim.py      (gpugate/lab/gpusim.py)
    usr/lib/python3/dist-packages/gpugate_nvidia_smi.py  (gpugate/lab/nvidia_smi.py)
    usr/lib/python3/dist-packages/gpustat.py             (gpugate/lab/standin/gpustat.py: a GPU monitor)
    usr/lib/python3/dist-packages/sglang/...             (gpugate/lab/standin/sglang + _server_args.py
                                                          = gpugate/sglang_args.py; bench_serving.py
                                                          is the benchmark client)

Example: ``install_container_extras(Path("/tmp/lab/hosts/pve1/ct/129/usr-upper"))``
"""

from __future__ import annotations

import shutil
from pathlib import Path

LAB_DIR = Path(__file__).resolve().parent
PACKAGE_DIR = LAB_DIR.parent

NVIDIA_SMI_SCRIPT = """#!/usr/bin/python3
# gpugate lab: simulated nvidia-smi (reads the simulated driver at /run/gpugate-sim)
import sys

from gpugate_nvidia_smi import main

sys.exit(main())
"""


def dist_packages(usr_root: Path) -> Path:
    """Where Debian's /usr/bin/python3 finds system packages, under a /usr tree."""
    return Path(usr_root) / "lib" / "python3" / "dist-packages"


def _copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)


def install_container_extras(usr_upper: Path) -> None:
    """Write the lab's nvidia-smi, pynvml and sglang stand-in into a container's /usr upper dir.

    Idempotent: rewrites the files each time (a lab upgrade reaches existing containers).
    """
    usr_upper = Path(usr_upper)
    dist = dist_packages(usr_upper)
    dist.mkdir(parents=True, exist_ok=True)
    _copy(LAB_DIR / "gpusim.py", dist / "gpugate_gpusim.py")
    _copy(LAB_DIR / "nvidia_smi.py", dist / "gpugate_nvidia_smi.py")
    _copy(LAB_DIR / "pynvml_sim" / "pynvml.py", dist / "pynvml.py")
    _copy(LAB_DIR / "standin" / "gpustat.py", dist / "gpustat.py")  # a GPU monitor: python3 -m gpustat -i 1
    sglang_dst = dist / "sglang"
    if sglang_dst.exists():
        shutil.rmtree(sglang_dst)
    shutil.copytree(LAB_DIR / "standin" / "sglang", sglang_dst,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    server_args = PACKAGE_DIR / "sglang_args.py"
    if server_args.exists():
        _copy(server_args, sglang_dst / "_server_args.py")
    smi = usr_upper / "bin" / "nvidia-smi"
    smi.parent.mkdir(parents=True, exist_ok=True)
    smi.write_text(NVIDIA_SMI_SCRIPT)
    smi.chmod(0o755)
