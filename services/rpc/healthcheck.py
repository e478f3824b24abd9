"""Container health probe: `python -m services.rpc.healthcheck HOST:PORT [--http URL]`.

Exit 0 when the gRPC server at HOST:PORT reports SERVING (and the URL, if given, answers 200)."""

from __future__ import annotations

import argparse
import sys
import urllib.request

from services.rpc.grpc_server import check_health_sync


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.rpc.healthcheck", description=__doc__)
    p.add_argument("address")
    p.add_argument("--http", default=None, help="also require HTTP 200 from this URL")
    p.add_argument("--timeout", type=float, default=2.0)
    a = p.parse_args(argv)
    if not check_health_sync(a.address, timeout=a.timeout):
        return 1
    if a.http:
        try:
            with urllib.request.urlopen(a.http, timeout=a.timeout) as r:
                return 0 if r.status == 200 else 1
        except OSError:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
