"""`python -m services.decode --model DIR --port 50071 --redis-url URL [engine flags]`

A decode engine with hybrid HiSparse (`--attention-config '{"hisparse_config": {...}}'`) and MTP
(`--speculative-config '{"method": "mtp", "num_speculative_tokens": 3}'`): one instance, or, with
`--data-parallel-size D --enable-expert-parallel`, one DP × EP group of D ranks, one process each
(`--rank r --world-size D --master-addr A --master-port P`, as the launcher or `services.launch.ranks`
start them). Rank 0 serves gRPC and drives the group; the others run the engine's worker loop and pull
their own requests' KV. The group registers as D instances `<id>-dp0` ... `<id>-dp{D-1}` at rank 0's
address (docs/dp_ep.md), and leaves service as one when a rank dies or hangs (services/rank_watch.py)."""

from __future__ import annotations

import argparse
import logging
import os
import secrets

from engine.config.arg_utils import EngineArgs
from engine.frontend.async_engine import AsyncEngine
from engine.parallel.worker import exit_now, worker_main
from proto.pdserve.v1 import decode_pb2_grpc
from services.cluster.redis_state import InstanceInfo, RedisState
from services.decode.faults import with_faults
from services.decode.server import SERVICE_NAME, DecodeRank, DecodeServicer
from services.engine_host import EngineHost, model_info
from services.rank_watch import exit_service, serve_until_stopped
from services.rpc.admission import Admission
from services.rpc.drain import Drain
from services.rpc.grpc_server import GrpcServer, run
from services.rpc.metrics import ServiceMetrics
from services.rpc.net import advertise_host
from services.rpc.service_args import add_service_args, set_rank_environ, setup_logging
from services.transfer.nixl_agent import NixlAgent
from services.transfer.pull import KVPuller
from services.transfer.rank_pull import rank_pullers

log = logging.getLogger("services.decode")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m services.decode", description=__doc__)
    EngineArgs.add_cli_args(p)
    add_service_args(p, default_port=50071)
    g = p.add_argument_group("decode")
    g.add_argument("--admit-timeout-s", type=float, default=30.0, help="wait this long for KV room, then 429")
    g.add_argument("--pull-timeout-s", type=float, default=30.0, help="deadline of one KV pull")
    g.add_argument("--staging-blocks", type=int, default=64, help="staging area for DCP re-layout, in blocks")
    args = p.parse_args(argv)
    if args.world_size != args.data_parallel_size:
        p.error(f"--world-size {args.world_size} must equal --data-parallel-size {args.data_parallel_size}: a "
                "decode engine runs one process per DP rank")
    return args


def _ranks(args, engine: AsyncEngine, agent: NixlAgent, instance_id: str) -> list[DecodeRank]:
    """The instances this process serves: the engine, or each DP rank of its group with that rank's puller."""
    runner = engine.core.runner
    pullers = [KVPuller(agent, runner.kv_cache, runner.spec, staging_blocks=args.staging_blocks,
                        timeout_s=args.pull_timeout_s)]
    ids = [instance_id]
    num_ranks = engine.config.parallel.data_parallel_size
    if num_ranks > 1:
        pullers += rank_pullers(engine, agent, instance_id, staging_blocks=args.staging_blocks,
                                timeout_s=args.pull_timeout_s)
        ids = [f"{instance_id}-dp{r}" for r in range(num_ranks)]
    return [DecodeRank(i, with_faults(p), Admission(f"decode {i}" if num_ranks > 1 else "decode",
                                                    args.max_inflight_requests, args.max_queued_requests))
            for i, p in zip(ids, pullers)]


def _infos(engine: AsyncEngine, ranks: list[DecodeRank], address: str, metrics_address: str,
           agent: NixlAgent) -> list[InstanceInfo]:
    cfg = engine.config
    extra = {"hisparse": cfg.hisparse is not None, "num_speculative_tokens": cfg.num_spec_tokens}
    if len(ranks) > 1:
        extra.update(dp_size=len(ranks), dp_group=ranks[0].instance_id.rsplit("-dp", 1)[0])
    st = engine.stats()
    return [InstanceInfo("decode", r.instance_id, address, metrics_address,
                         capacity={"num_blocks": (st.dp_ranks[rank] if st.dp_ranks else st).num_blocks,
                                   "max_model_len": cfg.scheduler.max_model_len},
                         extra={**extra, "nixl_agent": getattr(r.puller, "peer", agent.name),
                                **({"dp_rank": rank} if len(ranks) > 1 else {})})
            for rank, r in enumerate(ranks)]


async def serve(args: argparse.Namespace) -> int:
    host = advertise_host(args.advertise_host, args.host)
    server = GrpcServer(args.port, args.host)
    port = server.bind()  # gRPC and metrics ports bound before the engine loads (seconds): a port the
    # launcher picked could meanwhile be taken by another process
    instance_id = args.instance_id or f"decode-{host}-{port}"
    metrics, state = ServiceMetrics("decode", instance_id), RedisState(args.redis_url)
    metrics_port = metrics.serve(args.metrics_port, args.host)
    engine = AsyncEngine(EngineArgs.from_cli_args(args), text=False, cumulative=False)  # token-id deltas
    metrics.describe_model(*model_info(engine))  # the vllm: names too
    agent = NixlAgent(f"{instance_id}.{os.getpid()}.{secrets.token_hex(3)}", metrics=metrics)
    ranks = _ranks(args, engine, agent, instance_id)
    servicer = DecodeServicer(engine, None, metrics, admit_timeout_s=args.admit_timeout_s, ranks=ranks)
    server.add_service(decode_pb2_grpc.add_DecodeServicer_to_server, servicer, SERVICE_NAME)
    infos = _infos(engine, ranks, f"{host}:{port}", f"{host}:{metrics_port}", agent)
    host_obj = EngineHost(engine, infos, state, metrics, heartbeat_s=args.heartbeat_s,
                          instance_ttl_s=args.instance_ttl_s, block_ttl_s=args.block_ttl_s, publish_blocks=False)
    drain, grace = Drain(args.shutdown_timeout), 2.0
    try:
        engine.start()
        await server.start()
        await host_obj.start()
        await server.set_serving(True)
        log.info("decode %s serving %s at %s:%d (metrics :%d)", ", ".join(i.instance_id for i in infos),
                 engine.config.model_path, host, port, metrics_port)
        if len(ranks) > 1:  # a DP group: a dead or hung rank takes every rank's instance out of service
            if await serve_until_stopped(server, drain, engine, host_obj, "decode group"):
                return 1
        else:
            await drain.wait_for_signal()
        # out of service at once, then the streams in flight run to their end (the group drains as one: every
        # rank's requests are this process's streams); past the timeout they end UNAVAILABLE and migrate
        servicer.draining = True
        await server.set_serving(False)
        await host_obj.stop()
        grace = 2.0 if await drain.until_idle(lambda: servicer.num_streams == 0, "decode streams") else 0.0
        return 0
    finally:
        drain.uninstall()
        await server.set_serving(False)
        await host_obj.stop()  # out of the registry first: the router stops placing here whatever the rest takes
        await server.stop(grace=grace)
        await engine.shutdown()
        agent.close()
        await state.close()
        metrics.close()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging()
    if args.world_size > 1:  # a DP group started rank by rank (launcher / services.launch.ranks)
        set_rank_environ(args)
        if args.rank > 0:
            worker_main()
            exit_now(0)  # past the process group's teardown: no C++ thread left joinable at exit
    exit_service(run(lambda: serve(args)), args.world_size)
