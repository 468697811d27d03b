#!/usr/bin/env python3
"""Make gpugate's snapshot of an engine's flags for one release, from the real wheel on PyPI.

    python3 scripts/flags_snapshot.py sglang 0.5.23 [--torch SPEC] [--out gpugate/engine/sglang/flagtables]
    python3 scripts/flags_snapshot.py vllm 0.33.0 --torch torch==2.13.0

1. ``pip download ENGINE==VERSION --no-deps``: the real wheel.
2. Unpack it into a temporary target and run gpugate/engine/ENGINE/table_builder.py there (the builder
   that runs in containers): SGLang's imports ``sglang.srt.server_args`` and calls its own
   ``ServerArgs.add_cli_args(argparse.ArgumentParser())``; vLLM's calls its own
   ``make_arg_parser(FlexibleArgumentParser())`` (what ``vllm serve`` parses).
3. Only what that import needs is installed into a second temporary target, one module at a time:
   each ``ModuleNotFoundError`` names the next one; it is installed with pip, pinned as the wheel's
   ``Requires-Dist`` pins it (``--torch`` says where torch comes from: a CPU build is enough, e.g.
   ``--torch /opt/wheels/torch-2.13.0+cpu-...whl``).
4. The table goes to ``gpugate/engine/ENGINE/flagtables/ENGINE-VERSION.json`` with the version, the sha256 of
   the parser's source file, the number of option names, and what was installed and what was stubbed.

Every install is ``--no-deps``: a dependency that an import needs shows up as the next missing module
(or missing package metadata), so nothing but the import chain is installed and pip never replaces
the given torch with another build.

Stubbed, never installed (``STUBBED``, per engine):

- ``torchvision`` (0.5.10 .. 0.5.1x import ``from torchvision.io import decode_jpeg`` in
  ``sglang/srt/utils/common.py``, for image inputs). PyPI's torchvision is built against a CUDA torch
  and does not load beside a CPU torch (``operator torchvision::nms does not exist``); decode_jpeg is
  never called while the parser is built. Not checked against a real torchvision here: the GPU
  machine's script (tests/gpu/time_server_args_import.py) compares a snapshot with the table of a real
  install.

torch and triton are installed, never stubbed: SGLang probes them at import. With a permissive torch
stub, ``hasattr(torch, "npu")`` made 0.5.23 believe it ran on an NPU; with a triton stub, 0.5.10's
``triton.runtime.driver.active.get_current_target()`` (which raises on a machine without a GPU, so
SGLang falls back to "cpu") returned an object and the import failed. (For 0.5.23 alone a triton stub
gave the identical table: ``--compare-real`` checks such a claim.)


Exit 0 and the snapshot's path on success; 1 with the reason otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "gpugate" / "engine" / "argparse_table.py"
STUBBED = {"sglang": ("torchvision",), "vllm": ("torchvision",)}
# vLLM builds parts of its parser from its configs, which infer the device: on a machine without a GPU
# that fails ("Failed to infer device type") unless vLLM is told it runs on the CPU
BUILD_ENV = {"vllm": {"VLLM_TARGET_DEVICE": "cpu"}}
# import name -> distribution name, where they differ
DISTRIBUTIONS = {"zmq": "pyzmq", "PIL": "pillow", "yaml": "pyyaml", "google": "protobuf", "cv2": "opencv-python",
                 "sklearn": "scikit-learn", "dateutil": "python-dateutil", "jwt": "pyjwt",
                 "tvm_ffi": "apache-tvm-ffi"}
MAX_ROUNDS = 60

# Runs in the build's python: a finder that answers imports of the STUBBED roots with an empty,
# permissive module (any attribute is a class that can be called, subclassed, subscripted; falsy),
# then the builder's main().
_BOOT = r'''
import abc, importlib.abc, importlib.machinery, runpy, sys, types
ROOTS = set(sys.argv[1].split(",")) - {""}
class _Meta(abc.ABCMeta):
    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Meta(name, (_Stub,), {})
    def __call__(cls, *a, **k):
        if len(a) == 1 and callable(a[0]) and not k:
            return a[0]  # used as a decorator (@triton.jit): the function itself
        return _Stub()
    def __getitem__(cls, key): return cls
    def __or__(cls, other): return cls
    def __ror__(cls, other): return cls
    def __iter__(cls): return iter(())
    def __bool__(cls): return False
class _Stub:
    def __init__(self, *a, **k): pass
    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Meta(name, (_Stub,), {})
    def __call__(self, *a, **k):
        if len(a) == 1 and callable(a[0]) and not k:
            return a[0]
        return _Stub()
    def __bool__(self): return False
    def __iter__(self): return iter(())
    def __getitem__(self, key): return _Stub()
class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name == "__version__":
            return "0.0.0"
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Meta(name, (_Stub,), {})
class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in ROOTS:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None
    def create_module(self, spec):
        module = _Module(spec.name)
        module.__path__ = []
        return module
    def exec_module(self, module):
        pass
sys.meta_path.insert(0, _Finder())
import importlib.util
_core = importlib.util.spec_from_file_location("gpugate_argparse_table", sys.argv[2])
sys.modules["gpugate_argparse_table"] = importlib.util.module_from_spec(_core)
_core.loader.exec_module(sys.modules["gpugate_argparse_table"])
sys.argv = [sys.argv[3]] + sys.argv[4:]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def say(message: str) -> None:
    print(f"[snapshot] {message}", file=sys.stderr, flush=True)


def pip(*args: str) -> None:
    command = [sys.executable, "-m", "pip", *args]
    say(" ".join(command))
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)


def requires_dist(target: Path, engine: str) -> dict[str, str]:
    """distribution name (normalised) -> the wheel's requirement line for it (marker dropped)."""
    metadata = next(target.glob(f"{engine}-*.dist-info/METADATA"))
    pins: dict[str, str] = {}
    for line in metadata.read_text().splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        requirement = line.split(":", 1)[1].split(";")[0].strip()
        if "extra ==" in line:
            continue
        name = re.split(r"[\s<>=!~\[(]", requirement, maxsplit=1)[0]
        pins[normalise(name)] = requirement.replace(" ", "")
    return pins


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def run_builder(target: Path, deps: Path, stubs: tuple[str, ...], builder: Path) -> subprocess.CompletedProcess:
    # PYTHONHASHSEED: engines build some choice lists from sets; a fixed seed keeps their order stable
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), str(deps)]), PYTHONNOUSERSITE="1",
               PYTHONHASHSEED="0", **BUILD_ENV.get(builder.parent.name, {}))
    return subprocess.run([sys.executable, "-c", _BOOT, ",".join(stubs), str(CORE), str(builder), "--no-cache",
                           "--help-text", "--source", f"wheel {os.environ.get('SNAPSHOT_WHEEL', '')}"],
                          env=env, capture_output=True, text=True)


def build_table(target: Path, deps: Path, torch: str, engine: str) -> tuple[dict, list[str]]:
    pins = requires_dist(target, engine)
    builder = ROOT / "gpugate" / "engine" / engine / "table_builder.py"
    stubs = STUBBED.get(engine, ())
    record = deps / ".installed-modules.json"  # survives a rerun with the same --work
    installed: list[str] = json.loads(record.read_text()) if record.is_file() else []
    for _round in range(MAX_ROUNDS):
        began = time.monotonic()
        result = run_builder(target, deps, stubs, builder)
        if result.returncode == 0:
            table = json.loads(result.stdout.strip().splitlines()[-1])
            say(f"table built in {time.monotonic() - began:.1f} s ({table['option_count']} option names)")
            return table, installed
        missing = re.findall(r"No module named '([^']+)'", result.stderr)
        metadata = re.findall(r"No package metadata was found for ([A-Za-z0-9_.\-]+)", result.stderr)
        wrong = re.findall(r"(\S+) is required for a normal functioning of this module, but found", result.stderr)
        wrong += re.findall(r"The '([^']+)' distribution was not found and is required", result.stderr)
        if wrong and (not missing or "distribution was not found" in result.stderr):
            # transformers checks its own dependencies' versions at import: install what it asks
            if wrong[-1] in installed:
                raise SystemExit(f"installed {wrong[-1]} and still:\n" + result.stderr[-2000:])
            say(f"the parser needs {wrong[-1]}: installing it")
            name = normalise(re.split(r"[<>=!~\[]", wrong[-1], maxsplit=1)[0]).replace("-", "_")
            for old in deps.iterdir():  # pip --target keeps the old dist-info beside the new one
                if normalise(old.name.split("-")[0]).replace("-", "_") == name or old.name == name:
                    shutil.rmtree(old) if old.is_dir() else old.unlink()
            pip("install", "--quiet", "--no-deps", "--target", str(deps), wrong[-1])
            installed.append(wrong[-1])
            record.write_text(json.dumps(installed))
            continue
        if missing:
            module = missing[-1].split(".")[0]
            distribution = DISTRIBUTIONS.get(module, module)
        elif metadata:
            module = distribution = metadata[-1]
        else:
            raise SystemExit("the builder failed:\n" + result.stderr[-4000:])
        if module == engine or module in installed:
            raise SystemExit(f"cannot import {module!r} although it was installed:\n" + result.stderr[-3000:])
        requirement = torch if module == "torch" else pins.get(normalise(distribution), distribution)
        say(f"the parser needs {module!r}: installing {requirement}")
        pip("install", "--quiet", "--no-deps", "--target", str(deps), requirement)
        installed.append(module)
        record.write_text(json.dumps(installed))
    raise SystemExit(f"gave up after {MAX_ROUNDS} rounds; installed: {installed}")


def _comparable(actions: list[dict]) -> list[dict]:
    """Rows with choices as sets (SGLang makes a few choice lists from sets: their order is not part
    of the parser)."""
    return [dict(row, choices=sorted(map(repr, row["choices"])) if row["choices"] else row["choices"])
            for row in actions]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engine", choices=sorted(STUBBED), help="the engine: its package on PyPI")
    parser.add_argument("version", help="the release, e.g. 0.5.23")
    parser.add_argument("--torch", default="torch", help="pip requirement or wheel path for torch (a CPU build is enough)")
    parser.add_argument("--out", type=Path, default=None, help="default: gpugate/engine/ENGINE/flagtables")
    parser.add_argument("--work", type=Path, default=None, help="keep the downloads and targets here (reused)")
    parser.add_argument("--compare-real", default="", help="also build with these stubbed modules installed, "
                                                         "and fail if the table differs (e.g. triton)")
    args = parser.parse_args(argv)

    engine, stubbed = args.engine, STUBBED[args.engine]
    out = args.out or ROOT / "gpugate" / "engine" / engine / "flagtables"
    work = args.work or Path(tempfile.mkdtemp(prefix=f"{engine}-flags-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        wheels = work / "wheel"
        if not list(wheels.glob(f"{engine}-{args.version}-*.whl")):
            pip("download", "--quiet", "--no-deps", "--dest", str(wheels), f"{engine}=={args.version}")
        wheel = next(wheels.glob(f"{engine}-{args.version}-*.whl"))
        os.environ["SNAPSHOT_WHEEL"] = wheel.name
        target = work / f"{engine}-{args.version}"
        if not (target / engine).is_dir():
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(target)
        deps = work / "deps"
        deps.mkdir(exist_ok=True)
        table, installed = build_table(target, deps, args.torch, engine)
        if args.compare_real:
            real = tuple(m for m in args.compare_real.split(",") if m)
            for module in real:
                pip("install", "--quiet", "--no-deps", "--target", str(work / "real"), module)
            result = run_builder(target, Path(os.pathsep.join([str(deps), str(work / "real")])),
                                 tuple(s for s in stubbed if s not in real),
                                 ROOT / "gpugate" / "engine" / engine / "table_builder.py")
            if result.returncode != 0:
                raise SystemExit("the build with the real " + ", ".join(real) + " failed:\n" + result.stderr[-3000:])
            other = json.loads(result.stdout.strip().splitlines()[-1])
            if _comparable(other["actions"]) != _comparable(table["actions"]):
                raise SystemExit("the stub changes the parser: the tables differ")
            say("the table with the real " + ", ".join(real) + " is identical")
        table.pop("import_s", None)
        table["source"] = f"wheel {wheel.name} ({wheel.stat().st_size} bytes)"
        table["built_with"] = {"python": sys.version.split()[0], "installed": installed,
                               "stubbed": list(stubbed), "script": f"scripts/flags_snapshot.py {engine}"}
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{engine}-{args.version}.json"
        path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        say(f"{engine} {args.version}: {table['option_count']} option names, parser source sha256 "
            f"{table['server_args_sha256']}")
        print(path)
        return 0
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
