"""The DHT store ledger's figures as Prometheus metrics."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from lattica.dht.quota import StoreLedger, StoreLimits
from lattica.observability import NodeMetrics


def _samples(metrics: NodeMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("lattica_dht_store") or s.name.startswith("lattica_dht_stored")
    }


def test_store_figures_limits_and_counters_are_exported_and_counters_only_advance():
    metrics = NodeMetrics(process=False)
    ledger = StoreLedger(StoreLimits(max_records=4, max_bytes=400, max_records_per_sender=2, max_bytes_per_sender=200))
    for i in range(3):
        ledger.admit(("value", i), "flooder", 100)  # the third is over the sender's quota
    first = ledger.stats()
    metrics.set_dht_store(first, previous=None)
    ledger.admit(("value", 9), "flooder", 100)
    metrics.set_dht_store(ledger.stats(), previous=first)
    samples = _samples(metrics)
    assert samples[("lattica_dht_stored_records", ())] == 2
    assert samples[("lattica_dht_stored_bytes", ())] == 200
    assert samples[("lattica_dht_store_refused_total", (("reason", "sender-quota"),))] == 2
    assert samples[("lattica_dht_store_refused_total", (("reason", "store-full"),))] == 0
    assert samples[("lattica_dht_store_evicted_total", ())] == 0
    assert samples[("lattica_dht_store_limit", (("bound", "bytes_per_sender"),))] == 200
    assert samples[("lattica_dht_store_limit", (("bound", "records"),))] == 4
