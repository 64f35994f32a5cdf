"""Where peers observe us, per direct connection, next to the local end of that connection.

py-libp2p keeps identify's ``observed_addr`` per connection in the host's observed-address
manager; the local end comes from the connection's TCP socket. Comparing the two tells a
port-preserving NAT from one that rewrites ports (``lattica.diagnostics.classify_nat``).
"""

from __future__ import annotations

from typing import Any

import trio
from libp2p.abc import IHost

from lattica.diagnostics import Observation
from lattica.net.nat.addresses import conn_is_relayed

_CONN_LAYERS = ("muxed_conn", "secured_conn", "conn", "read_writer", "read_write_closer", "raw_conn",
                "_conn", "stream")


def observations(host: IHost) -> list[Observation]:
    """What peers observed us at on each direct connection, next to our socket's own end.

    py-libp2p keeps identify's observations per connection in the host's observed-address
    manager; the local end comes from the connection's TCP socket.
    """
    manager = getattr(host, "_observed_addr_manager", None)
    entries = getattr(manager, "_conn_observations", None)
    if not isinstance(entries, dict):
        return []
    out = []
    for _, external, _, conn_ref in list(entries.values()):
        conn = conn_ref()
        if conn is None or conn_is_relayed(conn) is not False:
            continue
        local = _local_end(conn)
        seen = _thin_waist_host_port(external)
        peer = getattr(getattr(conn, "muxed_conn", None), "peer_id", None)
        if local is None or seen is None or peer is None:
            continue
        out.append(Observation(observer=str(peer), local=local, observed=seen))
    return out


def _thin_waist_host_port(text: str) -> str | None:
    parts = str(text).split("/")
    if len(parts) >= 5 and parts[1] in ("ip4", "ip6") and parts[3] == "tcp":
        return f"[{parts[2]}]:{parts[4]}" if parts[1] == "ip6" else f"{parts[2]}:{parts[4]}"
    return None


def _local_end(conn: Any) -> str | None:
    """``ip:port`` of the TCP socket under a libp2p connection (walking its wrapper layers)."""
    layer: Any = conn
    for _ in range(len(_CONN_LAYERS) + 3):
        if isinstance(layer, trio.SocketStream):
            try:
                name = layer.socket.getsockname()
            except OSError:
                return None
            return f"[{name[0]}]:{name[1]}" if ":" in str(name[0]) else f"{name[0]}:{name[1]}"
        layer = next((getattr(layer, n) for n in _CONN_LAYERS if getattr(layer, n, None) is not None), None)
        if layer is None:
            return None
    return None
