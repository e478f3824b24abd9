"""Generate Python stubs for proto/pdserve/v1/*.proto (run by `make install`; idempotent).

Generated modules land beside the .proto files and are imported as `proto.pdserve.v1.<name>_pb2`.
The .proto files import each other as "pdserve/v1/<name>.proto" (the path that matches their
package, so grpcurl and other languages work with `-I proto`); protoc therefore emits absolute
`from pdserve.v1 import ...` lines, which we rewrite to `from proto.pdserve.v1 import ...`.
Stubs are written to a temporary directory and moved into place one by one (atomic rename), so
processes that build concurrently (several services starting on a fresh checkout) never see a
half-written module.

protoc runs in a child process, never in-process: grpc_tools' compiler extension and NIXL's bundled
libprotobuf corrupt each other's heap (a process that imported grpc_tools.protoc aborts when it
creates a NIXL agent).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PACKAGE_DIR = PROTO_ROOT / "pdserve" / "v1"
_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")
_ABSOLUTE_IMPORT = re.compile(r"^(from|import) pdserve\.v1\b", re.MULTILINE)


def protos() -> list[Path]:
    return sorted(PACKAGE_DIR.glob("*.proto"))


def stubs_of(proto: Path) -> list[Path]:
    return [proto.with_name(proto.stem + s) for s in _SUFFIXES]


def is_stale() -> bool:
    """True when a stub is missing or older than its .proto (or than this script)."""
    newest_input = max([Path(__file__).stat().st_mtime] + [p.stat().st_mtime for p in protos()])
    for proto in protos():
        for stub in stubs_of(proto):
            if not stub.exists() or stub.stat().st_mtime < newest_input:
                return True
    return False


def build() -> list[Path]:
    sources = protos()
    if not sources:
        return []
    spec = importlib.util.find_spec("grpc_tools")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("grpcio-tools is not installed: `pip install grpcio-tools` to generate the stubs")
    include = str(Path(spec.submodule_search_locations[0]) / "_proto")  # google/protobuf/*.proto
    with tempfile.TemporaryDirectory(dir=PACKAGE_DIR, prefix=".gen-") as out:
        args = [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{include}",
                f"--python_out={out}", f"--grpc_python_out={out}", f"--pyi_out={out}"]
        args += [str(p.relative_to(PROTO_ROOT)) for p in sources]
        result = subprocess.run(args, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"protoc failed on {', '.join(p.name for p in sources)}:\n{result.stderr}")
        for generated in sorted((Path(out) / "pdserve" / "v1").iterdir()):
            text = _ABSOLUTE_IMPORT.sub(r"\1 proto.pdserve.v1", generated.read_text())
            generated.write_text(text)
            os.replace(generated, PACKAGE_DIR / generated.name)
    return sources


def ensure_built() -> None:
    if is_stale():
        build()


if __name__ == "__main__":
    built = build()
    print(f"generated stubs for {len(built)} proto file(s)", file=sys.stderr)
