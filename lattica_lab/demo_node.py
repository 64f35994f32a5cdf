"""A minimal node for end-to-end tests and demos: one host plus ``ReplicatedState``.

    python -m lattica_lab.demo_node --data-dir D --run-id R [--admin PEER] [--connect MADDR]...

Prints JSON lines on stdout: ``{"event": "ready", "peer_id", "addr"}`` once listening, then
``{"event": "live", "live": [...], "left": [...]}`` each time its view of the live members
(or of those that left cleanly) changes. On
SIGTERM or SIGINT it calls ``leave()`` and exits; SIGKILL is the crash case.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from pathlib import Path

import multiaddr
import trio
from libp2p.peer.peerinfo import info_from_p2p_addr

from lattica.crdt.config import StateConfig
from lattica.crdt.liveness import LeasePolicy
from lattica.crdt.state import ReplicatedState
from lattica.net.host import build_host
from lattica.net.identity import load_or_create_identity


def _emit(**fields: object) -> None:
    print(json.dumps(fields, sort_keys=True), flush=True)


async def _report_live(state: ReplicatedState) -> None:
    last: tuple[list[str], list[str]] | None = None
    while True:
        live = state.live_members()
        left = sorted(p for p, m in state.snapshot()["members"].items() if m["left"])
        if (live, left) != last:
            _emit(event="live", live=live, left=left)
            last = (live, left)
        with trio.move_on_after(0.1):
            await state.wait_changed()


async def _connect(host, addrs: list[str]) -> None:
    for addr in addrs:
        with trio.fail_after(10):
            await host.connect(info_from_p2p_addr(multiaddr.Multiaddr(addr)))


async def main(args: argparse.Namespace) -> None:
    data_dir = Path(args.data_dir)
    key_pair = load_or_create_identity(data_dir)
    host = build_host(key_pair)
    config = StateConfig(
        admins=tuple(args.admin),
        lease=LeasePolicy(heartbeat_interval=args.heartbeat, lease=args.lease, clock_skew=0.0),
        sync_interval=0.5,
        peer_poll_interval=0.1,
        sync_timeout=5.0,
        max_backoff=2.0,
    )
    listen = multiaddr.Multiaddr(f"/ip4/127.0.0.1/tcp/{args.port}")
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with host.run([listen]), trio.open_nursery() as nursery:
            state = ReplicatedState(host, key_pair, data_dir=data_dir, run_id=args.run_id, config=config)
            await nursery.start(state.run)
            addr = f"{host.get_addrs()[0]}"
            await state.update_member(addrs=[addr], device="cpu", reachability="loopback")
            _emit(event="ready", peer_id=state.peer_id, addr=addr)
            await _connect(host, args.connect)
            nursery.start_soon(_report_live, state)
            async for _ in signals:
                await state.leave()
                _emit(event="left")
                nursery.cancel_scope.cancel()
                break


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="lattica-crdt-demo-node")
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--admin", action="append", default=[])
    parser.add_argument("--connect", action="append", default=[])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--heartbeat", type=float, default=0.5)
    parser.add_argument("--lease", type=float, default=3.0)
    return parser.parse_args(argv)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    trio.run(main, parse_args(sys.argv[1:]))
