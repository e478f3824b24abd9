"""`python -m services.router --model DIR --port 8000 --grpc-port 50050 --redis-url URL`

The OpenAI HTTP API and gRPC Router.Generate, in one asyncio process (uvloop)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

import uvicorn

from engine import settings
from engine.config.model_config import ModelConfig
from engine.frontend.tokenizer import Tokenizer
from proto.pdserve.v1 import router_pb2_grpc
from services.cluster.redis_state import InstanceInfo, InstancePresence, RedisState
from services.router.chat_request import ChatSettings
from services.router.chat_template import ChatTemplate
from services.router.extra_api import load_generation_defaults
from services.router.flow import Flow
from services.router.grpc_api import SERVICE_NAME, RouterServicer
from services.router.guard import ApiKeys
from services.router.http_api import RouterAPI
from services.router.reasoning import reasoning_parser
from services.router.requests import Limits
from services.router.responses_api.store import DEFAULT_TTL_S as RESPONSES_TTL_S
from services.router.routing import Routing
from services.router.tool_parsers import tool_parser
from services.rpc.admission import Admission
from services.rpc.drain import Drain
from services.rpc.grpc_server import GrpcServer, run
from services.rpc.metrics import ServiceMetrics
from services.rpc.net import advertise_host, bind_listener
from services.rpc.service_args import add_admission_args, add_endpoint_args, setup_logging

log = logging.getLogger("services.router")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m services.router", description=__doc__)
    p.add_argument("--model", required=True, help="checkpoint directory (tokenizer, chat template, limits)")
    p.add_argument("--served-model-name", action="extend", nargs="+", default=None,
                   help="the model ids clients may use, e.g. aliases (default: the dir name); responses carry "
                        "the first")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file instead of the checkpoint's")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model decide to call tools (tool_choice "auto"); needs --tool-call-parser')
    p.add_argument("--tool-call-parser", default=None, choices=["glm47", "glm45"],
                   help="parse the model's tool calls into tool_calls (GLM-4.7/GLM-5: glm47; GLM-4.5/4.6: glm45)")
    p.add_argument("--reasoning-parser", default=None, choices=["glm45"],
                   help="split <think>...</think> into reasoning_content")
    p.add_argument("--max-model-len", type=int, default=None)
    g = add_endpoint_args(p, 8000, host="0.0.0.0", host_help="address to bind (the public entry point: all interfaces)",
                          port_help="HTTP port (OpenAI API)",
                          metrics_help="separate /metrics port (also served on --port)")
    g.add_argument("--grpc-port", type=int, default=50050)
    add_admission_args(g, "requests (choices) in flight before 429 / RESOURCE_EXHAUSTED",
                       aliases=("--max-num-requests",))
    p.add_argument("--api-key", action="append", default=list(settings.api_keys()),
                   help="require `Authorization: Bearer <key>` on /v1/* and gRPC; `key` or `key:tenant`; "
                        "repeatable (default: PDSERVE_API_KEY, comma-separated)")
    p.add_argument("--api-keys-file", default=None, help="one `key` or `key:tenant` a line")
    p.add_argument("--max-body-bytes", type=int, default=32 << 20, help="larger request bodies get 413")
    p.add_argument("--max-n", type=int, default=16)
    p.add_argument("--prefill-timeout-s", type=float, default=600.0, help="deadline of the Prefill call")
    p.add_argument("--request-timeout-s", type=float, default=3600.0,
                   help="overall deadline of a request (prefill + every token); past it the client gets an error")
    p.add_argument("--stream-idle-timeout-s", type=float, default=120.0,
                   help="longest silence of a decode stream (covers decode's admission wait and KV pull)")
    p.add_argument("--lease-ms", type=int, default=0, help="KV lease asked of prefill (0: its default)")
    p.add_argument("--responses-ttl-s", type=float, default=RESPONSES_TTL_S,
                   help="how long /v1/responses keeps a stored response in Redis (previous_response_id, GET)")
    p.add_argument("--max-migrations", type=int, default=3,
                   help="times a request may move to another instance when its decode fails or drains under it "
                        "(re-prefilled with the tokens already streamed; services/router/flow.py); then an error")
    args = p.parse_args(argv)
    if args.max_migrations < 0:
        p.error(f"--max-migrations must be >= 0, got {args.max_migrations}")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        p.error("--enable-auto-tool-choice needs --tool-call-parser")
    return args


async def serve(args: argparse.Namespace) -> None:
    cfg = ModelConfig.from_pretrained(args.model)
    tok = Tokenizer(args.model)
    limits = Limits(max_model_len=args.max_model_len or cfg.max_position_embeddings, vocab_size=cfg.vocab_size,
                    max_n=args.max_n,
                    # GLM's reasoning parsers end thinking with </think>: structured outputs start after it
                    reasoning_end="</think>" if getattr(args, "reasoning_parser", None) else "")
    keys = ApiKeys.from_sources(args.api_key, args.api_keys_file)
    admission = Admission("router", args.max_inflight_requests)
    names = args.served_model_name or [args.model.rstrip("/").split("/")[-1]]
    name = names[0]
    chat = chat_settings(args)
    host = advertise_host(args.advertise_host, args.host)
    instance_id = args.instance_id or f"router-{host}-{args.port}"
    metrics, state = ServiceMetrics("router", instance_id), RedisState(args.redis_url)
    flow = Flow(Routing(state), tok, metrics, prefill_timeout_s=args.prefill_timeout_s,
                request_timeout_s=args.request_timeout_s, idle_timeout_s=args.stream_idle_timeout_s,
                lease_ms=args.lease_ms, max_migrations=args.max_migrations)
    api = RouterAPI(flow, limits, names, metrics, keys=keys, admission=admission, max_body_bytes=args.max_body_bytes,
                    chat=chat, generation_defaults=load_generation_defaults(args.model),
                    responses_ttl_s=args.responses_ttl_s)
    grpc_server = GrpcServer(args.grpc_port, args.host)
    grpc_server.add_service(router_pb2_grpc.add_RouterServicer_to_server,
                            RouterServicer(flow, limits, names, keys, admission, chat), SERVICE_NAME)
    http = uvicorn.Server(uvicorn.Config(api.build(), host=args.host, port=args.port, log_level="warning",
                                         loop="none", lifespan="off", timeout_graceful_shutdown=2))
    drain = Drain(args.shutdown_timeout)
    http_socket = bind_listener(args.host, args.port, "HTTP")  # here, so a taken port exits PORT_IN_USE_EXIT
    http_port = http_socket.getsockname()[1]
    metrics.describe_model(name)  # the vllm: names too (their model_name label is the served name)
    metrics_port = metrics.serve(args.metrics_port, args.host) if args.metrics_port else http_port
    info = InstanceInfo("router", instance_id, f"{host}:{grpc_server.bind()}", f"{host}:{metrics_port}",
                        extra={"http": f"{host}:{http_port}", "model": name})
    presence = InstancePresence(state, info)
    http_task = asyncio.get_running_loop().create_task(http.serve(sockets=[http_socket]))
    try:
        await grpc_server.start()
        await presence.start()
        await grpc_server.set_serving(True)
        log.info("router %s: HTTP :%d, gRPC :%d, model %s", instance_id, http_port, grpc_server.port, name)
        signal = asyncio.create_task(drain.wait_for_signal())
        done, _ = await asyncio.wait([http_task, signal], return_when=asyncio.FIRST_COMPLETED)
        if signal in done:
            # out of rotation (gRPC NOT_SERVING, /health 503), still serving what arrives meanwhile; the streams
            # in flight (HTTP and gRPC) run to their end, up to the timeout, then the servers stop
            api.draining = True
            await grpc_server.set_serving(False)
            await drain.until_idle(lambda: flow.num_running == 0, "router streams")
        else:
            signal.cancel()
    finally:
        drain.uninstall()
        http.should_exit = True
        await grpc_server.set_serving(False)
        await grpc_server.stop(grace=2.0)
        await asyncio.gather(http_task, return_exceptions=True)
        await presence.stop(deregister=True)
        await flow.close()
        await state.close()
        metrics.close()


def chat_settings(args: argparse.Namespace) -> ChatSettings:
    """The chat template and the parsers the flags name."""
    return ChatSettings(ChatTemplate.load(args.model, args.chat_template), tool_parser(args.tool_call_parser),
                        reasoning_parser(args.reasoning_parser), args.enable_auto_tool_choice)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging()
    sys.exit(run(lambda: serve(args)))
