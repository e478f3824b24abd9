"""`python -m services.kvstore --port 50060 --redis-url redis://... --model DIR --pool-gib 64`"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from engine.config.arg_utils import add_kv_layout_args
from engine.config.model_config import ModelConfig
from engine.kv.cache import KVCacheSpec, num_blocks_for_bytes
from proto.pdserve.v1 import kvstore_pb2_grpc
from services.cluster.redis_state import InstanceInfo, InstancePresence, RedisState
from services.kvstore.server import SERVICE_NAME, KVStoreServicer
from services.rpc.drain import Drain
from services.rpc.grpc_server import GrpcServer, run
from services.rpc.metrics import ServiceMetrics
from services.rpc.net import advertise_host
from services.rpc.service_args import add_instance_args, setup_logging

log = logging.getLogger("services.kvstore")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m services.kvstore", description=__doc__)
    p.add_argument("--model", required=True, help="checkpoint directory (its config.json sizes the blocks)")
    p.add_argument("--pool-gib", type=float, required=True, help="host memory for KV blocks, GiB")
    add_kv_layout_args(p.add_argument_group("KV block layout (the engines' flags)"), resolve_auto=False)
    p.add_argument("--reservation-ttl-ms", type=int, default=10_000)
    p.add_argument("--lease-ttl-ms", type=int, default=30_000)
    p.add_argument("--max-ttl-ms", type=int, default=300_000)
    p.add_argument("--reservation-grace-ms", type=int, default=2_000,
                   help="extra time an expired reservation's blocks stay unused (late WRITEs)")
    p.add_argument("--max-open-transfers", type=int, default=256,
                   help="reservations + leases open at once (NIXL transfers in flight); beyond: RESOURCE_EXHAUSTED")
    add_instance_args(p, 50060)
    args = p.parse_args(argv)
    if args.pool_gib <= 0:
        p.error(f"--pool-gib must be positive, got {args.pool_gib}")
    return args


async def serve(args: argparse.Namespace) -> None:
    spec = KVCacheSpec.from_model(ModelConfig.from_pretrained(args.model), block_size=args.block_size,
                                  kv_cache_dtype=args.kv_cache_dtype, indexer_precision=args.indexer_precision,
                                  with_mtp=args.mtp_kv)
    num_blocks = num_blocks_for_bytes(spec, int(args.pool_gib * (1 << 30)))
    if num_blocks == 0:
        raise SystemExit(f"--pool-gib {args.pool_gib} holds no block of {spec.block_bytes} bytes")
    host = advertise_host(args.advertise_host, args.host)
    server = GrpcServer(args.port, args.host)
    port = server.bind()
    instance_id = args.instance_id or f"kvstore-{host}-{port}"
    metrics, state = ServiceMetrics("kvstore", instance_id), RedisState(args.redis_url)
    servicer = KVStoreServicer(instance_id, spec, num_blocks, state=state, metrics=metrics,
                               reservation_ttl_s=args.reservation_ttl_ms / 1000, lease_ttl_s=args.lease_ttl_ms / 1000,
                               max_ttl_s=args.max_ttl_ms / 1000, grace_s=args.reservation_grace_ms / 1000,
                               block_ttl_s=args.block_ttl_s, max_open_transfers=args.max_open_transfers)
    server.add_service(kvstore_pb2_grpc.add_KVStoreServicer_to_server, servicer, SERVICE_NAME)
    metrics.describe_model(Path(args.model.rstrip("/")).name,
                           {"block_size": args.block_size, "cache_dtype": args.kv_cache_dtype, "num_gpu_blocks": 0,
                            "num_cpu_blocks": num_blocks})
    metrics_port = metrics.serve(args.metrics_port, args.host)
    info = InstanceInfo("kvstore", instance_id, f"{host}:{port}", f"{host}:{metrics_port}",
                        capacity={"num_blocks": num_blocks, "block_bytes": spec.block_bytes},
                        extra={"nixl_agent": servicer.agent.name})
    drain, grace = Drain(args.shutdown_timeout), 2.0
    presence = InstancePresence(state, info, ttl_s=args.instance_ttl_s, heartbeat_s=args.heartbeat_s,
                                block_ttl_s=args.block_ttl_s, held_blocks=servicer.pool.stored_hashes,
                                load=servicer.load_figures)
    try:
        await server.start()
        await presence.start()
        servicer.start()
        await server.set_serving(True)
        log.info("kvstore %s: %d blocks of %d B (%.3f GiB) at %s:%d, metrics at :%d", instance_id, num_blocks,
                 spec.block_bytes, num_blocks * spec.block_bytes / (1 << 30), host, port, metrics_port)
        await drain.wait_for_signal()
        # out of service at once (no new reservation or load), then the open transfers and leases finish
        servicer.draining = True
        await server.set_serving(False)
        await presence.stop(deregister=True)
        if not await drain.until_idle(lambda: servicer.pool.num_open == 0, "kvstore transfers"):
            grace = 0.0
        log.info("kvstore %s shutting down", instance_id)
    finally:
        drain.uninstall()
        await server.stop(grace=grace)
        await presence.stop(deregister=True)
        await servicer.stop()
        await state.close()
        metrics.close()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging()
    sys.exit(run(lambda: serve(args)))
