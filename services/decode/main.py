"""`python -m services.decode --model DIR --port 50071 --redis-url URL [engine flags]`

One DP rank: an engine with hybrid HiSparse (`--attention-config '{"hisparse_config": {...}}'`) and
MTP (`--speculative-config '{"method": "mtp", "num_speculative_tokens": 3}'`)."""

from __future__ import annotations

import argparse
import logging
import os
import secrets

from engine.config.arg_utils import EngineArgs
from engine.frontend.async_engine import AsyncEngine
from proto.pdserve.v1 import decode_pb2_grpc
from services.cluster.redis_state import InstanceInfo, RedisState
from services.decode.faults import with_faults
from services.decode.puller import KVPuller
from services.decode.server import SERVICE_NAME, DecodeServicer
from services.engine_host import EngineHost
from services.rpc.admission import Admission
from services.rpc.grpc_server import GrpcServer, run
from services.rpc.metrics import ServiceMetrics
from services.rpc.net import advertise_host
from services.rpc.service_args import add_service_args, setup_logging
from services.transfer.nixl_agent import NixlAgent

log = logging.getLogger("services.decode")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m services.decode", description=__doc__)
    EngineArgs.add_cli_args(p)
    add_service_args(p, default_port=50071)
    g = p.add_argument_group("decode")
    g.add_argument("--admit-timeout-s", type=float, default=30.0, help="wait this long for KV room, then 429")
    g.add_argument("--pull-timeout-s", type=float, default=30.0, help="deadline of one KV pull")
    g.add_argument("--staging-blocks", type=int, default=64, help="staging area for DCP re-layout, in blocks")
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    engine = AsyncEngine(EngineArgs.from_cli_args(args))
    host = advertise_host(args.advertise_host, args.host)
    server = GrpcServer(args.port, args.host)
    port = server.bind()
    instance_id = args.instance_id or f"decode-{host}-{port}"
    metrics, state = ServiceMetrics("decode", instance_id), RedisState(args.redis_url)
    agent = NixlAgent(f"{instance_id}.{os.getpid()}.{secrets.token_hex(3)}", metrics=metrics)
    runner = engine.core.runner
    puller = with_faults(KVPuller(agent, runner.kv_cache, runner.spec, staging_blocks=args.staging_blocks,
                                  timeout_s=args.pull_timeout_s))
    servicer = DecodeServicer(engine, puller, metrics, admit_timeout_s=args.admit_timeout_s,
                              admission=Admission("decode", args.max_inflight_requests, args.max_queued_requests))
    server.add_service(decode_pb2_grpc.add_DecodeServicer_to_server, servicer, SERVICE_NAME)
    metrics_port = metrics.serve(args.metrics_port, args.host)
    cfg = engine.config
    info = InstanceInfo("decode", instance_id, f"{host}:{port}", f"{host}:{metrics_port}",
                        capacity={"num_blocks": engine.stats().num_blocks,
                                  "max_model_len": cfg.scheduler.max_model_len},
                        extra={"nixl_agent": agent.name, "hisparse": cfg.hisparse is not None,
                               "num_speculative_tokens": cfg.num_spec_tokens})
    host_obj = EngineHost(engine, info, state, metrics, heartbeat_s=args.heartbeat_s,
                          instance_ttl_s=args.instance_ttl_s, block_ttl_s=args.block_ttl_s, publish_blocks=False)
    try:
        engine.start()
        await server.start()
        await host_obj.start()
        await server.set_serving(True)
        log.info("decode %s serving %s at %s:%d (metrics :%d)", instance_id, cfg.model_path, host, port, metrics_port)
        await server.wait_for_shutdown_signal()
    finally:
        await server.set_serving(False)
        await server.stop(grace=2.0)
        await host_obj.stop()
        await engine.shutdown()
        agent.close()
        await state.close()
        metrics.close()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging()
    run(lambda: serve(args))
