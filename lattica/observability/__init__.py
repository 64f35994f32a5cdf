"""Observability: the node's Prometheus metrics and their HTTP exporter."""

from lattica.observability.exporter import MetricsServer
from lattica.observability.metrics import NodeMetrics

__all__ = ["MetricsServer", "NodeMetrics"]
