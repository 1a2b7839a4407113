"""Every Prometheus metric splitserve exports, in one place (names are an API: dashboards, the
autoscaler and alerts read them). The router records the edge latencies and the TTFT stage split;
workers record their engine gauges. All carry the labels `service`, `pool`, `model`."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "splitserve_"
LABELS = ("service", "pool", "model")

# Millisecond-scale latencies up to long generations.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    20.0,
    30.0,
    60.0,
    120.0,
)
TOKEN_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
    2.0,
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512)


@dataclass
class RouterMetrics:
    """Edge metrics measured by the router, as the client experiences them."""

    ttft: Histogram
    tpot: Histogram
    itl: Histogram
    e2e: Histogram
    requests: Counter  # + label status: ok | error | abort | rejected | no_capacity | stalled
    prompt_tokens: Counter
    generation_tokens: Counter
    # The TTFT stage split (what no single engine exports).
    prefill_queue: Histogram
    prefill_compute: Histogram
    kv_transfer: Histogram
    kv_transfer_bytes: Counter
    decode_admission: Histogram
    requests_in_flight: Gauge


def router_metrics(registry: CollectorRegistry) -> RouterMetrics:
    def hist(name: str, doc: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Histogram:
        return Histogram(PREFIX + name, doc, LABELS, buckets=buckets, registry=registry)

    def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
        return Counter(PREFIX + name, doc, LABELS + extra, registry=registry)

    return RouterMetrics(
        ttft=hist("time_to_first_token_seconds", "Time from request arrival to first token."),
        tpot=hist(
            "time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            TOKEN_LATENCY_BUCKETS,
        ),
        itl=hist(
            "inter_token_latency_seconds",
            "Time between consecutive tokens.",
            TOKEN_LATENCY_BUCKETS,
        ),
        e2e=hist("e2e_request_latency_seconds", "Time from request arrival to last token."),
        requests=counter("requests", "Requests finished, by status.", ("status",)),
        prompt_tokens=counter("prompt_tokens", "Prompt tokens received."),
        generation_tokens=counter("generation_tokens", "Tokens generated."),
        prefill_queue=hist("prefill_queue_seconds", "TTFT stage: waiting in the prefill queue."),
        prefill_compute=hist("prefill_compute_seconds", "TTFT stage: prefill forward passes."),
        kv_transfer=hist("kv_transfer_seconds", "KV cache transfer from prefill to decode."),
        kv_transfer_bytes=counter("kv_transfer_bytes", "KV cache bytes moved to decode workers."),
        decode_admission=hist(
            "decode_admission_seconds", "TTFT stage: reserving KV blocks on a decode worker."
        ),
        requests_in_flight=Gauge(
            PREFIX + "router_requests_in_flight",
            "Requests the router is serving now.",
            LABELS,
            registry=registry,
        ),
    )


@dataclass
class WorkerMetrics:
    """Engine facts exported by prefill, decode and colocated workers."""

    requests_running: Gauge
    requests_waiting: Gauge
    batch_size: Histogram  # observed sequences per iteration
    iteration_tokens: Histogram
    max_batch_size: Gauge  # configured limit
    max_batch_tokens: Gauge  # configured limit
    kv_cache_usage_ratio: Gauge
    kv_blocks_free: Gauge
    kv_blocks_total: Gauge
    queued_prefill_tokens: Gauge
    preemptions: Counter
    requests_rejected: Counter  # + label reason
    prefix_cache_hits: Counter
    prefix_cache_queries: Counter
    prompt_tokens_processed: Counter  # prefill throughput, learned by the autoscaler
    generation_tokens_processed: Counter
    draining: Gauge
    busy_seconds: Counter  # time in forward passes: utilization = rate(busy) per replica
    draft_tokens: Counter  # speculative decoding: drafts verified
    accepted_tokens: Counter  # ... and accepted


def worker_metrics(registry: CollectorRegistry) -> WorkerMetrics:
    def gauge(name: str, doc: str) -> Gauge:
        return Gauge(PREFIX + name, doc, LABELS, registry=registry)

    def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
        return Counter(PREFIX + name, doc, LABELS + extra, registry=registry)

    return WorkerMetrics(
        requests_running=gauge("requests_running", "Sequences being computed."),
        requests_waiting=gauge("requests_waiting", "Sequences queued."),
        batch_size=Histogram(
            PREFIX + "batch_size",
            "Observed sequences per engine iteration.",
            LABELS,
            buckets=BATCH_BUCKETS,
            registry=registry,
        ),
        iteration_tokens=Histogram(
            PREFIX + "iteration_tokens",
            "Tokens computed per engine iteration.",
            LABELS,
            buckets=(1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384),
            registry=registry,
        ),
        max_batch_size=gauge("max_batch_size", "Configured limit: sequences per iteration."),
        max_batch_tokens=gauge(
            "max_batch_tokens", "Configured limit: prefill tokens per iteration."
        ),
        kv_cache_usage_ratio=gauge("kv_cache_usage_ratio", "Fraction of KV blocks in use."),
        kv_blocks_free=gauge("kv_blocks_free", "Free KV cache blocks."),
        kv_blocks_total=gauge("kv_blocks_total", "KV cache blocks in total."),
        queued_prefill_tokens=gauge(
            "queued_prefill_tokens", "Prompt tokens waiting to be prefilled."
        ),
        preemptions=counter("preemptions", "Sequences preempted for lack of KV blocks."),
        requests_rejected=counter(
            "requests_rejected", "Calls refused (each retry counts), by reason.", ("reason",)
        ),
        prefix_cache_hits=counter("prefix_cache_hits", "Prompt blocks found in the prefix cache."),
        prefix_cache_queries=counter(
            "prefix_cache_queries", "Prompt blocks looked up in the prefix cache."
        ),
        prompt_tokens_processed=counter("prompt_tokens_processed", "Prompt tokens prefilled."),
        generation_tokens_processed=counter(
            "generation_tokens_processed", "Tokens generated by decode iterations."
        ),
        draining=gauge("draining", "1 while the worker drains before exit."),
        busy_seconds=counter(
            "busy_seconds", "Seconds the engine spent in forward passes and sampling."
        ),
        draft_tokens=counter(
            "spec_draft_tokens", "Speculative decoding: draft tokens verified in decode passes."
        ),
        accepted_tokens=counter(
            "spec_accepted_tokens", "Speculative decoding: draft tokens accepted (emitted)."
        ),
    )
