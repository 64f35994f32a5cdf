"""How many dials peer exchange may cause (pure, a fake clock)."""

from __future__ import annotations

import pytest

from lattica.net.peerbook import PeerBook
from lattica.net.px_dials import PxDialBudget, PxDialLimits, target_of

VICTIM = "203.0.113.9"


def _entries(peers: int, ports: int, *, first_port: int = 1000) -> list[tuple[str, list[str]]]:
    return [
        (f"peer{i}", [f"/ip4/{VICTIM}/tcp/{first_port + i * ports + j}/p2p/peer{i}" for j in range(ports)])
        for i in range(peers)
    ]


def _dialed(plan: list[tuple[str, list[str]]]) -> int:
    return sum(len(addrs) for _, addrs in plan)


def test_one_reply_of_64_peers_by_8_ports_dials_at_most_per_reply() -> None:
    budget = PxDialBudget(PxDialLimits(per_reply=8, per_source=32))
    plan = budget.plan("mallory", _entries(64, 8), now=0.0)
    assert _dialed(plan) == 8
    assert budget.refused == 64 * 8 - 8


def test_a_source_is_bounded_per_window_and_a_host_port_per_interval() -> None:
    limits = PxDialLimits(per_reply=8, per_source=32, source_window_s=60.0, per_target_s=60.0)
    budget = PxDialBudget(limits)
    total = 0
    for k in range(30):  # a reply every two seconds for a minute, new ports each time
        total += _dialed(budget.plan("mallory", _entries(64, 8, first_port=1000 + 600 * k), now=2.0 * k))
    assert total == 32
    # the same host:ports named again by another member: not dialed again within the interval
    assert _dialed(budget.plan("bob", _entries(4, 1, first_port=1000), now=30.0)) == 0
    assert _dialed(budget.plan("bob", _entries(4, 1, first_port=90_000), now=30.0)) == 4
    # after the window mallory may cause dials again, and after the interval the same target
    assert _dialed(budget.plan("mallory", _entries(1, 1, first_port=1000), now=58.0)) == 0
    assert _dialed(budget.plan("mallory", _entries(1, 1, first_port=1000), now=61.0)) == 1


def test_targets_are_host_and_port_and_relay_addresses_count_as_their_relay() -> None:
    assert target_of("/ip4/10.0.0.1/tcp/4001/p2p/x") == "10.0.0.1:4001"
    assert target_of("/ip6/::1/tcp/7/p2p/x") == "::1:7"
    assert target_of("/dns4/relay.example/tcp/4001/p2p/r/p2p-circuit/p2p/x") == "relay.example:4001"
    assert target_of("/ip4/10.0.0.1/udp/4001/quic") is None
    assert target_of("garbage") is None


def test_memory_of_targets_is_bounded() -> None:
    budget = PxDialBudget(PxDialLimits(per_reply=10_000, per_source=10_000, max_targets=100))
    budget.plan("s", _entries(50, 10), now=0.0)
    assert len(budget._targets) == 100


def test_heard_addresses_expire_unless_confirmed_and_never_crowd_the_book() -> None:
    book = PeerBook("me")
    book.learn("member", ["/ip4/10.0.0.2/tcp/4001/p2p/member"], now=0.0)
    book.hear("member", [f"/ip4/{VICTIM}/tcp/{p}/p2p/member" for p in range(20)], now=0.0)
    record = book.get("member")
    assert record is not None
    assert len(record.heard) == 8
    assert len(record.addrs) == 1
    book.learn_reported("member", list(record.heard), now=1.0)  # dialed there: confirms nothing
    assert len(record.addrs) == 1
    book.hear("ghost", [f"/ip4/{VICTIM}/tcp/1/p2p/ghost"], now=0.0)
    book.forget_unanswered(now=601.0, heard_ttl=600.0)
    assert record.heard == {}
    assert book.get("ghost") is None
    assert book.get("member") is record


@pytest.mark.parametrize("bad", [{"per_reply": -1}, {"per_target_s": 0}, {"heard_ttl_s": -5}])
def test_limits_are_validated(bad: dict) -> None:
    with pytest.raises(ValueError, match="PxDialLimits"):
        PxDialLimits(**bad)
