"""Every Prometheus metric a Lattica node exports, defined in one place.

Each daemon owns one ``NodeMetrics``; it holds a private ``CollectorRegistry`` so that several
daemons in one process (tests, demos) never collide on the global default registry. Subsystems
receive the ``NodeMetrics`` object (or just the metric they update) and call the ordinary
prometheus_client methods on it: ``metrics.outer_round.set(7)``,
``metrics.bytes_sent.labels(protocol="/lattica/allreduce/1").inc(n)``,
``with metrics.collective_seconds.labels(op="allreduce").time(): ...``.

Naming follows the Prometheus conventions: counters end in ``_total``, durations are histograms
in ``_seconds``, sizes are in ``_bytes``; every name starts with ``lattica_``. Label sets that
dashboards query (connection paths, rejection reasons) are created up front with value 0, so a
panel shows a flat zero line rather than "no data" before the first event.
"""

from __future__ import annotations

import collections
import math
import platform
from collections.abc import Iterable
from importlib import metadata
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.process_collector import ProcessCollector

if TYPE_CHECKING:
    from lattica.dht.quota import StoreStats

NAMESPACE = "lattica"

# How a peer connection reached us; values of the ``path`` label of ``peers_by_path``.
CONNECTION_PATHS = ("direct", "hole-punched", "relayed")

# Reasons a replicated-state update may be refused; values of ``rejected_updates{reason}``.
# Subsystems may use other reasons too; these are pre-created so the dashboard always has series.
REJECT_REASONS = ("malformed", "bad-signature", "unknown-author", "oversized", "stale")

# Why the DHT refuses to store a record; values of ``dht_store_refused{reason}``.
DHT_STORE_REFUSALS = ("sender-quota", "store-full", "too-large")

# Collective operations timed by ``collective_seconds{op}``.
COLLECTIVE_OPS = ("allreduce", "exchange")

# Wide-area rounds last seconds to many minutes; collectives milliseconds to minutes.
ROUND_BUCKETS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600)
COLLECTIVE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
CHECKPOINT_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "unknown"


class NodeMetrics:
    """The metrics of one node, registered in their own registry (``self.registry``)."""

    def __init__(self, *, peer_id: str = "", run_id: str = "", process: bool = True) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        if process:
            # process_cpu_seconds_total, process_resident_memory_bytes, ... (Linux /proc only).
            ProcessCollector(registry=self.registry)
        self._define_identity(peer_id=peer_id, run_id=run_id)
        self._define_network()
        self._define_training()
        self._define_accounting()
        self._define_state()

    def _gauge(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
        return Gauge(name, doc, labels, namespace=NAMESPACE, registry=self.registry)

    def _counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        return Counter(name, doc, labels, namespace=NAMESPACE, registry=self.registry)

    def _histogram(
        self, name: str, doc: str, buckets: tuple[float, ...], labels: tuple[str, ...] = ()
    ) -> Histogram:
        return Histogram(
            name, doc, labels, namespace=NAMESPACE, registry=self.registry, buckets=buckets
        )

    def _define_identity(self, *, peer_id: str, run_id: str) -> None:
        self.build_info = Info(
            "build", "Lattica build: package versions.", namespace=NAMESPACE, registry=self.registry
        )
        """``lattica_build_info{version,python,libp2p} 1``."""
        self.build_info.info(
            {
                "version": _version("lattica"),
                "python": platform.python_version(),
                "libp2p": _version("libp2p"),
            }
        )
        self.node_info = Info(
            "node", "Identity of this node.", namespace=NAMESPACE, registry=self.registry
        )
        """``lattica_node_info{peer_id,run_id} 1``: joins an instance to its libp2p identity."""
        self.node_info.info({"peer_id": peer_id, "run_id": run_id})

    def _define_network(self) -> None:
        self.peers_connected = self._gauge("peers_connected", "Peers currently connected.")
        """``lattica_peers_connected``: set from the host's connection table."""
        self.peers_by_path = self._gauge(
            "peers_by_path", "Connected peers by connection path.", ("path",)
        )
        """``lattica_peers_by_path{path=direct|hole-punched|relayed}``."""
        for path in CONNECTION_PATHS:
            self.peers_by_path.labels(path=path)
        self.bytes_sent = self._counter(
            "bytes_sent", "Payload bytes sent, by libp2p protocol id.", ("protocol",)
        )
        """``lattica_bytes_sent_total{protocol}``: ``.labels(protocol=pid).inc(n)``."""
        self.bytes_received = self._counter(
            "bytes_received", "Payload bytes received, by libp2p protocol id.", ("protocol",)
        )
        """``lattica_bytes_received_total{protocol}``."""
        self.relay_reservations = self._gauge(
            "relay_reservations", "Active circuit-relay v2 reservations held by this node."
        )
        """``lattica_relay_reservations``."""
        self.dht_routing_table_peers = self._gauge(
            "dht_routing_table_peers", "Peers in the Kademlia routing table."
        )
        """``lattica_dht_routing_table_peers``."""
        self._define_dht_store()

    def _define_dht_store(self) -> None:
        self.dht_stored_records = self._gauge(
            "dht_stored_records", "DHT records this node stores for other peers."
        )
        """``lattica_dht_stored_records``: provider and value records of others (not our own)."""
        self.dht_stored_bytes = self._gauge(
            "dht_stored_bytes", "Bytes charged for the DHT records this node stores for other peers."
        )
        """``lattica_dht_stored_bytes``."""
        self.dht_store_limit = self._gauge(
            "dht_store_limit", "Bounds on what the DHT stores for others.", ("bound",)
        )
        """``lattica_dht_store_limit{bound=records|bytes|records_per_sender|bytes_per_sender}``."""
        self.dht_store_refused = self._counter(
            "dht_store_refused", "DHT records refused, by reason.", ("reason",)
        )
        """``lattica_dht_store_refused_total{reason=sender-quota|store-full|too-large}``."""
        for reason in DHT_STORE_REFUSALS:
            self.dht_store_refused.labels(reason=reason)
        self.dht_store_evicted = self._counter(
            "dht_store_evicted", "DHT records of others evicted to make room (largest holder first)."
        )
        """``lattica_dht_store_evicted_total``."""

    def set_dht_store(self, stats: StoreStats, *, previous: StoreStats | None) -> None:
        """Copy the DHT store ledger's figures; ``previous`` (the last copied) advances the counters."""
        self.dht_stored_records.set(stats.records)
        self.dht_stored_bytes.set(stats.bytes)
        limits = stats.limits
        for bound, value in (("records", limits.max_records), ("bytes", limits.max_bytes),
                             ("records_per_sender", limits.max_records_per_sender),
                             ("bytes_per_sender", limits.max_bytes_per_sender)):
            self.dht_store_limit.labels(bound=bound).set(value)
        for reason, count in stats.refused.items():
            before = previous.refused.get(reason, 0) if previous is not None else 0
            self.dht_store_refused.labels(reason=reason).inc(max(0, count - before))
        self.dht_store_evicted.inc(max(0, stats.evicted - (previous.evicted if previous is not None else 0)))

    def _define_training(self) -> None:
        self.outer_round = self._gauge("outer_round", "Current outer (DiLoCo) round of this node.")
        """``lattica_outer_round``."""
        self.rounds_completed = self._counter(
            "rounds_completed", "Outer rounds this node completed (outer step applied)."
        )
        """``lattica_rounds_completed_total``."""
        self.round_seconds = self._histogram(
            "round_duration_seconds", "Wall time of one outer round.", ROUND_BUCKETS
        )
        """``lattica_round_duration_seconds``: ``.observe(seconds)`` once per round."""
        self.collective_seconds = self._histogram(
            "collective_duration_seconds",
            "Wall time of one collective operation (all-reduce, pairwise exchange).",
            COLLECTIVE_BUCKETS,
            ("op",),
        )
        """``lattica_collective_duration_seconds{op=allreduce|exchange}``."""
        for op in COLLECTIVE_OPS:
            self.collective_seconds.labels(op=op)
        self.inner_steps_per_second = self._gauge(
            "inner_steps_per_second", "Inner optimizer steps per second (recent average)."
        )
        """``lattica_inner_steps_per_second``."""
        self.tokens_per_second = self._gauge(
            "tokens_per_second", "Training tokens per second (recent average)."
        )
        """``lattica_tokens_per_second``."""
        self.mfu = self._gauge(
            "model_flops_utilization",
            "Model FLOPs utilisation of the inner steps: model FLOPs per token x tokens/s / the device's "
            "dense bf16 peak (CUDA devices of known peak, the built-in GPT).",
        )
        """``lattica_model_flops_utilization``: a fraction; NaN where it is not known (the CPU, an
        unknown device, a model whose FLOPs are not counted)."""
        self.mfu.set(math.nan)
        self._define_device_metrics()
        self.train_loss = self._gauge("train_loss", "Most recent training loss.")
        """``lattica_train_loss``."""
        self.validation_loss = self._gauge("validation_loss", "Most recent validation loss.")
        """``lattica_validation_loss``."""
        # NaN until the first measurement: a loss of 0 would be a lie on the dashboard.
        self.train_loss.set(math.nan)
        self.validation_loss.set(math.nan)
        self.consensus_distance = self._gauge(
            "consensus_distance",
            "Gossip averaging: distance of this replica's outer weights to its group's mean, "
            "relative to their norm, at the last group exchange.",
        )
        """``lattica_consensus_distance``: NaN where replicas agree (all-reduce) or before the
        first exchange."""
        self.consensus_distance.set(math.nan)
        self.staleness_rounds = self._gauge(
            "staleness_rounds",
            "Outer rounds this node is behind the highest round seen in the swarm.",
        )
        """``lattica_staleness_rounds``: ``max_seen_round - outer_round``, never negative."""
        self.checkpoint_fetch_seconds = self._histogram(
            "checkpoint_fetch_duration_seconds",
            "Wall time to fetch and load a checkpoint from peers.",
            CHECKPOINT_BUCKETS,
        )
        """``lattica_checkpoint_fetch_duration_seconds``."""
        self.rejected_contributions = self._counter(
            "rejected_contributions",
            "Contributions from peers this node refused before averaging (non-finite values, "
            "norm outliers, malformed payloads): all-reduce parts and group partners' exchanges.",
        )
        """``lattica_rejected_contributions_total``: per peer in ``lattica status --json``."""
        self.avoided_partners = self._gauge(
            "avoided_partners", "Gossip partners left out of this node's group draws after a refusal."
        )
        """``lattica_avoided_partners``."""

    def _define_device_metrics(self) -> None:
        """One series per rank of the node (one rank per local device, ``train.devices``)."""
        labels = ("rank", "device")
        self.device_tokens_per_second = self._gauge(
            "device_tokens_per_second", "Training tokens per second of one rank (one local device).", labels
        )
        """``lattica_device_tokens_per_second{rank, device}``."""
        self.device_memory_bytes = self._gauge(
            "device_memory_bytes",
            "Peak memory of one rank: its CUDA allocator's peak, or its process's peak resident memory.", labels,
        )
        """``lattica_device_memory_bytes{rank, device}``."""
        self.device_mfu = self._gauge("device_model_flops_utilization", "Model FLOPs utilisation of one rank.", labels)
        """``lattica_device_model_flops_utilization{rank, device}``: where it is known."""

    def set_devices(self, devices: list[dict[str, object]]) -> None:
        """Copy ``lattica status``'s ``training.devices`` into the per-device gauges."""
        for entry in devices:
            labels = {"rank": str(entry.get("rank", 0)), "device": str(entry.get("name") or entry.get("device"))}
            for key, gauge in (("tokens_per_s", self.device_tokens_per_second),
                               ("memory_bytes", self.device_memory_bytes), ("mfu", self.device_mfu)):
                value = entry.get(key)  # NaN where the device does not know it (the CPU's memory, MFU)
                if isinstance(value, int | float) and not isinstance(value, bool):
                    gauge.labels(**labels).set(value)
                else:
                    gauge.labels(**labels).set(math.nan)

    def _define_accounting(self) -> None:
        self.strategy_bytes_sent = self._counter(
            "strategy_bytes_sent",
            "Encoded bytes the outer strategy put on the wire (all-reduces, exchanges).",
        )
        """``lattica_strategy_bytes_sent_total``."""
        self.strategy_syncs = self._counter(
            "strategy_syncs", "Communication units the outer strategy started (round, fragment)."
        )
        """``lattica_strategy_syncs_total``."""
        self.sync_bytes = self._gauge("sync_bytes", "Bytes sent in this node's last sync.")
        """``lattica_sync_bytes``."""
        self.sync_peak_bytes = self._gauge(
            "sync_peak_bytes", "Largest number of bytes this node sent in one sync."
        )
        """``lattica_sync_peak_bytes``: the largest burst on this node's link."""
        self.optimizer_state_bytes = self._gauge(
            "optimizer_state_bytes",
            "Optimizer state held by this node: inner (e.g. AdamW moments) and outer "
            "(outer weights, momentum).",
            ("kind",),
        )
        """``lattica_optimizer_state_bytes{kind=inner|outer}``."""
        self.parameter_bytes = self._gauge(
            "parameter_bytes", "Model weights held by this node.", ("kind",)
        )
        """``lattica_parameter_bytes{kind=trainable|frozen}`` (SPES: foreign experts frozen)."""
        for kind in ("inner", "outer"):
            self.optimizer_state_bytes.labels(kind=kind)
        for kind in ("trainable", "frozen"):
            self.parameter_bytes.labels(kind=kind)

    def set_accounting(self, figures: dict[str, int], *, previous: dict[str, int]) -> None:
        """Copy a strategy's ``accounting()`` figures; ``previous`` advances the counters."""
        self.strategy_bytes_sent.inc(max(0, figures["bytes_sent"] - previous.get("bytes_sent", 0)))
        self.strategy_syncs.inc(max(0, figures["syncs"] - previous.get("syncs", 0)))
        self.sync_bytes.set(figures["last_sync_bytes"])
        self.sync_peak_bytes.set(figures["peak_sync_bytes"])
        self.optimizer_state_bytes.labels(kind="inner").set(figures["inner_optimizer_state_bytes"])
        self.optimizer_state_bytes.labels(kind="outer").set(figures["outer_state_bytes"])
        self.parameter_bytes.labels(kind="trainable").set(figures["trainable_parameter_bytes"])
        self.parameter_bytes.labels(kind="frozen").set(figures["frozen_parameter_bytes"])

    def _define_state(self) -> None:
        self.replicated_state_bytes = self._gauge(
            "replicated_state_bytes", "Encoded size of the replicated (CRDT) state document."
        )
        """``lattica_replicated_state_bytes``."""
        self.rejected_updates = self._counter(
            "rejected_updates", "Replicated-state updates refused, by reason.", ("reason",)
        )
        """``lattica_rejected_updates_total{reason}``: ``.labels(reason=r).inc()``."""
        for reason in REJECT_REASONS:
            self.rejected_updates.labels(reason=reason)

    def set_peers(self, paths: Iterable[str]) -> None:
        """Set ``peers_connected`` and ``peers_by_path`` from the path of each connected peer.

        Paths outside ``CONNECTION_PATHS`` (e.g. "unknown") count as connected only.
        """
        counts = collections.Counter(paths)
        self.peers_connected.set(sum(counts.values()))
        for path in CONNECTION_PATHS:
            self.peers_by_path.labels(path=path).set(counts.get(path, 0))

    def set_staleness(self, *, own_round: int, max_seen_round: int) -> None:
        """Record how far behind the swarm this node is (0 when it leads)."""
        self.staleness_rounds.set(max(0, max_seen_round - own_round))
