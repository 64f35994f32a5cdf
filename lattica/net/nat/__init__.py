"""NAT traversal: reachability (AutoNAT), circuit relay v2, hole punching (DCUtR), UPnP.

Public entry points:

- :class:`ReachabilityService` (``autonat.py``): public / private / unknown, re-checked on change.
- :class:`RelayServer` and :class:`RelayReservations` (``relay.py``): serve relay v2 with limits;
  keep reservations on one or more relays and expose ``relay_addrs()`` to advertise.
- :class:`HolePuncher` (``holepunch.py``): DCUtR upgrade of relayed connections.
- :class:`Dialer` (``dialer.py``): direct, then relay + hole punch; records the winning path.
- :class:`PathBook` (``paths.py``): per-peer path (direct / hole-punched / relayed) and RTT.
- :class:`PortMapper` (``upnp.py``): UPnP IGD port mapping when a gateway offers it.
"""

from lattica.net.nat.autonat import AutoNATConfig, Reachability, ReachabilityService
from lattica.net.nat.dialer import Dialer, DialResult
from lattica.net.nat.holepunch import HolePuncher
from lattica.net.nat.paths import Path, PathBook, PeerPath
from lattica.net.nat.relay import RelayLimitsConfig, RelayReservations, RelayServer
from lattica.net.nat.upnp import PortMapper

__all__ = [
    "AutoNATConfig",
    "DialResult",
    "Dialer",
    "HolePuncher",
    "Path",
    "PathBook",
    "PeerPath",
    "PortMapper",
    "Reachability",
    "ReachabilityService",
    "RelayLimitsConfig",
    "RelayReservations",
    "RelayServer",
]
