"""One worker process of the swarm-scale lab: several real peers in one trio loop.

Run ``python -m lattica_lab.swarm_worker IP SEED_HEX...`` (``lattica_lab.swarm.Swarm`` starts
it inside a WAN-lab host's namespace). Each seed is a peer: a libp2p host listening on ``IP``,
its own ``TensorService`` data plane and, in a gossip phase, its own ``GossipGroups``. It
prints ``{"event": "ready", "peers": [{"peer_id", "addr"}]}``, then obeys JSON commands, one per
stdin line, answering each with one JSON line on stdout:

- ``{"cmd": "connect", "addrs": [...], "members": [...]}`` -> ``connected``: each of our peers
  dials every member listed before it, ``DIALS_IN_FLIGHT`` at a time;
- ``{"cmd": "prime", "members": [...], "tag": str}`` -> ``primed``: every pair's fast channel
  set up (a tiny fetch per pair), then a tiny all-reduce over all;
- ``{"cmd": "serve-warm"}`` -> ``served``, then ``{"cmd": "warm", "members": [...]}`` ->
  ``warmed``: every pair's fast channel set up again where a cancelled send closed it (before
  each phase; the tiny tensor each fetches is served anew first, as a repeated fetch of the
  same version is refused);
- ``{"cmd": "run", "phase", "mode": "allreduce"|"gossip", "members", "numel", "grace_s",
  "exchange_s", "compute_s", "seed", "round_base", "slow": {peer: compute_s}, "steps"?,
  "end_at"?, "linger"?, "sample"?}`` -> ``done`` with ``records``: per peer, one record per outer step
  (``step``, ``t0``/``t1`` around ``sync()``, ``key``, ``group`` (the size of the group it
  averaged with), ``drawn`` (gossip: the group drawn for the key from every member, whether or
  not they answered), ``handshake_s`` (gossip: the time spent confirming the group), ``bytes``,
  ``libp2p_bytes``, ``skipped``, ``detail``, ``sample``); with ``steps`` and ``linger`` the peers
  step on after ``steps``: ``reached`` when every peer of this worker has done ``steps``, then
  ``done`` after ``{"cmd": "stop"}`` (this loop reads commands while a phase runs);
- ``{"cmd": "quit"}``.

``ok``/``error`` in ``connected`` and ``primed`` say whether every dial and every fast channel
succeeded (a pair left on libp2p streams moves its tensors at a tenth of the speed).

Each peer is a real ``DiLoCo`` strategy (one outer step per inner phase) on a one-tensor model.
The inner phase is simulated: a fixed sleep, then the weights move by a drift shared by all
peers plus a per-peer one (± a fixed random direction, ``DRIFT`` of the norm), so replicas do
differ. Replicas start ``INIT_SPREAD`` apart (relative), as after joins from different
published states.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import multiaddr
import torch
import trio
from libp2p.abc import IHost
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import info_from_p2p_addr

from lattica.coordination.gossip import GossipGroups
from lattica.coordination.groups import GossipGroupsConfig
from lattica.coordination.provider import GroupProvider
from lattica.net.host import build_host
from lattica.net.tensors.stats import TrafficStats
from lattica.net.tensors.transfer import TensorService, TensorServiceConfig
from lattica.train.strategies.diloco import FIRST_IN_FLIGHT, DiLoCo, DiLoCoConfig
from lattica_lab.collective import FixedGroups

INIT_SPREAD = 0.10  # replicas start this far apart (relative)
DRIFT = 1e-3  # per inner phase: each of the shared and the per-peer drift, relative to the norm
SAMPLE = 512  # coordinates of each replica reported for the swarm's spread
DIALS_IN_FLIGHT = 8  # per worker process: more at once outlast py-libp2p's 10 s handshake timeouts
DIAL_ATTEMPTS = 3
# over a 150 ms link on a loaded machine the fast channel's setup (a libp2p stream, a round
# trip, a TCP connect) can take longer than the data plane's default 3 s; a pair that fell
# back to libp2p streams would move its tensors at a tenth of the speed
FAST_CONNECT_TIMEOUT_S = 20.0
FAST_RETRY_S = 2.0
WARM_NAME = "swarm-scale/warm"
# a fast channel holds three frame-sized buffers (send, receive, plaintext) and asks for
# frame-sized socket buffers: at the default 4 MiB, 8 peers of N = 32 in one process hold
# 248 channels, ~3 GiB, and the kernel's OOM killer ended a worker; 1 MiB frames hold a quarter
FAST_FRAME_BYTES = 1 << 20


def libp2p_sent(stats: TrafficStats) -> int:
    """Bytes the data plane sent over libp2p streams (its fallback when no fast channel)."""
    return sum(n for (_peer, path), n in stats.bytes_sent.items() if path == "libp2p")


def one_tensor_model(numel: int) -> torch.nn.Module:
    """The payload: a model of one fp32 tensor."""
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(torch.zeros(numel))
    return model


Message = dict[str, Any]


@dataclass(frozen=True)
class LocalPeer:
    """One peer of this process: its host and its data plane."""

    host: IHost
    service: TensorService

    @property
    def id(self) -> str:
        return self.service.peer_id


class TimedGroups:
    """``GossipGroups`` that remembers how long each key's ``group_for`` took: the time a peer
    spent on its group's handshake (waiting for partners), apart from moving its tensors (per
    key: with overlap the next key's handshake runs while the previous one lands)."""

    def __init__(self, groups: GossipGroups) -> None:
        self.groups = groups
        self.took: dict[str, float] = {}

    async def group_for(self, key: str) -> Sequence[str]:
        began = time.monotonic()
        try:
            return await self.groups.group_for(key)
        finally:
            self.took[key] = time.monotonic() - began

    def next_step(self) -> int | None:
        return self.groups.next_step()


class Worker:
    """Several peers (host + data plane + gossip groups) in one trio loop."""

    def __init__(self, stack: AsyncExitStack, nursery: trio.Nursery, ip: str, seeds: list[str]) -> None:
        self.stack, self.nursery, self.ip, self.seeds = stack, nursery, ip, seeds
        self.peers: list[LocalPeer] = []
        self.stop = trio.Event()  # set by ``stop``: a lingering phase ends

    async def start(self) -> list[Message]:
        listen = multiaddr.Multiaddr(f"/ip4/{self.ip}/tcp/0")
        for seed in self.seeds:
            key_pair = create_new_key_pair(bytes.fromhex(seed))
            host = build_host(key_pair, listen_addrs=[listen])
            await self.stack.enter_async_context(host.run([listen]))
            await host.get_network().auto_connector.stop()  # type: ignore[attr-defined]  # we connect the swarm ourselves
            service = TensorService(host, key_pair, config=TensorServiceConfig(
                fast_connect_timeout_s=FAST_CONNECT_TIMEOUT_S, fast_retry_s=FAST_RETRY_S,
                fast_frame_bytes=FAST_FRAME_BYTES))
            await self.nursery.start(service.run)
            self.peers.append(LocalPeer(host, service))
        return [{"peer_id": p.id, "addr": f"{p.host.get_addrs()[0]}"} for p in self.peers]

    async def connect(self, addrs: list[str], members: list[str]) -> Message:
        """Dial every peer listed before ours, at most ``DIALS_IN_FLIGHT`` at a time.

        All at once (N(N-1)/2 Noise handshakes and identifies on two loaded cores) some take
        longer than py-libp2p's 10 s upgrade and negotiation timeouts, and it resets those
        connections; a dial that failed is tried again after the others."""
        failed: dict[tuple[int, str], str] = {}
        gate = trio.Semaphore(DIALS_IN_FLIGHT)

        async def dial(k: int, host: IHost, addr: str) -> None:
            async with gate:
                try:
                    with trio.fail_after(60):
                        await host.connect(info_from_p2p_addr(multiaddr.Multiaddr(addr)))
                    failed.pop((k, addr), None)
                except Exception as exc:  # noqa: BLE001 - any failure to connect is reported
                    failed[(k, addr)] = f"{addr}: {exc!r}"[:300]

        todo = [(k, p.host, addr) for k, p in enumerate(self.peers)
                for addr in addrs[:members.index(p.id)]]
        for _attempt in range(DIAL_ATTEMPTS):
            async with trio.open_nursery() as nursery:
                for k, host, addr in todo:
                    nursery.start_soon(dial, k, host, addr)
            if not failed:
                break
            todo = [(k, self.peers[k].host, addr) for k, addr in failed]
            await trio.sleep(1.0)
        errors = list(failed.values())
        return {"ok": not errors, "error": f"{len(errors)} dial(s) failed, first: {errors[0]}" if errors else ""}

    async def warm(self, members: list[str]) -> Message:
        """Set up again every pair's fast channel that is gone, before a phase is timed.

        A phase that ends by its deadline cancels sends in flight, and a cancelled send closes
        its channel (never half a message on it); the next phase would otherwise start with
        every such pair setting up a channel at once, the very pile-up the setup paces. Each of
        our peers fetches a tiny tensor from every member after it, ``DIALS_IN_FLIGHT`` at a
        time; a fetch whose request went over libp2p streams (no fast channel) is a failure."""
        failed: list[str] = []
        gate = trio.Semaphore(DIALS_IN_FLIGHT)

        async def warm(p: LocalPeer, q: str) -> None:
            async with gate:
                before = p.service.stats.bytes_sent[(q, "libp2p")]
                try:
                    with trio.fail_after(60):
                        await p.service.fetch(q, [WARM_NAME])
                except Exception as exc:  # noqa: BLE001 - reported as a failed warm-up
                    failed.append(f"fetch {p.id[-8:]} <- {q[-8:]}: {type(exc).__name__}: {exc}"[:300])
                    return
                if p.service.stats.bytes_sent[(q, "libp2p")] != before:
                    failed.append(f"fetch {p.id[-8:]} <- {q[-8:]}: no fast channel")

        async with trio.open_nursery() as nursery:
            for p in self.peers:
                for q in members[members.index(p.id) + 1:]:
                    nursery.start_soon(warm, p, q)
        return {"ok": not failed, "error": f"{len(failed)} failure(s), first: {failed[0]}" if failed else ""}

    async def prime(self, members: list[str], tag: str) -> Message:
        """Set up every pair's fast channel before anything is timed, then a tiny all-reduce
        over all.

        Each of our peers fetches a tiny served tensor from every member after it, at most
        ``DIALS_IN_FLIGHT`` at a time per process: a fetch needs nothing from the other side's
        caller, and its request sets up the fast channel. The all-reduce alone would set up all
        N(N-1) channels at once; at N = 32 their libp2p setup streams then outlast
        py-libp2p's 10 s negotiation timeout. A pair whose fast channel could not be set up
        (its tensors would go over libp2p streams, at a tenth of the speed) fails the setup,
        which then primes again."""
        failed: list[str] = []
        gate = trio.Semaphore(DIALS_IN_FLIGHT)
        for p in self.peers:
            p.service.serve(WARM_NAME, torch.zeros(1))

        async def warm(p: LocalPeer, q: str) -> None:
            async with gate:
                try:
                    with trio.fail_after(60):
                        await p.service.fetch(q, [WARM_NAME])
                except Exception as exc:  # noqa: BLE001 - reported as a failed setup
                    failed.append(f"fetch {p.id[-8:]} <- {q[-8:]}: {type(exc).__name__}: {exc}"[:300])

        async def prime(p: LocalPeer) -> None:
            stats = p.service.stats
            try:
                with trio.fail_after(120):
                    await p.service.allreduce([torch.ones(len(members) * 64)], group=members, tag=tag)
            except Exception as exc:  # noqa: BLE001 - reported as a failed setup
                failed.append(f"prime {p.id[-8:]}: {type(exc).__name__}: {exc}"[:300])
                return
            slow = [q for q in members if q != p.id and stats.bytes_sent[(q, "fast")] == 0]
            if slow:
                failed.append(f"prime {p.id[-8:]}: no fast channel to {len(slow)} peer(s)")

        async with trio.open_nursery() as nursery:  # a channel serves both ways: one per pair
            for p in self.peers:
                for q in members[members.index(p.id) + 1:]:
                    nursery.start_soon(warm, p, q)
        if not failed:
            async with trio.open_nursery() as nursery:
                for p in self.peers:
                    nursery.start_soon(prime, p)
        return {"ok": not failed, "error": f"{len(failed)} failure(s), first: {failed[0]}" if failed else ""}

    async def run(self, cmd: Message, reply: Callable[[Message], None]) -> Message:
        """One phase. With ``steps`` and ``linger``, the peers go on stepping after ``steps``
        (a swarm does not stop) until ``stop``; ``reached`` tells the caller all ours got there,
        so no measured step of any peer pairs against partners that have already stopped. On
        ``stop`` each peer ends after the step it is in: no exchange is cut mid-send (a cut one
        closes its channel, and the next phase's first transfers on it would fail)."""
        records: dict[str, list[Message]] = {}
        self.stop = trio.Event()
        steps = int(cmd["steps"]) if cmd.get("steps") else None
        linger = steps is not None and bool(cmd.get("linger"))
        async with trio.open_nursery() as nursery:
            for p in self.peers:
                records[p.id] = []
                nursery.start_soon(self._peer_loop, p, cmd, records[p.id], linger)
            if linger:
                assert steps is not None
                while any(len(r) < steps for r in records.values()):
                    await trio.sleep(0.1)
                reply({"event": "reached", "phase": cmd["phase"]})
                # each peer ends after the step it is in (no exchange is cut mid-send)
        return {"ok": True, "records": records}

    async def _peer_loop(self, p: LocalPeer, cmd: Message, out: list[Message], linger: bool) -> None:
        members: list[str] = cmd["members"]
        numel, grace = int(cmd["numel"]), float(cmd["grace_s"])
        groups: GroupProvider
        gossip: TimedGroups | None = None
        if cmd["mode"] == "gossip":
            # a fresh handshake state per phase (its keys restart); it takes over the protocol
            drawn = GossipGroups(p.host, peer_id=p.id, run_id=cmd["phase"], members=lambda: members,
                                 config=GossipGroupsConfig(grace_s=grace))
            await self.nursery.start(drawn.run)
            groups = gossip = TimedGroups(drawn)
        else:
            groups = FixedGroups(sorted(members))
        model = one_tensor_model(numel)
        overlap = cmd["mode"] == "gossip" and bool(cmd.get("overlap"))
        strategy = DiLoCo(model, collective=p.service, groups=groups, config=DiLoCoConfig(
            inner_steps=1, averaging=cmd["mode"], exchange_timeout_s=float(cmd["exchange_s"]), max_attempts=1,
            overlap=overlap))
        common = torch.Generator().manual_seed(cmd["seed"])
        own = torch.Generator().manual_seed(cmd["seed"] * 1000 + members.index(p.id) + 1)
        base = torch.randn(numel, generator=common)
        init = base + INIT_SPREAD * torch.randn(numel, generator=own)
        shared_drift = DRIFT * torch.randn(numel, generator=common)
        own_drift = DRIFT * torch.randn(numel, generator=own)
        # distinct tags per phase: round keys start at the phase's base
        strategy.load_outer_state_dict({"params": {"weight": init}, "round": int(cmd["round_base"])})
        async with trio.open_nursery() as flights:
            strategy.bind_nursery(flights)  # overlapped exchanges run here
            await self._steps(p, strategy, cmd, out, (shared_drift, own_drift), linger=linger, gossip=gossip)
            # with overlap, the last exchange lands (no exchange is cut mid-send either)
            await strategy.finish()
        if gossip is not None:  # as a daemon whose training ended: partners asking are answered gone
            gossip.groups.leave()

    async def _steps(self, p: LocalPeer, strategy: DiLoCo, cmd: Message, out: list[Message],
                     drifts: tuple[torch.Tensor, torch.Tensor], *, linger: bool,
                     gossip: TimedGroups | None) -> None:
        """The peer's steps of one phase: inner phase (a sleep, then the drifts), sync, record."""
        members: list[str] = cmd["members"]
        shared_drift, own_drift = drifts
        weight = next(strategy.model.parameters())
        numel = weight.numel()
        idx = torch.linspace(0, numel - 1, min(SAMPLE, numel)).long()
        compute = float(cmd["slow"].get(p.id, cmd["compute_s"]))
        end_at = cmd.get("end_at")
        total = int(cmd["steps"]) if cmd.get("steps") and not linger else 10**9
        signs = random.Random(p.id)
        if gossip is not None:
            gossip.groups.begin()  # the first inner phase starts now
        # an all-reduce phase is cut at its end (a step would wait for peers that stopped); a
        # gossip peer finishes the step it is in, so no exchange is cut mid-send
        cut = end_at if end_at is not None and cmd["mode"] != "gossip" else None
        stats = p.service.stats
        sent, slow = stats.total_sent(), libp2p_sent(stats)
        with trio.move_on_after(max(0.0, cut - time.time()) if cut is not None else math.inf):
            def over() -> bool:  # a step under way when the phase ends is finished, not cut
                return (linger and self.stop.is_set()) or (end_at is not None and time.time() >= end_at)

            for step in range(total):
                if over():
                    break
                with trio.move_on_after(max(0.0, end_at - time.time()) if end_at else math.inf):
                    await trio.sleep(compute)  # the inner phase
                if over():
                    break
                with torch.no_grad():
                    weight.add_(shared_drift).add_(own_drift, alpha=signs.choice((-1.0, 1.0)))
                t0 = time.time()
                report = await strategy.sync()
                # with overlap the first sync lands nothing (its exchange is in flight): a step
                # all the same, its Δ taken on its own by the look-ahead start
                first = report.detail == FIRST_IN_FLIGHT
                drawn = members
                if gossip is not None:
                    drawn = [p.id] if first else list(gossip.groups.proposal(report.key))
                record = {"step": step, "t0": t0, "t1": time.time(), "key": report.key,
                          "group": max(1, len(report.group)), "first_in_flight": first, "drawn": drawn,
                          "handshake_s": gossip.took.get(report.key, 0.0) if gossip is not None else 0.0,
                          "left_out": list(gossip.groups.left_out) if gossip is not None else [],
                          # sent since the last step: overlapped exchanges send between syncs
                          "bytes": stats.total_sent() - sent, "libp2p_bytes": libp2p_sent(stats) - slow,
                          "skipped": report.skipped and not first, "detail": report.detail[:200]}
                sent, slow = stats.total_sent(), libp2p_sent(stats)
                if cmd.get("sample"):
                    record["sample"] = strategy.outer_parameters()[0][idx].tolist()
                out.append(record)


async def serve(ip: str, seeds: list[str]) -> None:
    """Start the peers of ``seeds`` on ``ip`` and obey commands on stdin until ``quit``."""

    def reply(obj: Message) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    # the hosts' contexts (on ``stack``) are entered inside the nursery, each opening its own
    # nursery: they must close before it, or trio finds the nurseries misnested at shutdown
    async with trio.open_nursery() as nursery, AsyncExitStack() as stack:
        worker = Worker(stack, nursery, ip, seeds)
        reply({"event": "ready", "peers": await worker.start()})

        async def run_phase(cmd: Message) -> None:
            reply({"event": "done", "phase": cmd["phase"], **await worker.run(cmd, reply)})

        async for line in trio.wrap_file(sys.stdin):
            cmd = json.loads(line)
            if cmd["cmd"] == "quit":
                break
            if cmd["cmd"] == "connect":
                reply({"event": "connected", **await worker.connect(cmd["addrs"], cmd["members"])})
            elif cmd["cmd"] == "serve-warm":  # a fresh version: a repeated fetch is refused
                for p in worker.peers:
                    p.service.serve(WARM_NAME, torch.zeros(1))
                reply({"event": "served"})
            elif cmd["cmd"] == "warm":
                reply({"event": "warmed", **await worker.warm(cmd["members"])})
            elif cmd["cmd"] == "prime":
                reply({"event": "primed", **await worker.prime(cmd["members"], cmd["tag"])})
            elif cmd["cmd"] == "run":  # runs beside this loop, which still reads ``stop``
                nursery.start_soon(run_phase, cmd)
            elif cmd["cmd"] == "stop":
                worker.stop.set()
        nursery.cancel_scope.cancel()


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit("usage: python -m lattica_lab.swarm_worker IP SEED_HEX...")
    logging.basicConfig(level=os.environ.get("SWARM_LOG_LEVEL", "WARNING"), stream=sys.stderr,
                        format="%(created).3f %(levelname)s %(name)s: %(message)s")
    if os.environ.get("SWARM_GROUPS_DEBUG"):  # every handshake verdict, in the worker's log
        logging.getLogger("lattica.coordination").setLevel(logging.DEBUG)
    trio.run(serve, sys.argv[1], sys.argv[2:])


if __name__ == "__main__":
    main()
