"""What the lab installs into a container's /usr overlay: nvidia-smi, pynvml and the SGLang stand-in.

Everything installed is stdlib-only Python run by the container's /usr/bin/python3:

    usr/bin/nvidia-smi                                   (#!/usr/bin/python3; gpugate_nvidia_smi.main)
    usr/lib/python3/dist-packages/pynvml.py              (lab/gpugate_lab/pynvml_sim/pynvml.py)
    usr/lib/python3/dist-packages/gpugate_gpusim.py      (lab/gpugate_lab/gpusim.py)
    usr/lib/python3/dist-packages/gpugate_nvidia_smi.py  (lab/gpugate_lab/nvidia_smi.py)
    usr/lib/python3/dist-packages/gpustat.py             (lab/gpugate_lab/standin/gpustat.py: a GPU monitor)
    usr/lib/python3/dist-packages/gpugate_sse.py         (lab/gpugate_lab/standin/_sse.py: the stand-ins'
                                                          streamed answers, server-sent events)
    usr/lib/python3/dist-packages/sglang/...             (lab/gpugate_lab/standin/sglang; bench_serving.py
                                                          is the benchmark client)
    .../sglang/srt/flag_table.json, sglang/_version.py   (the snapshot of ONE SGLang release's flags,
                                                          gpugate/engine/sglang/flagtables/sglang-<version>.json:
                                                          the stand-in's parser; never gpugate's
                                                          own sglang_args.py)
    usr/lib/python3/dist-packages/sglang-<version>.dist-info/METADATA   (the version, as pip writes it)

The release: ``gpugate lab up --sglang-version 0.5.23`` (kept in ``$LAB/sglang-version``), else the
newest snapshot.

Example: ``install_container_extras(Path("/tmp/lab/hosts/pve1/ct/129/usr-upper"))``
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

LAB_DIR = Path(__file__).resolve().parent

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


def snapshot_file(version: str | None = None) -> Path:
    """gpugate's snapshot of SGLang ``version``'s flags (default: the newest); LookupError naming
    the versions there are."""
    from gpugate.engine.sglang.flags import SNAPSHOT_DIR as folder, snapshot_versions  # noqa: PLC0415

    found = {p.name[len("sglang-"):-len(".json")]: p for p in folder.glob("sglang-*.json")}
    if not found:
        raise LookupError(f"no SGLang flag snapshot in {folder}")
    if version is None:
        version = snapshot_versions(folder)[-1]
    if version not in found:
        raise LookupError(f"no snapshot of SGLang {version}; the lab's stand-in can be "
                          f"{', '.join(sorted(found))} (scripts/flags_snapshot.py sglang makes more)")
    return found[version]


def lab_sglang_version(path: Path) -> str | None:
    """The release ``gpugate lab up --sglang-version`` chose for the lab that ``path`` (a container's
    dir or its usr-upper, $LAB/hosts/<h>/ct/<vmid>[/usr-upper]) belongs to, or None."""
    for parent in Path(path).resolve().parents:
        if parent.name == "hosts":
            marker = parent.parent / "sglang-version"
            return (marker.read_text().strip() or None) if marker.is_file() else None
    return None


def install_flag_table(sglang_dst: Path, dist: Path, version: str | None) -> str:
    """The stand-in's parser for one SGLang release: its snapshot as ``sglang/srt/flag_table.json``,
    ``sglang/_version.py``, and ``sglang-<version>.dist-info/METADATA`` in ``dist`` (where pip puts
    it, so the version reads as the real package's does). Returns the version."""
    source = snapshot_file(version)
    table = json.loads(source.read_text())
    version = str(table["sglang_version"])
    (sglang_dst / "srt").mkdir(parents=True, exist_ok=True)
    _copy(source, sglang_dst / "srt" / "flag_table.json")
    (sglang_dst / "_version.py").write_text(f"__version__ = {version!r}\n")
    for old in Path(dist).glob("sglang-*.dist-info"):
        shutil.rmtree(old)
    info = Path(dist) / f"sglang-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n"
                                   f"Summary: the gpugate lab's SGLang stand-in\n")
    (info / "INSTALLER").write_text("gpugate-lab\n")
    return version


def install_container_extras(usr_upper: Path, sglang_version: str | None = None) -> None:
    """Write the lab's nvidia-smi, pynvml and sglang stand-in into a container's /usr upper dir.

    ``sglang_version``: the SGLang release whose flags the stand-in takes (a snapshot in
    gpugate/engine/sglang/flagtables); default the lab's choice (``lab_sglang_version``), else the newest.
    Idempotent: rewrites the files each time (a lab upgrade reaches existing containers).
    """
    usr_upper = Path(usr_upper)
    dist = dist_packages(usr_upper)
    dist.mkdir(parents=True, exist_ok=True)
    _copy(LAB_DIR / "gpusim.py", dist / "gpugate_gpusim.py")
    _copy(LAB_DIR / "nvidia_smi.py", dist / "gpugate_nvidia_smi.py")
    _copy(LAB_DIR / "pynvml_sim" / "pynvml.py", dist / "pynvml.py")
    _copy(LAB_DIR / "standin" / "gpustat.py", dist / "gpustat.py")  # a GPU monitor: python3 -m gpustat -i 1
    _copy(LAB_DIR / "standin" / "_sse.py", dist / "gpugate_sse.py")  # every stand-in's streamed answers
    _copy(LAB_DIR / "standin" / "_common.py", dist / "gpugate_standin.py")  # what the stand-ins share
    sglang_dst = dist / "sglang"
    if sglang_dst.exists():
        shutil.rmtree(sglang_dst)
    shutil.copytree(LAB_DIR / "standin" / "sglang", sglang_dst,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    install_flag_table(sglang_dst, dist, sglang_version or lab_sglang_version(usr_upper))
    smi = usr_upper / "bin" / "nvidia-smi"
    smi.parent.mkdir(parents=True, exist_ok=True)
    smi.write_text(NVIDIA_SMI_SCRIPT)
    smi.chmod(0o755)


def set_sglang_version(lab_dir: Path, version: str | None) -> str:
    """``gpugate lab up --sglang-version``: the SGLang release the lab's stand-in is (a snapshot's
    version; None: the newest). Kept in ``$LAB/sglang-version`` for containers made later, and put
    into every container the lab already has. Returns the version; LookupError for one without a
    snapshot.

    Example: ``set_sglang_version(Path("/tmp/gpugate-lab"), "0.5.23")``
    """
    source = snapshot_file(version)
    version = str(json.loads(source.read_text())["sglang_version"])
    lab_dir = Path(lab_dir)
    lab_dir.mkdir(parents=True, exist_ok=True)
    (lab_dir / "sglang-version").write_text(version + "\n")
    for usr_upper in sorted(lab_dir.glob("hosts/*/ct/*/usr-upper")):
        sglang_dst = dist_packages(usr_upper) / "sglang"
        if sglang_dst.is_dir():
            install_flag_table(sglang_dst, dist_packages(usr_upper), version)
    return version
