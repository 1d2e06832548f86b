"""Prometheus metrics (`GET /metrics`) on a registry of one app's own (never the global default).

Gauges and engine counters are read at scrape time from `engine.snapshot()` and `engine.counters`,
so they never drift from admission's own numbers; the server counts requests and observes latencies.

Beside helexa's own names, the gauges of the Gateway API Inference Extension's model-server protocol
are exported under vLLM's names and semantics, so an endpoint picker configured for vLLM reads a helexa
replica unchanged (`VLLM_METRIC_NAMES`), each from the same snapshot as `/v1/admission`:

- `vllm:num_requests_waiting` = `queue_depth` (waiting for admission, preempted ones included);
- `vllm:num_requests_running` = `in_flight` (holding a reservation);
- `vllm:kv_cache_usage_perc` = (blocks in use + blocks reserved but not yet allocated) / total, a 0-1
  fraction. Every in-use block is charged to exactly one reservation (or kept for its sharers as an
  orphan, which is reserved too), so this is exactly `blocks_reserved / blocks_total`: a replica whose
  admitted requests have claimed the pool reads as full before they have written it. Cached, evictable
  blocks count as free, as vLLM counts them;
- `vllm:cache_config_info{block_size, num_gpu_blocks, ...}` = 1 (the pool's shape, for the picker's
  prefix scorers); `vllm:lora_requests_info{max_lora="0", ...}` = start time (no adapters are served).

`helexa_admission_estimated_wait_seconds` is what no engine gives a picker: how long a request of the
median recent size (`RequestSizes`) would wait for admission if it arrived now.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from helexa.admission import REJECTION_REASONS
from helexa.engine import MODEL_STATES, ServingEngine
from helexa.server.backend import median_wait

# Every metric the server exports (counters with their `_total` sample suffix).
METRIC_NAMES = (
    "helexa_kv_blocks_total", "helexa_kv_blocks_free", "helexa_kv_blocks_reserved", "helexa_kv_blocks_available",
    "helexa_kv_blocks_cached", "helexa_kv_blocks_in_use", "helexa_kv_blocks_retained",
    "helexa_requests_in_flight", "helexa_queue_depth", "helexa_model_state",
    "helexa_kv_cache_usage_ratio", "helexa_prefill_chunk_tokens",
    "helexa_admission_rejected_total", "helexa_requests_total", "helexa_prompt_tokens_total",
    "helexa_generation_tokens_total", "helexa_device_faults_total", "helexa_model_reloads_total",
    "helexa_prefix_cache_hit_tokens_total", "helexa_prefix_cache_query_tokens_total",
    "helexa_prefix_cache_evictions_total", "helexa_preemptions_total", "helexa_recomputed_tokens_total",
    "helexa_admission_wait_seconds", "helexa_time_to_first_token_seconds", "helexa_request_duration_seconds",
    "helexa_admission_estimated_wait_seconds", "helexa_kv_event_batches_published_total",
    "helexa_kv_event_batches_dropped_total", "helexa_spec_drafts_total", "helexa_spec_draft_tokens_total",
    "helexa_spec_accepted_tokens_total",
    "helexa_kv_blocks_host", "helexa_kv_blocks_disk",
    "helexa_kv_tier_blocks", "helexa_kv_tier_bytes", "helexa_kv_tier_capacity_bytes", "helexa_kv_tier_hits_total",
    "helexa_kv_tier_loads_total", "helexa_kv_tier_writes_total", "helexa_kv_tier_drops_total",
    "helexa_kv_tier_failures_total",
)  # fmt: skip
# The model-server protocol's metrics, under vLLM's names (the `model_name` label as vLLM sets it).
VLLM_METRIC_NAMES = (
    "vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:cache_config_info",
    "vllm:lora_requests_info",
)  # fmt: skip

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_WAIT_BUCKETS = (0.0, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600)
# The server's own histograms: admission wait, time to first token, request duration.
_HISTOGRAMS = (
    ("helexa_admission_wait_seconds", "Seconds from submit to KV reservation.", _WAIT_BUCKETS),
    ("helexa_time_to_first_token_seconds", "Seconds from request to first token.", _LATENCY_BUCKETS),
    ("helexa_request_duration_seconds", "Seconds from request to its last byte.", _LATENCY_BUCKETS),
)

# snapshot key -> (gauge name, help)
_SNAPSHOT_GAUGES = (
    ("blocks_total", "helexa_kv_blocks_total", "KV blocks in the pool (fixed while loaded)."),
    ("blocks_empty", "helexa_kv_blocks_free", "KV blocks empty (on the free list)."),
    ("blocks_reserved", "helexa_kv_blocks_reserved", "KV blocks reserved (by admitted requests, and for sharers)."),
    ("blocks_available", "helexa_kv_blocks_available", "KV blocks the next admission may reserve (total - reserved)."),
    ("blocks_cached", "helexa_kv_blocks_cached", "KV blocks cached, held by no request (evictable)."),
    ("blocks_in_use", "helexa_kv_blocks_in_use", "KV blocks held by running requests."),
    ("blocks_retained", "helexa_kv_blocks_retained", "Cached KV blocks retained for agent sessions (evicted last)."),
    ("in_flight", "helexa_requests_in_flight", "Sequences holding a reservation."),
    ("queue_depth", "helexa_queue_depth", "Requests waiting for admission."),
    ("prefill_chunk_tokens", "helexa_prefill_chunk_tokens", "Largest prefill chunk while requests decode (tokens)."),
    ("blocks_host", "helexa_kv_blocks_host", "KV blocks kept in the host-memory tier below the pool."),
    ("blocks_disk", "helexa_kv_blocks_disk", "KV blocks kept in the disk tier below the pool."),
)
# a tier's field in the snapshot's `kv_tiers` -> (metric, help, gauge or counter), each labelled `tier`
_TIER_METRICS = (
    ("blocks", "helexa_kv_tier_blocks", "KV blocks the tier holds.", GaugeMetricFamily),
    ("bytes", "helexa_kv_tier_bytes", "Bytes the tier's blocks take.", GaugeMetricFamily),
    ("capacity_bytes", "helexa_kv_tier_capacity_bytes", "The tier's byte budget.", GaugeMetricFamily),
    ("hits", "helexa_kv_tier_hits", "Blocks a starting request found in the tier.", CounterMetricFamily),
    ("loads", "helexa_kv_tier_loads", "Blocks read back from the tier into the pool.", CounterMetricFamily),
    ("writes", "helexa_kv_tier_writes", "Blocks written into the tier.", CounterMetricFamily),
    ("drops", "helexa_kv_tier_drops", "Blocks that left the tier (to the next one, or for good).", CounterMetricFamily),
    ("failures", "helexa_kv_tier_failures", "Tier reads or writes that failed or did not verify.", CounterMetricFamily),
)

# snapshot key -> (counter name, help): speculative decoding's totals (zero while it is off).
_SNAPSHOT_COUNTERS = (
    ("spec_drafts", "helexa_spec_drafts", "Speculative drafts verified."),
    ("spec_draft_tokens", "helexa_spec_draft_tokens", "Draft tokens verified (speculative decoding)."),
    ("spec_accepted_tokens", "helexa_spec_accepted_tokens", "Draft tokens kept: each one a decode step saved."),
)

# engine counter attribute -> (counter name, help).
_ENGINE_COUNTERS = (
    ("prompt_tokens", "helexa_prompt_tokens", "Prompt tokens prefilled."),
    ("generation_tokens", "helexa_generation_tokens", "Tokens generated."),
    ("device_faults", "helexa_device_faults", "Device faults the engine caught."),
    ("model_reloads", "helexa_model_reloads", "Model reloads after a device fault."),
    ("prefix_cache_query_tokens", "helexa_prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hit_tokens", "helexa_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache."),
    ("prefix_cache_evictions", "helexa_prefix_cache_evictions", "Cached KV blocks evicted to make room."),
    ("preemptions", "helexa_preemptions", "Requests preempted to let older ones grow (policy adaptive)."),
    ("recomputed_tokens", "helexa_recomputed_tokens", "Tokens computed again after a preemption dropped their K/V."),
)


class _EngineCollector(Collector):
    """Reads the engine's snapshot and counters at each scrape."""

    def __init__(self, engine: ServingEngine) -> None:
        self._engine = engine
        self._started = time.time()

    def collect(self) -> Iterator[Metric]:
        snap = self._engine.snapshot()
        yield from self._model_server_protocol(snap)
        yield from self._cluster()
        for key, name, doc in _SNAPSHOT_GAUGES:
            yield GaugeMetricFamily(name, doc, value=snap[key])
        for key, name, doc in _SNAPSHOT_COUNTERS:
            yield CounterMetricFamily(name, doc, value=snap[key])
        total = snap["blocks_total"]
        yield GaugeMetricFamily(
            "helexa_kv_cache_usage_ratio",
            "Reserved KV blocks / total (0-1).",
            value=snap["blocks_reserved"] / total if total else 0.0,
        )
        state = GaugeMetricFamily("helexa_model_state", "1 for the model's current state.", labels=["state"])
        for name in MODEL_STATES:
            state.add_metric([name], 1.0 if snap["model_state"] == name else 0.0)
        yield state
        rejected = CounterMetricFamily(
            "helexa_admission_rejected", "Requests admission rejected, by reason.", labels=["reason"]
        )
        for reason in REJECTION_REASONS:
            rejected.add_metric([reason], snap["rejected"].get(reason, 0))
        yield rejected
        counters = self._engine.counters
        for attr, name, doc in _ENGINE_COUNTERS:
            yield CounterMetricFamily(name, doc, value=getattr(counters, attr))
        for field, name, doc, kind in _TIER_METRICS:
            family = kind(name, doc, labels=["tier"])
            for tier, stats in snap["kv_tiers"].items():
                family.add_metric([tier], stats[field])
            yield family

    def _model_server_protocol(self, snap: dict[str, Any]) -> Iterator[Metric]:
        """vLLM's names for the gateway's endpoint picker, from the same snapshot as `/v1/admission` (module doc)."""
        engine, label = self._engine, {"model_name": self._engine.model_name}
        total = snap["blocks_total"]
        gauges = (
            ("vllm:num_requests_waiting", "Requests waiting for admission (queued, or preempted to resume).",
             snap["queue_depth"]),
            ("vllm:num_requests_running", "Requests holding a KV reservation (running).", snap["in_flight"]),
            ("vllm:kv_cache_usage_perc", "KV blocks in use or reserved but not yet allocated, over total (0-1).",
             snap["blocks_reserved"] / total if total else 0.0),
        )  # fmt: skip
        for name, doc, value in gauges:
            family = GaugeMetricFamily(name, doc, labels=list(label))
            family.add_metric(list(label.values()), value)
            yield family
        config = engine.config
        info = {
            "block_size": str(snap["block_size"]),
            "num_gpu_blocks": str(total),
            "cache_dtype": config.kv_cache_dtype,
            "enable_prefix_caching": str(config.prefix_cache),
        }
        cache = GaugeMetricFamily(
            "vllm:cache_config_info", "The KV cache's configuration (value 1).", labels=list(info)
        )
        cache.add_metric(list(info.values()), 1.0)
        yield cache
        lora = {"max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""}
        family = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "LoRA adapters: none are served (value: when that was last true).",
            labels=list(lora),
        )
        family.add_metric(list(lora.values()), self._started)
        yield family

    def _cluster(self) -> Iterator[Metric]:
        """The estimated wait of a median-size request, and the KV event stream's batch counters."""
        engine = self._engine
        wait = median_wait(engine)
        yield GaugeMetricFamily(
            "helexa_admission_estimated_wait_seconds",
            "Seconds a request of the median recent size would wait for admission if it arrived now.",
            value=wait,
        )
        events = engine.kv_events
        yield CounterMetricFamily(
            "helexa_kv_event_batches_published", "KV event batches sent (--kv-events-endpoint).",
            value=events.published if events is not None else 0,
        )  # fmt: skip
        yield CounterMetricFamily(
            "helexa_kv_event_batches_dropped",
            "KV event batches dropped because the publisher's queue was full (a full resync follows).",
            value=events.dropped if events is not None else 0,
        )


class ServerMetrics:
    """The metrics of one server: a private `CollectorRegistry`, the engine collector, and the server's own.

    `count_request(status)` once per generation request (by the HTTP status it got);
    `observe_admission_wait`, `observe_ttft`, `observe_duration` in seconds; `render()` the text format.
    """

    def __init__(self, engine: ServingEngine) -> None:
        self.registry = registry = CollectorRegistry()
        registry.register(_EngineCollector(engine))
        self._requests = Counter(
            "helexa_requests", "Generation requests, by HTTP status.", ["status"], registry=registry
        )
        self._admission_wait, self._ttft, self._duration = (
            Histogram(name, doc, buckets=buckets, registry=registry) for name, doc, buckets in _HISTOGRAMS
        )

    def count_request(self, status: int) -> None:
        """One generation request answered with HTTP `status`."""
        self._requests.labels(status=str(status)).inc()

    def observe_admission_wait(self, seconds: float) -> None:
        """A choice waited `seconds` for its reservation."""
        self._admission_wait.observe(max(0.0, seconds))

    def observe_ttft(self, seconds: float) -> None:
        """A request's first token came `seconds` after it arrived."""
        self._ttft.observe(max(0.0, seconds))

    def observe_duration(self, seconds: float) -> None:
        """A request took `seconds` from arrival to its last byte."""
        self._duration.observe(max(0.0, seconds))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
