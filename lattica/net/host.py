"""Building the libp2p host: TCP transport, Noise security, Yamux multiplexing — nothing else.

py-libp2p's default ``new_host`` offers Noise, TLS, secio *and plaintext*; we always pass the
security and muxer options explicitly so that no unencrypted or deprecated channel is ever
negotiated, whatever the remote side proposes.
"""

from __future__ import annotations

from collections.abc import Sequence

import multiaddr
from libp2p import new_host
from libp2p.abc import IHost
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as _new_x25519
from libp2p.custom_types import TProtocol
from libp2p.network.config import ConnectionConfig
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux

SECURITY_PROTOCOLS = (str(NOISE_PROTOCOL_ID),)
MUXER_PROTOCOLS = (YAMUX_PROTOCOL_ID,)


def build_host(
    key_pair: KeyPair,
    *,
    listen_addrs: Sequence[multiaddr.Multiaddr] = (),
    announce_addrs: Sequence[multiaddr.Multiaddr] = (),
) -> IHost:
    """A libp2p host that speaks TCP + Noise + Yamux only."""
    noise = NoiseTransport(libp2p_keypair=key_pair, noise_privkey=_new_x25519().private_key)
    return new_host(
        key_pair=key_pair,
        sec_opt={TProtocol(NOISE_PROTOCOL_ID): noise},
        muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux},
        listen_addrs=list(listen_addrs) or None,
        announce_addrs=list(announce_addrs) or None,
        connection_config=connection_config(),
    )


def connection_config() -> ConnectionConfig:
    """Watermarks for py-libp2p's connection manager: pruning caps the total at 256."""
    return ConnectionConfig(min_connections=0, low_watermark=0, high_watermark=256)


async def stop_auto_connector(host: IHost) -> None:
    """Stop py-libp2p's auto-connector once the host runs.

    It dials every peer the peerstore has heard of until it holds half the high watermark of
    connections, and the DHT fills the peerstore: in a large run every node would dial every
    node. Lattica decides whom to connect to itself (bootstrap peers, peer exchange, the run's
    members from the DHT).
    """
    connector = getattr(host.get_network(), "auto_connector", None)
    if connector is not None:
        await connector.stop()
