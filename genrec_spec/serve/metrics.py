"""Prometheus metrics of the service, in a registry of its own (one per app, so several apps in
one process, e.g. tests, do not share counts).

- ``genrec_spec_request_seconds{path, status}``: request latency histogram, from the first byte
  read to the response (queue wait and model time included);
- ``genrec_spec_batch_size{kind}``: requests per model call (kind recommend or generate);
- ``genrec_spec_target_passes_total{kind, method}``: sequential forward passes of the target
  (the recommender's backbone, or the LLM), per decoder or generation method;
- ``genrec_spec_model_calls_total{kind, method}``: model calls, to divide by;
- ``genrec_spec_mean_accepted_length{kind, method}``: since start, for generation the tokens
  each row emits per target forward (plain decoding: 1), for recommendation the code levels
  fixed per sequential target pass (beam search: 1; one-pass decoders: all levels);
- ``genrec_spec_errors_total{kind}``: refused or failed requests by kind (bad_request,
  invalid_request, unauthorized, not_found, too_large, overloaded, timeout, unavailable,
  internal);
- ``genrec_spec_queue_waiting{kind}``: requests waiting for the model now;
- ``genrec_spec_history_rows_total{how}``: recommendation histories by how the history cache
  served them (exact: no history pass, extended: only the new items encoded, missed).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ServiceMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.latency = Histogram(
            "genrec_spec_request_seconds",
            "request latency",
            ["path", "status"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "genrec_spec_batch_size",
            "requests per model call",
            ["kind"],
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.target_passes = Counter(
            "genrec_spec_target_passes",
            "sequential target forward passes",
            ["kind", "method"],
            registry=r,
        )
        self.calls = Counter(
            "genrec_spec_model_calls", "model calls", ["kind", "method"], registry=r
        )
        self.accepted_length = Gauge(
            "genrec_spec_mean_accepted_length",
            "mean accepted length since start (tokens per row-step, or code levels per pass)",
            ["kind", "method"],
            registry=r,
        )
        self.errors = Counter(
            "genrec_spec_errors", "refused or failed requests", ["kind"], registry=r
        )
        self.waiting = Gauge(
            "genrec_spec_queue_waiting", "requests waiting for the model", ["kind"], registry=r
        )
        self.history_rows = Counter(
            "genrec_spec_history_rows",
            "histories by how the cache served them",
            ["how"],
            registry=r,
        )
        # Running sums behind the mean accepted length: (accepted units, steps) per label pair.
        self._accepted: dict[tuple[str, str], tuple[float, float]] = {}

    def model_call(
        self, kind: str, method: str, target_passes: int, accepted: float, steps: float
    ) -> None:
        """Count one model call: its sequential target passes and `accepted` units (tokens or
        code levels) over `steps` (row-steps or passes) for the mean accepted length."""
        self.calls.labels(kind, method).inc()
        self.target_passes.labels(kind, method).inc(target_passes)
        total, count = self._accepted.get((kind, method), (0.0, 0.0))
        total, count = total + accepted, count + steps
        self._accepted[(kind, method)] = (total, count)
        self.accepted_length.labels(kind, method).set(total / max(count, 1e-9))

    def render(self) -> bytes:
        return generate_latest(self.registry)
