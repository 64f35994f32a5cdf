"""One simulated run of ``size`` members: state, discovery, averaging, joins, under churn.

Timeline (virtual seconds): the swarm forms at t = 0, then ``rounds`` rounds of ``round_s``
each run in ticks of ``tick_s`` (the state service's ``sync_interval``). Churn: every minute,
``churn_per_10min / 10`` of the size leaves and as many join (half of the leavers stop cleanly,
half are killed). At each round's end the live members publish progress and average their
vectors in gossip groups (views: the live members the reference replica shows). DHT lookups by
random live members run every minute. The state is measured on the observers as the mean of
the ``STATE_WINDOW`` rounds up to round 10 and of the last ones: a member's stream alternates
between its snapshot and the snapshot with an increment or two (``compaction.snapshot_due``),
and members that write their progress at the same moment alternate together, so the state
at one instant swings by ~40 % from round to round (``state_growth_instant``: round 100 ÷
round 10, as first measured).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np
from libp2p.peer.id import ID

from lattica.crdt.liveness import LeasePolicy
from lattica.dht.config import DHTConfig
from lattica_lab.sim.averaging import consensus_rounds, gossip_round, spread
from lattica_lab.sim.dht_swarm import DhtSwarm
from lattica_lab.sim.links import LinkModel
from lattica_lab.sim.state_swarm import StateSwarm

STATE_WINDOW = 4  # rounds the state is averaged over, up to round 10 and up to the end


@dataclass(frozen=True, kw_only=True)
class Scenario:
    size: int
    rounds: int = 100
    round_s: float = 60.0
    tick_s: float = 1.0
    churn_per_10min: float = 0.10
    degree: int = 64
    observers: int = 4
    lookups_per_min: int = 5
    group_size: int = 2
    dim: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if self.size < 4:
            raise ValueError("size must be >= 4")
        if self.rounds < 10:
            raise ValueError("rounds must be >= 10 (the state is compared with round 10)")
        if not 0 < self.tick_s <= self.round_s:
            raise ValueError("need 0 < tick_s <= round_s")


def run(scenario: Scenario, *, lease: LeasePolicy | None = None, dht: DHTConfig | None = None) -> dict[str, object]:
    started = time.perf_counter()
    links = LinkModel(seed=scenario.seed)
    state = StateSwarm(seed=scenario.seed, lease=lease or LeasePolicy(), degree=min(scenario.degree, scenario.size - 1),
                       observers=scenario.observers)
    discovery = DhtSwarm(dht or DHTConfig(), links, seed=scenario.seed)
    rng = np.random.default_rng(scenario.seed)
    for _ in range(scenario.size):
        member = state.join()
        discovery.add(ID.from_base58(member.peer_id), 0.0)
    state.add_observers()
    vectors = {m.peer_id: rng.standard_normal(scenario.dim) for m in state.alive()}
    drift = rng.standard_normal(scenario.dim) * 0.01

    churn_each_min = scenario.size * scenario.churn_per_10min / 10
    churn_debt, lookups, joins = 0.0, [], []
    state_samples: dict[int, float] = {}  # round -> the observers' state (median)
    traffic_at = state.traffic.total()
    per_round_bytes = []
    ticks_per_round = round(scenario.round_s / scenario.tick_s)
    for round_ in range(1, scenario.rounds + 1):
        for _tick in range(ticks_per_round):
            state.tick(scenario.tick_s)
            now = state.now_s
            if round(now / scenario.tick_s) % round(60 / scenario.tick_s) == 0:
                churn_debt += churn_each_min
                while churn_debt >= 1:
                    churn_debt -= 1
                    _churn(state, discovery, vectors, rng, now)
                members = [ID.from_base58(m.peer_id) for m in state.alive()]
                discovery.maintain(now, members)
                for asker in rng.choice(len(members), size=min(scenario.lookups_per_min, len(members)), replace=False):
                    lookups.append(discovery.lookup(members[int(asker)]))
        state.progress(round_)
        live = set(state.live())
        trainers = {p: v + drift + rng.standard_normal(scenario.dim) * 0.001 for p, v in vectors.items() if p in live}
        vectors.clear()
        vectors.update(trainers)
        view = sorted(live)
        gossip_round(vectors, {p: view for p in vectors}, key=f"round/{round_}", group_size=scenario.group_size)
        per_round_bytes.append(state.traffic.total() - traffic_at)
        traffic_at = state.traffic.total()
        if 10 - STATE_WINDOW < round_ <= 10 or round_ > scenario.rounds - STATE_WINDOW:
            state_samples[round_] = _state_bytes(state)
        if round_ % 10 == 0 or round_ == scenario.rounds:
            bootstrap = state.members[state.watchers[0].peer_id]
            joins.append(state.join_state(bootstrap, links)[0])

    live_count = len(state.live())
    state_at_10 = statistics.mean(v for r, v in state_samples.items() if r <= 10)
    final = statistics.mean(v for r, v in state_samples.items() if r > scenario.rounds - STATE_WINDOW)
    successes = [o for o in lookups if o.success]
    hops = sorted(o.hops for o in successes if o.hops is not None)
    observers = len(state.watchers)
    steady = per_round_bytes[len(per_round_bytes) // 2:]
    sync_per_peer = statistics.median(steady) / observers / 2
    return {
        "size": scenario.size,
        "live_members": live_count,
        "writers_held": len(state.watchers[0].writers()),
        "state_bytes": int(final),
        "state_bytes_per_member": round(final / live_count, 1),
        "state_bytes_at_round_10": int(state_at_10),
        "state_growth_100_vs_10_rounds": round(final / state_at_10, 3),
        "state_growth_instant": round(state_samples[scenario.rounds] / state_samples[10], 3),
        "state_sync_bytes_per_peer_per_round": int(sync_per_peer),
        "state_sync_bytes_per_member_per_peer_per_round": round(sync_per_peer / live_count, 1),
        "state_sync_hello_share": round(state.traffic.hello_bytes / max(state.traffic.total(), 1), 3),
        "state_sync_full_sessions_share": round(state.traffic.full_sessions / max(state.traffic.sessions, 1), 3),
        "heartbeat_interval_s": state.heartbeat_interval(),
        "dht_lookups": len(lookups),
        "dht_lookup_success": round(len(successes) / max(len(lookups), 1), 4),
        "dht_hops_p99": hops[min(len(hops) - 1, int(0.99 * len(hops)))] if hops else None,
        "dht_lookup_s_median": round(statistics.median(o.seconds for o in lookups), 3) if lookups else None,
        "gossip_spread_end": round(spread(vectors), 6),
        "gossip_consensus_rounds": consensus_rounds(sorted(vectors), dim=scenario.dim,
                                                    group_size=scenario.group_size, seed=scenario.seed),
        "join_state_s": round(max(joins), 3),
        "join_state_s_median": round(statistics.median(joins), 3),
        "wall_s": round(time.perf_counter() - started, 1),
    }


def _state_bytes(state: StateSwarm) -> float:
    return statistics.median(state.state_bytes(w) for w in state.watchers)


def _churn(
    state: StateSwarm, discovery: DhtSwarm, vectors: dict[str, np.ndarray], rng: np.random.Generator, now: float
) -> None:
    """One member goes (a clean leave or a kill, alternately) and a newcomer joins."""
    candidates = state.churnable()
    if candidates:
        gone = candidates[int(rng.integers(len(candidates)))]
        (state.leave if rng.random() < 0.5 else state.kill)(gone)
        discovery.remove(ID.from_base58(gone.peer_id))
        vectors.pop(gone.peer_id, None)
    member = state.join()
    discovery.add(ID.from_base58(member.peer_id), now)
    discovery.announce(ID.from_base58(member.peer_id), now)
    peers = list(vectors.values())
    vectors[member.peer_id] = peers[int(rng.integers(len(peers)))].copy() if peers else np.zeros(1)
