"""`python -m services.prefill --model DIR --port 50051 --redis-url URL [engine flags]`

Rank 0 serves gRPC and drives the engine; with PCP/DCP > 1 the other ranks run the engine's worker
loop (`--rank r --world-size N --master-addr A --master-port P`, as `services.launch.ranks` or the
launcher start them).
"""

from __future__ import annotations

import argparse
import logging

from engine.config.arg_utils import EngineArgs
from engine.frontend.async_engine import AsyncEngine
from engine.parallel.worker import exit_now, worker_main
from proto.pdserve.v1 import prefill_pb2_grpc
from services.cluster.redis_state import InstanceInfo, RedisState
from services.engine_host import EngineHost, model_info
from services.prefill.server import SERVICE_NAME, PrefillServicer
from services.rank_watch import exit_service, serve_until_stopped
from services.rpc.admission import Admission
from services.rpc.drain import Drain
from services.rpc.grpc_server import GrpcServer, run
from services.rpc.metrics import ServiceMetrics
from services.rpc.net import advertise_host
from services.rpc.service_args import add_service_args, set_rank_environ, setup_logging
from services.transfer.export import KVExporter
from services.transfer.kvstore_link import KVStoreLink
from services.transfer.prefix import PrefixTransfer

log = logging.getLogger("services.prefill")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m services.prefill", description=__doc__)
    EngineArgs.add_cli_args(p)
    add_service_args(p, default_port=50051)
    g = p.add_argument_group("prefill")
    g.add_argument("--lease-ms", type=int, default=30_000, help="how long exported KV waits for decode")
    g.add_argument("--max-lease-ms", type=int, default=300_000)
    g.add_argument("--kvstore", default="auto", help="'auto' (find one in Redis), 'off', or host:port")
    g.add_argument("--kvstore-timeout-s", type=float, default=2.0,
                   help="deadline of each kvstore call/transfer; past it the prefix is recomputed")
    g.add_argument("--kvstore-staging-blocks", type=int, default=64,
                   help="DCP > 1: whole blocks staged on rank 0 per kvstore transfer (its GPU memory)")
    args = p.parse_args(argv)
    if args.enforce_eager is None:  # a prefill engine emits one token per request: no decode graphs to capture
        args.enforce_eager = True
    return args


async def serve(args: argparse.Namespace) -> int:
    engine_args = EngineArgs.from_cli_args(args)
    host = advertise_host(args.advertise_host, args.host)
    server = GrpcServer(args.port, args.host)
    port = server.bind()  # gRPC and metrics ports bound before the engine loads (seconds): a port the
    # launcher picked could meanwhile be taken by another process
    instance_id = args.instance_id or f"prefill-{host}-{port}"
    metrics, state = ServiceMetrics("prefill", instance_id), RedisState(args.redis_url)
    metrics_port = metrics.serve(args.metrics_port, args.host)
    engine = AsyncEngine(engine_args, text=False, cumulative=False)  # deltas of token ids on the wire
    metrics.describe_model(*model_info(engine))  # the vllm: names too
    exporter = KVExporter(instance_id, engine, metrics)
    link = None
    if args.kvstore != "off":
        link = PrefixTransfer(engine, KVStoreLink(exporter.agent, exporter.tensors, exporter.spec, state,
                                                  static_address=None if args.kvstore == "auto" else args.kvstore,
                                                  timeout_s=args.kvstore_timeout_s, metrics=metrics))
    servicer = PrefillServicer(instance_id, engine, exporter, metrics, link, args.lease_ms / 1000,
                               args.max_lease_ms / 1000,
                               Admission("prefill", args.max_inflight_requests, args.max_queued_requests),
                               grpc_address=f"{host}:{port}")
    server.add_service(prefill_pb2_grpc.add_PrefillServicer_to_server, servicer, SERVICE_NAME)
    cfg = engine.config
    info = InstanceInfo("prefill", instance_id, f"{host}:{port}", f"{host}:{metrics_port}",
                        capacity={"num_blocks": engine.stats().num_blocks,
                                  "max_model_len": cfg.scheduler.max_model_len},
                        extra={"nixl_agent": exporter.agent.name, "pcp": cfg.parallel.prefill_context_parallel_size,
                               "dcp": cfg.parallel.decode_context_parallel_size})
    host_obj = EngineHost(engine, info, state, metrics, heartbeat_s=args.heartbeat_s,
                          instance_ttl_s=args.instance_ttl_s, block_ttl_s=args.block_ttl_s)
    drain, grace = Drain(args.shutdown_timeout), 2.0
    try:
        engine.start()
        await exporter.start()
        if link is not None:
            await link.setup(exporter.agent, args.kvstore_staging_blocks)
        await server.start()
        await host_obj.start()
        servicer.start()
        await server.set_serving(True)
        log.info("prefill %s serving %s at %s:%d (metrics :%d)", instance_id, cfg.model_path, host, port, metrics_port)
        if await serve_until_stopped(server, drain, engine, host_obj, "prefill"):
            return 1
        # out of service at once; prefills in flight finish, and their KV stays until decode pulled it (or
        # the lease ran out: decode then computes the prompt itself); a multi-rank engine drains as one
        servicer.draining = True
        await server.set_serving(False)
        await host_obj.stop()
        grace = 2.0 if await drain.until_idle(lambda: servicer.idle, "prefills and exported KV") else 0.0
        return 0
    finally:
        drain.uninstall()
        await server.set_serving(False)
        await host_obj.stop()  # out of the registry first: the router stops placing here whatever the rest takes
        await server.stop(grace=grace)
        await servicer.stop()
        await engine.shutdown()
        await state.close()
        metrics.close()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging()
    if args.world_size > 1:  # started rank by rank (launcher / services.launch.ranks): torchrun's contract
        set_rank_environ(args)
        if args.rank > 0:
            worker_main()
            exit_now(0)  # past the process group's teardown: no C++ thread left joinable at exit
    exit_service(run(lambda: serve(args)), args.world_size)
