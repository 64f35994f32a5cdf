"""DiLoCo at swarm scale over WAN sites: all-reduce against gossip averaging, stragglers, a kill.

Run as root (the WAN lab builds network namespaces)::

    nice -n 10 .venv/bin/python benchmarks/swarm_scale.py                        # N = 8, 16, 32
    nice -n 10 .venv/bin/python benchmarks/swarm_scale.py --sizes 4 --steps 4 \\
        --payload-mib 1 --window-s 15                                            # ~1-2 min

The harness is ``lattica_lab.swarm`` (sites, worker processes, setup) and
``lattica_lab.swarm_worker`` (the peers): four WAN-lab sites, every pair linked with its own RTT
(50, 70, 90, 110, 130, 150 ms; ``--mbit`` caps each link's rate); for each N the peers are
dealt round-robin over the sites, each site running its peers in one worker process (several
real libp2p hosts, each with its own ``TensorService`` data plane and ``GossipGroups``, in one
trio loop). At the straggler size two peers run alone in processes of their own, so they can be
SIGKILLed: the lowest peer id (the peer that sealed every round under the old coordinator) and
a random other one.

Each peer is a real ``DiLoCo`` strategy (one outer step per inner phase) on a one-tensor model of
``--payload-mib`` fp32 (16 MiB: 4,194,304 parameters). The inner phase is simulated: a fixed
sleep (``--compute-s``, 10 s: longer than a 32 MiB exchange on this machine, as a DiLoCo inner
phase of hundreds of steps is longer than its exchange), then the weights move by a drift shared by
all peers plus a per-peer one (± a fixed random direction, 0.1 % of the weights' norm), so replicas
do differ. Replicas start 10 % apart (relative), as after joins from different published states.

Phases, all-reduce and gossip measured the same way (the same warm-up steps, the same number
of measured steps, the same clock points):

0. Setup (every N): the workers start their hosts, dial a few at a time, set up every pair's
   fast channel and prime with a tiny all-reduce over all (``lattica_lab.swarm``); a pair left
   on libp2p streams fails the setup, which is tried a few times.
1. ``round`` (every N): ``--warmup`` (3) + ``--round-steps`` (8) outer steps; the gossip phase at
   the straggler size runs ``--steps`` (20) of them, for the consensus distance. A step's round time is a
   peer's ``sync()`` time (from the end of its inner phase to its next weights); the figure is
   the median over steps of the mean over peers. Bytes per peer: what its data plane sent per
   measured step (median over peers). All-reduce runs on the fixed group of all N peers (one
   global collective per step); gossip on ``GossipGroups`` pairs redrawn every step.
   Gossip's exchange waits ``--exchange-timeout-s`` (30 s) for its partner's tensors (a
   4M-parameter ``[φ, Δ]`` is 32 MiB each way); the group handshake keeps ``--grace-s``.
   Gossip is overlapped by default (``--overlap``, ``DiLoCoConfig.overlap``): each round's
   handshake and exchange run during the next inner phase and land at its end, so a gossip
   step's round time is the part of the exchange the inner phase did not hide; the JSON's
   ``*_period_s`` (median interval between a peer's steps) gives each mode's whole step.
   ``--no-overlap`` measures blocking gossip. All-reduce is DiLoCo's blocking one.
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
   (the median interval before the first kill). Each interval after the first kill is also
   told apart by the group drawn for the step that ends it: with a peer already dead (the
   dead peer's group) or not (outside it); ``kill_outside_max_interval_s`` and
   ``kill_outside_paused_peers`` (intervals over 1.5 steps + 1 s) show whether any peer outside
   the dead peers' groups paused, beside ``kill_normal_max_interval_s`` (the longest before);
   ``kill_*_max_handshake_s`` the longest time such steps spent confirming their group
   (waiting for partners), apart from moving tensors; ``gossip_round_max_interval_s`` and
   ``gossip_round_max_handshake_s`` are the same maxima in the gossip round phase, where no
   one is killed. Before the kill window the same window runs with nobody killed (the
   control, all peers alive): ``kill_control_max_interval_s`` and ``kill_control_paused_peers``
   are the same figures over the same part of it (from the first kill's offset), and
   ``kill_added_stall_s`` is the kill window's longest interval minus the control's — what the
   kills added to the swarm's ordinary step spread.

The membership view is static (every peer of the run): a dead peer stays in the view, so a peer
drawn with it learns it is gone by the handshake or the exchange (at most the grace) and steps
alone. All runs happen in one lab; the delay lines and peers share the machine's cores, so the
figures are for this machine (``load_avg_1m`` says how busy it was).

The last line is one JSON object: ``sizes``, ``allreduce_round_s``, ``gossip_round_s``,
``allreduce_bytes_per_peer``, ``gossip_bytes_per_peer`` (lists per N), ``straggler_rate_allreduce``,
``straggler_rate_gossip``, ``consensus_distance`` (``value``, ``trend``, ``shrinking``),
``kill_any_stall_s``, ``kill_stall_bound_s``, ``kill_outside_max_interval_s``,
``kill_outside_paused_peers``, ``kill_control_max_interval_s``, ``kill_added_stall_s`` and the
settings. A phase that does not finish — a worker that exits or misses its deadline, an all-reduce
step that fails, a peer short of its steps — fails the run: exit status 1 and one line on stderr, no
figures. Without root (or without the lab's tools) the run exits with status 2 and says why.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import statistics
import sys
import time

import _checkout  # noqa: F401  (the checkout root on sys.path: lattica_lab)

from lattica_lab.swarm import SITE_RTTS_MS, SITES, Swarm, SwarmFailed, add_sites, wire_summary
from lattica_lab.wan import WanLab, wan_unavailable_reason

PHASE_MARGIN_S = 120.0  # a phase's deadline: its expected length plus this


class BenchmarkFailed(SwarmFailed):
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
    """The longest interval between consecutive outer steps (ends) of any survivor from ``start``:
    the first counts from ``start``; a step ending after ``end`` (the one a peer was in when the
    window closed) counts whole, and a peer whose last step ended before ``end`` counts to ``end``."""
    longest = 0.0
    for peer in survivors:
        ends = [start, *sorted(r["t1"] for r in records.get(peer, []) if r["t1"] >= start)]
        if len(ends) < 2 or ends[1] > end:
            raise BenchmarkFailed(f"kill: surviving peer {peer[-8:]} completed no step after the kill")
        if ends[-1] < end:
            ends.append(end)
        longest = max(longest, max(b - a for a, b in itertools.pairwise(ends)))
    return longest


def paused_peers(records: dict[str, list[dict]], peers: list[str], start: float, end: float,
                 threshold: float) -> int:
    """How many of ``peers`` had an interval longer than ``threshold`` (``kill_stall``'s count)."""
    return sum(1 for p in peers if kill_stall(records, [p], start, end) > threshold)


def kill_groups(records: dict[str, list[dict]], survivors: list[str], kills: list[tuple[float, str]],
                start: float) -> dict[str, list[tuple[str, float, float]]]:
    """The survivors' outer steps that end after ``start``, split by the step's drawn group:
    ``dead_group`` when it held a peer killed before the step ended (the partner of a dead
    peer), else ``outside``; each as ``(peer, interval, handshake)``: the time since the peer's
    previous step ended (or since ``start``, as ``kill_stall`` counts it) and the time it spent
    confirming its group (waiting for partners)."""
    split: dict[str, list[tuple[str, float, float]]] = {"dead_group": [], "outside": []}
    for peer in survivors:
        steps = sorted(records.get(peer, []), key=lambda r: r["t1"])
        for prev, cur in itertools.pairwise(steps):
            if cur["t1"] < start:
                continue
            if "drawn" not in cur:
                raise BenchmarkFailed(f"kill: peer {peer[-8:]} did not report the group drawn for step {cur['step']}")
            with_dead = any(at < cur["t1"] and victim in cur["drawn"] for at, victim in kills)
            interval = cur["t1"] - max(prev["t1"], start)
            split["dead_group" if with_dead else "outside"].append((peer, interval, cur.get("handshake_s", 0.0)))
    return split


def _phase_cmd(args, mode: str, numel: int, round_base: int, **extra) -> dict:
    return {"mode": mode, "numel": numel, "grace_s": args.grace_s, "exchange_s": args.exchange_timeout_s,
            "compute_s": args.compute_s, "overlap": args.overlap,
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
            # gossip peers step on until all did their steps (no measured step meets a partner
            # that stopped); all-reduce is lockstep, so every peer runs the same count and stops
            # (one stopping while others began the next all-reduce would hold them)
            records = swarm.run(f"{mode}-round-{n}", _phase_cmd(args, mode, numel, base, steps=warm + steps,
                                                                 sample=at_straggler, linger=mode == "gossip"), timeout)
            check_steps(f"N={n} {mode} round phase", records, swarm.members, warm + steps,
                        allow_alone=mode == "gossip")
            out[f"{mode}_round_s"], out[f"{mode}_bytes"] = round_figures(records, warm, steps)
            out[f"{mode}_alone_steps"] = sum(
                (1 for r in records.values() for x in r[warm:warm + steps] if x["group"] == 1),
            )
            out[f"{mode}_libp2p_bytes"] = sum(x.get("libp2p_bytes", 0) for r in records.values() for x in r)
            if at_straggler and mode == "gossip":
                out["consensus"] = consensus_trend(records, warm + steps)
            period = statistics.median(x["t1"] - y["t1"] for r in records.values()
                                       for y, x in zip(r[warm:], r[warm + 1:], strict=False))
            out[f"{mode}_period_s"] = period
            # the longest step interval and handshake with no one killed: what a survivor's
            # pause in the kill phase is compared with
            out[f"{mode}_max_interval_s"] = max(x["t1"] - y["t1"] for r in records.values()
                                                for y, x in itertools.pairwise(r[warm:]))
            out[f"{mode}_max_handshake_s"] = max(x.get("handshake_s", 0.0) for r in records.values()
                                                 for x in r[warm:])
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
            phase = f"{mode}-straggler-{capped}"
            swarm.warm(phase)  # before the window is planned: a warm-up tried again takes minutes
            start = time.time() + 2.0
            end = start + window
            records = swarm.run(phase, _phase_cmd(args, mode, numel, base, end_at=end, slow=slow),
                                window + timeout, warmed=True)
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
    offsets = [window * (k + 1) / 3 + rng.uniform(0, out["gossip_period_s"]) for k in range(len(swarm.victims))]
    survivors = [m for m in swarm.members if m not in swarm.victims]
    # the control: the same window with nobody killed, measured from the same offset, so the
    # swarm's ordinary step spread is seen beside what the kills add to it
    swarm.warm("gossip-control")  # each window planned after its warm-up
    cstart = time.time() + 2.0
    control = swarm.run("gossip-control", _phase_cmd(args, "gossip", numel, base + 500_000, end_at=cstart + window),
                        window + timeout, warmed=True)
    check_steps("kill control phase", control, swarm.members, 1, allow_alone=True)
    swarm.warm("gossip-kill")
    start = time.time() + 2.0
    end = start + window
    kills = [(start + offset, v) for offset, v in zip(offsets, swarm.victims, strict=True)]
    records = swarm.run("gossip-kill", _phase_cmd(args, "gossip", numel, base, end_at=end),
                        window + timeout, kills=kills, warmed=True)
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
    paused = 1.5 * step_s + 1.0  # an interval this long is a pause, not a slow step
    out["kill_pause_threshold_s"] = paused
    out["kill_paused_peers"] = paused_peers(records, survivors, first_kill, end, paused)
    # the same figures in the control, from the first kill's offset to the window's end
    out["kill_control_max_interval_s"] = kill_stall(control, survivors, cstart + offsets[0], cstart + window)
    out["kill_control_paused_peers"] = paused_peers(control, survivors, cstart + offsets[0], cstart + window, paused)
    out["kill_added_stall_s"] = out["kill_any_stall_s"] - out["kill_control_max_interval_s"]
    # who paused: the dead peers' partners (their step's drawn group held one), or the others
    split = kill_groups(records, survivors, kills, first_kill)
    out["kill_normal_max_interval_s"] = max(before)
    out["kill_normal_max_handshake_s"] = max(
        (r.get("handshake_s", 0.0) for p in survivors for r in records[p] if r["t1"] < first_kill), default=0.0)
    for side in ("dead_group", "outside"):
        out[f"kill_{side}_max_interval_s"] = max((t for _p, t, _h in split[side]), default=0.0)
        out[f"kill_{side}_max_handshake_s"] = max((h for _p, _t, h in split[side]), default=0.0)
        out[f"kill_{side}_steps"] = len(split[side])
        out[f"kill_{side}_paused_peers"] = len({p for p, t, _h in split[side] if t > paused})
    out["kill_survivors"] = len(survivors)
    out["killed_lowest_id"] = swarm.victims[0] == swarm.members[0]
    print(f"  N={n:<3} kill: longest pause {out['kill_any_stall_s']:.2f} s (bound {out['kill_stall_bound_s']:.2f} s), "
          f"{out['kill_paused_peers']} of {len(survivors)} survivors paused; longest interval drawn with a dead "
          f"peer {out['kill_dead_group_max_interval_s']:.2f} s ({out['kill_dead_group_steps']} steps), outside "
          f"{out['kill_outside_max_interval_s']:.2f} s ({out['kill_outside_steps']} steps, "
          f"{out['kill_outside_paused_peers']} peers paused), before the kill {max(before):.2f} s; longest "
          f"handshake drawn with a dead peer {out['kill_dead_group_max_handshake_s']:.2f} s, outside "
          f"{out['kill_outside_max_handshake_s']:.2f} s, before {out['kill_normal_max_handshake_s']:.2f} s",
          file=sys.stderr, flush=True)
    print(f"  N={n:<3} kill control (nobody killed, same window and offset): longest interval "
          f"{out['kill_control_max_interval_s']:.2f} s, {out['kill_control_paused_peers']} of {len(survivors)} "
          f"paused; the kills added {out['kill_added_stall_s']:+.2f} s to the longest", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="8,16,32", help="peer counts, comma-separated (each >= 4)")
    parser.add_argument("--steps", type=int, default=20, help="measured outer steps per round phase")
    parser.add_argument("--round-steps", type=int, default=8,
                        help="measured outer steps of the round phases other than the consensus phase "
                             "(gossip at the straggler size, which runs --steps); at most --steps")
    parser.add_argument("--warmup", type=int, default=3, help="outer steps before measuring (paces settle)")
    parser.add_argument("--payload-mib", type=float, default=16.0, help="fp32 model size (16: 4M parameters)")
    parser.add_argument("--compute-s", type=float, default=10.0,
                        help="the inner phase's sleep (10 s: longer than a 32 MiB exchange here, as DiLoCo's "
                             "minutes-long inner phases are longer than their exchange)")
    parser.add_argument("--grace-s", type=float, default=5.0, help="group handshake and exchange grace")
    parser.add_argument("--exchange-timeout-s", type=float, default=30.0,
                        help="gossip: how long a peer waits for its partners' tensors (a 4M-parameter "
                             "[phi, delta] is 32 MiB each way; the handshake keeps --grace-s)")
    parser.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                        help="gossip: each round's exchange runs during the next inner phase (DiLoCoConfig.overlap; "
                             "--no-overlap: blocking gossip)")
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
    if (min(sizes) < 4 or args.steps < 2 or args.round_steps < 2 or args.warmup < 0 or args.payload_mib <= 0
            or args.window_s < 5):
        parser.error(
            "sizes must be >= 4, --steps and --round-steps >= 2, --warmup >= 0, --payload-mib > 0, --window-s >= 5",
        )
    straggler_size = args.straggler_size if args.straggler_size in sizes else sizes[len(sizes) // 2]

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
            pairs = add_sites(lab, args.sites, mbit=args.mbit)
            for n in sizes:
                results[n] = measure_size(lab, args, n, rng, numel, straggler_size)
            links = wire_summary(lab, pairs)
    except SwarmFailed as exc:
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
        "allreduce_period_s": [round(results[n]["allreduce_period_s"], 3) for n in sizes],
        "gossip_period_s": [round(results[n]["gossip_period_s"], 3) for n in sizes],
        "overlap": args.overlap,
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
        "kill_pause_threshold_s": figure("kill_pause_threshold_s"),
        "kill_step_s": figure("kill_step_s"),
        "kill_normal_max_interval_s": figure("kill_normal_max_interval_s"),
        "kill_dead_group_max_interval_s": figure("kill_dead_group_max_interval_s"),
        "kill_outside_max_interval_s": figure("kill_outside_max_interval_s"),
        "kill_normal_max_handshake_s": figure("kill_normal_max_handshake_s"),
        "gossip_round_max_interval_s": figure("gossip_max_interval_s"),
        "gossip_round_max_handshake_s": figure("gossip_max_handshake_s"),
        "kill_dead_group_max_handshake_s": figure("kill_dead_group_max_handshake_s"),
        "kill_outside_max_handshake_s": figure("kill_outside_max_handshake_s"),
        "kill_dead_group_steps": s.get("kill_dead_group_steps"),
        "kill_outside_steps": s.get("kill_outside_steps"),
        "kill_dead_group_paused_peers": s.get("kill_dead_group_paused_peers"),
        "kill_outside_paused_peers": s.get("kill_outside_paused_peers"),
        "kill_control_max_interval_s": figure("kill_control_max_interval_s"),
        "kill_control_paused_peers": s.get("kill_control_paused_peers"),
        "kill_added_stall_s": figure("kill_added_stall_s"),
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
    main()
