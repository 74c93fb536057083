"""Prometheus metrics of one app, on a registry of its own (never the global one).

Counters, not ratios: a dashboard derives reuse rates from them. Request-side counters are
incremented by the app; the store's per-tier counters, the vision encoder's calls, live
sessions and the queue are read from the runtime when scraped.

Not here: what the counters mean for the store (``cache/store/stats.py`` documents them).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from agent.adapters.vision import encoder_calls
from agent.engine.runtime import Runtime

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RESIDUAL_BUCKETS = (1e-6, 1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 1e-1)
STORE_COUNTERS = (
    "hits",
    "misses",
    "bytes_written",
    "bytes_read",
    "evictions",
    "promotions",
    "demotions",
    "corrupt_dropped",
    "misfiled",
)


class RuntimeCollector(Collector):
    """Reads the runtime's own counters at scrape time."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def collect(self) -> Iterator[Metric]:
        stats = self.runtime.store.stats()
        for name in STORE_COUNTERS:
            family = CounterMetricFamily(
                f"kamera_store_{name}", f"Store {name.replace('_', ' ')} per tier", labels=["tier"]
            )
            for tier in stats.tiers:
                family.add_metric([tier.tier], getattr(tier, name))
            yield family
        in_use = GaugeMetricFamily("kamera_store_bytes_in_use", "Bytes held per store tier", labels=["tier"])
        budget = GaugeMetricFamily("kamera_store_budget_bytes", "Byte budget per store tier", labels=["tier"])
        entries = GaugeMetricFamily("kamera_store_entries", "Entries per store tier", labels=["tier"])
        for tier in stats.tiers:
            in_use.add_metric([tier.tier], tier.bytes_in_use)
            budget.add_metric([tier.tier], tier.budget_bytes)
            entries.add_metric([tier.tier], tier.entries)
        yield in_use
        yield budget
        yield entries
        writes = CounterMetricFamily(
            "kamera_store_background_writes",
            "Disk writes handed to the background writer",
            labels=["outcome"],
        )
        writes.add_metric(["queued"], stats.writes_queued)
        writes.add_metric(["dropped"], stats.writes_dropped)
        yield writes
        yield GaugeMetricFamily("kamera_store_write_queue", "Disk writes waiting", value=stats.write_queue)
        yield from _shared_metrics(self.runtime)
        yield CounterMetricFamily(
            "kamera_vision_encoder_calls",
            "Vision encoder runs (one per image not already encoded)",
            value=encoder_calls(self.runtime.adapter),
        )
        yield CounterMetricFamily(
            "kamera_sessions_expired",
            "Sessions dropped after idling",
            value=self.runtime.sessions.expired_total,
        )
        yield GaugeMetricFamily("kamera_sessions", "Live agent sessions", value=len(self.runtime.sessions))
        yield GaugeMetricFamily(
            "kamera_queue_jobs",
            "Model jobs admitted (running and waiting)",
            value=self.runtime.worker.pending,
        )


def _shared_metrics(runtime: Runtime) -> Iterator[Metric]:
    """The shared tier's breaker and background writes; nothing without one."""
    health = runtime.store.shared_health()
    if health is None:
        return
    up = GaugeMetricFamily(
        "kamera_store_up", "1 while the tier's circuit breaker lets calls through", labels=["tier"]
    )
    up.add_metric(["redis"], 0 if health.state == "open" else 1)
    yield up
    queued = GaugeMetricFamily(
        "kamera_store_shared_write_queue", "Writes waiting for the shared tier", labels=["tier"]
    )
    queued.add_metric(["redis"], health.queued)
    yield queued
    writes = CounterMetricFamily(
        "kamera_store_shared_writes_lost",
        "Writes not stored: dropped (queue full, tier away) or refused (full, too large)",
        labels=["tier", "why"],
    )
    writes.add_metric(["redis", "dropped"], health.writes_dropped)
    writes.add_metric(["redis", "refused"], health.writes_refused)
    yield writes


class Metrics:
    def __init__(self, runtime: Runtime) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kamera_requests", "HTTP requests by route and status", ["route", "method", "status"], registry=r
        )
        self.prompt_tokens = Counter("kamera_prompt_tokens", "Chat prompt tokens", registry=r)
        self.completion_tokens = Counter("kamera_completion_tokens", "Generated tokens", registry=r)
        self.reused_tokens = Counter(
            "kamera_prompt_tokens_reused",
            "Chat prompt tokens whose cached KV the answer was computed from: by exact prefix, or by "
            "content (relocated); moved KV abandoned after a fallback is counted as abandoned",
            ["how"],
            registry=r,
        )
        self.reuse = Counter(
            "kamera_prompt_tokens_by_reuse",
            "Chat prompt tokens by reuse mode and what happened to them: reused exactly, reused by "
            "content and repaired, reused by content as stored, recomputed, and prefilled again "
            "when a close call on repaired KV moved decoding to exact KV, or prefilled exact for a "
            "repair given up (fallback; then the same tokens as recomputed)",
            ["mode", "how"],
            registry=r,
        )
        self.served = Counter(
            "kamera_requests_served",
            "Chat requests by how they were answered: on exact KV only (prefix), on moved KV (moved), "
            "on exact KV after a close call on moved KV (fallback), on exact KV for a repair given "
            "up before decoding (given_up)",
            ["mode", "served"],
            registry=r,
        )
        self.prefilled_tokens = Counter(
            "kamera_prompt_tokens_prefilled", "Chat prompt tokens prefilled", registry=r
        )
        self.rotated_tokens = Counter(
            "kamera_tokens_rotated", "Reused tokens moved by rotation", ["endpoint"], registry=r
        )
        self.tier_tokens = Counter(
            "kamera_prompt_tokens_from_tier",
            "Reused chat prompt tokens whose KV came from a shared tier this request",
            ["tier"],
            registry=r,
        )
        self.lost_entries = Counter(
            "kamera_prompt_cache_lost_entries", "Planned reuse whose store entry was gone", registry=r
        )
        self.session_steps = Counter("kamera_session_steps", "Agent session steps", registry=r)
        self.session_tokens = Counter(
            "kamera_session_tokens", "Session step tokens, reused or prefilled", ["how"], registry=r
        )
        self.rejected = Counter(
            "kamera_rejected_requests", "Requests refused before running", ["reason"], registry=r
        )
        self.cancelled = Counter("kamera_cancelled_requests", "Requests whose client went away", registry=r)
        self.ttft = Histogram(
            "kamera_time_to_first_token_seconds",
            "From request arrival to the first generated token",
            ["endpoint"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.repair_residual = Histogram(
            "kamera_repair_residual",
            "Deviation from the new context left in reused pieces after repair (relative, layer 1); "
            "the guard's margin scales with its square root (--repair-residual-unit)",
            buckets=RESIDUAL_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "kamera_queue_wait_seconds", "Time waiting for the model thread", buckets=TTFT_BUCKETS, registry=r
        )
        r.register(RuntimeCollector(runtime))

    def render(self) -> bytes:
        return generate_latest(self.registry)
