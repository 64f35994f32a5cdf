"""The swarm-scale lab: N real peers in worker processes on WAN-lab sites, driven by phases.

Used by ``benchmarks/swarm_scale.py``. Layout (:func:`add_sites`): up to four
``lattica_lab.wan.WanLab`` sites, every pair linked with its own RTT (``SITE_RTTS_MS``: 50, 70,
90, 110, 130, 150 ms), each site with two hosts. :class:`Swarm` deals N peers round-robin over the
sites at random; each site runs its peers in one worker process on its first host
(``lattica_lab.swarm_worker``: several real libp2p hosts, each with its own data plane, in one
trio loop); ``solo`` peers run alone in processes of their own on the site's second host, so
they can be SIGKILLed: the lowest peer id and ``solo - 1`` random others (``victims``).

Setup, before anything is timed: the workers start their hosts, dial (each peer the peers
before it, 8 at a time per process) and set up every pair's fast channel (a tiny fetch per
pair, as many at a time), then prime with a tiny all-reduce over all. All at once, at N = 32
some of the N(N-1)/2 handshakes outlasted py-libp2p's 10 s upgrade and negotiation timeouts
and it reset those connections. A pair left on libp2p streams (the data plane's fallback, a
tenth of the speed) fails the setup, which is tried ``SETUP_ATTEMPTS`` times.

:meth:`Swarm.run` runs one phase on every live worker (SIGKILLing victims at given wall
times) and returns each peer's step records; a worker that exits or misses the deadline raises
:class:`SwarmFailed`. Workers' stderr and each phase's records (without samples) are kept in
``$SWARM_LOG_DIR`` (default ``/tmp``) for a look afterwards.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from lattica_lab.netlab import LabHost, LabProcess
from lattica_lab.wan import WanLab, process_cpu_seconds

SITE_RTTS_MS = (50, 70, 90, 110, 130, 150)  # the six links of four sites, in pair order
SITES = ("s1", "s2", "s3", "s4")
SETUP_ATTEMPTS = 3  # connect and prime again after a failed setup, at most this often
LOG_DIR = os.environ.get("SWARM_LOG_DIR", "/tmp")


WARM_TRIES = 2  # warm-ups before a phase (untimed) that may be tried again


class SwarmFailed(RuntimeError):
    """The swarm could not be set up, or a phase did not finish."""


def add_sites(lab: WanLab, count: int, *, mbit: float | None = None) -> list[tuple[str, str]]:
    """Add ``count`` sites (two hosts each: the site's peers, peers alone in a process) and link
    every pair (RTTs from ``SITE_RTTS_MS``, ``mbit`` per link); the linked pairs."""
    if not 2 <= count <= len(SITES):
        raise ValueError(f"sites must be within 2..{len(SITES)}, got {count}")
    sites = SITES[:count]
    for site in sites:
        lab.add_site(site, hosts=2)
    pairs = [(a, b) for i, a in enumerate(sites) for b in sites[i + 1:]]
    for (a, b), rtt in zip(pairs, SITE_RTTS_MS, strict=False):
        lab.link(a, b, rtt_ms=rtt, mbit=mbit)
    return pairs


def wire_summary(lab: WanLab, pairs: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """Per delay line, over the whole run: tail drops, how late its releases ran at worst, its
    CPU seconds (the emulated wires stay exact only while the lines keep up)."""
    out: dict[str, Any] = {}
    for a, b in pairs:
        st = lab.link_stats(a, b)
        out[f"{a}-{b}"] = {"dropped": st["a_to_b"]["dropped"] + st["b_to_a"]["dropped"],
                           "max_late_ms": max(st["a_to_b"]["max_late_ms"], st["b_to_a"]["max_late_ms"]),
                           "cpu_s": round(st["cpu_s"], 1),
                           "gbytes": round((st["a_to_b"]["wire_bytes"] + st["b_to_a"]["wire_bytes"]) / 1e9, 2)}
    return out


def peer_id_of(seed: str) -> str:
    """The peer id of the host a worker builds from ``seed`` (hex)."""
    return ID.from_pubkey(create_new_key_pair(bytes.fromhex(seed)).public_key).to_base58()


class Swarm:
    """N peers in worker processes on the lab's sites; ``solo`` peers each in a process of their own."""

    def __init__(self, lab: WanLab, n: int, rng: random.Random, *, solo: int) -> None:
        self.lab, self.n = lab, n
        self.last_cpu: dict[str, float] = {}  # the last phase's wall and CPU seconds
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
        self.workers: list[LabProcess] = []
        self.victim_workers: dict[str, LabProcess] = {}
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
            raise SwarmFailed(f"start: {len(addrs)} of {n} peers came up")
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
            raise SwarmFailed(f"connect: {errors[0]}")

    def _spawn(self, host: LabHost, seeds: list[str], name: str) -> LabProcess:
        worker = self.lab.spawn(host, [sys.executable, "-m", "lattica_lab.swarm_worker", host.ip, *seeds],
                                name=name, stderr_path=os.path.join(LOG_DIR, f"swarm-{name}.log"))
        self.workers.append(worker)
        return worker

    @staticmethod
    def _wait(worker: LabProcess, event: str, timeout: float, phase: str) -> dict[str, Any]:
        try:
            return worker.wait_for(lambda e: e.get("event") == event, timeout, fresh=event != "ready")
        except (TimeoutError, RuntimeError) as exc:
            raise SwarmFailed(f"{phase}: worker {worker.name} did not finish: {str(exc)[:300]}") from None

    def warm(self, phase: str) -> None:
        """The untimed warm-up before ``phase`` (``run`` does it unless told it was done): a
        phase with wall-clock times (an end, kills) plans them after it, since a warm-up that
        is tried again takes a minute or more."""
        self._warm([w for w in self.workers if w.popen.poll() is None], phase)

    def run(self, phase: str, cmd: dict[str, Any], timeout: float, *, kills: Sequence[tuple[float, str]] = (),
            warmed: bool = False) -> dict[str, Any]:
        """Run one phase on every live worker; SIGKILL the given victims at the given wall times."""
        cmd = {"cmd": "run", "phase": phase, "members": self.members, **cmd}
        live = [w for w in self.workers if w.popen.poll() is None]
        if not warmed:
            self._warm(live, phase)
        end_at = cmd.get("end_at")
        if end_at is not None and time.time() >= end_at:  # nothing would be measured: no figure
            raise SwarmFailed(f"{phase}: its window ended {time.time() - end_at:.0f} s before the phase began")
        cpu_before, began = self._cpu(live), time.monotonic()
        for w in live:
            w.send(cmd)
        killed = set()
        for at, victim in kills:
            time.sleep(max(0.0, at - time.time()))
            worker = self.victim_workers[victim]
            os.kill(worker.popen.pid, signal.SIGKILL)  # the worker is this peer alone
            killed.add(worker)
        records: dict[str, list[dict[str, Any]]] = {}
        deadline = time.monotonic() + timeout
        if cmd.get("linger"):  # every peer did its steps: now they may all stop
            for w in live:
                if w not in killed:
                    self._wait(w, "reached", max(1.0, deadline - time.monotonic()), phase)
            for w in live:
                if w not in killed:
                    w.send({"cmd": "stop"})
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

    def _warm(self, live: list[LabProcess], phase: str) -> None:
        """Every pair of live peers on its fast channel again before the phase (the last
        phase's deadline cancelled sends in flight, and each such send closed its channel)."""
        dead = {m for m, w in self.victim_workers.items() if w.popen.poll() is not None}
        members = [m for m in self.members if m not in dead]
        for attempt in range(WARM_TRIES):
            for w in live:  # a fresh version each try: a repeated fetch of the same one is refused
                w.send({"cmd": "serve-warm"})
            for w in live:
                self._wait(w, "served", 60, f"{phase} warm-up")
            for w in live:
                w.send({"cmd": "warm", "members": members})
            errors = [f"{w.name}: {r.get('error')}" for w in live
                      if not (r := self._wait(w, "warmed", 240, f"{phase} warm-up")).get("ok")]
            if not errors:
                return
            # nothing is timed yet: a pair whose warm-up fetch got no answer (e.g. the answer went
            # out on a channel the last phase's deadline had just cut) is set up again
            print(f"  {phase} warm-up try {attempt + 1}: {errors[0]}", file=sys.stderr, flush=True)
        raise SwarmFailed(f"{phase} warm-up: {errors[0]}")

    def _cpu(self, workers: list[LabProcess]) -> dict[str, Any]:
        """CPU seconds so far of the given workers and of the lab's delay lines (where the
        time of a phase goes: the peers' data planes, or the emulated wires)."""

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


