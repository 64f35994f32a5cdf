"""A replica that fell behind jumps to the swarm's step and pairs again within two steps.

Real ``GossipGroups`` on in-process libp2p hosts on loopback (the handshake and the steps it
carries), with the in-memory collective for the tensors.
"""

from __future__ import annotations

import torch
import trio

from lattica.coordination.gossip import GossipGroups
from lattica.coordination.groups import SwarmStep, draw_step_groups
from lattica.train.strategies.diloco import DiLoCo, DiLoCoConfig
from lattica.train.strategies.gossip import realigned_round
from lattica.train.strategies.noloco import NoLoCo, NoLoCoConfig
from lattica_lab.collective import FixedGroups, InMemoryCollectiveGroup, scalar_model
from lattica_lab.gossip_peers import gossip_peers

GRACE_S = 3.0  # generous: a loaded machine must not turn a hold or an exchange into a timeout
AHEAD = 5  # steps the swarm syncs without the replica that fell behind
# the partner of the replica behind is held by it (it does not step) for the hold it asks, and
# asks twice its last interval at the next step: uncapped, the five steps ahead take ~50 s; the
# hold stays at its least (half the grace), which the wake-up steps need a fraction of
MAX_HOLD_S = GRACE_S / 2


def _behind(ids: list[str]) -> str | None:
    """A peer drawn with at least two others over the steps it misses; None when the identities
    drew the same pairs at every step (about 1 % of random sets). In a view of four, one peer's
    step is enough to jump (``SwarmStep.SMALL_VIEW``); before, two had to vouch within two
    steps, and a peer that had met its second partner only at the first steps did not jump."""
    def partners(p: str) -> set[str]:
        return {q for t in range(AHEAD) for s in draw_step_groups(ids, key=f"round/{t}", group_size=2)
                if p in s for q in s if q != p}

    behind = max(sorted(ids), key=lambda p: len(partners(p)))
    return behind if len(partners(behind)) >= 2 else None


async def _peers_with_one_behind(nursery: trio.Nursery) -> tuple[dict[str, GossipGroups], str]:
    """Four gossip peers and the one to freeze (fresh identities until one qualifies)."""
    for _ in range(5):
        peers = await gossip_peers(nursery, 4, grace_s=GRACE_S, max_hold_s=MAX_HOLD_S)
        behind = _behind(list(peers))
        if behind is not None:
            return peers, behind
    raise AssertionError("five sets of identities never drew a peer with two partners")


async def test_diloco_behind_jumps_to_the_swarms_step_and_pairs_again() -> None:
    cfg = DiLoCoConfig(inner_steps=1, outer_lr=1.0, outer_momentum=0.0, averaging="gossip",
                       group_size=2, exchange_timeout_s=GRACE_S)
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            peers, behind = await _peers_with_one_behind(nursery)
            ids = list(peers)
            collective = InMemoryCollectiveGroup(ids)
            models = {p: scalar_model(float(i)) for i, p in enumerate(ids)}
            strategies = {p: DiLoCo(models[p], collective=collective.member(p), groups=peers[p], config=cfg)
                          for p in ids}
            others = [p for p in ids if p != behind]
            for _ in range(AHEAD):  # the swarm syncs without it (it is frozen)
                async with trio.open_nursery() as rnd:
                    for p in others:
                        rnd.start_soon(strategies[p].sync)
            assert {strategies[p].round for p in others} == {AHEAD}
            reports: dict[str, list] = {p: [] for p in ids}

            async def sync(p: str) -> None:
                reports[p].append(await strategies[p].sync())

            for _ in range(2):  # it wakes: within two of the swarm's steps it is back in step
                async with trio.open_nursery() as rnd:
                    for p in ids:
                        rnd.start_soon(sync, p)
            last = reports[behind][-1]
            key = f"round/{AHEAD + 1}"
            assert last.key == key
            stripe = next(s for s in draw_step_groups(ids, key=key, group_size=2) if behind in s)
            assert last.group == stripe, reports  # it averaged with its partner
            partner = next(p for p in stripe if p != behind)
            torch.testing.assert_close(models[behind].weight, models[partner].weight)
            nursery.cancel_scope.cancel()


async def test_noloco_behind_jumps_to_the_swarms_step_and_keeps_the_offset() -> None:
    cfg = NoLoCoConfig(inner_steps=1, outer_lr=0.7, momentum=0.5, gamma=0.7, exchange_timeout_s=GRACE_S)
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            peers, behind = await _peers_with_one_behind(nursery)
            ids = list(peers)
            collective = InMemoryCollectiveGroup(ids)
            models = {p: scalar_model(float(i)) for i, p in enumerate(ids)}
            strategies = {p: NoLoCo(models[p], collective=collective.member(p), groups=peers[p], config=cfg)
                          for p in ids}
            others = [p for p in ids if p != behind]
            for step in range(AHEAD):  # round r runs at step r (H = 1)
                async with trio.open_nursery() as rnd:
                    for p in others:
                        rnd.start_soon(strategies[p].after_inner_step, step)
            reports: dict[str, list] = {p: [] for p in ids}

            async def sync(p: str, step: int) -> None:
                reports[p].extend(await strategies[p].after_inner_step(step))

            for i in range(2):  # it wakes at its own step 1: within two steps it is back in step
                async with trio.open_nursery() as rnd:
                    for p in ids:
                        rnd.start_soon(sync, p, 1 + i if p == behind else AHEAD + i)
            last = reports[behind][-1]
            key = f"round/{AHEAD + 1}"
            assert last.key == key
            stripe = next(s for s in draw_step_groups(ids, key=key, group_size=2) if behind in s)
            assert last.group == stripe, reports
            assert not last.skipped
            state = strategies[behind].outer_state_dict()
            assert state["round_offset"] == AHEAD - 1  # its step 2 is the swarm's round 6
            fresh = NoLoCo(scalar_model(), collective=collective.member(behind), groups=peers[behind], config=cfg)
            fresh.load_outer_state_dict(state)
            assert fresh._round_offset == AHEAD - 1
            nursery.cancel_scope.cancel()


async def test_noloco_reports_its_group_sorted() -> None:
    """A report's group is sorted, as the provider's is (NoLoCo's stripe comes from a shuffle;
    before, its report listed the stripe in shuffled order, unlike every other strategy's)."""
    ids = ["a", "b", "c", "d"]
    collective = InMemoryCollectiveGroup(ids)
    cfg = NoLoCoConfig(inner_steps=1, exchange_timeout_s=GRACE_S)
    strategies = {p: NoLoCo(scalar_model(float(i)), collective=collective.member(p), groups=FixedGroups(ids),
                            config=cfg) for i, p in enumerate(ids)}
    with trio.fail_after(30):
        for step in range(4):
            reports: dict[str, list] = {}

            async def sync(p: str, step: int, reports: dict[str, list] = reports) -> None:
                reports[p] = await strategies[p].after_inner_step(step)

            async with trio.open_nursery() as rnd:
                for p in ids:
                    rnd.start_soon(sync, p, step)
            for p in ids:
                (report,) = reports[p]
                assert len(report.group) == 2
                assert report.group == tuple(sorted(report.group))


class _Heard:
    """What a ``GossipGroups`` learned: peers and the rounds they announced."""

    def __init__(self, steps: dict[str, int]) -> None:
        self.swarm = SwarmStep()
        for peer, step in steps.items():
            self.swarm.heard(peer, step)

    def next_step(self) -> int | None:
        return self.swarm.next_step(members=8)


def test_only_a_replica_behind_the_swarm_jumps() -> None:
    swarm = _Heard({"b": 5, "c": 5})  # the swarm has reached round 5
    assert realigned_round(swarm, 5) == 5  # in step: about to sync round 5 as well
    assert realigned_round(swarm, 6) == 6  # in step: the others head for round 6 too
    assert realigned_round(swarm, 2) == 6  # behind: to the swarm's next round
    # a round or two below the highest is the normal spread: jumping there would put it past
    # the swarm's fastest, and the peers a round behind those would then jump past it in turn
    assert realigned_round(swarm, 4) == 4
    assert realigned_round(swarm, 3) == 3
    assert realigned_round(_Heard({"x": 10**9, "b": 5}), 5) == 5  # a lone far announcement
    assert realigned_round(FixedGroups(["a", "b"]), 2) == 2  # a provider without steps
