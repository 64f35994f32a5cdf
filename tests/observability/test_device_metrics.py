"""Per-device training metrics: one series per rank of the node, labelled by rank and device."""

from __future__ import annotations

import math

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from lattica.observability import NodeMetrics


def _samples(metrics: NodeMetrics, family: str) -> dict[tuple[str, str], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (s.labels["rank"], s.labels["device"]): s.value
        for f in text_string_to_metric_families(text) if f.name == family for s in f.samples
    }


def test_each_rank_of_the_status_is_a_series_labelled_by_its_device() -> None:
    metrics = NodeMetrics(peer_id="12D3KooWTest", run_id="test-run")
    metrics.set_devices([
        {"rank": 0, "device": "cpu (fp32)", "name": "cpu:0", "tokens_per_s": 1200.5, "memory_bytes": 2**30},
        {"rank": 1, "device": "cpu (fp32)", "name": "cpu:1", "tokens_per_s": 1100.0, "mfu": 0.4},
    ])
    assert _samples(metrics, "lattica_device_tokens_per_second") == {("0", "cpu:0"): 1200.5, ("1", "cpu:1"): 1100.0}
    memory = _samples(metrics, "lattica_device_memory_bytes")
    utilization = _samples(metrics, "lattica_device_model_flops_utilization")
    assert memory[("0", "cpu:0")] == float(2**30)
    assert math.isnan(memory[("1", "cpu:1")])
    assert utilization[("1", "cpu:1")] == 0.4
    assert math.isnan(utilization[("0", "cpu:0")])
