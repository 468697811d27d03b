"""The Echo server: /health, /generate (a "generation": the greeting), /info (its arguments);
drains on SIGTERM (it simply stops serving and exits)."""

import argparse
import json
import signal
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main():
    parser = argparse.ArgumentParser(prog="echo_server")
    parser.add_argument("--model", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--greeting", default="hello")
    parser.add_argument("--fail-at-start", action="store_true")
    parser.add_argument("--load-s", type=float, default=0.2)
    args = parser.parse_args()
    if args.fail_at_start:
        print("echo: told to fail at start", file=sys.stderr, flush=True)
        sys.exit(3)
    time.sleep(args.load_s)
    info = {"model_path": args.model, "host": args.host, "port": args.port, "greeting": args.greeting}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = {"/health": b"ok", "/generate": json.dumps({"text": args.greeting}).encode(),
                    "/info": json.dumps(info).encode()}.get(self.path.split("?")[0])
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *what):
            pass

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    signal.signal(signal.SIGTERM, lambda *_: (server.server_close(), sys.exit(0)))
    server.serve_forever()


if __name__ == "__main__":
    main()
