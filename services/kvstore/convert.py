"""kvstore proto <-> pool objects (the only place the kvstore touches message fields)."""

from __future__ import annotations

from proto.pdserve.v1 import kvstore_pb2
from services.kvstore.pool import Lease, Reservation
from services.rpc.convert import unix_ms


def reserve_response(res: Reservation | None, num_present: int, agent_name: str) -> kvstore_pb2.ReserveResponse:
    if res is None:
        return kvstore_pb2.ReserveResponse(num_present=num_present, agent_name=agent_name)
    return kvstore_pb2.ReserveResponse(reservation_id=res.reservation_id, expires_unix_ms=unix_ms(res.expires_at),
                                       block_hashes=res.block_hashes, block_ids=res.block_ids,
                                       num_present=num_present, agent_name=agent_name)


def load_response(lease: Lease | None, agent_name: str) -> kvstore_pb2.LoadResponse:
    if lease is None:
        return kvstore_pb2.LoadResponse(agent_name=agent_name)
    return kvstore_pb2.LoadResponse(lease_id=lease.lease_id, expires_unix_ms=unix_ms(lease.expires_at),
                                    block_ids=lease.block_ids, agent_name=agent_name)


def release_id(request: kvstore_pb2.ReleaseRequest) -> str:
    if not request.id:
        raise ValueError("Release needs the id of a reservation or a lease")
    return request.id
