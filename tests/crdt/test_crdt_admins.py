"""Who may write the run config: fixed admins, or admins that follow from the run.

Pure replicas first (a founder, a joiner through it, a joiner through that joiner), then the
state service on real libp2p hosts: a founder restarted as if with ``--peer`` keeps its
authority from its own log, and a peer relaying a run config record we refuse is not dropped.
"""

from __future__ import annotations

import multiaddr
import pytest
import trio
from crdt_helpers import RUN
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import info_from_p2p_addr

from lattica.crdt import LeasePolicy, ReplicatedState, StateConfig, documents
from lattica.crdt.envelope import Envelope, RejectedUpdate
from lattica.crdt.replica import Replica
from lattica.net.host import build_host

LOOPBACK = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")
FAST = {
    "lease": LeasePolicy(heartbeat_interval=0.2, lease=4.0, clock_skew=0.0),
    "sync_interval": 0.3, "peer_poll_interval": 0.1, "sync_timeout": 3.0,
}
SOMEONE = "12D3KooWJbM6u2R3tE5hD3ZKg1b3wHv7n9t4yZ6JzWq2mF8o1QxA"


async def _until(predicate, timeout: float = 5.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.05)


def _replica(*, admins: tuple[str, ...] = (), relays: tuple[str, ...] | None = None) -> Replica:
    return Replica(run_id=RUN, key_pair=create_new_key_pair(), admins=admins, admin_relays=relays)


def _config(replica: Replica, **values: object) -> list[Envelope]:
    return replica.local_write(documents.CONFIG_DOC, lambda d: documents.write_config(d, values))


def test_a_run_config_relayed_by_the_peer_we_joined_through_makes_its_writer_an_admin() -> None:
    founder = _replica()
    founder.adopt_admin(founder.peer_id)
    via = _replica(relays=())  # joined through the founder, knows no admin yet
    joiner = _replica(relays=(via.peer_id,))  # joined through ``via``, not through the founder
    stranger = _replica()
    (genesis,) = _config(founder, founder=founder.peer_id)
    with pytest.raises(RejectedUpdate, match="unauthorized"):
        joiner.receive(genesis, from_peer=stranger.peer_id)  # nobody it trusts relays it
    assert joiner.admins == frozenset()
    via2 = _replica(relays=(founder.peer_id,))
    via2.receive(genesis, from_peer=founder.peer_id)  # the founder relays its own record
    joiner.receive(genesis, from_peer=via.peer_id)  # the peer it joined through relays it
    assert via2.admins == joiner.admins == frozenset({founder.peer_id})
    (update,) = _config(founder, rounds=7)
    joiner.receive(update, from_peer=stranger.peer_id)  # now an admin: from anyone
    assert joiner.snapshot()["config"] == {"rounds": 7}
    # a stranger's own run config, relayed by the stranger: refused
    stranger.adopt_admin(stranger.peer_id)
    (own,) = _config(stranger, rounds=1)
    with pytest.raises(RejectedUpdate, match="unauthorized"):
        joiner.receive(own, from_peer=stranger.peer_id)
    assert joiner.admins == frozenset({founder.peer_id})


def test_fixed_admins_follow_nobody() -> None:
    founder = _replica()
    founder.adopt_admin(founder.peer_id)
    other = _replica(admins=(SOMEONE,))
    (genesis,) = _config(founder, founder=founder.peer_id)
    for relay in (founder.peer_id, other.peer_id):
        with pytest.raises(RejectedUpdate, match="unauthorized"):
            other.receive(genesis, from_peer=relay)
    assert founder.peer_id not in other.admins


def test_its_own_log_replayed_gives_a_node_back_the_admins_it_had() -> None:
    founder = _replica()
    founder.adopt_admin(founder.peer_id)
    records = [e.to_wire() for e in _config(founder, founder=founder.peer_id)]
    restarted = Replica(run_id=RUN, key_pair=founder.key_pair, admins=(), admin_relays=("someone",))
    for record in records:
        restarted.receive_wire(record, from_peer=restarted.peer_id)
    assert restarted.admins == frozenset({founder.peer_id})
    assert restarted.local_write("config", lambda d: None) == []  # allowed (nothing changed)


async def test_a_founder_restarted_through_another_peer_is_still_the_admin(tmp_path) -> None:
    keys = create_new_key_pair()
    host = build_host(keys)
    async with host.run([LOOPBACK]), trio.open_nursery() as nursery:
        first = ReplicatedState(
            host, keys, data_dir=tmp_path, run_id="svc", config=StateConfig(max_backoff=1.0, **FAST),
        )
        await nursery.start(first.run)
        assert first.admins == frozenset({first.peer_id})  # no admin known, joined through nobody
        await first.set_run_config({"rounds": 5})
        nursery.cancel_scope.cancel()
    host = build_host(keys)
    async with host.run([LOOPBACK]), trio.open_nursery() as nursery:
        config = StateConfig(anchors=(SOMEONE,), max_backoff=1.0, **FAST)
        again = ReplicatedState(host, keys, data_dir=tmp_path, run_id="svc", config=config)
        await nursery.start(again.run)
        assert again.admins == frozenset({again.peer_id})
        assert again.snapshot()["config"] == {"rounds": 5}
        assert "unauthorized" not in again.counters()["updates_rejected"]
        await again.set_run_config({"rounds": 6})
        nursery.cancel_scope.cancel()


async def test_a_run_config_record_we_refuse_costs_only_that_record(tmp_path) -> None:
    # ``strict`` trusts another admin; ``founder`` relays its own run config along with its
    # member record: the record is skipped, the session and the next ones go on at once
    # (before, the session ended there and the peer was backed off for 30 s)
    fast = {**FAST, "max_backoff": 30.0}  # the default
    keys = [create_new_key_pair(), create_new_key_pair()]
    hosts = [build_host(k) for k in keys]
    async with hosts[0].run([LOOPBACK]), hosts[1].run([LOOPBACK]), trio.open_nursery() as nursery:
        founder = ReplicatedState(hosts[0], keys[0], data_dir=tmp_path / "f", run_id="svc", config=StateConfig(**fast))
        config = StateConfig(admins=(SOMEONE,), **fast)
        strict = ReplicatedState(hosts[1], keys[1], data_dir=tmp_path / "s", run_id="svc", config=config)
        for state in (founder, strict):
            await nursery.start(state.run)
        await founder.set_run_config({"rounds": 5})
        await hosts[1].connect(info_from_p2p_addr(hosts[0].get_addrs()[0]))
        await _until(lambda: founder.peer_id in strict.snapshot()["members"])
        await _until(lambda: strict.counters()["updates_rejected"].get("unauthorized"))
        for round_ in range(1, 4):  # every change arrives within a sync interval or two
            await founder.set_progress(round_, f"h{round_}")
            await _until(lambda r=round_: strict.snapshot()["progress"].get(founder.peer_id, {}).get("round") == r)
        assert strict.snapshot()["config"] == {}
        assert founder.peer_id in strict.live_members()
        assert strict.peer_id in founder.live_members()
        nursery.cancel_scope.cancel()
