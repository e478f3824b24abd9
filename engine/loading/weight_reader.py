"""Reading safetensors checkpoints tensor by tensor: the index from headers alone, then only the tensors a
rank keeps, one at a time, to the device in their stored dtype (FP8 stays FP8).

    header index (no tensor bytes) -> plan (names this rank keeps) -> per shard: read one tensor
      -> [CUDA: pinned staging buffer -> device copy] -> its parameter -> next tensor

Host memory while loading is one tensor read from the file plus the staging buffer (the file itself is
memory-mapped by safetensors, so at most the shard being read is resident). `ShardReader` counts the
bytes and names it read, so a test can check that an expert-parallel rank read only its own experts.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

_DTYPE_BYTES = {"F8_E4M3": 1, "F8_E5M2": 1, "BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4,
                "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


class WeightLoadError(ValueError):
    """A checkpoint that does not fit the model; the message names the tensor."""


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str  # safetensors' name: F8_E4M3, BF16, F32, ...
    shape: tuple[int, ...]

    @property
    def is_fp8(self) -> bool:
        return self.dtype.startswith("F8_")

    def nbytes(self, rows: slice | None = None) -> int:
        n = 1
        for d in self.shape:
            n *= d
        if rows is not None and self.shape:
            n = n // self.shape[0] * len(range(*rows.indices(self.shape[0])))
        return n * _DTYPE_BYTES.get(self.dtype, 4)


def checkpoint_files(path: str | Path) -> list[Path]:
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({path / f for f in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no safetensors files in {path}")
    for f in files:
        if not f.exists():
            raise WeightLoadError(f"checkpoint index names {f.name}, which is missing from {path}")
    return files


def read_index(path: str | Path) -> dict[str, TensorInfo]:
    """Every tensor's file, dtype and shape, from the safetensors headers (8-byte length + JSON)."""
    out: dict[str, TensorInfo] = {}
    for f in checkpoint_files(path):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                out[name] = TensorInfo(f, meta["dtype"], tuple(meta["shape"]))
    return out


@dataclass
class ShardReader:
    """Reads named tensors (optionally a leading-dim row range) and moves them to `device`."""

    device: torch.device
    staging_bytes: int = 0
    bytes_read: int = 0
    names_read: list[str] = field(default_factory=list)
    peak_tensor_bytes: int = 0
    _staging: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.device.type == "cuda" and self.staging_bytes:
            self._staging = torch.empty(self.staging_bytes, dtype=torch.uint8, pin_memory=True)

    def read(self, handle, name: str, rows: slice | None = None) -> torch.Tensor:
        t = handle.get_slice(name)[rows] if rows is not None else handle.get_tensor(name)
        nbytes = t.numel() * t.element_size()
        self.bytes_read += nbytes
        self.peak_tensor_bytes = max(self.peak_tensor_bytes, nbytes)
        self.names_read.append(name)
        return t

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor on the device, same dtype. CUDA: through the pinned staging buffer (one copy in flight)."""
        if self.device.type != "cuda":
            return t
        nbytes = t.numel() * t.element_size()
        if self._staging is None or nbytes > self._staging.numel():
            return t.to(self.device)  # larger than planned: a plain (pageable) copy
        stage = self._staging[:nbytes].view(t.dtype).view(t.shape)
        stage.copy_(t)
        out = torch.empty(t.shape, dtype=t.dtype, device=self.device)
        out.copy_(stage, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()  # the staging buffer is reused next
        return out
