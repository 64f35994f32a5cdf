"""Where peers observe us, per direct connection, next to the local end of that connection.

py-libp2p keeps identify's ``observed_addr`` per connection in the host's observed-address
manager; the local end comes from the connection's TCP socket (both read through
``lattica.net.libp2p_compat``). Comparing the two tells a port-preserving NAT from one that
rewrites ports (``lattica.diagnostics.classify_nat``).
"""

from __future__ import annotations

from libp2p.abc import IHost

from lattica.diagnostics import Observation
from lattica.net.libp2p_compat import connection_observations, tcp_socket_of
from lattica.net.nat.addresses import conn_is_relayed


def observations(host: IHost) -> list[Observation]:
    """What peers observed us at on each direct connection, next to our socket's own end."""
    out = []
    for external, conn in connection_observations(host):
        if conn_is_relayed(conn) is not False:
            continue
        local = _local_end(conn)
        seen = _thin_waist_host_port(external)
        if local is None or seen is None:
            continue
        out.append(Observation(observer=str(conn.muxed_conn.peer_id), local=local, observed=seen))
    return out


def _thin_waist_host_port(text: str) -> str | None:
    parts = str(text).split("/")
    if len(parts) >= 5 and parts[1] in ("ip4", "ip6") and parts[3] == "tcp":
        return f"[{parts[2]}]:{parts[4]}" if parts[1] == "ip6" else f"{parts[2]}:{parts[4]}"
    return None


def _local_end(conn: object) -> str | None:
    """``ip:port`` of the TCP socket under a libp2p connection."""
    sock = tcp_socket_of(conn)
    if sock is None:
        return None
    try:
        name = sock.socket.getsockname()
    except OSError:
        return None
    return f"[{name[0]}]:{name[1]}" if ":" in str(name[0]) else f"{name[0]}:{name[1]}"
