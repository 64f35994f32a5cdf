"""A swarm of 100 to 1,000+ virtual peers on virtual time, running the product's own cores.

Theory of operation
-------------------
Nothing here re-implements a protocol: every peer's replicated state is a
``lattica.crdt.replica.Replica`` with its own Ed25519 key, written through
``lattica.crdt.documents`` exactly as ``ReplicatedState`` writes it; anti-entropy sessions are
``Replica.state_vector`` / ``missing_for`` / ``receive`` with messages built by
``lattica.crdt.sync`` and sized by msgpack, so byte counts are those of the wire; live members
come from ``lattica.crdt.liveness``; DHT lookups are ``lattica.dht.lookup.ProviderLookup`` walks
over per-node k-bucket tables in py-libp2p's keyspace; groups are drawn by
``lattica.coordination.groups``. A change to one of those cores changes the simulation.

What is simulated instead of done: time (a virtual clock advanced in ticks of the state service's
``sync_interval``), links (one-way latency drawn per pair from a seeded distribution, 50-300 ms,
and a per-peer rate; ``links.py``), churn (joins, clean leaves and kills per minute) and training
(a vector per peer: pseudo-gradients with noise, averaged by the gossip groups).

Scale: holding every replica of a 1,000-member swarm means 10^6 envelope applications per
heartbeat wave. So the swarm's union (what every member eventually holds) is one reference
replica that every write reaches, and a few members (``observers``) hold full replicas of their
own that they keep by real sessions with it, as a member keeps its state by sessions with its
connected peers; the per-peer figures are the observers'. ``scenario.py`` runs one size.
"""
