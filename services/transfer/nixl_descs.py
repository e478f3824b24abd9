"""What NIXL transfers are made of: block-major tensor descriptions, prepared descriptor lists,
transfer records, counters, errors, and the "pulled <lease>" notification (see nixl_agent.py)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

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
    def of(cls, name: str, tensor: torch.Tensor) -> BlockTensor:
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


def by_mem_type(tensors: Sequence[BlockTensor]) -> list[tuple[str, tuple[BlockTensor, ...]]]:
    """The tensors grouped by memory type (DRAM, VRAM), in order of first appearance. NIXL registers
    and prepares one memory type per call: a HiSparse cache is a host pool (DRAM) beside a device
    indexer cache (VRAM), so it is two registrations and two prepared lists."""
    groups: dict[str, list[BlockTensor]] = {}
    for t in tensors:
        groups.setdefault(t.mem_type, []).append(t)
    return [(mem, tuple(ts)) for mem, ts in groups.items()]


def region_descs(tensors: Sequence[BlockTensor]) -> np.ndarray:
    """[len(tensors), 3] uint64 rows (address, length, device id): one registration region per tensor."""
    return np.array([(t.base_addr, t.block_bytes * t.num_blocks, t.device_id) for t in tensors],
                    dtype=np.uint64).reshape(-1, 3)


def _tensor_major(tensors: Sequence[BlockTensor], block_ids: Sequence[int], names: Sequence[str] | None,
                  where: str) -> np.ndarray:
    ids = np.asarray(block_ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or any(ids.max() >= t.num_blocks for t in tensors)):
        raise ValueError(f"block ids out of range for {where} tensors "
                         f"({[t.num_blocks for t in tensors]} blocks): {ids.min()}..{ids.max()}")
    offsets = np.cumsum([0] + [t.num_blocks for t in tensors[:-1]])
    wanted = [i for i, t in enumerate(tensors) if names is None or t.name in names]
    if not wanted:
        return np.empty(0, dtype=np.int32)
    return np.concatenate([ids + offsets[i] for i in wanted]).astype(np.int32)


@dataclass(eq=False)
class DescGroup:
    """The tensors of one memory type in a BlockDescList, with NIXL's prepared list over their blocks."""

    mem_type: str
    tensors: tuple[BlockTensor, ...]
    handle: Any  # nixl_prepped_dlist_handle; None once released

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors)

    def indices(self, block_ids: Sequence[int], names: Sequence[str] | None = None) -> np.ndarray:
        """Descriptor indices of `block_ids` in the tensors named `names` (all by default), tensor-major."""
        return _tensor_major(self.tensors, block_ids, names, self.mem_type)


@dataclass(eq=False)
class BlockDescList:
    """Prepared NIXL descriptor lists over every block of some tensors of one agent: one DescGroup
    per memory type (NIXL prepares one memory type per list)."""

    peer: str  # "" for local
    tensors: tuple[BlockTensor, ...]
    groups: tuple[DescGroup, ...] = ()

    @property
    def released(self) -> bool:
        return any(g.handle is None for g in self.groups) or not self.groups

    def indices(self, block_ids: Sequence[int]) -> np.ndarray:
        """Descriptor indices of `block_ids` in every tensor, tensor-major (as if one list)."""
        return _tensor_major(self.tensors, block_ids, None, self.peer or "local")

    def num_bytes(self, num_blocks: int) -> int:
        return num_blocks * sum(t.block_bytes for t in self.tensors)


@dataclass(frozen=True)
class TransferPart:
    """One NIXL transfer of a split one: tensors of one local memory type and one remote memory type."""

    local: DescGroup
    local_idx: np.ndarray
    remote: DescGroup
    remote_idx: np.ndarray
    names: tuple[str, ...]


def transfer_parts(local: BlockDescList, local_ids: Sequence[int], remote: BlockDescList,
                   remote_ids: Sequence[int]) -> list[TransferPart]:
    """Split a block transfer into one NIXL transfer per (local memory type, remote memory type) pair
    of tensors: a transfer's two descriptor lists each hold one memory type."""
    local.indices(local_ids), remote.indices(remote_ids)  # range checks over every tensor
    parts = []
    for lg in local.groups:
        for rg in remote.groups:
            names = tuple(n for n in lg.names if n in rg.names)
            if names:
                parts.append(TransferPart(lg, lg.indices(local_ids, names), rg, rg.indices(remote_ids, names), names))
    return parts


@dataclass
class Transfer:
    handles: list[Any]  # nixl_xfer_handles still running: one per TransferPart ([] once done)
    op: str
    peer: str
    num_bytes: int
    started: float
    notif_after: bytes = b""  # sent once every part is done (a split transfer carries no NIXL notification)


@dataclass
class NixlStats:
    bytes_transferred: int = 0
    num_transfers: int = 0
    num_failed_transfers: int = 0
    num_timeouts: int = 0
