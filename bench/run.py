"""gpugate against the alternatives, in the lab, side by side in one run.

    python3 bench/run.py            # the full run (~10 min on 2 cores): docs/benchmarks.md, bench/results/latest.json
    python3 bench/run.py --quick    # a ~2 min smoke version (fewer trials, a smaller fleet)

It builds its own lab in a fresh temporary directory (never the lab of ``$GPUGATE_LAB_DIR``, the one
you may be working with), measures, takes that lab down and removes the directory (``--keep`` keeps it):

1. gate latency: memory back (the simulated driver's ``freed_at``) -> the gate passes, for gpugate's
   ``wait_for_idle``, the hand-run ``sleep 3; nvidia-smi`` loop, and the Ansible until-loop (5 s and 1 s);
2. restart overhead: a flag change's wall time minus the stand-in's own drain + release + load (measured
   in the container with 10 ms polling), gpugate vs the Ansible playbook, and where the time goes;
3. rolling restart of one container per host against N x a single restart;
4. converged re-run (nothing to change) for 1, 8 and 32 containers: remote commands and wall time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench import report  # noqa: E402
from bench.benchlab import BenchLab, Container, machine, server_argv, tool_path  # noqa: E402
from gpugate_lab import core  # noqa: E402
from bench.tools import (  # noqa: E402
    gpugate_host,
    read_events,
    run_ansible,
    run_gpugate,
    shell_check_argv,
    start_ansible,
)

LOAD_S = 1.0
ENV = {"SGLANG_STANDIN_LOAD_S": str(LOAD_S)}
BASE = {"tp": 8}
FP8 = {"tp": 8, "kv-cache-dtype": "fp8_e4m3"}
HOLD_MIB = 4096
HOLD = (f"setsid nohup python3 -m gpugate_gpusim hold --gpu all --mib {HOLD_MIB} >/dev/null 2>&1 "
        "</dev/null & echo $!")

PROFILES = {
    "full": {"hosts": 8, "vmids": (129, 130, 131, 132), "gate_n": 15, "restart_n": 3, "floor_n": 5,
             "sizes": (1, 8, 32), "converged_reps": 2},
    "quick": {"hosts": 2, "vmids": (129, 130), "gate_n": 2, "restart_n": 1, "floor_n": 2,
              "sizes": (1, 2, 4), "converged_reps": 1},
}

FLOOR_SCRIPT = r"""
import glob, json, os, signal, subprocess, sys, time, urllib.request
argv_a, argv_b, n, load = json.loads(sys.argv[1])
env = dict(os.environ, SGLANG_STANDIN_LOAD_S=str(load))
def start(argv):
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL, start_new_session=True, cwd="/")
def healthy():
    try:
        return urllib.request.urlopen("http://127.0.0.1:30000/health", timeout=1).status == 200
    except Exception:
        return False
def used():
    total = 0
    for path in glob.glob("/run/gpugate-sim/alloc/*.json"):
        try:
            total += json.load(open(path))["mib"]
        except Exception:
            pass
    return total
def until(pred):
    while not pred():
        time.sleep(0.01)
proc = start(argv_a)
until(healthy)
out = []
for i in range(n):
    t0 = time.time(); proc.send_signal(signal.SIGTERM); proc.wait(); t1 = time.time()
    until(lambda: used() == 0); t2 = time.time()
    proc = start(argv_b if i % 2 == 0 else argv_a); until(healthy); t3 = time.time()
    out.append({"drain_s": t1 - t0, "release_s": t2 - t1, "load_s": t3 - t2, "total_s": t3 - t0})
proc.kill(); proc.wait()
print(json.dumps(out))
"""


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def p90(values):
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=10, method="inclusive")[-1]


# ------------------------------------------------------------------------------------------ gate latency


def gate_trial(lab: BenchLab, ct: Container, method: str, rng: random.Random, api_host, inventory: Path,
               workdir: Path) -> dict:
    """Hold memory in the container, start the waiter, SIGKILL the holder at a random moment while the
    waiter polls; latency = the moment the waiter passes (on the controller) - the driver's freed_at."""
    from gpugate.operations.gpu import wait_for_idle

    pid = int(lab.in_ct(ct.host, ct.vmid, HOLD).stdout.split()[-1])
    if not lab.wait_gpus(ct.host, lambda used: all(u >= HOLD_MIB for u in used), timeout=15):
        raise RuntimeError("the memory holder did not allocate")
    offset = lab.released_offset(ct.host)

    def kill() -> None:
        lab.in_ct(ct.host, ct.vmid, f"kill -9 {pid}")

    trial: dict = {"method": method}
    if method == "gpugate":
        timer = threading.Timer(rng.uniform(0.8, 1.8), kill)
        timer.start()
        decision = wait_for_idle(api_host, max_used_mib=64, timeout=30, poll_interval_s=0.05)
        timer.join()
        timing = decision.timing or {}
        passed_at = timing["returned_at"]
        trial.update(passed=decision.passed, polls=timing.get("polls"),
                     in_container_passed_at=timing.get("passed_at"))
    elif method == "shell":
        proc = subprocess.Popen(shell_check_argv(lab, ct), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                stdin=subprocess.DEVNULL, text=True)
        proc.stdout.readline()  # the first check (memory still held)
        time.sleep(rng.uniform(0.0, 3.0))
        kill()
        checks = 1 + len(proc.stdout.read().splitlines())
        proc.wait()
        passed_at = time.time()
        trial.update(passed=proc.returncode == 0, polls=checks)
    else:
        delay = int(method.split("-")[1].rstrip("s"))
        proc, log_path, began = start_ansible("gate.yml", inventory, {"gate_delay": delay}, workdir)
        while not any(e["event"] == "task_start" for e in read_events(log_path)):
            if proc.poll() is not None:
                raise RuntimeError(f"ansible-playbook gate.yml exited early: {proc.stdout.read()[-2000:]}")
            time.sleep(0.02)
        # First attempt at task start, then one every delay + the command's own time.
        time.sleep(rng.uniform(0.3, 0.8 + delay))
        kill()
        proc.communicate(timeout=120)
        events = read_events(log_path)
        oks = [e for e in events if e["event"] == "ok" and e.get("action") in ("ansible.builtin.command",
                                                                                "command")]
        passed_at = oks[-1]["t"] if oks else float("nan")
        trial.update(passed=proc.returncode == 0 and bool(oks), polls=oks[-1].get("attempts") if oks else None)
    freed = [r for r in lab.released_since(ct.host, offset) if f"-{pid}-" in r["id"]]
    freed_at = max((r["freed_at"] for r in freed), default=float("nan"))
    trial.update(freed_at=freed_at, passed_at=passed_at, latency_s=passed_at - freed_at)
    if trial.get("in_container_passed_at"):
        trial["in_container_latency_s"] = trial["in_container_passed_at"] - freed_at
    return trial


def phase_gate(lab: BenchLab, profile: dict, rng: random.Random, workdir: Path) -> dict:
    ct = lab.spread(1)[0]
    fleet = lab.write_fleet(workdir / "fleet-gate.yaml", {ct: BASE}, ENV)
    inventory = lab.write_ansible_inventory(workdir / "inventory-gate.yml", {ct: BASE}, ENV)
    lab.reset([ct])
    api_host = gpugate_host(fleet, ct.pyinfra_name)
    # One bare remote command through the same connection: what every gpugate step pays at least.
    round_trips = []
    for _ in range(10):
        began = time.time()
        api_host.run_shell_command("true")
        round_trips.append(time.time() - began)
    methods = ["gpugate", "shell", "ansible-5s", "ansible-1s"]
    trials = []
    for round_no in range(profile["gate_n"]):
        order = methods[:]
        rng.shuffle(order)  # interleaved: drift in the machine's load hits every method alike
        for method in order:
            trials.append(gate_trial(lab, ct, method, rng, api_host, inventory, workdir))
        log(f"gate round {round_no + 1}/{profile['gate_n']}: "
            + ", ".join(f"{t['method']} {t['latency_s']:.3f}s" for t in trials[-len(methods):]))
    api_host.disconnect()
    lab.reset([ct])
    summary = {}
    for method in methods:
        latencies = [t["latency_s"] for t in trials if t["method"] == method]
        summary[method] = {"n": len(latencies), "median_s": median(latencies), "p90_s": p90(latencies),
                           "min_s": min(latencies), "max_s": max(latencies),
                           "all_passed": all(t["passed"] for t in trials if t["method"] == method)}
    inside = [t["in_container_latency_s"] for t in trials if "in_container_latency_s" in t]
    summary["gpugate"]["in_container_median_s"] = median(inside)
    return {"container": ct.pyinfra_name, "hold_mib_per_gpu": HOLD_MIB, "summary": summary, "trials": trials,
            "round_trip_s": {"median": median(round_trips), "samples": round_trips}}


# ------------------------------------------------------------------------------------------ restarts


def phase_floor(lab: BenchLab, ct: Container, n: int) -> dict:
    """The stand-in's own drain + release + load + warmup, measured in the container (10 ms polls)."""
    lab.reset([ct])
    payload = json.dumps([server_argv(BASE).split(), server_argv(FP8).split(), n, LOAD_S])
    script = f"python3 -c {shlex.quote(FLOOR_SCRIPT)} {shlex.quote(payload)}"
    result = lab.in_ct(ct.host, ct.vmid, script, timeout=300)
    samples = json.loads(result.stdout.strip().splitlines()[-1])
    lab.reset([ct])
    return {"container": ct.pyinfra_name, "samples": samples,
            "median": {k: median([s[k] for s in samples]) for k in samples[0]}}


def restart_summary(runs: list[dict], floor_s: float) -> dict:
    walls = [r["wall_s"] for r in runs]
    return {"n": len(runs), "wall_median_s": median(walls), "overhead_median_s": median(walls) - floor_s,
            "walls_s": walls, "commands_median": median([sum(r["commands"].values()) for r in runs])}


def phase_restart(lab: BenchLab, profile: dict, floor: dict, workdir: Path) -> dict:
    ct_g, ct_a = lab.spread(2)
    lab.reset([ct_g, ct_a])
    floor_s = floor["median"]["total_s"]
    flags_for = lambda i: FP8 if i % 2 == 0 else BASE  # noqa: E731
    # gpugate: the first start, then flag changes (each a new fleet file, as an operator edits fleet.yaml)
    first = run_gpugate(lab.write_fleet(workdir / "fleet-restart-0.yaml", {ct_g: BASE}, ENV), workdir=workdir)
    gpugate_runs = []
    for i in range(profile["restart_n"]):
        fleet = lab.write_fleet(workdir / f"fleet-restart-{i + 1}.yaml", {ct_g: flags_for(i)}, ENV)
        gpugate_runs.append(run_gpugate(fleet, workdir=workdir))
        log(f"gpugate restart {i + 1}: {gpugate_runs[-1]['wall_s']:.2f}s, "
            f"{sum(gpugate_runs[-1]['commands'].values())} remote commands")
    # Ansible: same first start, then the same flag changes, at delay 1 s (careful) and 5 s (default)
    ansible_first = run_ansible("restart.yml", lab.write_ansible_inventory(
        workdir / "inv-restart-0.yml", {ct_a: BASE}, ENV), {"gate_delay": 1, "health_delay": 1}, workdir)
    ansible_runs: dict[str, list] = {"ansible-1s": [], "ansible-5s": []}
    step = 0
    for delay_name, delay in (("ansible-1s", 1), ("ansible-5s", 5)):
        for _ in range(profile["restart_n"]):
            inv = lab.write_ansible_inventory(workdir / f"inv-restart-{step + 1}.yml", {ct_a: flags_for(step)}, ENV)
            ansible_runs[delay_name].append(run_ansible("restart.yml", inv, {"gate_delay": delay,
                                                                              "health_delay": delay}, workdir))
            step += 1
            log(f"{delay_name} restart: {ansible_runs[delay_name][-1]['wall_s']:.2f}s")
    lab.reset([ct_g, ct_a])
    for run in [*ansible_runs["ansible-1s"], *ansible_runs["ansible-5s"], ansible_first]:
        run.pop("events", None)
    return {
        "floor_s": floor_s,
        "gpugate": {**restart_summary(gpugate_runs, floor_s), "runs": gpugate_runs, "first_start": first},
        **{name: {**restart_summary(runs, floor_s), "runs": runs} for name, runs in ansible_runs.items()},
        "ansible_first_start": ansible_first,
    }


def phase_rolling(lab: BenchLab, profile: dict, restart: dict, workdir: Path) -> dict:
    members = lab.spread(profile["hosts"])  # vmid 129 on every host: one serving container per host
    lab.reset(members)
    first = run_gpugate(lab.write_fleet(workdir / "fleet-roll-0.yaml", {c: BASE for c in members}, ENV),
                        workdir=workdir)
    log(f"first start of {len(members)} in parallel: {first['wall_s']:.2f}s")
    rolling = run_gpugate(lab.write_fleet(workdir / "fleet-roll-1.yaml", {c: FP8 for c in members}, ENV),
                          "--data", "rolling=true", workdir=workdir)
    log(f"gpugate rolling restart of {len(members)}: {rolling['wall_s']:.2f}s")
    parallel = run_gpugate(lab.write_fleet(workdir / "fleet-roll-2.yaml", {c: BASE for c in members}, ENV),
                           workdir=workdir)
    log(f"gpugate parallel restart of {len(members)}: {parallel['wall_s']:.2f}s")
    inv = lab.write_ansible_inventory(workdir / "inv-roll.yml", {c: FP8 for c in members}, ENV)
    ansible_rolling = run_ansible("restart.yml", inv, {"gate_delay": 1, "health_delay": 1, "bench_serial": 1},
                                  workdir)
    ansible_rolling.pop("events", None)
    log(f"ansible (1 s, serial 1) rolling restart of {len(members)}: {ansible_rolling['wall_s']:.2f}s")
    lab.reset(members)
    single_g = restart["gpugate"]["wall_median_s"]
    single_a = restart["ansible-1s"]["wall_median_s"]
    return {
        "containers": len(members),
        "gpugate_rolling": rolling, "gpugate_parallel": parallel, "gpugate_first_start_parallel": first,
        "ansible_rolling_1s": ansible_rolling,
        "gpugate_single_s": single_g, "ansible_single_s": single_a,
        "gpugate_ratio": rolling["wall_s"] / (len(members) * single_g),
        "ansible_ratio": ansible_rolling["wall_s"] / (len(members) * single_a),
    }


# ------------------------------------------------------------------------------------------ converged


def converged_flags(ct: Container) -> dict:
    # Every container of a lab host sees all 8 GPUs; each serves tp 1 on its own GPU.
    return {"tp": 1, "base-gpu-id": ct.vmid - 129}


def phase_converged(lab: BenchLab, profile: dict, workdir: Path) -> dict:
    everyone = lab.containers()
    lab.reset(everyone)
    # Lab containers see every GPU of their host, so the first start must let a container start while its
    # neighbours hold their own GPU: the gate threshold is raised for this setup (and the re-runs, which
    # never reach the gate).
    host_data = {"gpu_max_used_mib": 10**6}
    setup = run_gpugate(lab.write_fleet(workdir / "fleet-conv-all.yaml",
                                        {c: converged_flags(c) for c in everyone}, ENV, host_data),
                        workdir=workdir)
    log(f"first start of {len(everyone)} containers: {setup['wall_s']:.2f}s")
    sizes = {}
    for size in profile["sizes"]:
        members = {c: converged_flags(c) for c in lab.spread(size)}
        fleet = lab.write_fleet(workdir / f"fleet-conv-{size}.yaml", members, ENV, host_data)
        inv = lab.write_ansible_inventory(workdir / f"inv-conv-{size}.yml", members, ENV)
        g_runs, a_runs = [], []
        for _ in range(profile["converged_reps"]):
            g_runs.append(run_gpugate(fleet, workdir=workdir))
            a = run_ansible("restart.yml", inv, {"gate_delay": 1, "health_delay": 1}, workdir)
            a.pop("events", None)
            a_runs.append(a)
        changed = sum(len(r["transitions"]) for r in g_runs) + sum(
            t["commands"] for r in a_runs for t in r["tasks"][1:])
        entry = {
            "containers": size,
            "gpugate_wall_s": median([r["wall_s"] for r in g_runs]),
            "ansible_wall_s": median([r["wall_s"] for r in a_runs]),
            "gpugate_commands_per_container": median([sum(r["commands"].values()) / size for r in g_runs]),
            "ansible_commands_per_container": median([sum(r["commands"].values()) / size for r in a_runs]),
            "gpugate_ssh_connections": median([sum(r["connections"].values()) for r in g_runs]),
            "gpugate_startup_s": median([r["startup_s"] for r in g_runs]),
            "ansible_startup_s": median([r["startup_s"] for r in a_runs]),
            "something_changed": changed,
            "gpugate_runs": g_runs, "ansible_runs": a_runs,
        }
        entry["speedup"] = entry["ansible_wall_s"] / entry["gpugate_wall_s"]
        sizes[str(size)] = entry
        log(f"converged x{size}: gpugate {entry['gpugate_wall_s']:.2f}s "
            f"({entry['gpugate_commands_per_container']:.1f} cmd/ct), ansible {entry['ansible_wall_s']:.2f}s "
            f"({entry['ansible_commands_per_container']:.1f} cmd/ct)")
    lab.reset(everyone)
    return {"setup_first_start": {k: setup[k] for k in ("wall_s", "startup_s")}, "sizes": sizes}


# ------------------------------------------------------------------------------------------ main


def missing_tools() -> list[str]:
    """The baseline's executables that are not installed (beside this interpreter, or on PATH)."""
    return [name for name in ("ansible-playbook",)
            if not Path(tool_path(name)).is_absolute() and shutil.which(name) is None]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a ~2 minute smoke run (fewer trials, smaller fleet)")
    parser.add_argument("--seed", type=int, default=8)
    parser.add_argument("--markdown", type=Path, default=None,
                        help="where the table goes (default docs/benchmarks.md; --quick: bench/results/quick.md)")
    parser.add_argument("--json", type=Path, default=None,
                        help="raw results (default bench/results/latest.json; --quick: bench/results/quick.json)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the run's directory (its lab's state, fleet files, logs) instead of removing it")
    args = parser.parse_args(argv)
    missing = missing_tools()
    if missing:  # the baseline's tools: a clear word, never a traceback minutes into a run
        print(f"bench/run.py: {', '.join(missing)} not found: the benchmarks compare gpugate with an Ansible "
              f"playbook; install the baseline's tools with `scripts/bootstrap --bench` (pip install -e '.[bench]')",
              file=sys.stderr)
        return 2
    mode = "quick" if args.quick else "full"
    profile = PROFILES[mode]
    markdown = args.markdown or (REPO_ROOT / ("bench/results/quick.md" if args.quick else "docs/benchmarks.md"))
    raw = args.json or (REPO_ROOT / ("bench/results/quick.json" if args.quick else "bench/results/latest.json"))
    rng = random.Random(args.seed)
    compile_gpugate()
    started = time.time()
    results: dict = {"mode": mode, "profile": {k: list(v) if isinstance(v, tuple) else v for k, v in profile.items()},
                     "machine": machine(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "seed": args.seed,
                     "load_s": LOAD_S, "loadavg_before": list(os.getloadavg())}
    log(f"{mode} run; {profile['hosts']} hosts x {len(profile['vmids'])} containers")
    try:
        with own_lab(profile["hosts"], profile["vmids"], keep=args.keep) as (lab, workdir):
            log(f"lab {lab.dir}; gpugate frozen at {freeze_tree(workdir)}")
            results["gate"] = phase_gate(lab, profile, rng, workdir)
            results["floor"] = phase_floor(lab, lab.spread(3)[2], profile["floor_n"])
            log(f"floor (drain + release + load): {results['floor']['median']}")
            results["restart"] = phase_restart(lab, profile, results["floor"], workdir)
            results["rolling"] = phase_rolling(lab, profile, results["restart"], workdir)
            results["converged"] = phase_converged(lab, profile, workdir)
    finally:
        results["duration_s"] = time.time() - started
        results["loadavg_after"] = list(os.getloadavg())
        raw.parent.mkdir(parents=True, exist_ok=True)
        raw.write_text(json.dumps(results, indent=1, default=str) + "\n")
    markdown.parent.mkdir(parents=True, exist_ok=True)
    markdown.write_text(report.render(results))
    log(f"done in {results['duration_s']:.0f}s: {markdown} and {raw}")
    return 0


def freeze_tree(workdir: Path) -> Path:
    """A copy of what a gpugate run reads (the package, inventory.py, deploy.py, group_data, templates) in
    the run's directory, named by GPUGATE_BENCH_SRC for bench.tools.run_gpugate: the checkout is shared
    and may be edited while the bench runs; every gpugate run of the bench then measures the same code."""
    src = workdir / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("gpugate", "group_data", "templates"):
        if (REPO_ROOT / name).is_dir():
            shutil.copytree(REPO_ROOT / name, src / name, ignore=ignore)
    for name in ("inventory.py", "deploy.py"):
        shutil.copy2(REPO_ROOT / name, src / name)
    import compileall

    compileall.compile_dir(str(src / "gpugate"), quiet=1)
    os.environ["GPUGATE_BENCH_SRC"] = str(src)
    return src


def compile_gpugate() -> None:
    """gpugate's bytecode, written as `pip install` writes it, so that gpugate is measured as installed:
    the shells on this machine set PYTHONDONTWRITEBYTECODE=1, and without the cache every pyinfra start
    would compile gpugate's modules again (~0.2 s of CPU per run, which no installed copy pays; Ansible's
    and pyinfra's own packages are compiled at install)."""
    import compileall

    compileall.compile_dir(str(REPO_ROOT / "gpugate"), quiet=1)


@contextlib.contextmanager
def own_lab(hosts: int, vmids: tuple[int, ...], keep: bool = False) -> Iterator[tuple[BenchLab, Path]]:
    """A lab made for this run in a new temporary directory, with a work directory around it (fleet
    files, logs, audit): yields ``(lab, workdir)``, then takes the lab down and removes the directory
    (``keep``: left for a look). The user's lab (``$GPUGATE_LAB_DIR``) is never read, stopped or
    written: while the run lasts, that variable names this run's lab, for its child processes.
    """
    workdir = Path(tempfile.mkdtemp(prefix="gpugate-bench-"))
    lab_dir = workdir / "lab"
    previous = os.environ.get("GPUGATE_LAB_DIR")
    os.environ["GPUGATE_LAB_DIR"] = str(lab_dir)
    try:
        lab = BenchLab.up(lab_dir, hosts=hosts, vmids=vmids)
        yield lab, workdir
    finally:
        core.down(lab_dir)  # also when BenchLab.up failed half-way
        if previous is None:
            os.environ.pop("GPUGATE_LAB_DIR", None)
        else:
            os.environ["GPUGATE_LAB_DIR"] = previous
        if keep:
            log(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
