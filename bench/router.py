"""Benchmark of issue 21: a rolling flag change of 3 replicas behind a real smg, with a client sending
requests through smg the whole time (bounded in count and time, loopback only).

    python3 bench/router.py [--out bench/results/router.json]

Three ways, each a change of ``disable-radix-cache`` on all three servers, one after the other:

- (a) gpugate with the router: ``router: lab`` in fleet.yaml, ``--data rolling=true``: each server
  leaves smg, drains to 0 in flight, restarts, is ready, rejoins, then the next;
- (b) gpugate's rolling restart without it: the same servers stay registered in smg, but fleet.yaml
  does not say so: SIGTERM (SGLang's drain, which keeps admitting), restart, next;
- (c) smg's own removal, then the restart: ``DELETE /workers/{id}`` (smg drains on its timer), the
  restart (gpugate, not routed), ``POST /workers`` back (smg's health check decides when it serves).

Per way: requests sent, failed (any status but 200 or a broken connection), p50/p99 latency, wall.
The stand-in drains with SGLang's shape at a 1 s tick; requests take 0.2 s (100 tokens x 2 ms).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VMIDS = (129, 130, 131)
ENV = {"SGLANG_STANDIN_LOAD_S": "1.0", "SGLANG_STANDIN_DRAIN_TICK_S": "1.0", "SGLANG_STANDIN_SCHEDULER_EXIT_S": "0.5"}
CLIENTS = 4
MAX_REQUESTS = 50000
MAX_S = 240.0


class Client:
    def __init__(self, url: str):
        self.url, self.latencies, self.failed, self.errors = url, [], 0, {}
        self.stop, self.lock = threading.Event(), threading.Lock()
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(CLIENTS)]

    def _loop(self) -> None:
        began = time.monotonic()
        count = 0
        while not self.stop.is_set() and time.monotonic() - began < MAX_S:
            count += 1  # a different prompt each time: smg's cache-aware policy would pin one prompt to one worker
            body = json.dumps({"text": f"bench {threading.get_ident()} {count}",
                               "sampling_params": {"max_new_tokens": 100}}).encode()
            with self.lock:
                if len(self.latencies) + self.failed >= MAX_REQUESTS:
                    return
            t0 = time.monotonic()
            try:
                request = urllib.request.Request(self.url + "/generate", data=body,
                                                 headers={"content-type": "application/json"})
                with urllib.request.urlopen(request, timeout=60) as response:
                    response.read()
                    error = None if response.status == 200 else f"HTTP {response.status}"
            except urllib.error.HTTPError as exc:
                error = f"HTTP {exc.code}"
            except OSError as exc:
                error = type(exc).__name__
            with self.lock:
                if error is None:
                    self.latencies.append(time.monotonic() - t0)
                else:
                    self.failed += 1
                    self.errors[error] = self.errors.get(error, 0) + 1

    def __enter__(self):
        for thread in self.threads:
            thread.start()
        time.sleep(1.0)
        return self

    def __exit__(self, *exc):
        time.sleep(1.0)
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=70)

    def figures(self) -> dict:
        ordered = sorted(self.latencies)
        p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] if ordered else None
        return {"sent": len(ordered) + self.failed, "failed": self.failed, "errors": self.errors,
                "p50_ms": round(statistics.median(ordered) * 1000, 1) if ordered else None,
                "p99_ms": round(p99 * 1000, 1) if p99 else None}


def write_fleet(lab_dir: Path, router: dict, flags: dict, routed: bool) -> Path:
    from gpugate_lab import core

    state = json.loads((lab_dir / "lab.json").read_text())
    doc = core.fleet_document(lab_dir, [(h["name"], h["port"]) for h in state["hosts"]], {"pve1": list(VMIDS)},
                              router=router)
    for container in doc["hosts"]["pve1"]["containers"].values():
        container["sglang"]["flags"].update(flags)
        if not routed:
            container["sglang"].pop("router", None)
            container["sglang"].pop("router_url", None)
    if not routed:
        doc.pop("routers", None)
    path = lab_dir / "fleet.bench.yaml"
    path.write_text(core.render_fleet_yaml(doc))
    return path


def pyinfra(lab_dir: Path, fleet: Path, *args: str) -> tuple[int, str]:
    exe = shutil.which("pyinfra") or str(Path(sys.executable).with_name("pyinfra"))
    env = dict(os.environ, GPUGATE_LAB_DIR=str(lab_dir), GPUGATE_FLEET=str(fleet),
               GPUGATE_AUDIT_LOG=str(lab_dir / "audit.jsonl"))
    result = subprocess.run([exe, "-y", "inventory.py", "deploy.py", "--data", f"sglang_env={json.dumps(ENV)}", *args],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    return result.returncode, result.stdout + result.stderr


def smg(router: dict, method: str, path: str, body: dict | None = None):
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(router["url"] + path, data=data, method=method,
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        raw = response.read()
    return json.loads(raw) if raw else None


def way(name: str, lab_dir: Path, router: dict, flip: bool, run) -> dict:
    with Client(router["url"]) as client:
        began = time.monotonic()
        code = run(flip)
        wall = time.monotonic() - began
    figures = {"way": name, "exit": code, "wall_s": round(wall, 1), **client.figures()}
    print(json.dumps(figures), flush=True)
    return figures


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "router.json"))
    parser.add_argument("--smg-args", default="", help="more smg arguments, e.g. --disable-retries")
    args = parser.parse_args()
    os.environ["GPUGATE_LAB_SMG_ARGS"] = args.smg_args
    from gpugate_lab import core

    lab_dir = Path(tempfile.mkdtemp(prefix="gpugate-bench-router-"))
    results = []
    try:
        state = core.up(lab_dir, hosts=1, gpus=8, vmids=VMIDS, router=True)
        router = state["router"]
        code, out = pyinfra(lab_dir, write_fleet(lab_dir, router, {}, True))  # starts them, adds them to smg
        assert code == 0, out

        def routed(flip: bool) -> int:
            return pyinfra(lab_dir, write_fleet(lab_dir, router, {"disable-radix-cache": flip}, True),
                           "--data", "rolling=true")[0]

        def unrouted(flip: bool) -> int:
            return pyinfra(lab_dir, write_fleet(lab_dir, router, {"disable-radix-cache": flip}, False),
                           "--data", "rolling=true")[0]

        def smg_removal(flip: bool) -> int:
            fleet = write_fleet(lab_dir, router, {"disable-radix-cache": flip}, False)
            worst = 0
            for vmid in VMIDS:
                url = f"http://127.0.0.1:{router['ports'][f'pve1:{vmid}']}"
                worker = next(w for w in smg(router, "GET", "/workers")["workers"] if w["url"] == url)
                smg(router, "DELETE", f"/workers/{worker['id']}")
                worst = max(worst, pyinfra(lab_dir, fleet, "--limit", f"@pct/pve1:{vmid}")[0])
                while any(w["url"] == url for w in smg(router, "GET", "/workers")["workers"]):
                    time.sleep(0.2)  # smg's settle timer
                smg(router, "POST", "/workers", {"url": url, "model_id": worker.get("model_id"), "runtime": "sglang"})
            return worst

        results.append(way("a: gpugate with the router", lab_dir, router, True, routed))
        results.append(way("b: gpugate rolling, router not told", lab_dir, router, False, unrouted))
        # (b) leaves smg with workers it saw fail: wait until it lists all three healthy again
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and sum(1 for w in smg(router, "GET", "/workers")["workers"]
                                                  if w.get("is_healthy")) < 3:
            time.sleep(0.5)
        results.append(way("c: smg's removal, then the restart", lab_dir, router, True, smg_removal))
    finally:
        core.down(lab_dir)
    Path(args.out).write_text(json.dumps({"generated_at": time.time(), "env": ENV, "clients": CLIENTS,
                                          "smg_args": args.smg_args,
                                          "results": results}, indent=2) + "\n")
    print("| way | exit | wall | requests | failed | p50 | p99 | errors |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['way']} | {r['exit']} | {r['wall_s']} s | {r['sent']} | {r['failed']} | {r['p50_ms']} ms | "
              f"{r['p99_ms']} ms | {r['errors'] or '-'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
