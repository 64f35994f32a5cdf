"""The pure checks of ``lattica doctor`` (``lattica.diagnostics``) and the clock arithmetic."""

from __future__ import annotations

import pytest

from lattica.diagnostics import (
    MachineFacts,
    NodeFacts,
    Observation,
    PeerFacts,
    classify_nat,
    diagnose,
)
from lattica.errors import RemoteProtocolError
from lattica.net.clock import clock_offset, peer_time_from

A, B, C = "12D3KooWAAAAAAAAAAAAAAAAAAAA", "12D3KooWBBBBBBBBBBBBBBBBBBBB", "12D3KooWCCCCCCCCCCCCCCCCCCCC"
MACHINE = MachineFacts(data_dir="/data", free_bytes=50 << 30)


def by_check(diagnosis, check):
    return [f for f in diagnosis.findings if f.check == check]


def test_observed_port_decides_cone_or_symmetric():
    cone = (Observation(A, "198.19.1.2:40000", "198.18.0.3:40000"),)
    symmetric = (Observation(A, "198.19.1.2:40000", "198.18.0.3:61234"),)
    own = (Observation(A, "198.18.0.5:40000", "198.18.0.5:40000"),)
    assert classify_nat("private", cone).kind == "cone"
    assert classify_nat("private", symmetric).kind == "symmetric"
    assert "61234" in classify_nat("private", symmetric).evidence
    assert classify_nat("unknown", own).kind == "public"
    assert classify_nat("public", ()).kind == "public"
    assert classify_nat("private", ()).kind == "unknown"
    assert classify_nat("unknown", ()).kind == "unknown"
    # one rewritten port among preserved ones: the mapping is not predictable
    assert classify_nat("private", cone + symmetric).kind == "symmetric"


def test_symmetric_node_is_told_it_is_relayed_and_why():
    facts = NodeFacts(
        peer_id=C, reachability="private",
        observations=(Observation(A, "198.19.2.2:41000", "198.18.0.4:7777"),),
        relay_addrs=(f"/ip4/198.18.0.2/tcp/4001/p2p/{A}/p2p-circuit",),
        peers=(PeerFacts(peer_id=B, connected=True, path="relayed", relay=A, rtt_ms=12.5,
                         last_transfer_bytes=4_000_000, last_transfer_mbit_s=80.0, reachability="private"),
               PeerFacts(peer_id=A, connected=True, path="direct", rtt_ms=3.0)),
        dialback={A: False}, bootstrap_tried=1,
    )
    diagnosis = diagnose(facts, MACHINE)
    assert diagnosis.nat is not None
    assert diagnosis.nat.kind == "symmetric"
    [relayed] = [f for f in diagnosis.findings if f.check.startswith("peer ") and "relayed" in f.detail]
    assert relayed.status == "warn"
    assert "symmetric NAT" in relayed.detail
    assert "12.5 ms" in relayed.detail
    assert "80.0 Mbit/s" in relayed.detail
    assert "--announce" in relayed.advice
    assert by_check(diagnosis, "relay")[0].status == "ok"
    assert diagnosis.healthy  # relayed is slower, not broken


def test_private_node_without_relay_is_a_problem():
    facts = NodeFacts(peer_id=C, reachability="private", dialback={A: False},
                      observations=(Observation(A, "198.19.2.2:41000", "198.18.0.4:41000"),))
    diagnosis = diagnose(facts, MACHINE)
    [relay] = by_check(diagnosis, "relay")
    assert relay.status == "problem"
    assert relay.advice
    assert not diagnosis.healthy


def test_unreachable_announced_address_names_the_port_mapping():
    facts = NodeFacts(peer_id=C, announce=("/ip4/203.0.113.7/tcp/40123",), dialback={A: False, B: False})
    [dialable] = by_check(diagnose(facts, MACHINE), "dialable")
    assert dialable.status == "problem"
    assert "-p HOST_PORT:4001" in dialable.advice


@pytest.mark.parametrize(
    ("why", "hint"),
    [
        ("[Errno 111] Error connecting to ('127.0.0.1', 4001): Connection refused", "nothing listens"),
        ("timed out", "packets get no answer"),
        ("peer id does not correspond to the received pubkey", "another peer id"),
        ("did not prove membership of the run (secret or allowlist)", "--secret-file"),
        (f"relay {A} refused the circuit: status 204 NO_RESERVATION (the peer holds no reservation "
         "on this relay)", "does not lead to the peer"),
    ],
)
def test_each_bootstrap_failure_gets_its_own_advice(why, hint):
    facts = NodeFacts(peer_id=C, bootstrap_failures={f"/ip4/198.18.0.2/tcp/4001/p2p/{A}": why}, bootstrap_tried=1)
    [finding] = by_check(diagnose(facts, MACHINE), "bootstrap")
    assert finding.status == "problem"
    assert why in finding.detail
    assert hint in finding.advice


def test_a_plain_libp2p_bootstrap_peer_is_no_problem_and_is_named_by_its_address():
    addr = f"/ip4/198.18.0.2/tcp/4001/p2p/{A}"
    facts = NodeFacts(peer_id=C, reachability="public", dialback={A: True}, bootstrap_plain=(addr,),
                      peers=(PeerFacts(peer_id=A, connected=True, path="direct", clock_offset_s=0.0,
                                       clock_error_s=0.01),),
                      bootstrap_tried=1)
    diagnosis = diagnose(facts, MACHINE)
    [noted, reached] = by_check(diagnosis, "bootstrap")
    assert noted.status == "ok"
    assert noted.detail.startswith(addr)
    assert "speaks no Lattica protocol" in noted.detail
    assert reached.status == "ok"
    assert diagnosis.healthy


def test_clock_skew_beyond_the_measurement_error():
    def clock(offset, error):
        peers = (PeerFacts(peer_id=A, connected=True, path="direct", clock_offset_s=offset, clock_error_s=error),)
        return by_check(diagnose(NodeFacts(peer_id=C, peers=peers), MACHINE), "clock")[0]

    assert clock(0.3, 0.01).status == "ok"
    assert clock(1.2, 0.5).status == "ok"  # within what the round trip allows
    assert clock(-3.0, 0.01).status == "warn"
    skewed = clock(30.0, 0.01)
    assert skewed.status == "problem"
    assert "NTP" in skewed.advice


def test_disk_and_device():
    low = MachineFacts(data_dir="/data", free_bytes=2 << 30, checkpoint_bytes=1 << 30)
    assert by_check(diagnose(None, low), "disk")[0].status == "problem"
    assert by_check(diagnose(None, MACHINE), "disk")[0].status == "ok"
    unused_gpu = MachineFacts(data_dir="/data", free_bytes=50 << 30, gpu_present=True)
    device = by_check(diagnose(None, unused_gpu), "device")[0]
    assert device.status == "problem"
    assert "--gpus all" in device.advice
    cuda = MachineFacts(data_dir="/data", free_bytes=50 << 30, device="cuda", device_name="H100",
                        memory_total_bytes=80 << 30)
    assert by_check(diagnose(None, cuda), "device")[0].detail.startswith("CUDA: H100")


def test_clock_offset_arithmetic_and_hostile_answers():
    measured = clock_offset(100.0, 110.05, 100.1)
    assert measured.offset_s == pytest.approx(10.0)
    assert measured.error_s == pytest.approx(0.05)
    with pytest.raises(ValueError, match="clock jumped"):
        clock_offset(100.0, 1.0, 99.0)
    assert peer_time_from({"t": 1.7e9}, A) == 1.7e9
    for bad in ({}, {"t": "now"}, {"t": float("nan")}, {"t": -1}, {"t": True}, [1.0], None):
        with pytest.raises(RemoteProtocolError):
            peer_time_from(bad, A)


def test_last_transfers_give_each_peer_its_size_and_rate():
    facts = NodeFacts(peer_id=A, peers=(PeerFacts(B, connected=True), PeerFacts(C, connected=True)))
    sent = {B: (10_000_000, 2.0), C: (5, 0.0), "not-a-peer": (1, 1.0)}  # C: no measurable duration
    peers = {p.peer_id: p for p in facts.with_last_transfers(sent).peers}
    assert (peers[B].last_transfer_bytes, peers[B].last_transfer_mbit_s) == (10_000_000, 40.0)
    assert (peers[C].last_transfer_bytes, peers[C].last_transfer_mbit_s) == (None, None)
    assert len(peers) == 2


def test_member_reachability_is_set_on_the_peers_that_advertise_one():
    facts = NodeFacts(peer_id=A, peers=(PeerFacts(B, connected=True), PeerFacts(C, connected=False)))
    peers = facts.with_member_reachability({B: "private", "elsewhere": "public"}).peers
    assert [(p.peer_id, p.reachability) for p in peers] == [(B, "private"), (C, None)]
