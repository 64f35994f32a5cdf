"""Kademlia DHT: run-scoped discovery, content routing, validated expiring records."""

from lattica.dht.config import DHTConfig
from lattica.dht.content import LookupResult
from lattica.dht.discovery import RunDiscovery
from lattica.dht.keys import content_key, run_key
from lattica.dht.node import LatticaDHT

__all__ = ["DHTConfig", "LatticaDHT", "LookupResult", "RunDiscovery", "content_key", "run_key"]
