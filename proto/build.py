"""Generate Python stubs for proto/pdserve/v1/*.proto (run by `make install`; idempotent).

Generated modules land beside the .proto files and are imported as `proto.pdserve.v1.<name>_pb2`.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def build() -> list[Path]:
    from grpc_tools import protoc
    import grpc_tools

    protos = sorted((ROOT / "proto" / "pdserve" / "v1").glob("*.proto"))
    if not protos:
        return []
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={ROOT}", f"--grpc_python_out={ROOT}",
            f"--pyi_out={ROOT}"] + [str(p.relative_to(ROOT)) for p in protos]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed on " + ", ".join(p.name for p in protos))
    return protos


if __name__ == "__main__":
    built = build()
    print(f"generated stubs for {len(built)} proto file(s)", file=sys.stderr)
