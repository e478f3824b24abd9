"""pdserve wire API, version 1: `from proto.pdserve.v1 import kvstore_pb2, kvstore_pb2_grpc`.

The *_pb2 modules are generated (proto/build.py, run by `make install`); a stale or missing stub
is regenerated on first import so a fresh checkout or an edited .proto just works.
"""

from proto.build import ensure_built as _ensure_built

_ensure_built()
