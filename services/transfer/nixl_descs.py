"""What NIXL transfers are made of: block-major tensor descriptions, prepared descriptor lists,
transfer records, counters, errors, and the "pulled <lease>" notification (see nixl_agent.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

MEM_TYPES = ("DRAM", "VRAM")
PULLED_PREFIX = b"pulled "


class TransferError(RuntimeError):
    """A NIXL transfer failed (state ERR or a NIXL exception)."""


class PeerDisconnected(TransferError):
    """The remote agent is gone (its process died or its metadata was invalidated)."""


class TransferTimeout(TransferError, TimeoutError):
    """The transfer did not finish before its deadline (a hung peer); it was cancelled."""


def deadline_in(seconds: float) -> float:
    """An absolute deadline on the `time.monotonic()` clock."""
    return time.monotonic() + seconds


def pulled_notif(lease_id: str) -> bytes:
    """The notification a puller sends the KV owner once its READ finished."""
    return PULLED_PREFIX + lease_id.encode()


def parse_pulled(msg: bytes) -> str | None:
    """lease id of a 'pulled <lease>' notification, None for any other message."""
    return msg[len(PULLED_PREFIX):].decode() if msg.startswith(PULLED_PREFIX) else None


@dataclass(frozen=True)
class BlockTensor:
    """One registered block-major tensor as any process can address it (proto MemoryDesc)."""

    name: str
    base_addr: int
    block_bytes: int
    num_blocks: int
    mem_type: str  # "DRAM" | "VRAM"
    device_id: int

    def __post_init__(self) -> None:
        if self.mem_type not in MEM_TYPES:
            raise ValueError(f"mem_type must be one of {MEM_TYPES}, got {self.mem_type!r}")
        if self.block_bytes <= 0 or self.num_blocks <= 0:
            raise ValueError(f"tensor {self.name!r}: block_bytes and num_blocks must be positive")

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> "BlockTensor":
        if not tensor.is_contiguous():
            raise ValueError(f"tensor {name!r} must be contiguous (block-major [num_blocks, ...])")
        device_id = tensor.get_device()
        return cls(name=name, base_addr=tensor.data_ptr(),
                   block_bytes=tensor.stride(0) * tensor.element_size(), num_blocks=tensor.shape[0],
                   mem_type="DRAM" if device_id < 0 else "VRAM", device_id=max(device_id, 0))

    def descs(self) -> np.ndarray:
        """[num_blocks, 3] uint64 rows (address, length, device id), one per block."""
        out = np.empty((self.num_blocks, 3), dtype=np.uint64)
        out[:, 0] = self.base_addr + np.arange(self.num_blocks, dtype=np.uint64) * np.uint64(self.block_bytes)
        out[:, 1] = self.block_bytes
        out[:, 2] = self.device_id
        return out


@dataclass(eq=False)
class BlockDescList:
    """A prepared NIXL descriptor list over every block of some tensors of one agent."""

    peer: str  # "" for local
    tensors: tuple[BlockTensor, ...]
    handle: Any  # nixl_prepped_dlist_handle

    def indices(self, block_ids: Sequence[int]) -> np.ndarray:
        """Descriptor indices of `block_ids` in every tensor, tensor-major."""
        ids = np.asarray(block_ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or any(ids.max() >= t.num_blocks for t in self.tensors)):
            raise ValueError(f"block ids out of range for {self.peer or 'local'} tensors "
                             f"({[t.num_blocks for t in self.tensors]} blocks): {ids.min()}..{ids.max()}")
        offsets = np.cumsum([0] + [t.num_blocks for t in self.tensors[:-1]])
        return np.concatenate([ids + off for off in offsets]).astype(np.int32)

    def num_bytes(self, num_blocks: int) -> int:
        return num_blocks * sum(t.block_bytes for t in self.tensors)


@dataclass
class Transfer:
    handle: Any  # nixl_xfer_handle, None when there was nothing to move
    op: str
    peer: str
    num_bytes: int
    started: float


@dataclass
class NixlStats:
    bytes_transferred: int = 0
    num_transfers: int = 0
    num_failed_transfers: int = 0
    num_timeouts: int = 0
