"""Turning listen addresses into the addresses other peers can dial.

A daemon listening on ``0.0.0.0`` or ``::`` is reachable on every interface address; peers
need the concrete ones. Loopback comes last so that remote peers try real interfaces first.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from collections.abc import Iterable, Sequence

import multiaddr
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr

_SIOCGIFADDR = 0x8915


def interface_ipv4_addresses() -> list[str]:
    found: list[str] = []
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
        found.append(socket.inet_ntoa(packed[20:24]))
    return found


def interface_ipv6_addresses() -> list[str]:
    found: list[str] = []
    try:
        with open("/proc/net/if_inet6") as f:
            lines = f.read().splitlines()
    except OSError:
        return found
    for line in lines:
        fields = line.split()
        if len(fields) < 6:
            continue
        addr = ipaddress.IPv6Address(int(fields[0], 16))
        if addr.is_link_local:
            continue  # needs a zone id to dial; useless in a multiaddr
        found.append(str(addr))
    return found


def _sort_key(ip: str) -> tuple[int, str]:
    return (1 if ipaddress.ip_address(ip).is_loopback else 0, ip)


def dialable_addrs(
    bound: Iterable[multiaddr.Multiaddr], peer_id: str
) -> list[str]:
    """Expand wildcard listen addrs into concrete ``/ipX/…/tcp/…/p2p/<id>`` strings."""
    out: list[str] = []
    for addr in bound:
        text = str(addr).split("/p2p/")[0]
        parts = text.split("/")
        if len(parts) < 5:
            continue
        family, ip, port = parts[1], parts[2], parts[4]
        if family == "ip4" and ip == "0.0.0.0":
            ips = sorted(interface_ipv4_addresses(), key=_sort_key)
        elif family == "ip6" and ip == "::":
            ips = sorted(interface_ipv6_addresses(), key=_sort_key)
        else:
            ips = [ip]
        out.extend(f"/{family}/{i}/tcp/{port}/p2p/{peer_id}" for i in ips)
    return list(dict.fromkeys(out))


def strip_peer_id(addrs: Sequence[str]) -> list[str]:
    return [a.split("/p2p/")[0] for a in addrs]


def peer_info_from_addr(text: str) -> PeerInfo:
    """The peer a full address names, and the address to dial it at.

    ``/ip4/…/tcp/…/p2p/<id>`` -> ``<id>`` at ``/ip4/…/tcp/…`` (as ``info_from_p2p_addr``).
    A relay address ``…/p2p/<relay>/p2p-circuit/p2p/<id>`` names ``<id>`` and is kept whole:
    the relay is asked for that final id (``lattica.net.nat.circuit``). ValueError when the
    address names no peer.
    """
    if "/p2p-circuit" in text:
        from lattica.net.nat.circuit import parse_circuit_addr

        circuit = parse_circuit_addr(text)
        return PeerInfo(circuit.peer_id, [multiaddr.Multiaddr(text)])
    try:
        return info_from_p2p_addr(multiaddr.Multiaddr(text))
    except Exception as exc:  # noqa: BLE001 - multiaddr and libp2p raise several kinds
        raise ValueError(f"not a peer address (…/p2p/<peer id>): {text[:200]} ({exc})") from None
