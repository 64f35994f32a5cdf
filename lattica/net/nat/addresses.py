"""Address helpers shared by the NAT services: what is relayed, what is our external address.

A relayed connection is one whose transport addresses carry ``/p2p-circuit``. Our *external*
address is predicted the way NAT hole punching needs it: the IP that peers observe us at
(reported by identify over direct connections) combined with our TCP *listen* port, since
hole-punch and dial-back traffic targets the listen port and port-preserving NATs keep it.
"""

from __future__ import annotations

import ipaddress

from libp2p.abc import IHost, IMuxedConn, INetConn
from multiaddr import Multiaddr
from multiaddr.exceptions import Error as MultiaddrError

from lattica.net.libp2p_compat import observed_addrs, relay_peer_of


def is_circuit(addr: Multiaddr | str) -> bool:
    return "/p2p-circuit" in str(addr)


def conn_is_relayed(conn: INetConn | IMuxedConn) -> bool | None:
    """True for a relayed connection, False for direct, None when it cannot tell (yet)."""
    try:
        addrs = conn.get_transport_addresses()
    except Exception:  # noqa: BLE001 - a closing libp2p connection raises various kinds; the answer is: unknown
        return None
    if not addrs:
        return None
    return all(is_circuit(a) for a in addrs)


def relay_of(conn: INetConn, own_id: str) -> str | None:
    """The peer id of the relay carrying a relayed connection, or None.

    A dialed circuit names the relay in its address (``/p2p/<relay>/p2p-circuit/...``).
    py-libp2p 0.8.1 names *ourselves* there on the receiving side, so there we look under the
    connection's layers for the stream it runs on: a stream on our connection to the relay.
    """
    for addr in _transport_addrs(conn):
        head = str(addr).split("/p2p-circuit")[0]
        if "/p2p/" in head and (named := head.rsplit("/p2p/", 1)[1]) != own_id:
            return named
    return relay_peer_of(conn)


def _transport_addrs(conn: INetConn) -> list[Multiaddr]:
    try:
        return list(conn.get_transport_addresses() or [])
    except Exception:  # noqa: BLE001 - a closing libp2p connection raises various kinds; the answer is: none
        return []


def tcp_ip_port(addr: Multiaddr) -> tuple[str, int] | None:
    try:
        ip = addr.value_for_protocol("ip4")
        port = addr.value_for_protocol("tcp")
    except (MultiaddrError, ValueError):
        return None
    if ip is None or port is None:
        return None
    return str(ip), int(port)


def listen_ports(host: IHost) -> list[int]:
    ports: list[int] = []
    for addr in host.get_transport_addrs() if hasattr(host, "get_transport_addrs") else []:
        parsed = tcp_ip_port(addr)
        if parsed and parsed[1] not in ports:
            ports.append(parsed[1])
    return ports


def observed_ips(host: IHost) -> list[str]:
    """IPs that peers reported seeing us at over direct connections (newest evidence first)."""
    ips: list[str] = []
    for addr in observed_addrs(host, min_observers=1):
        parsed = tcp_ip_port(addr) if not is_circuit(addr) else None
        if parsed and parsed[0] not in ips:
            ips.append(parsed[0])
    return ips


def predicted_external_addrs(host: IHost) -> list[Multiaddr]:
    """Observed IP x listen port, for every observed IP that is not one of our own."""
    own = {p[0] for p in (tcp_ip_port(a) for a in _plain_addrs(host)) if p}
    return [
        Multiaddr(f"/ip4/{ip}/tcp/{port}")
        for ip in observed_ips(host)
        if ip not in own
        for port in listen_ports(host)
    ]


def dialable_addrs(host: IHost) -> list[Multiaddr]:
    """Our own direct addresses (listen + announce + predicted external), no /p2p suffix."""
    result: list[Multiaddr] = []
    for addr in [*_plain_addrs(host), *predicted_external_addrs(host)]:
        if str(addr) not in {str(a) for a in result}:
            result.append(addr)
    return result


def _plain_addrs(host: IHost) -> list[Multiaddr]:
    result = []
    for addr in host.get_addrs():
        if is_circuit(addr):
            continue
        text = str(addr).split("/p2p/")[0]
        parsed = tcp_ip_port(Multiaddr(text))
        if parsed and not ipaddress.ip_address(parsed[0]).is_unspecified:
            result.append(Multiaddr(text))
    return result
