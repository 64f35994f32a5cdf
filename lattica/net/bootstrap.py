"""Start-up's first contact: the ``--peer`` addresses dialed until one answers, and what it joined.

Theory of operation: ``join_through`` dials every bootstrap address (``--peer``), with backoff,
until the peer one of them names is connected within ``bootstrap_timeout_s`` — for a relay
address the peer behind the relay, not the relay. The dials of one attempt run at once, and once
one has reached its peer the others get ``_LINGER_S`` more: a bootstrap peer that is down or
cut off would otherwise hold start-up (a restarted member's rejoining) for a whole dial timeout;
the reconnector dials it again later. Then the reached peers' identify tells run
members (they speak a Lattica protocol and pass the access check) from plain libp2p nodes (a
relay or DHT server) and from peers that did not prove membership: the ``JoinOutcome``. A run
with a secret is joined only through a member that proved it. When none is reached, start-up
fails with ``ConfigError``: one line naming each address and why.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID

from lattica.config import NodeConfig
from lattica.errors import ConfigError
from lattica.net.access import AccessGate
from lattica.net.addrs import peer_info_from_addr
from lattica.net.peerbook import PeerBook

_IDENTIFY_WAIT_S = 3.0  # for a bootstrap peer's identify, to tell a Lattica node from others
_LINGER_S = 0.5  # the other dials of an attempt, once one reached its peer

PLAIN_PEER = "speaks no Lattica protocol (a plain libp2p node)"


@dataclass(frozen=True)
class JoinOutcome:
    """What start-up reached, by the bootstrap address given: the members of the run, the
    plain libp2p nodes (no Lattica protocol: a relay or DHT server, fine without a secret),
    and why the others are not members."""

    members: tuple[str, ...] = ()
    plain: tuple[str, ...] = ()
    refused: dict[str, str] = field(default_factory=dict)

    def not_members(self) -> dict[str, str]:
        """Every reached bootstrap address that is no member, with why."""
        return {**dict.fromkeys(self.plain, PLAIN_PEER), **self.refused}

    def summary(self, run_id: str) -> str:
        others = len(self.plain) + len(self.refused)
        if self.members:
            text = f"joined run {run_id!r} through {len(self.members)} member(s)"
            return text + (f"; {others} bootstrap peer(s) are not members" if others else "")
        if self.plain:
            return (f"connected to {len(self.plain)} bootstrap peer(s) that speak no Lattica protocol (a plain "
                    f"libp2p relay or DHT node); run {run_id!r} members are found through the DHT")
        return f"joined run {run_id!r}"


async def join_through(
    config: NodeConfig, *, host: IHost, access: AccessGate, peer_book: PeerBook,
    connected: Callable[[], set[str]], dial: Callable[[str, dict[str, str]], Awaitable[bool]],
) -> JoinOutcome:
    """Reach at least one bootstrap peer within the timeout, retrying with backoff (``dial``
    records why an address failed); what start-up joined, or ``ConfigError``.

    Reached means connected to the peer the address names: for a relay address the
    peer behind the relay, not the relay (which stays connected when it refuses the
    circuit)."""
    if not config.peers:
        return JoinOutcome()
    targets: set[str] = set()
    for peer in config.peers:
        try:
            info = peer_info_from_addr(peer)
        except ValueError as exc:
            raise ConfigError(f"--peer: {exc}") from None
        targets.add(info.peer_id.to_base58())
        peer_book.learn(info.peer_id.to_base58(), [peer], now=time.time(), bootstrap=True)
    errors: dict[str, str] = {}
    outcome = JoinOutcome()
    with trio.move_on_after(config.bootstrap_timeout_s):
        delay = 0.5
        while True:
            await _dial_all(config.peers, dial, errors)
            if targets & connected():
                outcome = await reached_members(host, access, config.peers, connected())
                # a run with a secret is joined only through a member that proved it
                if outcome.members or access.access.secret is None:
                    return outcome
            await trio.sleep(delay)
            delay = min(delay * 2, config.max_backoff_s)
    if outcome.not_members():
        reasons = "; ".join(f"{addr}: {why}" for addr, why in outcome.not_members().items())
        raise ConfigError(
            f"no bootstrap peer proved to be a member of run {config.run_id!r} within "
            f"{config.bootstrap_timeout_s:g} s ({reasons})"
        )
    reasons = "; ".join(f"{addr}: {why}" for addr, why in errors.items()) or "timed out"
    raise ConfigError(
        f"could not reach any bootstrap peer within {config.bootstrap_timeout_s:g} s ({reasons})"
    )


async def _dial_all(
    peers: Sequence[str], dial: Callable[[str, dict[str, str]], Awaitable[bool]], errors: dict[str, str],
) -> None:
    """Dial every address at once, until every dial ended or ``_LINGER_S`` after the first one
    that reached its peer."""
    async with trio.open_nursery() as nursery:

        async def dial_one(addr: str) -> None:
            if await dial(addr, errors):
                scope = nursery.cancel_scope
                scope.deadline = min(scope.deadline, trio.current_time() + _LINGER_S)

        for addr in peers:
            nursery.start_soon(dial_one, addr)


async def reached_members(
    host: IHost, access: AccessGate, peers: Sequence[str], connected: set[str],
) -> JoinOutcome:
    """Which reached bootstrap addresses lead to members of the run, by what their
    identify says (a Lattica protocol) and, with a secret or allowlist, the access check."""
    reached = {addr: peer_info_from_addr(addr).peer_id.to_base58() for addr in peers}
    reached = {addr: peer_id for addr, peer_id in reached.items() if peer_id in connected}
    with trio.move_on_after(_IDENTIFY_WAIT_S):  # identify runs right after connecting
        while not all(_identified(host, peer_id) for peer_id in reached.values()):
            await trio.sleep(0.05)
    members: list[str] = []
    plain: list[str] = []
    refused: dict[str, str] = {}
    for addr, peer_id in reached.items():
        if not speaks_lattica(host, peer_id):
            plain.append(addr)
            continue
        conns = host.get_network().connections.get(ID.from_base58(peer_id)) or []
        if conns and await access.admit(peer_id, conns[0].muxed_conn):
            members.append(addr)
        else:
            refused[addr] = "did not prove membership of the run (secret or allowlist)"
    return JoinOutcome(members=tuple(members), plain=tuple(plain), refused=refused)


def bootstrap_peers(addrs: Sequence[str]) -> dict[str, list[str]]:
    """Bootstrap peer id -> its ``--peer`` addresses (a malformed one is start-up's to report)."""
    peers: dict[str, list[str]] = {}
    for addr in addrs:
        try:
            peers.setdefault(peer_info_from_addr(addr).peer_id.to_base58(), []).append(addr)
        except ValueError:
            continue
    return peers


def _identified(host: IHost, peer_id: str) -> bool:
    try:
        return bool(host.get_peerstore().get_protocols(ID.from_base58(peer_id)))
    except Exception:  # noqa: BLE001 - not in the peerstore yet
        return False


def speaks_lattica(host: IHost, peer_id: str) -> bool:
    try:
        protocols = host.get_peerstore().get_protocols(ID.from_base58(peer_id))
    except Exception:  # noqa: BLE001 - not in the peerstore yet
        return False
    return any(str(p).startswith("/lattica/") for p in protocols)
