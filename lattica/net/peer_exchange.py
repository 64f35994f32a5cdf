"""Peer exchange and goodbye: the two smallest protocols of the daemon.

Theory of operation:
- ``/lattica/px/1.0.0``: the dialer sends ``{"run": <run id>}``; the listener answers with up to
  ``MAX_PEERS`` ``{"id", "addrs"}`` entries for the peers it is connected to in that run. A node
  that knows one address thus learns its neighbours' neighbours within a few exchanges, even
  before the DHT has filled its routing table. The round trip doubles as an RTT sample.
- ``/lattica/bye/1.0.0``: a node shutting down sends ``{"run": <run id>}`` to every connected
  peer and waits briefly for an ack; the peer marks it as *left* at once instead of waiting for the
  connection to time out.
Replies are size-capped and validated; a malformed reply is a ``RemoteProtocolError``.
"""

from __future__ import annotations

from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from lattica.decoding import str_list
from lattica.errors import RemoteProtocolError

PX_PROTOCOL = TProtocol("/lattica/px/1.0.0")
BYE_PROTOCOL = TProtocol("/lattica/bye/1.0.0")
MAX_PEERS = 64
MAX_ADDRS = 8
MAX_REPLY_BYTES = 64 * 1024
MAX_ADDR_LEN = 256


MAX_RELAY_ADDRS = 3  # of the MAX_ADDRS: room kept for a NAT'd peer's /p2p-circuit addresses


def px_reply(entries: list[tuple[str, list[str]]]) -> dict[str, list[dict[str, object]]]:
    return {"peers": [{"id": pid, "addrs": _pick_addrs(addrs)} for pid, addrs in entries[:MAX_PEERS]]}


def _pick_addrs(addrs: list[str]) -> list[str]:
    """Up to ``MAX_ADDRS``: the relay addresses (a NAT'd peer's only way in) and direct ones."""
    relayed = [a for a in addrs if "/p2p-circuit" in a][:MAX_RELAY_ADDRS]
    direct = [a for a in addrs if "/p2p-circuit" not in a][: MAX_ADDRS - len(relayed)]
    return direct + relayed


def parse_px_reply(obj: object, *, peer_id: str) -> list[tuple[str, list[str]]]:
    """Validate a peer-exchange reply; ids are checked to be well-formed peer ids."""
    peers = obj.get("peers") if isinstance(obj, dict) else None
    if not isinstance(peers, list):
        raise RemoteProtocolError("peer-exchange reply is not {peers: [...]}", peer_id=peer_id)
    if len(peers) > MAX_PEERS:
        raise RemoteProtocolError(f"peer-exchange reply lists {len(peers)} > {MAX_PEERS} peers", peer_id=peer_id)
    out: list[tuple[str, list[str]]] = []
    for entry in peers:
        if not isinstance(entry, dict):
            raise RemoteProtocolError("peer-exchange entry is not an object", peer_id=peer_id)
        pid, raw_addrs = entry.get("id"), entry.get("addrs")
        if not isinstance(pid, str) or not isinstance(raw_addrs, list) or len(raw_addrs) > MAX_ADDRS:
            raise RemoteProtocolError("peer-exchange entry has bad id/addrs", peer_id=peer_id)
        addrs = str_list(raw_addrs)
        if addrs is None or not all(len(a) <= MAX_ADDR_LEN for a in addrs):
            raise RemoteProtocolError("peer-exchange entry has a bad address", peer_id=peer_id)
        try:
            ID.from_base58(pid)
        except ValueError:
            raise RemoteProtocolError(f"peer-exchange entry has a bad peer id {pid[:60]!r}", peer_id=peer_id) from None
        out.append((pid, addrs))
    return out
