"""docs/benchmarks.md from the results of bench/run.py (a pure function of the results dict).

Example:
    >>> text = render(json.loads(Path("bench/results/latest.json").read_text()))   # doctest: +SKIP
"""

from __future__ import annotations

import json
from pathlib import Path

TARGET_GATE_S = 0.150
TARGET_RESTART_OVERHEAD_S = 0.8   # issue 11 (1.11 s before the transition was rebuilt)
TARGET_COMMANDS = 3
TARGET_SPEEDUP = 3.0              # issue 11 (2.02x before the rebuild)
BEFORE = {"overhead_s": 1.11, "speedup": 2.02, "gate_s": 0.039,  # bench run of 2026-11-29, the old transition
          "ansible_1s_restart_s": 3.11, "ansible_32_s": 7.65, "gpugate_startup_s": 0.31}

METHOD_NAMES = {
    "gpugate": "gpugate `gpu.idle` wait (one command, polls in the container every 50 ms)",
    "shell": "hand-run `sleep 3; nvidia-smi` loop (on the Proxmox host, `pct exec`)",
    "ansible-5s": "Ansible `until:` loop, `delay: 5` (Ansible's default)",
    "ansible-1s": "Ansible `until:` loop, `delay: 1`",
}


def ms(value) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def sec(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f} s"


def verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def _gate(results: dict) -> list[str]:
    gate = results["gate"]
    rows = ["| method | n | median | p90 | min | max |", "|---|---|---|---|---|---|"]
    for method, name in METHOD_NAMES.items():
        s = gate["summary"][method]
        rows.append(f"| {name} | {s['n']} | {ms(s['median_s'])} | {ms(s['p90_s'])} | {ms(s['min_s'])} | "
                    f"{ms(s['max_s'])} |")
    g = gate["summary"]["gpugate"]
    raw = {m: ", ".join(f"{t['latency_s'] * 1000:.0f}" for t in gate["trials"] if t["method"] == m)
           for m in METHOD_NAMES}
    return [
        "## 1. Gate latency: memory back -> gate passes",
        "",
        f"Container {gate['container']} holds {gate['hold_mib_per_gpu']} MiB on each of 8 GPUs (a `gpugate_gpusim "
        "hold` process). The waiter starts; the holder is SIGKILLed at a random moment while the waiter polls. "
        "Latency = the moment the waiter's result is on the controller minus `freed_at`, the moment the lab's "
        "simulated driver returned the memory (`released.jsonl`, after its 150 ms release delay, which is the "
        "physical release time of an H200 and is not counted). Trials are interleaved (shuffled per round).",
        "",
        *rows,
        "",
        f"gpugate in the container (the passing reading, before the answer travels back): median "
        f"{ms(g.get('in_container_median_s'))}. One bare remote command (`true` over the open SSH connection "
        f"and `pct exec`) costs {ms(gate['round_trip_s']['median'])} median in this lab.",
        "",
        f"Target: gpugate median < 150 ms: {verdict(g['median_s'] is not None and g['median_s'] < TARGET_GATE_S)} "
        f"({ms(g['median_s'])}).",
        "",
        "Raw latencies (ms): " + "; ".join(f"{m}: {raw[m]}" for m in METHOD_NAMES),
        "",
    ]


def _breakdown_gpugate(run: dict) -> str:
    transitions = run.get("transitions") or [{}]
    t = transitions[0]
    steps = ", ".join(f"{k} {v:.2f}" for k, v in t.items() if k not in ("total", "outcome") and v is not None)
    commands = ", ".join(f"{c.get('label', c['kind'])} {c['s']:.2f}" for c in run["calls"] if c["kind"] == "exec")
    ended = max((c["at"] + c["s"] for c in run["calls"]), default=run["wall_s"])
    return (f"startup (interpreter, pyinfra, inventory) {sec(run['startup_s'])}; SSH connect "
            f"{sec(run['connect_s'])}; {sum(run['commands'].values())} remote commands in order (s): {commands}; "
            f"after the last answer (results, disconnect, exit) {sec(run['wall_s'] - ended)}; in the container "
            f"(the agent's journal, s): {steps}, run total {sec(t.get('total'))}")


def _breakdown_ansible(run: dict) -> str:
    tasks = "; ".join(f"{t['task']} {t['s']:.2f} s ({t['commands']} cmd)" for t in run["tasks"])
    return (f"startup {sec(run['startup_s'])}; {tasks}; exit {sec(run['teardown_s'])}; "
            f"{sum(run['commands'].values())} remote commands")


def _median_run(runs: list[dict]) -> dict:
    ordered = sorted(runs, key=lambda r: r["wall_s"])
    return ordered[(len(ordered) - 1) // 2]


def _gpugate_exec_median(runs: list[dict]):
    durations = sorted(c["s"] for r in runs for c in r["calls"] if c["kind"] == "exec")
    return durations[len(durations) // 2] if durations else None


def _restart(results: dict) -> list[str]:
    restart, floor = results["restart"], results["floor"]
    fm = floor["median"]
    rows = ["| tool | n | wall (median) | overhead beyond drain + load | remote commands | walls |",
            "|---|---|---|---|---|---|"]
    for key, name in (("gpugate", "gpugate (`pyinfra -y inventory.py deploy.py`)"),
                      ("ansible-1s", "Ansible playbook, delays 1 s"), ("ansible-5s", "Ansible playbook, delays 5 s")):
        r = restart[key]
        rows.append(f"| {name} | {r['n']} | {sec(r['wall_median_s'])} | {sec(r['overhead_median_s'])} | "
                    f"{r['commands_median']:.0f} | {', '.join(f'{w:.2f}' for w in r['walls_s'])} |")
    g = restart["gpugate"]
    return [
        "## 2. Restart overhead: a flag change, beyond the server's own drain and load",
        "",
        f"One container (tp 8 on 8 GPUs, stand-in load time {results['load_s']:g} s), flag change "
        "`tp 8` <-> `tp 8 + kv-cache-dtype fp8_e4m3`, the whole command timed (process start to exit). "
        "The floor, the stand-in's own time, is measured in a container by a local script with 10 ms polls "
        f"(SIGTERM -> exit, -> memory back, start -> /health 200): median drain {sec(fm['drain_s'])}, "
        f"release {sec(fm['release_s'])}, load + warmup {sec(fm['load_s'])}, total **{sec(fm['total_s'])}**. "
        "Overhead = wall - floor.",
        "",
        *rows,
        "",
        f"Target: gpugate overhead <= {TARGET_RESTART_OVERHEAD_S:g} s per container: "
        f"{verdict(g['overhead_median_s'] <= TARGET_RESTART_OVERHEAD_S)} ({sec(g['overhead_median_s'])}; "
        f"{BEFORE['overhead_s']:.2f} s with the transition before issue 11's rebuild).",
        "",
        f"The machine's speed in this run, for comparing with the run before the rebuild (2026-11-29): the same "
        f"Ansible playbook's restart (delays 1 s) took {sec(restart['ansible-1s']['wall_median_s'])} against "
        f"{BEFORE['ansible_1s_restart_s']:.2f} s then, and gpugate's controller start (interpreter, pyinfra, "
        f"inventory: the same pyinfra) {sec(_median_run(g['runs'])['startup_s'])} against "
        f"{BEFORE['gpugate_startup_s']:.2f} s then.",
        "",
        "Where the time goes (the trial with the median wall time of each):",
        "",
        f"- gpugate: {_breakdown_gpugate(_median_run(g['runs']))}",
        f"- Ansible 1 s: {_breakdown_ansible(_median_run(restart['ansible-1s']['runs']))}",
        f"- Ansible 5 s: {_breakdown_ansible(_median_run(restart['ansible-5s']['runs']))}",
        "",
        f"Reading: gpugate sends {g['commands_median']:.0f} remote commands for one restart against the "
        f"playbook's {restart['ansible-1s']['commands_median']:.0f}: the agent's `observe` (the plan's one "
        "look; a run of deploy.py sends no connect-time `pct list`: this observe is the container's check, "
        "pct_connect_check), ONE command on the Proxmox host that takes the GPU locks (gpugate.claims: a "
        "detached holder there until the run ends) and, holding them, hands off: the container's `start` (its "
        "agent then runs stop, gate, prepare, start, load, verify and commit on its own, detached), and one "
        "batched `follow` per 3 s of the run (the controller prints the journal's progress; the answer "
        "comes the moment the run ends). The agent's own time beyond the stand-in's drain, release and load "
        "is its 50 ms polls and verify (the journal's steps above); the rest of the overhead is the "
        f"controller's: the pyinfra start, and about {ms(results['gate']['round_trip_s']['median'])} per lab "
        "round trip for each command before the hand-off. The playbook loses its time in the `until:` delays "
        "instead (the 5 s row), and does none of gpugate's checks (lock, flags verified through "
        "/get_server_info, rollback, stray processes).",
        "",
        "What is left of gpugate's overhead: the controller's start (pyinfra's import and gevent's "
        "monkey-patching; gpugate's own modules load in ~0.1 s) and its exit (pyinfra's results, disconnect, "
        "interpreter teardown) are pyinfra's; the commands before the hand-off are two round trips (`observe`, "
        "then the host's GPU locks with the `start`; issue 18 folded the connect-time `pct list` and a "
        "separate lock command into them), each mostly the remote Python starts in this lab; in the "
        "container, the agent's 50 ms polls of the gate, the load and the journal cost ~25 ms each on average.",
        "",
    ]


def _rolling(results: dict) -> list[str]:
    r = results["rolling"]
    n = r["containers"]
    return [
        f"## 3. Rolling restart of {n} hosts",
        "",
        f"One serving container (tp 8) on each of {n} lab hosts, the same flag change, one container at a time.",
        "",
        "| run | wall | against N x single restart |",
        "|---|---|---|",
        f"| gpugate `--data rolling=true` | {sec(r['gpugate_rolling']['wall_s'])} | "
        f"{n} x {sec(r['gpugate_single_s'])} = {sec(n * r['gpugate_single_s'])} (ratio {r['gpugate_ratio']:.2f}) |",
        f"| Ansible `serial: 1`, delays 1 s | {sec(r['ansible_rolling_1s']['wall_s'])} | "
        f"{n} x {sec(r['ansible_single_s'])} = {sec(n * r['ansible_single_s'])} (ratio {r['ansible_ratio']:.2f}) |",
        f"| gpugate, all {n} at once (not rolling) | {sec(r['gpugate_parallel']['wall_s'])} | |",
        f"| gpugate, first start of all {n} at once | {sec(r['gpugate_first_start_parallel']['wall_s'])} | |",
        "",
    ]


def _labels(run: dict) -> dict[str, int]:
    counts: dict[str, int] = {}
    for call in run["calls"]:
        if call["kind"] != "connect":
            label = call.get("label", call["kind"])
            counts[label] = counts.get(label, 0) + 1
    return counts


def _converged(results: dict) -> list[str]:
    c = results["converged"]
    rows = ["| containers | gpugate wall | Ansible wall | speedup | gpugate cmds/ct | Ansible cmds/ct | "
            "gpugate startup | Ansible startup | changed |",
            "|---|---|---|---|---|---|---|---|---|"]
    for size, e in c["sizes"].items():
        rows.append(f"| {size} | {sec(e['gpugate_wall_s'])} | {sec(e['ansible_wall_s'])} | {e['speedup']:.2f}x | "
                    f"{e['gpugate_commands_per_container']:.1f} | {e['ansible_commands_per_container']:.1f} | "
                    f"{sec(e['gpugate_startup_s'])} | {sec(e['ansible_startup_s'])} | {e['something_changed']} |")
    largest = c["sizes"][max(c["sizes"], key=int)]
    smallest = c["sizes"][min(c["sizes"], key=int)]
    probe_task = lambda e: _median_run(e["ansible_runs"])["tasks"][0]["s"]  # noqa: E731
    return [
        "## 4. Converged re-run: nothing to change",
        "",
        "Containers spread over the lab hosts (vmid 129 on every host first, then 130, ...), each serving "
        "tp 1 on its own GPU. gpugate: `pyinfra -y inventory.py deploy.py`; Ansible: the same playbook "
        "(its first task reads argv and health; the rest is skipped). Remote commands: pyinfra's SSH "
        "connector calls (exec, put, get) per container; Ansible's module runs per host (with pipelining, "
        "one SSH exec each). Wall: median of the repetitions; startup: process start to the first "
        "connection (gpugate) or the first task (Ansible).",
        "",
        *rows,
        "",
        f"Targets at {largest['containers']} containers: <= 3 remote commands per container: "
        f"{verdict(largest['gpugate_commands_per_container'] <= TARGET_COMMANDS)} "
        f"({largest['gpugate_commands_per_container']:.1f}); >= 3x faster than Ansible: "
        f"{verdict(largest['speedup'] >= TARGET_SPEEDUP)} ({largest['speedup']:.2f}x; {BEFORE['speedup']:.2f}x "
        "with the transition before issue 11's rebuild). Each gpugate run's remote commands: "
        + "; ".join(f"{size} containers: " + " | ".join(", ".join(
            f"{n} {label}" for label, n in sorted(_labels(run).items())) for run in e["gpugate_runs"])
            for size, e in c["sizes"].items())
        + f". The playbook at {largest['containers']} containers took {sec(largest['ansible_wall_s'])} here against "
        f"{BEFORE['ansible_32_s']:.2f} s in the run before the rebuild (the machine's load).",
        "",
        "Reading: gpugate needs one `observe` of the installed agent per container (the flag table of the "
        "container's SGLang is named in it, so no command of its own once the controller has that table; "
        "and no connect-time `pct list` in a run of deploy.py: the observe is the container's check), over "
        "one SSH "
        "connection per Proxmox host shared by its containers; the playbook needs 1 command per container "
        "over one multiplexed connection per Proxmox host. Both grow linearly; in this lab every remote "
        "command is a Python start (the lab's `pct`, and a probe or Ansible's module) on the same 2 cores, "
        f"so the fleet run is CPU-bound: a gpugate remote command takes {ms(_gpugate_exec_median(smallest['gpugate_runs']))} "
        f"median with {smallest['containers']} container(s) and "
        f"{ms(_gpugate_exec_median(largest['gpugate_runs']))} with {largest['containers']}; Ansible's probe "
        f"task takes {sec(probe_task(smallest))} and {sec(probe_task(largest))}. On real Proxmox hosts the "
        "remote work is spread over the hosts' own CPUs and the per-container cost is a network round trip.",
        "",
    ]


def _load(results: dict) -> list[str]:
    """The machine's load average (1, 5, 15 min) when the run began and ended: the 2 cores are shared."""
    before, after = results.get("loadavg_before"), results.get("loadavg_after")
    if not before:
        return []
    fmt = lambda load: "/".join(f"{x:.2f}" for x in load)  # noqa: E731
    return [f"- Load average (1/5/15 min) at the start {fmt(before)}, at the end {fmt(after) if after else '-'} "
            "(other work on the machine shares the 2 cores; every figure below is slower under load)"]


def render(results: dict) -> str:
    m = results["machine"]
    lines = [
        "# Benchmarks: gpugate against the alternatives",
        "",
        f"Generated by `python3 bench/run.py{' --quick' if results['mode'] == 'quick' else ''}` on "
        f"{results['started']} in {results['duration_s']:.0f} s; raw numbers in "
        f"`bench/results/{'quick' if results['mode'] == 'quick' else 'latest'}.json`.",
        "",
        "## Machine",
        "",
        f"- CPU: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB memory; kernel {m['kernel']}",
        f"- Python {m['python']}, pyinfra {m['pyinfra']}, ansible-core {m['ansible_core']}, {m['openssh']}",
        f"- Lab: {results['profile']['hosts']} simulated Proxmox hosts (real sshd on loopback, real namespaces), "
        f"{len(results['profile']['vmids'])} containers each, 8 simulated GPUs per host; the SGLang stand-in.",
        *_load(results),
        "",
        "## Method",
        "",
        "Everything runs in one lab, in one run, side by side. Times are wall clock (`time.time()` on one "
        "machine, the clock the lab's simulated driver stamps `freed_at` with). The Ansible baseline "
        "(`bench/ansible/`) is tuned as a competent user would: `pipelining = True`, `gather_facts: false`, "
        "`forks = 64` (more than the fleet), SSH `ControlPersist`, `interpreter_python` fixed (no discovery); "
        "it reaches containers with `pct exec` through `ansible.builtin.command` on the Proxmox host over SSH "
        "(no community collection is installed). Its inventory has one host per container. "
        "Setup and cleanup reach containers through `nsenter` (no SSH) and are never timed.",
        "",
        "Caveat for every absolute figure: a lab `pct exec` costs a Python start of the lab's `pct` plus a "
        "namespace entry (one bare remote command is given in section 1; about 30 ms of CPU since issue 11's "
        "work, 90 ms before: see the per-command table below; Proxmox's own `pct` is Perl and costs more); "
        "every tool pays it per remote command, so tools that send fewer commands gain. The machine has 2 "
        "cores shared by the tools, the lab hosts and the stand-ins, and by other work on it (its load "
        "average is given above). gpugate's bytecode is compiled before the run, as `pip install` does "
        "(this machine's shells set PYTHONDONTWRITEBYTECODE=1).",
        "",
        *_gate(results),
        *_restart(results),
        *_rolling(results),
        *_converged(results),
        *_command_costs(),
        *_h200(),
        *_h200_e2e(),
    ]
    return "\n".join(lines)


COMMAND_COSTS = Path(__file__).resolve().parents[1] / "docs" / "results" / "command_costs.json"


def _command_costs(path: Path = COMMAND_COSTS) -> list[str]:
    """What one remote command costs, this tree against the one before issue 11's performance work
    (bench/command_costs.py, kept in docs/results/): the per-container cost the fleet figures are made of."""
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    rows = ["| command | CPU (median) | CPU (min) | wall (median) |", "|---|---|---|---|"]
    for name, cost in data["costs"].items():
        rows.append(f"| {name} | {cost['cpu_ms']:.0f} ms | {cost['cpu_min_ms']:.0f} ms | {cost['wall_ms']:.0f} ms |")
    load = "/".join(f"{x:.2f}" for x in data.get("loadavg") or [])
    return [
        "## Per-command costs in the lab, before and after (issue 11)",
        "",
        f"`python3 bench/command_costs.py --before {data['before']}` (this tree: {data['after']}), {data['n']} "
        f"rounds, every variant once a round in turn, in a lab container serving tp 8 on 8 GPUs; {data['measured']}, "
        f"load average {load} at the end. CPU is user+sys of the command and its children. `before` is the tree "
        "before this work: the agent loaded through importlib, the socket/subprocess/typing/base64 imports on "
        "every command, the simulated pynvml importing dataclasses, pathlib, uuid, argparse and string, and the "
        "lab's pct running `ldconfig -p` (ctypes.util.find_library) and importing pathlib, json, socket and pty "
        "on every exec. The crossed rows tell the agent's share from the simulated pynvml's.",
        "",
        *rows,
        "",
    ]


H200_RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results" / "h200_bench.json"


def _h200(path: Path = H200_RESULTS) -> list[str]:
    """Section 5 from the real-GPU run (bench/h200_gate.py on the lent H200), kept in docs/results/."""
    lines = ["## 5. Real H200 gate latency", ""]
    if not path.exists():
        return lines + ["_No H200 run recorded: run `python3 bench/h200_gate.py` on a GPU machine and keep "
                        "its JSON as docs/results/h200_bench.json._", ""]
    data = json.loads(path.read_text())
    release = data["release_ms"]
    lines += [
        f"{data['gpu']}, driver {data['driver']}, a torch process holding {data['hold_gib']:g} GiB on GPU 0, "
        "SIGKILLed at a random moment 0.5-1.5 s after the waiter starts; a thread polling NVML v2 every "
        "~1 ms records the moment the memory is back (`freed_at`). Latency = the moment the waiter knows "
        "the GPU is free minus `freed_at`. Command: `tests/gpu/run_on_gpu.sh .whl && python3 "
        "bench/h200_gate.py --trials 8` through the device tool; raw samples: docs/results/h200_bench.json.",
        "",
        "| method | n | median | p90 | min | max |",
        "|---|---|---|---|---|---|",
    ]
    labels = {"gpugate": "gpugate `wait_for_idle` (@local, polls NVML v2 every 50 ms)"}
    for method, figures in data["latency_ms"].items():
        lines.append(f"| {labels.get(method, method)} | {figures['n']} | {figures['median']:g} ms | "
                     f"{figures['p90']:g} ms | {figures['min']:g} ms | {figures['max']:g} ms |")
    lines += [
        "",
        f"Physical release (kill -> NVML v2 used back under 64 MiB), all trials: median {release['median']:g} ms, "
        f"p90 {release['p90']:g} ms, {release['min']:g}-{release['max']:g} ms (n={release['n']}). "
        "The 1 s shell loop is what an Ansible `until:` with `delay: 1` polls at, without Ansible's own "
        "cost per try, so it is a lower bound for the playbook (Ansible is not installed on the GPU machine).",
        "",
    ]
    return lines


H200_E2E = Path(__file__).resolve().parents[1] / "docs" / "results" / "h200_e2e"


def _h200_e2e(folder: Path = H200_E2E) -> list[str]:
    """Section 6 from the whole transition on real GPUs (tests/gpu/run_e2e_on_gpu.sh through the device
    tool), kept in docs/results/h200_e2e/: its own report, with the lab's figures beside it."""
    lines = ["## 6. The whole transition on real H200 GPUs (issue 15)", ""]
    report = folder / "e2e_report.md"
    if not report.exists():
        return lines + ["_No real-GPU transition recorded: run `tests/gpu/run_e2e_on_gpu.sh RESULTS` on a GPU "
                        "machine and keep its files in docs/results/h200_e2e/._", ""]
    lines += [
        "`tests/gpu/run_e2e_on_gpu.sh \"$OUT\"` through the device tool on `nvidia-h200-x2` (2 H200 GPUs, one "
        "call, carrying `.gpu-carry/` from `tests/gpu/pack_for_gpu.sh`): `gpugate lab up --gpus real` (the lab's "
        "sshd, `pct` and PID-namespaced container 129 with the real /dev/nvidia*, driver libraries, nvidia-smi and "
        "the torch environment bound in), the stand-in's TP workers holding real CUDA memory (tp 2, "
        "`--mem-fraction-static` of each GPU) and answering `/generate` with a forward pass of a small random "
        "transformer, a side process reading NVML v2 every 2 ms. Every step through the real pyinfra CLI and "
        "`@pct/pve1:129`. Raw: docs/results/h200_e2e/ (e2e_results.json, e2e.log, audit.jsonl, gpu_samples.jsonl).",
        "",
        "Columns: the phases from the agent's journal (s); *release after exit* = the moment NVML v2 read every "
        "GPU free minus the moment the agent saw the main process gone (negative: the TP workers, which hold "
        "the memory, were gone first); *gate overhead* = the gate's pass minus that moment (it includes the "
        "wait for the main process: the gate starts once the stop has ended); *overhead* = the pyinfra "
        "command's wall time minus drain and load.",
        "",
    ]
    lines += [line.rstrip("\n") for line in report.read_text().splitlines()]
    lines += [
        "",
        "Beside the lab (section 2, same tool, same five remote commands): the gate inside a real transition "
        "took 0.04 s (lab: 0.19 s, which absorbs the simulator's 0.15 s release delay); the physical release "
        "came 0.10-0.14 s before the agent saw the main process exit; the tool's overhead beyond drain and load "
        "was 1.2-1.6 s on the GPU machine's 32 cores (the pyinfra start and five round trips), against 1.85 s "
        "in the loaded 2-core lab run above. The crash-and-rollback row's overhead holds the failed start's "
        "own load (the rollback is a second start).",
        "",
    ]
    return lines


if __name__ == "__main__":
    import sys

    sys.stdout.write(render(json.loads(Path(sys.argv[1]).read_text())))
