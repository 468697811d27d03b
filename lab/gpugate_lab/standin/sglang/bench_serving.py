"""``python3 -m sglang.bench_serving``: the lab's stand-in of SGLang's benchmark client (stdlib only).

A real client process for the lab: it sends requests to a server in a loop and holds no GPU, so a deploy
must leave it alone (it matches SGLang's own kill pattern ``sglang\\.bench``, but is no server part).
SGLang's flags it understands (others are accepted and ignored, as a client that does not use them):
``--backend`` (sglang, sglang-oai), ``--host``, ``--port``, ``--base-url``, ``--num-prompts``,
``--request-rate`` (requests/s, inf = back to back), ``--random-input-len``, ``--random-output-len``,
``--max-concurrency``. A refused connection or an error answer counts as a failed request, and the
client goes on (a restart of the server under it is what the lab tests). It prints one progress line
every 5 s and SGLang's result block at the end.

Example (in a lab container)::

    python3 -m sglang.bench_serving --backend sglang --port 30000 --num-prompts 100000 --request-rate 5
"""

import argparse
import json
import sys
import time
import urllib.error
import urllib.request


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_serving.py")
    p.add_argument("--backend", default="sglang")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--base-url", default=None)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--dataset-name", default="random")
    p.add_argument("--random-input-len", type=int, default=32)
    p.add_argument("--random-output-len", type=int, default=8)
    return p


def send(url: str, backend: str, input_len: int, output_len: int) -> bool:
    prompt = " ".join(["lab"] * max(1, input_len))
    if backend == "sglang-oai":
        body = {"model": "default", "prompt": prompt, "max_tokens": output_len}
        path = "/v1/completions"
    else:
        body = {"text": prompt, "sampling_params": {"max_new_tokens": output_len}}
        path = "/generate"
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            answer.read()
            return answer.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def main(argv=None) -> int:
    args, _ignored = build_parser().parse_known_args(argv)
    url = (args.base_url or "http://%s:%d" % (args.host, args.port)).rstrip("/")
    print("Namespace(backend=%r, base_url=%r, num_prompts=%d, request_rate=%s)"
          % (args.backend, url, args.num_prompts, args.request_rate), flush=True)
    interval = 0.0 if args.request_rate == float("inf") else 1.0 / max(args.request_rate, 1e-6)
    started = last_report = time.monotonic()
    done = failed = 0
    for _ in range(args.num_prompts):
        begun = time.monotonic()
        if send(url, args.backend, args.random_input_len, args.random_output_len):
            done += 1
        else:
            failed += 1
            time.sleep(0.2)  # a server that is down: do not spin
        now = time.monotonic()
        if now - last_report >= 5:
            print("progress: %d ok, %d failed in %.0f s" % (done, failed, now - started), flush=True)
            last_report = now
        time.sleep(max(0.0, interval - (now - begun)))
    elapsed = time.monotonic() - started
    print("\n============ Serving Benchmark Result ============")
    print("%-40s %-10s" % ("Backend:", args.backend))
    print("%-40s %-10d" % ("Successful requests:", done))
    print("%-40s %-10d" % ("Failed requests:", failed))
    print("%-40s %-10.2f" % ("Benchmark duration (s):", elapsed))
    print("%-40s %-10.2f" % ("Request throughput (req/s):", done / elapsed if elapsed else 0.0))
    print("=" * 50, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
