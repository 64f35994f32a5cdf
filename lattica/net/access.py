"""Who may take part in a run: an allowlist of peer ids and/or a shared run secret.

Theory of operation
-------------------
Noise already proves *which* peer is on the other end of a connection; this module decides
whether that peer belongs to the run. ``RunAccess`` is the sans-IO policy: an allowlist check
and an HMAC challenge-response. ``AccessGate`` is the thin trio loop around it.

Proof of the secret (``AUTH_PROTOCOL``): the verifier opens a stream to the prover and sends
``{"run": run_id, "nonce": 32 random bytes}``; the prover answers
``{"mac": HMAC-SHA256(secret, "lattica-auth/1" | run_id | verifier id | prover id | nonce)}``.
The MAC binds both authenticated peer ids, so a non-member cannot relay a member's answer to a
third peer, and the fresh nonce makes a recorded answer useless. The secret never crosses the
wire. Each side verifies the other on its own initiative, so membership is mutual.

Every protocol is checked, not only the connection: a host built with the gate as its stream
guard (``build_host(..., guard=gate)``, see ``LatticaHost``) passes every stream handler
registered after its construction through ``guard_handler`` and every stream it opens through
``check_opened``, so the handlers go through ``guard`` first and every stream this host opens on
one of those protocols is guarded too (we neither serve nor send run data to a non-member).
``attach(host)`` then serves the auth protocol on it. A denied stream is reset and counted per
protocol. Verdicts are cached per peer for the life of the connection they were reached on; a
new connection is verified again. Handlers the host registers itself (identify, ping) and the
auth protocol stay open.

A peer that stalls or fails the handshake must not hold anyone's streams for long: one
handshake per peer runs at a time, at most ``_MAX_WAITING_PER_PEER`` of its streams wait for it
(more are denied at once), it times out after ``_VERIFY_TIMEOUT_S``, and a failure of any kind
(a wrong proof, a timeout, a broken stream) is remembered for ``_FAILURE_TTL_S``: meanwhile every
stream of that peer on that connection, in or out, is denied at once, with no new handshake (a
new connection — a restarted member — is verified afresh). We answer at most
``_MAX_ANSWERS_PER_PEER`` challenges of one peer at a time.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import trio
from libp2p.abc import IHost, INetStream
from libp2p.custom_types import StreamHandlerFn, TProtocol
from libp2p.peer.id import ID

from lattica.errors import ConfigError, PeerUnavailableError, RemoteProtocolError
from lattica.files import read_capped
from lattica.net.streams import close_quietly, reset_quietly
from lattica.net.wire import read_message, write_message

log = logging.getLogger(__name__)

AUTH_PROTOCOL = TProtocol("/lattica/auth/1.0.0")
NONCE_BYTES = 32
MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096
_MAX_AUTH_MESSAGE = 256
_VERIFY_TIMEOUT_S = 3.0
_FAILURE_TTL_S = 5.0
_MAX_WAITING_PER_PEER = 8
_MAX_ANSWERS_PER_PEER = 4
_MAX_CACHED_PEERS = 4096
_PEER_ID = re.compile(r"^[1-9A-HJ-NP-Za-km-z]{40,60}$")


class AccessDeniedError(PeerUnavailableError):
    """The peer is not a member of this run (or could not prove it)."""


def read_secret_file(path: Path) -> bytes:
    """The run secret: a file readable by its owner only, like the identity key."""
    raw = read_capped(path, what="secret file", max_bytes=MAX_SECRET_BYTES, private=True)
    secret = raw.strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"secret file {path} holds {len(secret)} bytes; use at least {MIN_SECRET_BYTES}")
    return secret


def check_peer_ids(peer_ids: Iterable[str], *, what: str) -> None:
    for peer_id in peer_ids:
        if not isinstance(peer_id, str) or not _PEER_ID.match(peer_id):
            raise ConfigError(f"{what} must be a peer id, got {peer_id!r}")


@dataclass(frozen=True, kw_only=True)
class RunAccess:
    """The sans-IO policy: ``allow_peers`` (empty: anyone) and an optional shared ``secret``."""

    run_id: str
    self_id: str
    allow_peers: frozenset[str] = frozenset()
    secret: bytes | None = None

    def __post_init__(self) -> None:
        check_peer_ids(self.allow_peers, what="allow_peers")
        if self.secret is not None and len(self.secret) < MIN_SECRET_BYTES:
            raise ValueError(f"a run secret needs at least {MIN_SECRET_BYTES} bytes")

    @property
    def open(self) -> bool:
        """No restriction at all: every peer is a member."""
        return not self.allow_peers and self.secret is None

    def listed(self, peer_id: str) -> bool:
        return not self.allow_peers or peer_id == self.self_id or peer_id in self.allow_peers

    @staticmethod
    def challenge() -> bytes:
        return secrets.token_bytes(NONCE_BYTES)

    def proof(self, nonce: bytes, *, verifier: str, prover: str) -> bytes:
        if self.secret is None:
            raise ValueError("no run secret to prove")
        message = b"|".join(
            [b"lattica-auth/1", self.run_id.encode(), verifier.encode(), prover.encode(), nonce]
        )
        return hmac.new(self.secret, message, hashlib.sha256).digest()

    def check_proof(self, nonce: bytes, mac: object, *, verifier: str, prover: str) -> bool:
        if not isinstance(mac, bytes):
            return False
        expected = self.proof(nonce, verifier=verifier, prover=prover)
        return hmac.compare_digest(expected, mac)

    def answer(self, request: object, *, verifier: str) -> dict[str, object]:
        """The prover's reply to a challenge message."""
        if not isinstance(request, dict) or request.get("run") != self.run_id:
            return {"error": "unknown run"}
        nonce = request.get("nonce")
        if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
            return {"error": "bad nonce"}
        if self.secret is None:
            return {"error": "no secret"}
        return {"mac": self.proof(nonce, verifier=verifier, prover=self.self_id)}


class AccessGate:
    """Applies a ``RunAccess`` to every stream of a host; see the module docstring."""

    def __init__(self, access: RunAccess) -> None:
        self.access = access
        self.denied: Counter[str] = Counter()
        self.verified = 0
        self._verdicts: dict[str, tuple[object, bool]] = {}
        self._failed_until: dict[str, tuple[object, float]] = {}  # peer -> (connection, until when)
        self._locks: dict[str, trio.Lock] = {}
        self._waiting: Counter[str] = Counter()  # streams waiting for a peer's handshake
        self._answering: Counter[str] = Counter()  # challenges of a peer being answered
        self._guarded: set[str] = set()
        self._host: IHost | None = None  # opens our challenges, once attached

    def attach(self, host: IHost) -> None:
        """Serve the auth protocol on ``host`` (built with this gate as its stream guard) and
        send our challenges through it."""
        self._host = host
        host.set_stream_handler(AUTH_PROTOCOL, self._answer_challenge)

    def guard_handler(self, protocol_id: TProtocol, handler: StreamHandlerFn) -> StreamHandlerFn:
        """The handler the host registers for ``protocol_id``: members only, except the
        handshake itself."""
        if protocol_id == AUTH_PROTOCOL:
            return handler
        self._guarded.add(str(protocol_id))
        return self.wrap(handler, str(protocol_id))

    async def check_opened(self, stream: INetStream, protocol_ids: Sequence[TProtocol]) -> None:
        """Raise ``AccessDeniedError`` (the stream reset) when a stream the host opened on a
        guarded protocol reaches a non-member."""
        if any(str(p) in self._guarded for p in protocol_ids) and not await self.guard(stream):
            peer_id = stream.muxed_conn.peer_id.to_base58()
            raise AccessDeniedError("peer is not a member of this run", peer_id=peer_id)

    def wrap(self, handler: StreamHandlerFn, protocol: str) -> StreamHandlerFn:
        async def guarded_handler(stream: INetStream) -> None:
            if await self.guard(stream, protocol=protocol):
                await handler(stream)

        return guarded_handler

    async def guard(self, stream: INetStream, *, protocol: str = "outbound") -> bool:
        """Whether the stream's peer is a member; a non-member's stream is reset and counted."""
        if self.access.open:
            return True
        peer_id = stream.muxed_conn.peer_id.to_base58()
        if await self.admit(peer_id, stream.muxed_conn):
            return True
        self.denied[protocol] += 1
        log.info("denied %s stream of non-member %s", protocol, peer_id)
        await reset_quietly(stream)
        return False

    async def admit(self, peer_id: str, conn: object) -> bool:
        if not self.access.listed(peer_id):
            return False
        if self.access.secret is None:
            return True
        cached = self._cached(peer_id, conn)
        if cached is not None:
            return cached
        if self._waiting[peer_id] >= _MAX_WAITING_PER_PEER:
            return False  # its handshake is already awaited by plenty of its streams
        self._waiting[peer_id] += 1
        try:
            async with self._locks.setdefault(peer_id, trio.Lock()):
                cached = self._cached(peer_id, conn)
                if cached is not None:
                    return cached
                ok = await self._handshake(peer_id)
                self._remember(peer_id, conn, ok)
                return bool(ok)
        finally:
            self._waiting[peer_id] -= 1
            if not self._waiting[peer_id]:
                del self._waiting[peer_id]
                self._locks.pop(peer_id, None)  # nobody holds or awaits it

    def _cached(self, peer_id: str, conn: object) -> bool | None:
        """The verdict on ``peer_id`` without a handshake, if there is one: False while a recent
        failure is remembered, else what this connection was found to be."""
        failed = self._failed_until.get(peer_id)
        if failed is not None and failed[0] is conn and failed[1] > trio.current_time():
            return False
        cached = self._verdicts.get(peer_id)
        return cached[1] if cached is not None and cached[0] is conn else None

    async def _handshake(self, peer_id: str) -> bool | None:
        """Whether the peer proved the secret; None when the handshake failed or stalled."""
        try:
            return await self._verify(peer_id)
        except (RemoteProtocolError, PeerUnavailableError, OSError, trio.TooSlowError) as exc:
            log.debug("could not verify %s: %r", peer_id, exc)
        except Exception as exc:  # noqa: BLE001 - libp2p raises many kinds on a broken stream
            log.debug("could not verify %s: %r", peer_id, exc)
        return None

    def _remember(self, peer_id: str, conn: object, ok: bool | None) -> None:
        if ok:
            self.verified += 1
        else:  # wrong proof, stalled or broken: no new handshake on this connection for a while
            if len(self._failed_until) >= _MAX_CACHED_PEERS:
                self._forget_expired_failures()
            self._failed_until.pop(peer_id, None)
            self._failed_until[peer_id] = (conn, trio.current_time() + _FAILURE_TTL_S)
        if ok is None:
            return  # a stall or a broken stream is asked again once that has run out
        if len(self._verdicts) >= _MAX_CACHED_PEERS:
            self._verdicts.pop(next(iter(self._verdicts)))
        self._verdicts[peer_id] = (conn, ok)

    def _forget_expired_failures(self) -> None:
        now = trio.current_time()
        for peer_id in [p for p, (_, until) in self._failed_until.items() if until <= now]:
            del self._failed_until[peer_id]
        while len(self._failed_until) >= _MAX_CACHED_PEERS:  # all recent: the oldest go
            self._failed_until.pop(next(iter(self._failed_until)))

    async def _verify(self, peer_id: str) -> bool:
        if self._host is None:
            raise PeerUnavailableError("the access gate is not attached to a host", peer_id=peer_id)
        nonce = self.access.challenge()
        me = self.access.self_id
        with trio.fail_after(_VERIFY_TIMEOUT_S):
            stream = await self._host.new_stream(ID.from_base58(peer_id), [AUTH_PROTOCOL])  # not guarded
            try:
                await write_message(stream, {"run": self.access.run_id, "nonce": nonce}, peer_id=peer_id)
                reply = await read_message(stream, max_size=_MAX_AUTH_MESSAGE, peer_id=peer_id)
            finally:
                await close_quietly(stream)
        mac = reply.get("mac") if isinstance(reply, dict) else None
        return self.access.check_proof(nonce, mac, verifier=me, prover=peer_id)

    async def _answer_challenge(self, stream: INetStream) -> None:
        peer_id = stream.muxed_conn.peer_id.to_base58()
        if self._answering[peer_id] >= _MAX_ANSWERS_PER_PEER:
            log.debug("too many auth challenges from %s at once", peer_id)
            await reset_quietly(stream)
            return
        self._answering[peer_id] += 1
        try:
            with trio.fail_after(_VERIFY_TIMEOUT_S):
                request = await read_message(stream, max_size=_MAX_AUTH_MESSAGE, peer_id=peer_id)
                await write_message(stream, self.access.answer(request, verifier=peer_id), peer_id=peer_id)
        except Exception as exc:  # noqa: BLE001 - a bad challenge only ends this stream
            log.debug("auth challenge from %s failed: %r", peer_id, exc)
        finally:
            self._answering[peer_id] -= 1
            if not self._answering[peer_id]:
                del self._answering[peer_id]
            await close_quietly(stream)

    def statistics(self) -> AccessStatus:
        return AccessStatus(mode=_mode(self.access), verified_peers=self.verified, denied_streams=dict(self.denied))

    def status(self) -> dict[str, object]:
        """The ``access`` part of ``lattica status``."""
        return self.statistics().as_json()


@dataclass(frozen=True)
class AccessStatus:
    mode: str  # open, allowlist, secret or allowlist+secret
    verified_peers: int  # connections that proved membership
    denied_streams: Mapping[str, int]  # protocol -> streams refused

    def as_json(self) -> dict[str, object]:
        return {"mode": self.mode, "verified_peers": self.verified_peers, "denied_streams": dict(self.denied_streams)}


def _mode(access: RunAccess) -> str:
    parts = [name for name, on in (("allowlist", access.allow_peers), ("secret", access.secret)) if on]
    return "+".join(parts) or "open"
