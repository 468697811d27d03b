"""What the lab installs into a container's /usr overlay: nvidia-smi, pynvml and the engine stand-ins.

Everything installed is stdlib-only Python run by the container's /usr/bin/python3:

    usr/bin/nvidia-smi                                   (#!/usr/bin/python3; gpugate_nvidia_smi.main)
    usr/bin/vllm                                         (#!/usr/bin/python3; vllm.entrypoints.cli.main, as
                                                          pip writes vLLM's console script)
    usr/lib/python3/dist-packages/pynvml.py              (lab/gpugate_lab/pynvml_sim/pynvml.py)
    usr/lib/python3/dist-packages/gpugate_gpusim.py      (lab/gpugate_lab/gpusim.py)
    usr/lib/python3/dist-packages/gpugate_nvidia_smi.py  (lab/gpugate_lab/nvidia_smi.py)
    usr/lib/python3/dist-packages/gpustat.py             (lab/gpugate_lab/standin/gpustat.py: a GPU monitor)
    usr/lib/python3/dist-packages/gpugate_sse.py         (lab/gpugate_lab/standin/_sse.py: the stand-ins'
                                                          streamed answers, server-sent events)
    usr/lib/python3/dist-packages/gpugate_metrics.py     (lab/gpugate_lab/standin/_metrics.py: the
                                                          stand-ins' Prometheus counters and histograms)
    usr/lib/python3/dist-packages/gpugate_standin.py     (lab/gpugate_lab/standin/_common.py: what the
                                                          stand-ins share: titles, memory, children, HTTP)
    usr/lib/python3/dist-packages/gpugate_standin_real.py  (lab/gpugate_lab/standin/_realgpu.py: their
                                                          real-GPU mode)
    usr/lib/python3/dist-packages/sglang/...             (lab/gpugate_lab/standin/sglang; bench_serving.py
                                                          is the benchmark client)
    .../sglang/srt/flag_table.json, sglang/_version.py   (the snapshot of ONE SGLang release's flags,
                                                          gpugate/engine/sglang/flagtables/sglang-<version>.json:
                                                          the stand-in's parser; never gpugate's
                                                          own sglang_args.py)
    usr/lib/python3/dist-packages/sglang-<version>.dist-info/METADATA   (the version, as pip writes it)
    usr/lib/python3/dist-packages/vllm/...               (lab/gpugate_lab/standin/vllm)
    .../vllm/engine/flag_table.json, vllm/_version.py    (the snapshot of ONE vLLM release's serve parser,
                                                          gpugate/engine/vllm/flagtables/vllm-<version>.json)
    usr/lib/python3/dist-packages/vllm-<version>.dist-info/METADATA

The releases: ``gpugate lab up --sglang-version 0.5.23`` (kept in ``$LAB/sglang-version``) and
``$LAB/vllm-version`` (``set_engine_version(lab, "0.33.0", "vllm")``), else the newest snapshot.

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


# Each stand-in: its package under standin/, where its parser's snapshot goes in it, its label
STANDINS = {"sglang": ("srt/flag_table.json", "SGLang"), "vllm": ("engine/flag_table.json", "vLLM")}
VLLM_SCRIPT = """#!/usr/bin/python3
# -*- coding: utf-8 -*-
import re
import sys
from vllm.entrypoints.cli.main import main
if __name__ == "__main__":
    sys.argv[0] = re.sub(r"(-script\\.pyw|\\.exe)?$", "", sys.argv[0])
    sys.exit(main())
"""


def _snapshots(engine: str) -> tuple:
    """(the folder of gpugate's snapshots of ``engine``, its versions oldest first)."""
    if engine == "vllm":
        from gpugate.engine.vllm import flags as vllm_flags  # noqa: PLC0415
        return vllm_flags.SNAPSHOT_DIR, vllm_flags.snapshot_versions()
    from gpugate.engine.sglang.flags import SNAPSHOT_DIR, snapshot_versions  # noqa: PLC0415
    return SNAPSHOT_DIR, snapshot_versions(SNAPSHOT_DIR)


def snapshot_file(version: str | None = None, engine: str = "sglang") -> Path:
    """gpugate's snapshot of ``engine`` ``version``'s flags (default: the newest); LookupError naming
    the versions there are."""
    (folder, versions), label = _snapshots(engine), STANDINS[engine][1]
    found = {p.name[len(engine) + 1:-len(".json")]: p for p in folder.glob(f"{engine}-*.json")}
    if not found:
        raise LookupError(f"no {label} flag snapshot in {folder}")
    if version is None:
        version = versions[-1]
    if version not in found:
        raise LookupError(f"no snapshot of {label} {version}; the lab's stand-in can be "
                          f"{', '.join(sorted(found))} (scripts/flags_snapshot.py {engine} makes more)")
    return found[version]


def lab_engine_version(path: Path, engine: str = "sglang") -> str | None:
    """The release the lab that ``path`` (a container's dir or its usr-upper,
    $LAB/hosts/<h>/ct/<vmid>[/usr-upper]) belongs to chose for ``engine`` (``$LAB/<engine>-version``), or None."""
    for parent in Path(path).resolve().parents:
        if parent.name == "hosts":
            marker = parent.parent / f"{engine}-version"
            return (marker.read_text().strip() or None) if marker.is_file() else None
    return None


def lab_sglang_version(path: Path) -> str | None:
    """The release ``gpugate lab up --sglang-version`` chose for the lab that ``path`` belongs to, or None."""
    return lab_engine_version(path, "sglang")


def install_flag_table(standin_dst: Path, dist: Path, version: str | None, engine: str = "sglang") -> str:
    """The stand-in's parser for one release: its snapshot inside the package (``sglang/srt/flag_table.json``,
    ``vllm/engine/flag_table.json``), ``<package>/_version.py``, and ``<engine>-<version>.dist-info/METADATA``
    in ``dist`` (where pip puts it, so the version reads as the real package's does). Returns the version."""
    source = snapshot_file(version, engine)
    table = json.loads(source.read_text())
    version = str(table[f"{engine}_version"])
    target = Path(standin_dst) / STANDINS[engine][0]
    target.parent.mkdir(parents=True, exist_ok=True)
    _copy(source, target)
    (Path(standin_dst) / "_version.py").write_text(f"__version__ = {version!r}\n")
    for old in Path(dist).glob(f"{engine}-*.dist-info"):
        shutil.rmtree(old)
    info = Path(dist) / f"{engine}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {engine}\nVersion: {version}\n"
                                   f"Summary: the gpugate lab's {STANDINS[engine][1]} stand-in\n")
    (info / "INSTALLER").write_text("gpugate-lab\n")
    return version


def install_standins(dist: Path, versions: dict | None = None, lab_path: Path | None = None) -> None:
    """The engine stand-ins and what they share into ``dist`` (a site-packages dir: a container's
    dist-packages, or a real-GPU lab's torch env). ``versions``: {engine: release}, else the lab's
    choice for ``lab_path`` (``$LAB/<engine>-version``), else the newest snapshot."""
    dist = Path(dist)
    dist.mkdir(parents=True, exist_ok=True)
    _copy(LAB_DIR / "gpusim.py", dist / "gpugate_gpusim.py")
    _copy(LAB_DIR / "standin" / "_sse.py", dist / "gpugate_sse.py")  # every stand-in's streamed answers
    _copy(LAB_DIR / "standin" / "_metrics.py", dist / "gpugate_metrics.py")  # and their /metrics
    _copy(LAB_DIR / "standin" / "_common.py", dist / "gpugate_standin.py")  # what the stand-ins share
    _copy(LAB_DIR / "standin" / "_realgpu.py", dist / "gpugate_standin_real.py")  # and on real GPUs
    for engine in STANDINS:
        dst = dist / engine
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(LAB_DIR / "standin" / engine, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        chosen = (versions or {}).get(engine) or (lab_engine_version(lab_path, engine) if lab_path else None)
        install_flag_table(dst, dist, chosen, engine)


def install_container_extras(usr_upper: Path, sglang_version: str | None = None,
                             vllm_version: str | None = None) -> None:
    """Write the lab's nvidia-smi, pynvml and the engine stand-ins into a container's /usr upper dir.

    ``sglang_version``, ``vllm_version``: the releases whose flags the stand-ins take (snapshots in
    gpugate/engine/<engine>/flagtables); default the lab's choice (``lab_engine_version``), else the
    newest. Idempotent: rewrites the files each time (a lab upgrade reaches existing containers).
    """
    usr_upper = Path(usr_upper)
    dist = dist_packages(usr_upper)
    dist.mkdir(parents=True, exist_ok=True)
    _copy(LAB_DIR / "nvidia_smi.py", dist / "gpugate_nvidia_smi.py")
    _copy(LAB_DIR / "pynvml_sim" / "pynvml.py", dist / "pynvml.py")
    _copy(LAB_DIR / "standin" / "gpustat.py", dist / "gpustat.py")  # a GPU monitor: python3 -m gpustat -i 1
    install_standins(dist, {"sglang": sglang_version, "vllm": vllm_version}, usr_upper)
    for name, text in (("nvidia-smi", NVIDIA_SMI_SCRIPT), ("vllm", VLLM_SCRIPT)):
        script = usr_upper / "bin" / name
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text(text)
        script.chmod(0o755)


def set_engine_version(lab_dir: Path, version: str | None, engine: str = "sglang") -> str:
    """The release of ``engine`` the lab's stand-in is (a snapshot's version; None: the newest). Kept
    in ``$LAB/<engine>-version`` for containers made later, and put into every container the lab
    already has. Returns the version; LookupError for one without a snapshot.

    Example: ``set_engine_version(Path("/tmp/gpugate-lab"), "0.33.0", "vllm")``
    """
    source = snapshot_file(version, engine)
    version = str(json.loads(source.read_text())[f"{engine}_version"])
    lab_dir = Path(lab_dir)
    lab_dir.mkdir(parents=True, exist_ok=True)
    (lab_dir / f"{engine}-version").write_text(version + "\n")
    for usr_upper in sorted(lab_dir.glob("hosts/*/ct/*/usr-upper")):
        dst = dist_packages(usr_upper) / engine
        if dst.is_dir():
            install_flag_table(dst, dist_packages(usr_upper), version, engine)
    return version


def set_sglang_version(lab_dir: Path, version: str | None) -> str:
    """``gpugate lab up --sglang-version``: the SGLang release the lab's stand-in is (a snapshot's
    version; None: the newest). Kept in ``$LAB/sglang-version`` for containers made later, and put
    into every container the lab already has. Returns the version; LookupError for one without a
    snapshot.

    Example: ``set_sglang_version(Path("/tmp/gpugate-lab"), "0.5.23")``
    """
    return set_engine_version(lab_dir, version, "sglang")
