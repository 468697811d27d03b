"""What one remote command costs in the lab, this tree against an older revision, interleaved.

    python3 bench/command_costs.py --before 98feb98            # -> docs/results/command_costs.json
    python3 bench/command_costs.py --before 98feb98 --n 10 --json /tmp/costs.json

Issue 11's converged re-run sends one command per container (the agent's ``observe``) and the lab's
``pct exec`` carries every remote command of every tool, so their CPU is what a fleet run on 2 cores is
made of. This measures, in one lab of its own (one host, container 129 serving tp 8 on 8 GPUs, built in
a temporary directory and taken down after), round by round in alternation so that the machine's load
hits both alike:

- ``observe`` of the agent installed by each revision (each revision's bootstrap and agent, the simulated
  pynvml of each, then crossed: the new agent with the old pynvml and the reverse, to tell them apart);
- ``import pynvml`` of the lab's simulated binding of each revision;
- the flag-table read (gpugate/remote/flag_table.py inline) that issue 13 added to every plan, which
  observe now makes unnecessary when the controller has the table;
- ``pct exec 129 -- true`` with the lab's pct of each revision (on the lab host, as sshd runs it).

CPU is user+sys of the command and its children (``RUSAGE_CHILDREN``), wall is the command's; medians.
The older revision is checked out with ``git worktree add --detach`` in a temporary directory (removed
after); nothing of this checkout is touched.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

OBSERVE_ARGS = {"port": 30000, "env_names": [], "model_path": "/opt/models/lab-model", "gpus": list(range(8)),
                "tail_lines": 0, "generate": False, "host": "127.0.0.1"}

# Runs in the container (or on the lab host): N rounds of every variant in turn -> JSON of samples.
HARNESS = r'''
import json, resource, subprocess, sys, time
variants, n, shell = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "shell"
res = {k: {"cpu": [], "wall": []} for k in variants}
for _ in range(n):
    for name, cmd in variants.items():
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN); t = time.time()
        p = subprocess.run(["sh", "-c", cmd] if shell else cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"} if shell else None)
        res[name]["wall"].append(time.time() - t); r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        res[name]["cpu"].append(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime)
        if p.returncode != 0 or not (p.stdout.strip() or name.startswith(("import", "pct"))):
            res[name]["error"] = (p.stderr or p.stdout)[-300:].decode("utf-8", "replace")
print(json.dumps(res))
'''


def commands_of(root: Path) -> dict:
    """The observe / start commands and the install document that the tree at ``root`` sends."""
    code = (f"import sys, json; sys.path.insert(0, {str(root)!r})\n"
            "from gpugate import agentcmd\n"
            f"args = {OBSERVE_ARGS!r}\n"
            "print(json.dumps({'observe': agentcmd.observe_command('/usr/bin/python3', args),"
            " 'start': agentcmd.start_command('/usr/bin/python3'),"
            " 'stdin': agentcmd.start_stdin({'run': '-install-only'}, include_source=True)}))")
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, check=True,
                         env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    return json.loads(out.stdout)


def summary(samples: dict) -> dict:
    return {name: {"cpu_ms": round(statistics.median(s["cpu"]) * 1000, 1),
                   "cpu_min_ms": round(min(s["cpu"]) * 1000, 1),
                   "wall_ms": round(statistics.median(s["wall"]) * 1000, 1),
                   "n": len(s["cpu"]), **({"error": s["error"]} if "error" in s else {})}
            for name, s in samples.items()}


def measure(before: str, n: int) -> dict:
    from bench.benchlab import BenchLab, tool_path
    from gpugate_lab import core
    from gpugate.facts.sglang import flag_table_command
    from gpugate.engine.sglang import flags as sglang_args

    work = Path(tempfile.mkdtemp(prefix="gpugate-costs-"))
    old = work / "before"
    subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "add", "--detach", str(old), before],
                   check=True, capture_output=True)
    lab_dir = work / "lab"
    previous = os.environ.get("GPUGATE_LAB_DIR")
    os.environ["GPUGATE_LAB_DIR"] = str(lab_dir)
    try:
        lab = BenchLab.up(lab_dir, hosts=1, vmids=(129,))
        ct = lab.containers()[0]
        fleet = lab.write_fleet(work / "fleet.yaml", {ct: {"tp": 8}}, {"SGLANG_STANDIN_LOAD_S": "0.3"})
        env = dict(os.environ, GPUGATE_FLEET=str(fleet), GPUGATE_AUDIT_LOG=str(work / "audit.jsonl"))
        subprocess.run([tool_path("pyinfra"), "-y", "inventory.py", "deploy.py"], cwd=REPO_ROOT, env=env,
                       check=True, capture_output=True, timeout=300)
        host = core.host_exec_argv(lab.dir, ct.host)

        def in_ct(script: str, stdin: str | None = None) -> subprocess.CompletedProcess:
            return subprocess.run(host + ["pct", "exec", str(ct.vmid), "--", "sh", "-c", script], input=stdin,
                                  capture_output=True, text=True, timeout=300)

        was, now = commands_of(old), commands_of(REPO_ROOT)
        for cmds in (was, now):  # both agents installed side by side (content-addressed)
            in_ct(cmds["start"], cmds["stdin"])
        for name, src in (("pynvml.py", "lab/gpugate_lab/pynvml_sim/pynvml.py"), ("gpugate_gpusim.py", "lab/gpugate_lab/gpusim.py")):
            data = base64.b64encode((old / src).read_bytes()).decode()
            in_ct(f"mkdir -p /root/old-nvml && echo {data} | base64 -d > /root/old-nvml/{name}")
        # bytecode of both pynvml copies, as a first import over SSH writes it
        in_ct("env -u PYTHONDONTWRITEBYTECODE python3 -c 'import sys; sys.path.insert(0, \"/root/old-nvml\"); "
              "import pynvml'; env -u PYTHONDONTWRITEBYTECODE python3 -c 'import pynvml'")
        old_nvml = "export PYTHONPATH=/root/old-nvml; "
        variants = {
            "observe, before": old_nvml + was["observe"],
            "observe, after": now["observe"],
            "observe, after's agent with before's pynvml": old_nvml + now["observe"],
            "observe, before's agent with after's pynvml": was["observe"],
            "flag-table read (issue 13; skipped when observe names a known table)":
                flag_table_command("/usr/bin/python3", sglang_args.known_table_keys(), False),
            "import pynvml, before": "/usr/bin/python3 -S -c 'import sys; sys.path[:0] = [\"/root/old-nvml\", "
                                     "\"/usr/lib/python3/dist-packages\"]; import pynvml'",
            "import pynvml, after": "/usr/bin/python3 -S -c 'import sys; sys.path.append(\"/usr/lib/python3/dist-packages\"); "
                                    "import pynvml'",
        }
        out = in_ct(f"python3 -c {shlex.quote(HARNESS)} {shlex.quote(json.dumps(variants))} {n} shell")
        samples = json.loads(out.stdout.strip().splitlines()[-1])
        hdir = str(core.host_dir(lab.dir, ct.host))
        pct = lambda root: ["python3", "-S", "-E", "-c", f"import sys; sys.path.insert(0, {str(root)!r}); "  # noqa: E731
                            f"from gpugate_lab.pct import main; sys.exit(main(sys.argv[1:], host_dir={hdir!r}))",
                            "exec", str(ct.vmid), "--", "true"]
        host_variants = {"pct exec 129 -- true, before": pct(old), "pct exec 129 -- true, after": pct(REPO_ROOT)}
        out = subprocess.run(host + ["python3", "-c", HARNESS, json.dumps(host_variants), str(n), "argv"],
                             capture_output=True, text=True, timeout=600)
        samples.update(json.loads(out.stdout.strip().splitlines()[-1]))
        return {"before": before, "after": subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
                                                          capture_output=True, text=True).stdout.strip(),
                "n": n, "measured": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "loadavg": list(os.getloadavg()),
                "costs": summary(samples)}
    finally:
        core.down(lab_dir)
        if previous is None:
            os.environ.pop("GPUGATE_LAB_DIR", None)
        else:
            os.environ["GPUGATE_LAB_DIR"] = previous
        subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "remove", "--force", str(old)], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the git revision to compare with (e.g. 98feb98)")
    parser.add_argument("--n", type=int, default=30, help="rounds (each runs every variant once)")
    parser.add_argument("--json", type=Path, default=REPO_ROOT / "docs" / "results" / "command_costs.json")
    args = parser.parse_args(argv)
    result = measure(args.before, args.n)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    for name, cost in result["costs"].items():
        print(f"{name:70s} CPU {cost['cpu_ms']:6.1f} ms (min {cost['cpu_min_ms']:6.1f})  wall {cost['wall_ms']:6.1f} ms"
              + (f"  ERROR {cost['error']}" if "error" in cost else ""))
    print(f"load average {result['loadavg']}; written {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
