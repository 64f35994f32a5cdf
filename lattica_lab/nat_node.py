"""A small node for the NAT lab: one host with every NAT service, driven over stdin/stdout.

Run: ``python -m lattica_lab.nat_node --listen /ip4/198.18.0.1/tcp/4001 [--relay MA ...]``.
Stdout carries one JSON event per line (``ready``, ``reachability``, ``relay_addrs``,
``connected``, ``path``, ``hole_punch``, ``transfer``, ``error``); stdin takes one JSON command
per line: ``{"cmd": "dial", "peer": ID, "addrs": [MA...]}``,
``{"cmd": "send", "peer": ID, "bytes": N}`` (a framed transfer echoed back as a SHA-256),
``{"cmd": "status"}``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time
from typing import Literal

import multiaddr
import trio
from libp2p.abc import INetStream
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr

from lattica.errors import LatticaError, RemoteProtocolError
from lattica.net.host import build_host
from lattica.net.nat.addresses import conn_is_relayed
from lattica.net.nat.autonat import AutoNATConfig, ReachabilityService
from lattica.net.nat.dialer import Dialer
from lattica.net.nat.holepunch import HolePuncher
from lattica.net.nat.paths import PathBook
from lattica.net.nat.relay import RelayLimitsConfig, RelayReservations, RelayServer
from lattica.net.wire import read_exactly, read_message, write_message

TRANSFER_PROTOCOL = TProtocol("/lattica/lab/transfer/1.0.0")
MAX_TRANSFER = 64 << 20
CHUNK = 64 << 10


def emit(event: str, **fields: object) -> None:
    sys.stdout.write(json.dumps({"event": event, "t": round(time.time(), 3), **fields}) + "\n")
    sys.stdout.flush()


async def handle_transfer(stream: INetStream) -> None:
    peer = str(stream.muxed_conn.peer_id)
    try:
        header = await read_message(stream, max_size=256, peer_id=peer)
        n = header.get("n") if isinstance(header, dict) else None
        if not isinstance(n, int) or not 0 <= n <= MAX_TRANSFER:
            raise RemoteProtocolError(f"bad transfer header {header!r}", peer_id=peer)
        digest = hashlib.sha256()
        remaining = n
        while remaining:
            chunk = await read_exactly(stream, min(CHUNK, remaining), peer_id=peer)
            digest.update(chunk)
            remaining -= len(chunk)
        await write_message(stream, {"n": n, "sha256": digest.hexdigest()}, peer_id=peer)
    except LatticaError as exc:
        emit("rejected", peer=peer, error=str(exc))
        await stream.reset()
        return
    await stream.close()


async def send_bytes(node: LabNode, peer_id: ID, n: int) -> None:
    payload = os.urandom(n)
    start = time.monotonic()
    stream = await node.host.new_stream(peer_id, [TRANSFER_PROTOCOL])
    await write_message(stream, {"n": n})
    for i in range(0, n, CHUNK):
        await stream.write(payload[i:i + CHUNK])
    reply = await read_message(stream, peer_id=str(peer_id))
    await stream.close()
    ok = reply == {"n": n, "sha256": hashlib.sha256(payload).hexdigest()}
    relayed = conn_is_relayed(stream.muxed_conn)  # the connection this stream actually used
    via = None if relayed is None else ("relayed" if relayed else "direct")
    emit("transfer", peer=str(peer_id), bytes=n, ok=ok, path=str(node.paths.path(peer_id)),
         via=via, seconds=round(time.monotonic() - start, 3))


class LabNode:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.listen = multiaddr.Multiaddr(args.listen)
        self.host = build_host(create_new_key_pair(), listen_addrs=[self.listen])
        self.reachability = ReachabilityService(self.host, config=AutoNATConfig())
        limits = RelayLimitsConfig(reservation_ttl=args.reservation_ttl)
        relay_serve: dict[str, bool | Literal["auto"]] = {"on": True, "off": False, "auto": "auto"}
        serve = relay_serve[args.relay_serve]
        self.relay = RelayServer(self.host, limits=limits, serve=serve,
                                 reachability=self.reachability)
        self.reservations = RelayReservations(
            self.host, relays=[info_from_p2p_addr(multiaddr.Multiaddr(a)) for a in args.relay],
            want=args.want, refresh_margin=min(60.0, args.reservation_ttl / 3))
        self.paths = PathBook(self.host)
        self.holepuncher = HolePuncher(self.host)
        self.dialer = Dialer(self.host, relay=self.relay, paths=self.paths,
                             holepuncher=self.holepuncher)

    async def main(self) -> None:
        self.host.set_stream_handler(TRANSFER_PROTOCOL, handle_transfer)
        async with self.host.run([self.listen]), trio.open_nursery() as nursery:
            for service in (self.relay, self.holepuncher, self.paths, self.dialer,
                            self.reachability):
                await nursery.start(service.run)
            if self.args.relay:
                await nursery.start(self.reservations.run)
            emit("ready", peer_id=str(self.host.get_id()),
                 addrs=[str(a) for a in self.host.get_addrs()])
            nursery.start_soon(self._watch)
            await self._commands(nursery)
            nursery.cancel_scope.cancel()

    async def _watch(self) -> None:
        last: dict[str, object] = {}
        while True:
            current = {
                "reachability": str(self.reachability.reachability),
                "relay_addrs": [str(a) for a in self.reservations.relay_addrs()],
                "serving_relay": self.relay.serving,
            }
            for key, value in current.items():
                if last.get(key) != value:
                    emit(key, value=value)
            for entry in self.paths.peers():
                key = f"path:{entry.peer_id}"
                if last.get(key) != entry.path:
                    current[key] = entry.path
                    emit("path", peer=entry.peer_id, path=str(entry.path), rtt_ms=entry.rtt_ms)
                else:
                    current[key] = last[key]
            for pid, result in self.dialer.results.items():
                key = f"punch:{pid}"
                current[key] = result.hole_punch
                if last.get(key) != result.hole_punch and result.hole_punch in (
                        "succeeded", "failed"):
                    emit("hole_punch", peer=str(pid), result=result.hole_punch,
                         direct_s=result.direct_s)
            last = current
            await trio.sleep(0.1)

    async def _commands(self, nursery: trio.Nursery) -> None:
        stdin = trio.lowlevel.FdStream(os.dup(0))
        buffer = b""
        while True:
            data = await stdin.receive_some(65536)
            if not data:
                return
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                nursery.start_soon(self._run_command, line)

    async def _run_command(self, line: bytes) -> None:
        try:
            command = json.loads(line)
            if command["cmd"] == "dial":
                peer_id = ID.from_base58(command["peer"])
                result = await self.dialer.connect(
                    peer_id, [multiaddr.Multiaddr(a) for a in command["addrs"]])
                emit("connected", peer=str(peer_id), path=str(result.path),
                     connect_s=result.connect_s)
            elif command["cmd"] == "send":
                await send_bytes(self, ID.from_base58(command["peer"]), int(command["bytes"]))
            elif command["cmd"] == "status":
                emit("status", reachability=str(self.reachability.reachability),
                     relay_addrs=[str(a) for a in self.reservations.relay_addrs()],
                     peers=[{"peer": p.peer_id, "path": str(p.path), "rtt_ms": p.rtt_ms}
                            for p in self.paths.peers()])
        except Exception as exc:  # noqa: BLE001 - process boundary: every failure of a command is reported to the driver
            emit("error", command=line.decode(errors="replace"), error=repr(exc))


def main() -> None:
    parser = argparse.ArgumentParser(prog="lattica-lab-node")
    parser.add_argument("--listen", required=True)
    parser.add_argument("--relay", action="append", default=[], help="relay multiaddr to reserve on")
    parser.add_argument("--want", type=int, default=1)
    parser.add_argument("--relay-serve", choices=["on", "off", "auto"], default="auto")
    parser.add_argument("--reservation-ttl", type=int, default=3600)
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument("--libp2p-log-level", default="WARNING")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("lattica").setLevel(args.log_level)
    logging.getLogger("libp2p").setLevel(args.libp2p_log_level)
    trio.run(LabNode(args).main)


if __name__ == "__main__":
    main()
