"""A stand-in service for launcher tests (`python -m tests.helpers.standin_service <any flags>`):
records its argv, serves gRPC health on --port (rank 0) or --grpc-port (router), HTTP /health on
--port for the router; `--crash` exits at once with an error."""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

from services.rpc.drain import Drain
from services.rpc.grpc_server import GrpcServer, run


class _Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


async def serve(a: argparse.Namespace) -> None:
    server = GrpcServer(a.grpc_port or a.port, a.host)
    await server.start()
    await server.set_serving(True)
    await Drain(0.0).wait_for_signal()
    await server.stop(grace=0.5)


def main() -> None:
    p = argparse.ArgumentParser()
    for flag in ("--port", "--grpc-port", "--rank"):
        p.add_argument(flag, type=int, default=0)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--instance-id", default="standin")
    p.add_argument("--crash", action="store_true")
    a, _ = p.parse_known_args()
    out = os.environ.get("STANDIN_ARGV_DIR")
    if out:
        with open(os.path.join(out, f"{a.instance_id}.rank{a.rank}.json"), "w") as f:
            json.dump(sys.argv[1:], f)
    if a.crash:
        sys.exit("stand-in told to crash")
    if a.grpc_port:  # the router shape: HTTP on --port, gRPC on --grpc-port
        http = HTTPServer((a.host, a.port), _Health)
        threading.Thread(target=http.serve_forever, daemon=True).start()
    if a.rank == 0:
        run(lambda: serve(a))
    else:  # a non-zero rank serves nothing; it lives until SIGTERM
        import signal
        signal.sigwait({signal.SIGTERM, signal.SIGINT})


if __name__ == "__main__":
    main()
