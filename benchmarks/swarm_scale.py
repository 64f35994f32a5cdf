"""DiLoCo at swarm scale over WAN sites: all-reduce against gossip averaging, stragglers, a kill.

Run as root (the WAN lab builds network namespaces)::

    nice -n 10 .venv/bin/python benchmarks/swarm_scale.py                        # N = 8, 16, 32
    nice -n 10 .venv/bin/python benchmarks/swarm_scale.py --sizes 4 --steps 4 \\
        --payload-mib 1 --window-s 15                                            # ~1-2 min

Layout: four WAN-lab sites (``lattica_lab.wan.WanLab``), every pair linked with its own RTT
(50, 70, 90, 110, 130, 150 ms; ``--mbit`` caps each link's rate). For each N the peers are
dealt round-robin over the sites; each site runs its peers in one worker process (several real
libp2p hosts, each with its own ``TensorService`` data plane and ``GossipGroups``, in one trio
loop). At the straggler size two peers run alone in processes of their own, so they can be
SIGKILLed: the lowest peer id (the peer that sealed every round under the old coordinator) and
a random other one.

Each peer is a real ``DiLoCo`` strategy (one outer step per inner phase) on a one-tensor model of
``--payload-mib`` fp32 (16 MiB: 4,194,304 parameters). The inner phase is simulated: a fixed
sleep (``--compute-s``), then the weights move by a drift shared by all peers plus a per-peer
one (± a fixed random direction, 0.1 % of the weights' norm), so replicas do differ. Replicas
start 10 % apart (relative), as after joins from different published states.

Phases, all-reduce and gossip measured the same way (the same warm-up steps, the same number
of measured steps, the same clock points):

0. Setup (every N): the workers start their hosts, dial (each peer the peers before it,
   ``DIALS_IN_FLIGHT`` at a time per process) and set up every pair's fast channel (a tiny
   fetch per pair, as many at a time), then prime with a tiny all-reduce over all. All at once,
   at N = 32 some of the N(N-1)/2 handshakes outlasted py-libp2p's 10 s upgrade and negotiation
   timeouts and it reset those connections. A pair left on libp2p streams (the data plane's
   fallback, a tenth of the speed) fails the setup, which is tried ``SETUP_ATTEMPTS`` times.
1. ``round`` (every N): ``--warmup`` + ``--round-steps`` (5) outer steps; the gossip phase at
   the straggler size runs ``--steps`` (20) of them, for the consensus distance. A step's round time is a
   peer's ``sync()`` time (from the end of its inner phase to its next weights); the figure is
   the median over steps of the mean over peers. Bytes per peer: what its data plane sent per
   measured step (median over peers). All-reduce runs on the fixed group of all N peers (one
   global collective per step); gossip on ``GossipGroups`` pairs redrawn every step.
   Gossip's exchange waits ``--exchange-timeout-s`` (30 s) for its partner's tensors (a
   4M-parameter ``[φ, Δ]`` is 32 MiB each way); the group handshake keeps ``--grace-s``.
   Each phase also reports the share of peer-steps averaged alone and the CPU seconds of the
   workers and of the delay lines; the JSON's ``links`` has each delay line's drops, worst
   late release and CPU over the run.
2. ``straggler`` (at N = 16, or the size of ``--straggler-size``): for ``--window-s`` seconds
   (and at least 10 of the mode's step periods) without, then (at least 25 periods, so the
   capped peer steps twice) with, one peer whose step period is capped to 1/10 of the others' (its inner
   phase sleeps 10x their measured period); the other peers' outer steps per minute with it,
   divided by the same without it.
3. ``consensus``: the gossip ``round`` phase at the straggler size, with a fixed sample of
   coordinates of every replica after each step: the swarm's spread
   ``‖φ_i − mean φ‖ / ‖mean φ‖`` (median over peers) per step — its value after the last step
   and the per-step trend.
4. ``kill`` (gossip, straggler size): during a ``--window-s`` window the lowest-id peer is
   SIGKILLed at 1/3 and a random other peer at 2/3, each at a random point of its step. The
   stall is the longest interval between two consecutive outer steps of any surviving peer
   (it includes one normal step); the bound it is held to is the group grace plus one step
   (the median interval before the first kill).

The membership view is static (every peer of the run): a dead peer stays in the view, so a peer
drawn with it learns it is gone by the handshake or the exchange (at most the grace) and steps
alone. All runs happen in one lab; the delay lines and peers share the machine's cores, so the
figures are for this machine (``load_avg_1m`` says how busy it was).

The last line is one JSON object: ``sizes``, ``allreduce_round_s``, ``gossip_round_s``,
``allreduce_bytes_per_peer``, ``gossip_bytes_per_peer`` (lists per N), ``straggler_rate_allreduce``,
``straggler_rate_gossip``, ``consensus_distance`` (``value``, ``trend``, ``shrinking``),
``kill_any_stall_s``, ``kill_stall_bound_s`` and the settings. A phase that does not finish — a
worker that exits or misses its deadline, an all-reduce step that fails, a peer short of its
steps — fails the run: exit status 1 and one line on stderr, no figures. Without root (or without
the lab's tools) the run exits with status 2 and says why.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import signal
import statistics
import sys
import time
from contextlib import AsyncExitStack

import _checkout  # noqa: F401  (the checkout root on sys.path: lattica_lab)

SITE_RTTS_MS = (50, 70, 90, 110, 130, 150)  # the six links of four sites, in pair order
SITES = ("s1", "s2", "s3", "s4")
INIT_SPREAD = 0.10  # replicas start this far apart (relative)
DRIFT = 1e-3  # per inner phase: each of the shared and the per-peer drift, relative to the norm
SAMPLE = 512  # coordinates of each replica reported for the swarm's spread
PHASE_MARGIN_S = 120.0  # a phase's deadline: its expected length plus this
SETUP_ATTEMPTS = 3  # connect and prime again after a failed setup, at most this often
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
WORKER_SCRIPT = os.path.abspath(__file__)


class BenchmarkFailed(RuntimeError):
    """A phase did not finish: the benchmark reports no figures."""


# -- pure summaries (tested without a lab) ----------------------------------------------------


def check_steps(phase: str, records: dict[str, list[dict]], peers: list[str], steps: int, *,
                allow_alone: bool) -> None:
    """Raise unless every peer of ``peers`` reported ``steps`` outer steps, none skipped (and,
    for an all-reduce, none averaged alone)."""
    missing = [p for p in peers if p not in records]
    if missing:
        raise BenchmarkFailed(f"{phase}: {len(missing)} of {len(peers)} peers reported nothing")
    for peer in peers:
        done = records[peer]
        if len(done) < steps:
            raise BenchmarkFailed(f"{phase}: peer {peer[-8:]} finished {len(done)} of {steps} steps")
        for r in done[:steps]:
            if r.get("skipped"):
                raise BenchmarkFailed(f"{phase}: peer {peer[-8:]} skipped step {r['step']}: {r.get('detail', '')}")
            if not allow_alone and r.get("group", 0) < len(peers):
                raise BenchmarkFailed(f"{phase}: peer {peer[-8:]} averaged step {r['step']} with "
                                      f"{r.get('group')} of {len(peers)} peers")


def round_figures(records: dict[str, list[dict]], warmup: int, steps: int) -> tuple[float, float]:
    """(round seconds: median over measured steps of the mean over peers of the sync time,
    bytes per peer per step: median over peers)."""
    per_step = []
    for i in range(warmup, warmup + steps):
        per_step.append(statistics.fmean(r[i]["t1"] - r[i]["t0"] for r in records.values()))
    per_peer_bytes = [sum(x["bytes"] for x in r[warmup:warmup + steps]) / steps for r in records.values()]
    return statistics.median(per_step), statistics.median(per_peer_bytes)


def steps_per_minute(records: dict[str, list[dict]], peers: list[str], start: float, end: float) -> float:
    """Outer steps per minute per peer of ``peers`` completed within ``[start, end]`` (mean).

    A skipped step (its all-reduce failed, so no outer step was taken) is no progress and does
    not count; a gossip step averaged alone is an outer step (on the peer's own Δ) and does."""
    if end <= start:
        raise BenchmarkFailed("rate window is empty")
    counts = [sum(1 for r in records.get(p, []) if start <= r["t1"] <= end and not r.get("skipped"))
              for p in peers]
    return statistics.fmean(counts) * 60.0 / (end - start)


def spread(samples: list[list[float]]) -> float:
    """Median over replicas of ‖φ_i − mean φ‖ / ‖mean φ‖ on the sampled coordinates."""
    n = len(samples)
    mean = [sum(col) / n for col in zip(*samples, strict=True)]
    norm = math.sqrt(sum(m * m for m in mean))
    if norm == 0:
        raise BenchmarkFailed("consensus: the replicas' mean is zero")
    return statistics.median(
        math.sqrt(sum((a - m) ** 2 for a, m in zip(s, mean, strict=True))) / norm for s in samples
    )


def consensus_trend(records: dict[str, list[dict]], steps: int) -> dict:
    """The swarm's spread after each of the first ``steps`` steps; ``shrinking`` when the last
    is below the first and the second half's mean is below the first half's."""
    trend = []
    for i in range(steps):
        samples = [r[i]["sample"] for r in records.values() if len(r) > i and r[i].get("sample")]
        if len(samples) != len(records):
            raise BenchmarkFailed(f"consensus: step {i} sampled by {len(samples)} of {len(records)} peers")
        trend.append(spread(samples))
    half = max(1, len(trend) // 2)
    shrinking = trend[-1] < trend[0] and statistics.fmean(trend[half:] or trend) < statistics.fmean(trend[:half])
    return {"steps": steps, "value": trend[-1], "trend": [round(t, 5) for t in trend],
            "shrinking": shrinking, "bounded": max(trend) <= trend[0] * 1.05}


def kill_stall(records: dict[str, list[dict]], survivors: list[str], start: float, end: float) -> float:
    """The longest interval between consecutive outer steps (ends) of any survivor in the window."""
    longest = 0.0
    for peer in survivors:
        ends = [start, *sorted(r["t1"] for r in records.get(peer, []) if start <= r["t1"] <= end), end]
        if len(ends) < 3:
            raise BenchmarkFailed(f"kill: surviving peer {peer[-8:]} completed no step after the kill")
        longest = max(longest, max(b - a for a, b in itertools.pairwise(ends)))
    return longest


def libp2p_sent(stats) -> int:
    """Bytes the data plane sent over libp2p streams (its fallback when no fast channel)."""
    return sum(n for (_peer, path), n in stats.bytes_sent.items() if path == "libp2p")


# -- worker process ------------------------------------------------------------------------


def one_tensor_model(numel: int):
    """The payload: a model of one fp32 tensor."""
    import torch

    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(torch.zeros(numel))
    return model


class Worker:
    """Several peers (host + data plane + gossip groups) in one trio loop."""

    def __init__(self, stack: AsyncExitStack, nursery, ip: str, seeds: list[str]) -> None:
        self.stack, self.nursery, self.ip, self.seeds = stack, nursery, ip, seeds
        self.peers: list[dict] = []

    async def start(self) -> list[dict]:
        import multiaddr
        from libp2p.crypto.ed25519 import create_new_key_pair

        from lattica.net.host import build_host
        from lattica.net.tensors.transfer import TensorService, TensorServiceConfig

        listen = multiaddr.Multiaddr(f"/ip4/{self.ip}/tcp/0")
        for seed in self.seeds:
            key_pair = create_new_key_pair(bytes.fromhex(seed))
            host = build_host(key_pair, listen_addrs=[listen])
            await self.stack.enter_async_context(host.run([listen]))
            await host.get_network().auto_connector.stop()  # we connect the swarm ourselves
            service = TensorService(host, key_pair, config=TensorServiceConfig(
                fast_connect_timeout_s=FAST_CONNECT_TIMEOUT_S, fast_retry_s=FAST_RETRY_S,
                fast_frame_bytes=FAST_FRAME_BYTES))
            await self.nursery.start(service.run)
            self.peers.append({"host": host, "service": service, "id": service.peer_id})
        return [{"peer_id": p["id"], "addr": f"{p['host'].get_addrs()[0]}"} for p in self.peers]

    async def connect(self, addrs: list[str], members: list[str]) -> dict:
        """Dial every peer listed before ours, at most ``DIALS_IN_FLIGHT`` at a time.

        All at once (N(N-1)/2 Noise handshakes and identifies on two loaded cores) some take
        longer than py-libp2p's 10 s upgrade and negotiation timeouts, and it resets those
        connections; a dial that failed is tried again after the others."""
        import multiaddr
        import trio
        from libp2p.peer.peerinfo import info_from_p2p_addr

        failed: dict[tuple[int, str], str] = {}
        gate = trio.Semaphore(DIALS_IN_FLIGHT)

        async def dial(k: int, host, addr: str) -> None:
            async with gate:
                try:
                    with trio.fail_after(60):
                        await host.connect(info_from_p2p_addr(multiaddr.Multiaddr(addr)))
                    failed.pop((k, addr), None)
                except Exception as exc:  # noqa: BLE001 - any failure to connect is reported
                    failed[(k, addr)] = f"{addr}: {exc!r}"[:300]

        todo = [(k, p["host"], addr) for k, p in enumerate(self.peers)
                for addr in addrs[:members.index(p["id"])]]
        for _attempt in range(DIAL_ATTEMPTS):
            async with trio.open_nursery() as nursery:
                for k, host, addr in todo:
                    nursery.start_soon(dial, k, host, addr)
            if not failed:
                break
            todo = [(k, self.peers[k]["host"], addr) for k, addr in failed]
            await trio.sleep(1.0)
        errors = list(failed.values())
        return {"ok": not errors, "error": f"{len(errors)} dial(s) failed, first: {errors[0]}" if errors else ""}

    async def prime(self, members: list[str], tag: str) -> dict:
        """Set up every pair's fast channel before anything is timed, then a tiny all-reduce
        over all.

        Each of our peers fetches a tiny served tensor from every member after it, at most
        ``DIALS_IN_FLIGHT`` at a time per process: a fetch needs nothing from the other side's
        caller, and its request sets up the fast channel. The all-reduce alone would set up all
        N(N-1) channels at once; at N = 32 their libp2p setup streams then outlast
        py-libp2p's 10 s negotiation timeout. A pair whose fast channel could not be set up
        (its tensors would go over libp2p streams, at a tenth of the speed) fails the setup,
        which then primes again."""
        import torch
        import trio

        failed: list[str] = []
        gate = trio.Semaphore(DIALS_IN_FLIGHT)
        for p in self.peers:
            p["service"].serve(WARM_NAME, torch.zeros(1))

        async def warm(p, q: str) -> None:
            async with gate:
                try:
                    with trio.fail_after(60):
                        await p["service"].fetch(q, [WARM_NAME])
                except Exception as exc:  # noqa: BLE001 - reported as a failed setup
                    failed.append(f"fetch {p['id'][-8:]} <- {q[-8:]}: {type(exc).__name__}: {exc}"[:300])

        async def prime(p) -> None:
            stats = p["service"].stats
            try:
                with trio.fail_after(120):
                    await p["service"].allreduce([torch.ones(len(members) * 64)], group=members, tag=tag)
            except Exception as exc:  # noqa: BLE001 - reported as a failed setup
                failed.append(f"prime {p['id'][-8:]}: {type(exc).__name__}: {exc}"[:300])
                return
            slow = [q for q in members if q != p["id"] and stats.bytes_sent[(q, "fast")] == 0]
            if slow:
                failed.append(f"prime {p['id'][-8:]}: no fast channel to {len(slow)} peer(s)")

        async with trio.open_nursery() as nursery:  # a channel serves both ways: one per pair
            for p in self.peers:
                for q in members[members.index(p["id"]) + 1:]:
                    nursery.start_soon(warm, p, q)
        if not failed:
            async with trio.open_nursery() as nursery:
                for p in self.peers:
                    nursery.start_soon(prime, p)
        return {"ok": not failed, "error": f"{len(failed)} failure(s), first: {failed[0]}" if failed else ""}

    async def run(self, cmd: dict) -> dict:
        import trio

        records: dict[str, list[dict]] = {}
        async with trio.open_nursery() as nursery:
            for p in self.peers:
                records[p["id"]] = []
                nursery.start_soon(self._peer_loop, p, cmd, records[p["id"]])
        return {"ok": True, "records": records}

    async def _peer_loop(self, p: dict, cmd: dict, out: list[dict]) -> None:
        import torch
        import trio

        from lattica.coordination.gossip import GossipGroups
        from lattica.coordination.groups import GossipGroupsConfig
        from lattica.train.strategies.diloco import DiLoCo, DiLoCoConfig
        from lattica_lab.collective import FixedGroups

        members: list[str] = cmd["members"]
        numel, grace = int(cmd["numel"]), float(cmd["grace_s"])
        if cmd["mode"] == "gossip":
            # a fresh handshake state per phase (its keys restart); it takes over the protocol
            groups = GossipGroups(p["host"], peer_id=p["id"], run_id=cmd["phase"], members=lambda: members,
                                  config=GossipGroupsConfig(grace_s=grace))
            await self.nursery.start(groups.run)
        else:
            groups = FixedGroups(sorted(members))
        model = one_tensor_model(numel)
        strategy = DiLoCo(model, collective=p["service"], groups=groups, config=DiLoCoConfig(
            inner_steps=1, averaging=cmd["mode"], exchange_timeout_s=float(cmd["exchange_s"]), max_attempts=1))
        common = torch.Generator().manual_seed(cmd["seed"])
        own = torch.Generator().manual_seed(cmd["seed"] * 1000 + members.index(p["id"]) + 1)
        base = torch.randn(numel, generator=common)
        init = base + INIT_SPREAD * torch.randn(numel, generator=own)
        shared_drift = DRIFT * torch.randn(numel, generator=common)
        own_drift = DRIFT * torch.randn(numel, generator=own)
        # distinct tags per phase: round keys start at the phase's base
        strategy.load_outer_state_dict({"params": {"weight": init}, "round": int(cmd["round_base"])})
        idx = torch.linspace(0, numel - 1, min(SAMPLE, numel)).long()
        compute = float(cmd["slow"].get(p["id"], cmd["compute_s"]))
        end_at = cmd.get("end_at")
        total = int(cmd["steps"]) if cmd.get("steps") else 10**9
        signs = random.Random(p["id"])
        with trio.move_on_after(max(0.0, end_at - time.time()) if end_at else math.inf):
            for step in range(total):
                await trio.sleep(compute)  # the inner phase
                with torch.no_grad():
                    model.weight.add_(shared_drift).add_(own_drift, alpha=signs.choice((-1.0, 1.0)))
                stats = p["service"].stats
                t0, sent, slow = time.time(), stats.total_sent(), libp2p_sent(stats)
                report = await strategy.sync()
                record = {"step": step, "t0": t0, "t1": time.time(), "group": len(report.group),
                          "bytes": stats.total_sent() - sent, "libp2p_bytes": libp2p_sent(stats) - slow,
                          "skipped": report.skipped, "detail": report.detail[:200]}
                if cmd.get("sample"):
                    record["sample"] = strategy.outer_parameters()[0][idx].tolist()
                out.append(record)


async def _worker_main(ip: str, seeds: list[str]) -> None:
    import trio

    def reply(obj: dict) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    async with AsyncExitStack() as stack, trio.open_nursery() as nursery:
        worker = Worker(stack, nursery, ip, seeds)
        reply({"event": "ready", "peers": await worker.start()})
        async for line in trio.wrap_file(sys.stdin):
            cmd = json.loads(line)
            if cmd["cmd"] == "quit":
                break
            if cmd["cmd"] == "connect":
                reply({"event": "connected", **await worker.connect(cmd["addrs"], cmd["members"])})
            elif cmd["cmd"] == "prime":
                reply({"event": "primed", **await worker.prime(cmd["members"], cmd["tag"])})
            elif cmd["cmd"] == "run":
                reply({"event": "done", "phase": cmd["phase"], **await worker.run(cmd)})
        nursery.cancel_scope.cancel()


# -- the parent: lab, layout, phases ----------------------------------------------------------


def peer_id_of(seed: str) -> str:
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.id import ID

    return ID.from_pubkey(create_new_key_pair(bytes.fromhex(seed)).public_key).to_base58()


class Swarm:
    """N peers in worker processes on the lab's sites; ``solo`` peers each in a process of their own."""

    def __init__(self, lab, n: int, rng: random.Random, *, solo: int) -> None:
        self.lab, self.n = lab, n
        sites = list(lab.sites)
        seeds = [rng.randbytes(32).hex() for _ in range(n)]
        ids = [peer_id_of(s) for s in seeds]
        order = sorted(range(n), key=lambda i: ids[i])
        self.members = [ids[i] for i in order]  # sorted: members[0] is the lowest id
        seeds = [seeds[i] for i in order]
        victims = [0, *rng.sample(range(1, n), solo - 1)] if solo else []
        self.victims = [self.members[i] for i in victims]
        bulk: dict[str, list[str]] = {s: [] for s in sites}
        solo_at: list[tuple[str, str]] = []
        for j, i in enumerate(rng.sample(range(n), n)):  # random site for each peer
            site = sites[j % len(sites)]
            if i in victims:
                solo_at.append((site, seeds[i]))
            else:
                bulk[site].append(seeds[i])
        self.workers: list = []
        self.victim_workers: dict[str, object] = {}
        for site, site_seeds in bulk.items():
            if site_seeds:
                self._spawn(lab.sites[site].hosts[0], site_seeds, f"{site}-bulk")
        for k, (site, seed) in enumerate(solo_at):
            worker = self._spawn(lab.sites[site].hosts[1], [seed], f"{site}-solo{k}")
            self.victim_workers[peer_id_of(seed)] = worker
        addrs: dict[str, str] = {}
        for w in self.workers:
            ready = self._wait(w, "ready", 120, "start")
            addrs.update({p["peer_id"]: p["addr"] for p in ready["peers"]})
        if sorted(addrs) != self.members:
            raise BenchmarkFailed(f"start: {len(addrs)} of {n} peers came up")
        # py-libp2p now and then resets a fresh connection while many are set up at once: dial
        # again (a no-op where connected) and prime again, a few times, before giving up
        for attempt in range(SETUP_ATTEMPTS):
            began = time.time()
            for w in self.workers:
                w.send({"cmd": "connect", "addrs": [addrs[m] for m in self.members], "members": self.members})
            errors = [f"{w.name}: {r.get('error')}" for w in self.workers
                      if not (r := self._wait(w, "connected", 240, "connect")).get("ok")]
            if not errors:
                connected = time.time()
                for w in self.workers:
                    w.send({"cmd": "prime", "members": self.members, "tag": f"prime/{attempt}"})
                errors = [f"{w.name}: {r.get('error')}" for w in self.workers
                          if not (r := self._wait(w, "primed", 240, "connect")).get("ok")]
            if not errors:
                print(f"  N={n:<3} connected in {connected - began:.0f} s, fast channels and prime in "
                      f"{time.time() - connected:.0f} s", file=sys.stderr, flush=True)
                break
            print(f"  N={n:<3} setup attempt {attempt + 1} failed: {errors[0]}", file=sys.stderr, flush=True)
        else:
            raise BenchmarkFailed(f"connect: {errors[0]}")

    def _spawn(self, host, seeds: list[str], name: str):
        worker = self.lab.spawn(host, [sys.executable, WORKER_SCRIPT, "--worker", host.ip, *seeds],
                                name=name, stderr_path=os.path.join(LOG_DIR, f"swarm-{name}.log"))
        self.workers.append(worker)
        return worker

    @staticmethod
    def _wait(worker, event: str, timeout: float, phase: str) -> dict:
        try:
            return worker.wait_for(lambda e: e.get("event") == event, timeout, fresh=event != "ready")
        except (TimeoutError, RuntimeError) as exc:
            raise BenchmarkFailed(f"{phase}: worker {worker.name} did not finish: {str(exc)[:300]}") from None

    def run(self, phase: str, cmd: dict, timeout: float, *, kills: list[tuple[float, str]] = ()) -> dict:
        """Run one phase on every live worker; SIGKILL the given victims at the given wall times."""
        cmd = {"cmd": "run", "phase": phase, "members": self.members, **cmd}
        live = [w for w in self.workers if w.popen.poll() is None]
        cpu_before, began = self._cpu(live), time.monotonic()
        for w in live:
            w.send(cmd)
        killed = set()
        for at, victim in kills:
            time.sleep(max(0.0, at - time.time()))
            worker = self.victim_workers[victim]
            os.kill(worker.popen.pid, signal.SIGKILL)  # the worker is this peer alone
            killed.add(worker)
        records: dict[str, list[dict]] = {}
        deadline = time.monotonic() + timeout
        for w in live:
            if w in killed:
                continue
            reply = self._wait(w, "done", max(1.0, deadline - time.monotonic()), phase)
            records.update(reply["records"])
        with open(os.path.join(LOG_DIR, f"swarm-records-{phase}.json"), "w") as f:  # for a look afterwards
            json.dump({p: [{k: v for k, v in r.items() if k != "sample"} for r in rs]
                       for p, rs in records.items()}, f)
        cpu_after = self._cpu([w for w in live if w not in killed])
        self.last_cpu = {"wall_s": time.monotonic() - began, **{
            k: cpu_after[k] - cpu_before[k] for k in ("workers_cpu_s", "links_cpu_s")}}
        return records

    def _cpu(self, workers: list) -> dict:
        """CPU seconds so far of the given workers and of the lab's delay lines (where the
        time of a phase goes: the peers' data planes, or the emulated wires)."""
        from lattica_lab.wan import process_cpu_seconds

        def cpu(pid: int) -> float:
            try:
                return process_cpu_seconds(pid)
            except OSError:
                return 0.0

        return {"workers_cpu_s": sum(cpu(w.popen.pid) for w in workers),
                "links_cpu_s": sum(cpu(link.pid) for link in self.lab.links.values())}

    def close(self) -> None:
        for w in self.workers:
            if w.popen.poll() is None:
                w.send({"cmd": "quit"})
        for w in self.workers:
            w.kill()


LOG_DIR = os.environ.get("SWARM_LOG_DIR", "/tmp")


def _phase_cmd(args, mode: str, numel: int, round_base: int, **extra) -> dict:
    return {"mode": mode, "numel": numel, "grace_s": args.grace_s, "exchange_s": args.exchange_timeout_s,
            "compute_s": args.compute_s,
            "seed": args.seed, "round_base": round_base, "slow": {}, **extra}


def measure_size(lab, args, n: int, rng: random.Random, numel: int, straggler_size: int) -> dict:
    at_straggler = n == straggler_size
    began = time.time()
    swarm = Swarm(lab, n, rng, solo=2 if at_straggler and "kill" in args.phases else 0)
    print(f"  N={n:<3} set up in {time.time() - began:.0f} s", file=sys.stderr, flush=True)
    out: dict = {}
    try:
        warm = args.warmup
        per_step_s = args.compute_s + 30.0 * max(1.0, numel / 4e6) * max(1.0, n / 8)
        timeout = (args.steps + warm) * per_step_s + PHASE_MARGIN_S
        base = 0
        for mode in ("allreduce", "gossip"):
            base += 100_000
            # the consensus phase runs --steps; the others' round time needs fewer
            steps = args.steps if at_straggler and mode == "gossip" else min(args.round_steps, args.steps)
            records = swarm.run(f"{mode}-round-{n}", _phase_cmd(args, mode, numel, base, steps=warm + steps,
                                                                 sample=at_straggler), timeout)
            check_steps(f"N={n} {mode} round phase", records, swarm.members, warm + steps,
                        allow_alone=mode == "gossip")
            out[f"{mode}_round_s"], out[f"{mode}_bytes"] = round_figures(records, warm, steps)
            out[f"{mode}_alone_steps"] = sum(1 for r in records.values() for x in r[warm:] if x["group"] == 1)
            out[f"{mode}_libp2p_bytes"] = sum(x.get("libp2p_bytes", 0) for r in records.values() for x in r)
            if at_straggler and mode == "gossip":
                out["consensus"] = consensus_trend(records, warm + steps)
            period = statistics.median(x["t1"] - y["t1"] for r in records.values()
                                       for y, x in zip(r[warm:], r[warm + 1:], strict=False))
            out[f"{mode}_period_s"] = period
            out[f"{mode}_cpu"] = {k: round(v, 1) for k, v in swarm.last_cpu.items()}
            out[f"{mode}_alone_share"] = out[f"{mode}_alone_steps"] / (n * steps)
            print(f"  N={n:<3} {mode:<9} round {out[f'{mode}_round_s']:7.2f} s  period {period:6.2f} s  "
                  f"sent/peer/step {out[f'{mode}_bytes'] / 2**20:7.1f} MiB  over libp2p streams "
                  f"{out[f'{mode}_libp2p_bytes'] / 2**20:.1f} MiB  alone {out[f'{mode}_alone_share']:.0%}  "
                  f"CPU s workers/wires {swarm.last_cpu['workers_cpu_s']:.0f}/{swarm.last_cpu['links_cpu_s']:.0f} "
                  f"in {swarm.last_cpu['wall_s']:.0f} s  ({time.time() - began:.0f} s)",
                  file=sys.stderr, flush=True)
        if not at_straggler:
            return out
        if "straggler" in args.phases:
            measure_straggler(swarm, args, numel, out, rng, timeout)
        if "kill" in args.phases:
            measure_kill(swarm, args, numel, out, rng, timeout)
        return out
    finally:
        swarm.close()


def measure_straggler(swarm: Swarm, args, numel: int, out: dict, rng: random.Random, timeout: float) -> None:
    n, base = swarm.n, 1_000_000
    straggler = rng.choice([m for m in swarm.members if m not in swarm.victims])
    others = [m for m in swarm.members if m != straggler and m not in swarm.victims]
    for mode in ("allreduce", "gossip"):
        rates = []
        for capped in (False, True):
            base += 100_000
            period = out[f"{mode}_period_s"]
            slow = {straggler: 10 * period} if capped else {}
            # long enough for the capped peer to step at least twice
            window = max(args.window_s, (25 if capped else 10) * period)
            start = time.time() + 2.0
            end = start + window
            records = swarm.run(f"{mode}-straggler-{capped}", _phase_cmd(
                args, mode, numel, base, end_at=end, slow=slow), window + timeout)
            if not capped:  # with the straggler, no step at all is a measured rate of 0
                check_steps(f"{mode} straggler phase", records, others, 1, allow_alone=True)
            warm_until = start + min(window / 4, 3 * period)
            rates.append(steps_per_minute(records, others, warm_until, end))
        out[f"straggler_skipped_{mode}"] = sum(1 for p in others for r in records.get(p, []) if r.get("skipped"))
        out[f"straggler_rate_{mode}"] = rates[1] / rates[0]
        out[f"straggler_steps_per_min_{mode}"] = rates
        print(f"  N={n:<3} {mode:<9} steps/min without/with straggler {rates[0]:.1f} / {rates[1]:.1f} "
              f"({out[f'straggler_skipped_{mode}']} skipped steps with it)", file=sys.stderr, flush=True)


def measure_kill(swarm: Swarm, args, numel: int, out: dict, rng: random.Random, timeout: float) -> None:
    n, base = swarm.n, 2_000_000
    # at least 4 of the round phase's step periods before the first kill (a step interval to
    # measure before it, on a loaded machine) and as many after each
    window = max(args.window_s, 12 * out["gossip_period_s"])
    start = time.time() + 2.0
    end = start + window
    kills = [(start + window * (k + 1) / 3 + rng.uniform(0, out["gossip_period_s"]), v)
             for k, v in enumerate(swarm.victims)]
    records = swarm.run("gossip-kill", _phase_cmd(args, "gossip", numel, base, end_at=end),
                        window + timeout, kills=kills)
    survivors = [m for m in swarm.members if m not in swarm.victims]
    check_steps("kill phase", records, survivors, 1, allow_alone=True)
    first_kill = kills[0][0]
    before = [x["t1"] - y["t1"] for p in survivors for y, x in zip(records[p], records[p][1:], strict=False)
              if x["t1"] < first_kill]
    if not before:
        raise BenchmarkFailed("kill phase: no step completed before the first kill")
    step_s = statistics.median(before)
    out["kill_any_stall_s"] = kill_stall(records, survivors, first_kill, end)
    out["kill_stall_bound_s"] = args.grace_s + step_s
    out["kill_step_s"] = step_s
    out["kill_paused_peers"] = sum(
        1 for p in survivors if kill_stall(records, [p], first_kill, end) > 1.5 * step_s + 1.0)
    out["kill_survivors"] = len(survivors)
    out["killed_lowest_id"] = swarm.victims[0] == swarm.members[0]
    print(f"  N={n:<3} kill: longest pause {out['kill_any_stall_s']:.2f} s (bound {out['kill_stall_bound_s']:.2f} s), "
          f"{out['kill_paused_peers']} of {len(survivors)} survivors paused", file=sys.stderr, flush=True)


def wire_summary(lab, pairs: list[tuple[str, str]]) -> dict:
    """Per delay line, over the whole run: tail drops, how late its releases ran at worst, its
    CPU seconds (the emulated wires stay exact only while the lines keep up)."""
    out = {}
    for a, b in pairs:
        st = lab.link_stats(a, b)
        out[f"{a}-{b}"] = {"dropped": st["a_to_b"]["dropped"] + st["b_to_a"]["dropped"],
                           "max_late_ms": max(st["a_to_b"]["max_late_ms"], st["b_to_a"]["max_late_ms"]),
                           "cpu_s": round(st["cpu_s"], 1),
                           "gbytes": round((st["a_to_b"]["wire_bytes"] + st["b_to_a"]["wire_bytes"]) / 1e9, 2)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="8,16,32", help="peer counts, comma-separated (each >= 4)")
    parser.add_argument("--steps", type=int, default=20, help="measured outer steps per round phase")
    parser.add_argument("--round-steps", type=int, default=5,
                        help="measured outer steps of the round phases other than the consensus phase "
                             "(gossip at the straggler size, which runs --steps); at most --steps")
    parser.add_argument("--warmup", type=int, default=1, help="outer steps before measuring")
    parser.add_argument("--payload-mib", type=float, default=16.0, help="fp32 model size (16: 4M parameters)")
    parser.add_argument("--compute-s", type=float, default=1.0, help="the inner phase's sleep")
    parser.add_argument("--grace-s", type=float, default=5.0, help="group handshake and exchange grace")
    parser.add_argument("--exchange-timeout-s", type=float, default=30.0,
                        help="gossip: how long a peer waits for its partners' tensors (a 4M-parameter "
                             "[phi, delta] is 32 MiB each way; the handshake keeps --grace-s)")
    parser.add_argument("--window-s", type=float, default=60.0, help="straggler and kill windows")
    parser.add_argument("--straggler-size", type=int, default=16)
    parser.add_argument("--sites", type=int, default=4, help="WAN sites (2-4), every pair linked")
    parser.add_argument("--mbit", type=float, default=None, help="rate cap per WAN link (default none)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--phases", default="round,straggler,kill",
                        help="round (always), straggler, kill: the others' keys are null when left out")
    args = parser.parse_args()
    args.phases = {p.strip() for p in args.phases.split(",") if p.strip()} | {"round"}
    if not args.phases <= {"round", "straggler", "kill"}:
        parser.error("--phases takes round, straggler and kill")
    try:
        sizes = sorted({int(s) for s in args.sizes.split(",")})
    except ValueError:
        parser.error("--sizes must be comma-separated integers")
    if not 2 <= args.sites <= len(SITES):
        parser.error(f"--sites must be within 2..{len(SITES)}")
    if args.exchange_timeout_s <= 0 or args.grace_s <= 0:
        parser.error("--grace-s and --exchange-timeout-s must be positive")
    if min(sizes) < 4 or args.steps < 2 or args.round_steps < 2 or args.warmup < 0 or args.payload_mib <= 0 or args.window_s < 5:
        parser.error("sizes must be >= 4, --steps and --round-steps >= 2, --warmup >= 0, --payload-mib > 0, --window-s >= 5")
    straggler_size = args.straggler_size if args.straggler_size in sizes else sizes[len(sizes) // 2]

    from lattica_lab.wan import WanLab, wan_unavailable_reason

    reason = wan_unavailable_reason()
    if reason:
        print(f"swarm_scale needs the WAN lab (run as root): {reason}", file=sys.stderr)
        sys.exit(2)
    numel = int(args.payload_mib * 2**20) // 4
    rng = random.Random(args.seed)
    results: dict[int, dict] = {}
    started = time.time()
    try:
        with WanLab() as lab:
            sites = SITES[:args.sites]
            for site in sites:
                lab.add_site(site, hosts=2)  # host 1: the site's peers; host 2: peers alone in a process
            pairs = [(a, b) for i, a in enumerate(sites) for b in sites[i + 1:]]
            for (a, b), rtt in zip(pairs, SITE_RTTS_MS, strict=False):
                lab.link(a, b, rtt_ms=rtt, mbit=args.mbit)
            for n in sizes:
                results[n] = measure_size(lab, args, n, rng, numel, straggler_size)
            links = wire_summary(lab, pairs)
    except BenchmarkFailed as exc:
        print(f"swarm_scale benchmark failed: {exc}", file=sys.stderr)
        sys.exit(1)
    s = results[straggler_size]

    def figure(key: str, digits: int = 3):
        return round(s[key], digits) if key in s else None

    ar = [results[n]["allreduce_round_s"] for n in sizes]
    gb = [results[n]["gossip_bytes"] for n in sizes]
    print(f"{'N':>4}{'allreduce round s':>19}{'gossip round s':>16}{'allreduce MiB/peer':>20}"
          f"{'gossip MiB/peer':>17}{'gossip alone steps':>20}")
    for n in sizes:
        r = results[n]
        print(f"{n:>4}{r['allreduce_round_s']:>19.2f}{r['gossip_round_s']:>16.2f}"
              f"{r['allreduce_bytes'] / 2**20:>20.1f}{r['gossip_bytes'] / 2**20:>17.1f}{r['gossip_alone_steps']:>20}")
    print(json.dumps({
        "sizes": sizes,
        "allreduce_round_s": [round(x, 3) for x in ar],
        "gossip_round_s": [round(results[n]["gossip_round_s"], 3) for n in sizes],
        "allreduce_bytes_per_peer": [round(results[n]["allreduce_bytes"]) for n in sizes],
        "gossip_bytes_per_peer": [round(x) for x in gb],
        "gossip_bytes_max_over_min": round(max(gb) / min(gb), 3) if min(gb) > 0 else None,
        "allreduce_libp2p_bytes": [results[n]["allreduce_libp2p_bytes"] for n in sizes],
        "gossip_libp2p_bytes": [results[n]["gossip_libp2p_bytes"] for n in sizes],
        "gossip_alone_share": [round(results[n]["gossip_alone_share"], 3) for n in sizes],
        "round_cpu_s": {m: [results[n][f"{m}_cpu"] for n in sizes] for m in ("allreduce", "gossip")},
        "links": links,
        "allreduce_round_growing": all(b > a for a, b in itertools.pairwise(ar)),
        "straggler_size": straggler_size,
        "straggler_rate_allreduce": figure("straggler_rate_allreduce"),
        "straggler_rate_gossip": figure("straggler_rate_gossip"),
        "straggler_steps_per_min": {m: [round(x, 2) for x in s[f"straggler_steps_per_min_{m}"]]
                                    for m in ("allreduce", "gossip")} if "straggler" in args.phases else None,
        "consensus_distance": s["consensus"],
        "kill_any_stall_s": figure("kill_any_stall_s"),
        "kill_stall_bound_s": figure("kill_stall_bound_s"),
        "kill_paused_peers": s.get("kill_paused_peers"),
        "kill_survivors": s.get("kill_survivors"),
        "killed_lowest_id": s.get("killed_lowest_id"),
        "phases": sorted(args.phases),
        "payload_mib": args.payload_mib,
        "steps": args.steps,
        "round_steps": min(args.round_steps, args.steps),
        "warmup": args.warmup,
        "compute_s": args.compute_s,
        "grace_s": args.grace_s,
        "exchange_timeout_s": args.exchange_timeout_s,
        "window_s": args.window_s,
        "sites": args.sites,
        "site_rtts_ms": list(SITE_RTTS_MS[:args.sites * (args.sites - 1) // 2]),
        "mbit": args.mbit,
        "wall_s": round(time.time() - started, 1),
        "load_avg_1m": round(os.getloadavg()[0], 1),
    }))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        import logging

        import trio

        logging.basicConfig(level=os.environ.get("SWARM_LOG_LEVEL", "WARNING"), stream=sys.stderr)
        trio.run(_worker_main, sys.argv[2], sys.argv[3:])
    else:
        main()
