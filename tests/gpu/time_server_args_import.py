#!/usr/bin/env python3
"""Time ``import sglang.srt.server_args`` of the real SGLang wheel on the GPU machine (issue 13), and
check that gpugate's snapshot is the table the real import gives there.

What the container-side flag table build costs with real SGLang: the import pulls torch. This
machine (the GPU one) has torch (and triton) in /opt/torch/.venv but no internet, so the wheel and the
few small modules server_args imports besides travel along:

    # on a machine with PyPI (python 3.12 wheels: the GPU machine's python):
    pip download --no-deps --python-version 3.12 --only-binary=:all: --platform manylinux_2_34_x86_64 \\
        -d carry/ sglang==0.5.23                                   # 39.0 MB
    pip download --no-deps --python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64 \\
        -d carry/deps psutil pybase64 pillow starlette anyio msgspec pyzmq tqdm aiohttp multidict yarl \\
        propcache aiohappyeyeballs aiosignal frozenlist           # 12 MB (what 0.5.23's import needs
                                                                 #  besides torch and triton)
    # what the H200 machine's image lacks of that chain (the run of docs/results/h200_server_args_import.json
    # carried only these, 10 MB): orjson pybase64 starlette msgspec pyzmq ipython traitlets decorator jedi
    # parso matplotlib-inline pexpect ptyprocess prompt_toolkit wcwidth stack_data executing asttokens
    # pure_eval ipython_pygments_lexers pydantic pydantic_core typing_inspection annotated_types
    # on the GPU machine (stdlib + the venv's torch):
    python3 tests/gpu/time_server_args_import.py carry/sglang-0.5.23-*.whl --deps carry/deps

Prints, and writes to ``--out`` (JSON): the wheel's size, the import time of 3 runs in fresh
interpreters (the first after unpacking: cold page cache for sglang's files; torch's may be warm),
with ``CUDA_VISIBLE_DEVICES=""`` as gpugate's builder sets it, and once without; the whole builder run
(gpugate/engine/sglang/table_builder.py: import + add_cli_args + describe); and whether the table equals
gpugate/engine/sglang/flagtables/sglang-<version>.json (choice lists compared as sets: SGLang builds some from
sets). A module that is missing is named (exit 2): carry its wheel in ``--deps`` too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUILDER = ROOT / "gpugate" / "engine" / "sglang" / "table_builder.py"
IMPORT = ("import time; t = time.perf_counter(); import sglang.srt.server_args; "
          "print(round(time.perf_counter() - t, 3))")


EXTRA_PATH: list[str] = []  # --path: folders of modules already unpacked (added after the wheel's)


def run(code_or_argv, target: Path, cuda_hidden: bool) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), *EXTRA_PATH]), PYTHONNOUSERSITE="1",
               PYTHONHASHSEED="0")
    if cuda_hidden:
        env["CUDA_VISIBLE_DEVICES"] = ""
    else:
        env.pop("CUDA_VISIBLE_DEVICES", None)
    argv = [sys.executable, "-c", code_or_argv] if isinstance(code_or_argv, str) else [sys.executable, *code_or_argv]
    return subprocess.run(argv, env=env, capture_output=True, text=True, cwd=tempfile.gettempdir())


def comparable(actions: list[dict]) -> list[dict]:
    return [dict({k: v for k, v in row.items() if k != "help"},
                 choices=sorted(map(repr, row["choices"])) if row.get("choices") else row.get("choices"))
            for row in actions]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("--deps", type=Path, default=None, help="a folder of wheels to unpack beside it")
    parser.add_argument("--out", type=Path, default=Path("server_args_import.json"))
    parser.add_argument("--path", action="append", default=[], help="a folder of unpacked modules to add")
    args = parser.parse_args(argv)
    EXTRA_PATH[:] = [str(Path(p).resolve()) for p in args.path]

    report: dict = {"wheel": args.wheel.name, "wheel_bytes": args.wheel.stat().st_size,
                    "python": sys.version.split()[0]}
    with tempfile.TemporaryDirectory(prefix="sglang-import-") as tmp:
        target = Path(tmp)
        began = time.monotonic()
        for wheel in [args.wheel] + (sorted(args.deps.glob("*.whl")) if args.deps else []):
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(target)
        report["unpack_s"] = round(time.monotonic() - began, 2)
        report["unpacked_bytes"] = sum(p.stat().st_size for p in target.rglob("*") if p.is_file())
        torch = run("import torch, sys; print(torch.__version__)", target, True)
        report["torch"] = torch.stdout.strip() or torch.stderr.strip()[-200:]

        times = []
        for _ in range(3):
            result = run(IMPORT, target, True)
            if result.returncode != 0:
                missing = [line for line in result.stderr.splitlines() if "No module named" in line]
                print(result.stderr[-3000:], file=sys.stderr)
                print("import failed: " + (missing[-1] if missing else "see above"), file=sys.stderr)
                return 2
            times.append(float(result.stdout.strip().splitlines()[-1]))
        report["import_s_cuda_hidden"] = times
        visible = run(IMPORT, target, False)
        report["import_s_cuda_visible"] = float(visible.stdout.strip().splitlines()[-1]) if visible.returncode == 0 \
            else visible.stderr.strip()[-300:]

        began = time.monotonic()
        built = run([str(BUILDER), "--no-cache", "--help-text"], target, True)
        report["builder_wall_s"] = round(time.monotonic() - began, 2)
        if built.returncode != 0:
            print(built.stderr[-3000:], file=sys.stderr)
            return 2
        table = json.loads(built.stdout.strip().splitlines()[-1])
        report.update(version=table["sglang_version"], option_count=table["option_count"],
                      server_args_sha256=table["server_args_sha256"], builder_import_s=table.get("import_s"))
        snapshot_path = ROOT / "gpugate" / "engine" / "sglang" / "flagtables" / f"sglang-{table['sglang_version']}.json"
        if snapshot_path.is_file():
            snapshot = json.loads(snapshot_path.read_text())
            mine, theirs = comparable(table["actions"]), comparable(snapshot["actions"])
            report["snapshot_identical"] = mine == theirs
            if mine != theirs:
                by_options = {str(r["options"]): r for r in theirs}
                report["snapshot_differences"] = [
                    {"options": r["options"], "here": r, "snapshot": by_options.get(str(r["options"]))}
                    for r in mine if by_options.get(str(r["options"])) != r][:10]
        else:
            report["snapshot_identical"] = None
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "snapshot_differences"}, indent=1))
    print(f"import sglang.srt.server_args ({report['version']}): {report['import_s_cuda_hidden']} s "
          f"(CUDA hidden), {report['import_s_cuda_visible']} s (CUDA visible); the builder's whole run "
          f"{report['builder_wall_s']} s; snapshot identical: {report['snapshot_identical']}")
    return 0 if report["snapshot_identical"] in (True, None) else 1


if __name__ == "__main__":
    sys.exit(main())
