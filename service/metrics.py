"""Prometheus metrics of the data plane: bytes, tensors, requests, latency, open streams.

Each server gets its own registry, so several servers can run in one process (tests).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "weightserve_requests_total",
            "Requests by transport, operation and outcome",
            ["transport", "operation", "code"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "weightserve_request_seconds",
            "Time to answer a request (whole stream for data)",
            ["transport", "operation"],
            registry=self.registry,
            buckets=(
                0.0005,
                0.001,
                0.0025,
                0.005,
                0.01,
                0.025,
                0.05,
                0.1,
                0.25,
                0.5,
                1,
                2.5,
                5,
                10,
                30,
                60,
                120,
            ),
        )
        self.bytes_served = Counter(
            "weightserve_bytes_served_total",
            "Tensor data bytes sent",
            ["transport", "model"],
            registry=self.registry,
        )
        self.tensors_served = Counter(
            "weightserve_tensors_served_total",
            "Tensors (or slices) sent completely",
            ["transport", "model"],
            registry=self.registry,
        )
        self.open_streams = Gauge(
            "weightserve_open_streams",
            "Tensor streams in progress",
            ["transport"],
            registry=self.registry,
        )
        self.models = Gauge(
            "weightserve_models",
            "Models in the catalog",
            registry=self.registry,
        )
        self.refused_models = Gauge(
            "weightserve_refused_models",
            "Models found but refused (failed validation)",
            registry=self.registry,
        )
        self.model_refusals = Counter(
            "weightserve_model_refusals_total",
            "Times a model was refused (once per version of its files: not per rescan)",
            registry=self.registry,
        )
