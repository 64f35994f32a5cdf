"""Observability: the node's Prometheus metrics, their HTTP exporter and stream metering."""

from lattica.observability.exporter import MetricsServer
from lattica.observability.metrics import NodeMetrics
from lattica.observability.traffic import MeteredStream

__all__ = ["MeteredStream", "MetricsServer", "NodeMetrics"]
