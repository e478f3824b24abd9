"""The router's HTTP API in-process (no Redis, no engines): the real RouterAPI and Flow with the prefill
call replaced by the prefill service's own request check and a one-token answer. Every value the router
lets through therefore also passes the real wire conversion (`sampling_to_proto`) and the engine
services' checks; a value that breaks either shows up as a 5xx here."""

from __future__ import annotations

from fastapi.testclient import TestClient

from engine.config.model_config import ModelConfig
from engine.frontend.tokenizer import Tokenizer
from proto.pdserve.v1 import common_pb2, prefill_pb2
from services.router.chat_request import ChatSettings
from services.router.chat_template import ChatTemplate
from services.router.flow import Flow
from services.router.http_api import RouterAPI
from services.router.requests import Limits
from services.rpc.bounds import ModelLimits, check_generate_proto
from services.rpc.metrics import ServiceMetrics
from tests.helpers import ROOT
from tests.helpers.fake_flow import StubRouting

MODEL = "tiny-code"
TINY_CODE = ROOT / "checkpoints" / "tiny-code"


class CheckingFlow(Flow):
    """Flow whose prefill checks the wire request as the prefill service does and answers one token."""

    def __init__(self, tok: Tokenizer, limits: Limits):
        super().__init__(StubRouting(), tok, ServiceMetrics("router", "test"))
        self.engine_limits = ModelLimits(limits.max_model_len, limits.vocab_size)
        self.sent: list[common_pb2.GenerateRequest] = []

    async def _prefill(self, g, hashes, stats) -> prefill_pb2.PrefillResponse:
        check_generate_proto(g, self.engine_limits)
        self.sent.append(g)
        return prefill_pb2.PrefillResponse(first=common_pb2.TokenDelta(
            token_ids=[g.prompt_token_ids[-1]], finish_reason=common_pb2.FINISH_REASON_LENGTH))


def make_client(max_n: int = 4, max_body_bytes: int = 8 << 20) -> tuple[TestClient, CheckingFlow, Limits]:
    cfg = ModelConfig.from_pretrained(str(TINY_CODE))
    tok = Tokenizer(TINY_CODE)
    limits = Limits(max_model_len=cfg.max_position_embeddings, vocab_size=cfg.vocab_size, max_n=max_n)
    flow = CheckingFlow(tok, limits)
    api = RouterAPI(flow, limits, MODEL, flow.metrics, max_body_bytes=max_body_bytes,
                    chat=ChatSettings(ChatTemplate.load(TINY_CODE)))
    return TestClient(api.build(), raise_server_exceptions=False), flow, limits
