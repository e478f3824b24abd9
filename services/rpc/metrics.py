"""Prometheus metrics of one service process: vLLM's names with a `pdserve:` prefix (docs/metrics.md, "Prometheus
metrics"), and the same figures again under vLLM's own names (`vllm:...{model_name=...}`) once the service
says which model it serves, so that vLLM's Grafana dashboards, llm-d's model-server scrapers and KEDA / HPA
rules written for vLLM read a pdserve instance unchanged.

    m = ServiceMetrics("kvstore", instance_id="kvstore-0")
    m.kv_cache_usage_perc.set(0.25)
    m.describe_model("glm-5.3", {"block_size": "64", "cache_dtype": "fp8_ds_mla"})  # the vllm: names
    port = m.serve(port=9100)          # GET http://host:9100/metrics

Each service owns one CollectorRegistry (never the process-global default) so tests can run
several services in one process, and a role gets only the metrics it can move.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server
from prometheus_client.core import GaugeMetricFamily

from services.rpc.net import raise_if_port_in_use

PREFIX = "pdserve:"
ROLES = ("router", "prefill", "decode", "kvstore")

# Latency buckets as vLLM uses them (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)

# an engine step and the engine thread's time between two steps (seconds)
STEP_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
                0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
DELAY_BUCKETS = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)


@dataclass(frozen=True)
class MetricDef:
    attr: str  # attribute on ServiceMetrics
    kind: type  # Counter | Gauge | Histogram
    doc: str
    roles: tuple[str, ...]
    buckets: tuple[float, ...] | None = None
    labels: tuple[str, ...] = ()

    @property
    def name(self) -> str:  # prometheus_client appends `_total` to counters itself
        return PREFIX + self.attr


ENGINES = ("prefill", "decode")
METRICS: tuple[MetricDef, ...] = (
    MetricDef("time_to_first_token_seconds", Histogram, "Time to first token.", ("router", "prefill"), TTFT_BUCKETS),
    MetricDef("time_per_output_token_seconds", Histogram, "Time per output token after the first.",
              ("router", "decode"), TPOT_BUCKETS),
    MetricDef("e2e_request_latency_seconds", Histogram, "End-to-end request latency.", ("router",), E2E_BUCKETS),
    MetricDef("request_migrations", Counter, "Requests moved to another instance after theirs failed or drained "
              "under them (re-prefilled with the tokens already streamed).", ("router",)),
    MetricDef("num_requests_running", Gauge, "Requests being computed.", ("router",) + ENGINES),
    MetricDef("num_requests_waiting", Gauge, "Requests queued.", ("router",) + ENGINES),
    MetricDef("engine_steps", Counter, "Engine steps that ran a forward.", ENGINES),
    MetricDef("engine_step_seconds", Counter, "Wall time of those steps (schedule + forward + update), summed.",
              ENGINES),
    MetricDef("engine_step_phase_seconds", Counter, "That wall time by phase (schedule, launch, device_wait, "
              "read_back, update; one-rank engines), summed.", ENGINES, labels=("phase",)),
    MetricDef("engine_step_phase_cpu_seconds", Counter, "The engine thread's CPU time in the phases it computes in "
              "(schedule, launch, update; one-rank engines), summed: the wall time above it is time the thread did "
              "not run (the interpreter lock, the OS scheduler, a blocking call).", ENGINES, labels=("phase",)),
    MetricDef("engine_step_duration_seconds", Histogram, "Wall time of each engine step that ran a forward (its tail: "
              "steps stretched by the other engine on a shared device, or by host work).", ENGINES, STEP_BUCKETS),
    MetricDef("engine_step_gap_seconds", Histogram, "The engine thread's time between one step's end and the next "
              "one's start while it had work (commands between steps, handing outputs over, waiting for the "
              "interpreter lock); not counted after an idle wait.", ENGINES, STEP_BUCKETS),
    MetricDef("token_delta_delay_seconds", Histogram, "Decode: from the engine step that produced a token delta "
              "to its gRPC message sent; router: from a decode message received to its chunk written to the client.",
              ("router", "decode"), DELAY_BUCKETS),
    MetricDef("kv_cache_usage_perc", Gauge, "Fraction of KV blocks in use (1 = full).", ENGINES + ("kvstore",)),
    MetricDef("prefix_cache_queries", Counter, "Prefix-cache queries, in tokens.", ("router", "kvstore") + ENGINES),
    MetricDef("prefix_cache_hits", Counter, "Prefix-cache hits, in tokens (an engine's include its host KV tier's).",
              ("router", "kvstore") + ENGINES),
    MetricDef("external_prefix_cache_queries", Counter, "Tokens of prefix blocks the device pool missed, looked "
              "up in the engine's host KV tier (--kv-offloading-size).", ENGINES),
    MetricDef("external_prefix_cache_hits", Counter, "Tokens the host KV tier served (loaded back to the device).",
              ENGINES),
    MetricDef("kv_offload_store_bytes", Counter, "Bytes copied from the device KV pool into the host KV tier.",
              ENGINES),
    MetricDef("kv_offload_load_bytes", Counter, "Bytes copied from the host KV tier back into the device pool.",
              ENGINES),
    MetricDef("kv_offload_cpu_cache_usage_perc", Gauge, "Fraction of the host KV tier's blocks holding a block "
              "(1 = full).", ENGINES),
    MetricDef("spec_decode_num_draft_tokens", Counter, "Draft tokens proposed.", ("decode",)),
    MetricDef("spec_decode_num_accepted_tokens", Counter, "Draft tokens accepted.", ("decode",)),
    MetricDef("spec_decode_num_full_rounds", Counter, "Verification rounds of a request with all its draft tokens "
              "(the engine's MTP acceptance length = emitted / rounds).", ("decode",)),
    MetricDef("spec_decode_num_full_round_tokens", Counter, "Tokens those rounds emitted (accepted drafts + 1 "
              "each).", ("decode",)),
    MetricDef("nixl_bytes_transferred", Counter, "Bytes moved by NIXL transfers this process initiated.",
              ENGINES),
    MetricDef("nixl_num_failed_transfers", Counter, "NIXL transfers that failed or passed their deadline.",
              ENGINES),
    MetricDef("kv_lease_expired", Counter, "KV leases/reservations that expired before release.",
              ("prefill", "kvstore")),
    MetricDef("hisparse_hits", Counter, "HiSparse top-k rows found in the device hot buffer.", ("decode",)),
    MetricDef("hisparse_misses", Counter, "HiSparse top-k rows copied from host.", ("decode",)),
    MetricDef("hisparse_h2d_bytes", Counter, "HiSparse host-to-device bytes.", ("decode",)),
    MetricDef("hisparse_device_blocks_in_use", Gauge, "HiSparse device pages held by requests (0 when idle).",
              ("decode",)),
    MetricDef("hisparse_requests_placed", Gauge, "Requests holding HiSparse device pages or hot-buffer rows.",
              ("decode",)),
    MetricDef("kvstore_num_blocks", Gauge, "Blocks in the host KV pool.", ("kvstore",)),
    MetricDef("kvstore_num_stored_blocks", Gauge, "Committed (readable) blocks in the pool.", ("kvstore",)),
    MetricDef("kvstore_evictions", Counter, "Blocks evicted (LRU) to make room.", ("kvstore",)),
    MetricDef("kv_pull_failures", Counter, "KV pull attempts that failed or passed their deadline.", ("decode",)),
    MetricDef("kv_pull_not_intact", Counter, "KV pulls the prefill could not confirm (lease expired, pages "
              "reused): never decoded from.", ("decode",)),
    MetricDef("kvstore_failures", Counter, "kvstore loads/offloads that failed or timed out (recomputed instead).",
              ("prefill",)),
    MetricDef("weight_bytes", Gauge, "Bytes of model weights held by each engine rank, by dtype.", ENGINES,
              labels=("rank", "dtype")),
    MetricDef("kv_pull_recomputes", Counter, "Requests whose prompt KV was computed locally instead of pulled.",
              ("decode",)),
    MetricDef("dp_rank_requests", Counter, "Requests admitted, by DP rank of the decode engine (0 for one rank).",
              ("decode",), labels=("dp_rank",)),
    MetricDef("dp_steps", Counter, "Steps of a DP x EP decode group by kind: planned (fixed shapes, static dispatch, "
              "captured) or dynamic (a prompt chunk or a batch past the capture sizes).", ("decode",),
              labels=("kind",)),
)


# Our metrics that vLLM exports under the same meaning: re-exported as `vllm:<name>` with a model_name label
VLLM_NAMES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries",
              "prefix_cache_hits", "time_to_first_token_seconds", "time_per_output_token_seconds",
              "e2e_request_latency_seconds", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
VLLM_PREFIX = "vllm:"


class VllmNames:
    """A collector that re-exports the service's vLLM-named figures as `vllm:<name>{model_name=..., engine="0"}`
    (vLLM's label set; one engine per process here), plus
    the two info gauges llm-d's scrapers read: `vllm:cache_config_info` (the KV cache's configuration as
    labels) and `vllm:lora_requests_info` (no LoRA adapters here: empty adapter lists, max_lora 0)."""

    def __init__(self, metrics: ServiceMetrics, model_name: str, cache: dict[str, str]):
        self.metrics, self.model_name, self.cache = metrics, model_name, dict(cache)
        self.started = time.time()

    def collect(self):
        for name in VLLM_NAMES:
            metric = getattr(self.metrics, name, None)
            if metric is None:
                continue
            for family in metric.collect():
                family.name = VLLM_PREFIX + family.name.removeprefix(PREFIX)
                family.samples = [s._replace(name=VLLM_PREFIX + s.name.removeprefix(PREFIX),
                                             labels={**s.labels, "model_name": self.model_name, "engine": "0"})
                                  for s in family.samples]
                yield family
        info = GaugeMetricFamily(VLLM_PREFIX + "cache_config_info", "Information of the KV cache configuration.",
                                 labels=sorted(self.cache))
        info.add_metric([self.cache[k] for k in sorted(self.cache)], 1.0)
        yield info
        lora = GaugeMetricFamily(VLLM_PREFIX + "lora_requests_info", "Running stats on LoRA requests.",
                                 labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        lora.add_metric(["0", "", ""], self.started)
        yield lora


class ServiceMetrics:
    """The metrics of one service role, registered on a private registry."""

    def __init__(self, role: str, instance_id: str = "", registry: CollectorRegistry | None = None):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.role = role
        self.registry = registry or CollectorRegistry()
        self._server = None
        Info(PREFIX + "service", "Which service this is.", registry=self.registry).info(
            {"role": role, "instance_id": instance_id})
        for m in METRICS:
            if role in m.roles:
                kwargs = {"buckets": m.buckets} if m.buckets else {}
                if m.labels:
                    kwargs["labelnames"] = m.labels
                setattr(self, m.attr, m.kind(m.name, m.doc, registry=self.registry, **kwargs))

    def describe_model(self, model_name: str, cache: dict[str, str] | None = None) -> None:
        """Export the vLLM-named figures too (`VllmNames`), labelled with the served model's name; `cache`: the
        labels of `vllm:cache_config_info` (block_size, cache_dtype, num_gpu_blocks, ...). Once per service."""
        self.registry.register(VllmNames(self, model_name, {k: str(v) for k, v in (cache or {}).items()}))

    def serve(self, port: int = 0, host: str = "127.0.0.1") -> int:
        """Serve /metrics over HTTP from a daemon thread; returns the bound port (0 = any free)."""
        try:
            self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise_if_port_in_use(exc, "metrics", host, port)
            raise
        return self._server.server_port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
