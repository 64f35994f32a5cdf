"""Which addresses of a peer are worth dialing, and why a dial failed, in one line.

Both are pure: ``dial_addrs_for`` filters addresses heard from peers (untrusted) before any
dial; ``short_reason`` turns py-libp2p's nested dial errors into the line the user sees
(``lattica join`` start-up, ``lattica doctor``, the connectivity log).
"""

from __future__ import annotations

from collections.abc import Sequence

import multiaddr
import trio

from lattica.net.host import circuit_addr_for
from lattica.net.libp2p_compat import nested_errors


def dial_addrs_for(peer_id: str, addrs: Sequence[str], *, relayed: bool) -> list[multiaddr.Multiaddr]:
    """The addresses worth dialing for ``peer_id``, as heard from peers (untrusted).

    Direct addresses lose their ``/p2p/<id>`` suffix (the handshake proves the id); relay
    addresses are kept whole and only when they end in ``peer_id`` (or in ``/p2p-circuit``, as
    identify and DHT records carry them; ``peer_id`` is then appended) — one naming another
    peer would connect us to someone else. Unparsable addresses are skipped.
    """
    out: list[multiaddr.Multiaddr] = []
    for text in addrs:
        is_relay = "/p2p-circuit" in text
        if is_relay:  # identify and DHT records carry them without the trailing id
            text = circuit_addr_for(text, peer_id) or ""
        if is_relay and (not relayed or not text):
            continue
        if not is_relay:
            base, _, named = text.partition("/p2p/")
            if named and named != peer_id:
                continue
            text = base
        try:
            out.append(multiaddr.Multiaddr(text))
        except Exception:  # noqa: BLE001 - a malformed address from a peer is just skipped
            continue
    return out


def short_reason(exc: BaseException) -> str:
    """The cause of a failed dial, in one line: py-libp2p wraps it (``unable to connect …
    (with exceptions)``) with the real reasons a level or two down."""
    if isinstance(exc, trio.TooSlowError):
        return "timed out"
    reasons = list(dict.fromkeys(_root_reasons(exc)))
    text = "; ".join(reasons)[:300]
    if "negotiate the secure protocol" in text:
        text += " (the peer offers no Noise; Lattica speaks TCP + Noise + Yamux)"
    elif "negotiate the multiplexer" in text:
        text += " (the peer offers no Yamux; Lattica speaks TCP + Noise + Yamux)"
    return text


def _root_reasons(exc: BaseException, depth: int = 0) -> list[str]:
    """One line per failure inside ``exc``'s exception groups (``errors`` or ``exceptions``),
    looking through a ``__cause__`` that holds them."""
    for holder in (exc, exc.__cause__):
        subs = nested_errors(holder) if holder is not None else []
        if subs and depth < 4:
            return [r for sub in subs for r in _root_reasons(sub, depth + 1)]
    if isinstance(exc, trio.TooSlowError):
        return ["timed out"]
    text = _first_line(exc)
    deepest: str | None = None
    inner: BaseException = exc
    for _ in range(6):  # down to the OS error under "fail to open connection to peer …"
        group = inner.exceptions if isinstance(inner, BaseExceptionGroup) else ()
        below = inner.__cause__ if inner.__cause__ is not None else (group[0] if group else None)
        if below is None:
            break
        inner = below
        if not isinstance(inner, BaseExceptionGroup) and _first_line(inner) not in text:
            deepest = _first_line(inner)
    if deepest is not None:
        text = f"{text}: {deepest}"
    return [text[:300]]


def _first_line(exc: BaseException) -> str:
    return (str(exc) or type(exc).__name__).splitlines()[0][:200]
