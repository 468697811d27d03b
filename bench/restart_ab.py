"""bench/run.py's restart phase alone, gpugate only, for trees side by side (interleaved in one lab).

    python3 bench/restart_ab.py --n 8 base=cfca190 now=WORKTREE          # -> bench/results/restart_ab.json

Each tree (a git revision, or WORKTREE for the checkout as it is) is copied the way bench/run.py freezes
gpugate (the package, inventory.py, deploy.py, group_data, templates; bytecode compiled) and named by
GPUGATE_BENCH_SRC for its runs. One lab (1 host, containers 129-131); the floor as bench/run.py measures
it; then rounds of one flag change per tree (`tp 8` <-> `tp 8 + kv-cache-dtype fp8_e4m3`, each a real
`pyinfra -y inventory.py deploy.py`, counted by bench/pyinfra_counted.py), the order of the trees reversed
every other round: the machine's load drifts over both alike. Overhead = wall - floor, as in section 2.
Prints per tree the medians of the wall, the overhead, the startup, the remote commands before the
follow (summed) and the agent's run in the container.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import run as bench  # noqa: E402
from bench.tools import run_gpugate  # noqa: E402

TREE_PARTS = ("gpugate", "group_data", "templates", "inventory.py", "deploy.py")


def freeze(ref: str, dest: Path) -> Path:
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    if ref == "WORKTREE":
        for name in TREE_PARTS:
            source = REPO_ROOT / name
            if source.is_dir():
                shutil.copytree(source, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                shutil.copy2(source, dest / name)
    else:
        tar = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", ref, *TREE_PARTS], capture_output=True,
                             check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=tar, check=True)
    compileall.compile_dir(str(dest / "gpugate"), quiet=1)
    return dest


def summary(runs: list[dict], floor_s: float) -> dict:
    def before_follow(run: dict) -> float:
        return sum(c["s"] for c in run["calls"] if c["kind"] != "connect" and c["label"] != "follow")

    walls = [r["wall_s"] for r in runs]
    return {"n": len(runs), "wall_median_s": statistics.median(walls),
            "overhead_median_s": statistics.median(walls) - floor_s,
            "startup_median_s": statistics.median(r["startup_s"] for r in runs),
            "before_follow_median_s": statistics.median(before_follow(r) for r in runs),
            "run_in_container_median_s": statistics.median(r["transitions"][0]["total"] for r in runs),
            "commands": sorted({sum(r["commands"].values()) for r in runs}),
            "labels": [c["label"] for c in runs[0]["calls"] if c["kind"] != "connect"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs="+", help="label=REV (a git revision) or label=WORKTREE")
    parser.add_argument("--n", type=int, default=6, help="flag changes per tree")
    parser.add_argument("--json", type=Path, default=REPO_ROOT / "bench/results/restart_ab.json")
    args = parser.parse_args(argv)
    trees = dict(tree.split("=", 1) for tree in args.trees)
    bench.compile_gpugate()
    results: dict = {"trees": trees, "machine": bench.machine(), "loadavg_before": list(os.getloadavg()), "runs": {}}
    with bench.own_lab(1, (129, 130, 131)) as (lab, workdir):
        sources = {label: freeze(ref, workdir / f"src-{label}") for label, ref in trees.items()}
        floor = bench.phase_floor(lab, lab.spread(3)[2], 3)
        floor_s = floor["median"]["total_s"]
        ct = lab.spread(1)[0]
        lab.reset([ct])
        os.environ["GPUGATE_BENCH_SRC"] = str(next(iter(sources.values())))
        run_gpugate(lab.write_fleet(workdir / "fleet-0.yaml", {ct: bench.BASE}, bench.ENV), workdir=workdir)
        step = 0
        for round_no in range(args.n):
            order = list(sources.items()) if round_no % 2 == 0 else list(sources.items())[::-1]
            for label, source in order:
                os.environ["GPUGATE_BENCH_SRC"] = str(source)
                flags = bench.FP8 if step % 2 == 0 else bench.BASE
                step += 1
                run = run_gpugate(lab.write_fleet(workdir / f"fleet-{step}.yaml", {ct: flags}, bench.ENV),
                                  workdir=workdir)
                results["runs"].setdefault(label, []).append(run)
                bench.log(f"{label} {round_no + 1}/{args.n}: {run['wall_s']:.2f} s, "
                          f"{sum(run['commands'].values())} remote commands")
        lab.reset([ct])
    results.update(floor=floor, loadavg_after=list(os.getloadavg()),
                   summary={label: summary(runs, floor_s) for label, runs in results["runs"].items()})
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(f"floor (drain + release + load) {floor_s:.2f} s; load average {results['loadavg_before']} -> "
          f"{results['loadavg_after']}")
    for label, s in results["summary"].items():
        print(f"{label}: n={s['n']} wall {s['wall_median_s']:.3f} s, overhead {s['overhead_median_s']:.3f} s, "
              f"startup {s['startup_median_s']:.3f} s, commands before the follow {s['before_follow_median_s']:.3f} s, "
              f"run in the container {s['run_in_container_median_s']:.2f} s; {s['commands']} commands: "
              f"{', '.join(s['labels'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
