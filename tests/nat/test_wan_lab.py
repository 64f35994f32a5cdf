"""WAN sites in the namespace lab: the delay line's model, and TCP seeing the emulated link.

The lab tests build real namespaces joined by ``lattica_lab.delay_line`` processes and measure
with real sockets (``lattica_lab.wan_probe``): a TCP handshake and a ping-pong take the link's
round trip (median within 10 %), a bulk transfer runs at the link's rate, unlinked sites do not
reach each other, and two real ``lattica join`` daemons in different sites connect and
replicate their state across the delayed link.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lattica.control import client
from lattica.errors import LatticaError
from lattica_lab.daemons import wait_for
from lattica_lab.delay_line import VNET_HDR, LinkQueue, LinkShape, wire_size
from lattica_lab.wan import LinkSpec, WanLab, wan_unavailable_reason

PROBE = [sys.executable, "-m", "lattica_lab.wan_probe"]


@pytest.fixture
def wan_available() -> None:
    reason = wan_unavailable_reason()
    if reason:
        pytest.skip(f"WAN lab unavailable: {reason}")


# -- the sans-IO link model -------------------------------------------------------------------

def test_link_queue_serializes_at_rate_then_delays_one_way():
    queue = LinkQueue(LinkShape(one_way_s=0.05, rate_bps=8e6, buffer_s=0.1))  # 1 byte per µs
    assert queue.offer(0.0, b"first", wire_bytes=1000)
    assert queue.offer(0.0, b"second", wire_bytes=1000)  # waits for the first on the wire
    assert queue.next_release() == pytest.approx(0.051)
    assert list(queue.pop_due(0.0509)) == []
    assert [p for _, p in queue.pop_due(0.0515)] == [b"first"]
    assert [(round(t, 6), p) for t, p in queue.pop_due(1.0)] == [(0.052, b"second")]
    assert queue.next_release() is None


def test_link_queue_drops_what_would_wait_longer_than_the_buffer():
    queue = LinkQueue(LinkShape(one_way_s=0.0, rate_bps=8e6, buffer_s=0.01))
    accepted = [queue.offer(0.0, b"x", wire_bytes=4000) for _ in range(5)]  # 4 ms each
    assert accepted == [True, True, True, False, False]  # the 4th would wait 12 ms
    assert queue.stats.dropped == 2
    assert queue.offer(0.02, b"later", wire_bytes=4000)  # the wire drained meanwhile


def test_link_queue_without_rate_only_delays_and_keeps_order():
    queue = LinkQueue(LinkShape(one_way_s=0.02))
    for i in range(100):
        assert queue.offer(i * 1e-4, bytes([i]), wire_bytes=1500)
    released = list(queue.pop_due(0.03))
    assert [p[0] for _, p in released] == list(range(100))
    assert released[0][0] == pytest.approx(0.02)
    assert released[-1][0] == pytest.approx(0.0299)


def test_wire_size_counts_the_headers_of_every_segment_of_a_gso_packet():
    ip = bytes([0x45]) + bytes(19)  # IPv4, 20-byte header
    ip = ip[:9] + bytes([6]) + ip[10:]  # protocol TCP
    tcp = bytes(12) + bytes([8 << 4]) + bytes(19)  # 32-byte TCP header
    payload = bytes(1448 * 3 + 100)
    gso = VNET_HDR.pack(1, 1, 0, 1448, 0, 0) + ip + tcp + payload  # GSO_TCPV4, mss 1448
    assert wire_size(gso) == (4, len(ip + tcp + payload) + 3 * 52)
    plain = VNET_HDR.pack(0, 0, 0, 0, 0, 0) + ip + tcp + bytes(100)
    assert wire_size(plain) == (1, 152)
    assert wire_size(b"\0" * 4) == (1, 0)  # shorter than its header: no crash


def test_link_spec_rejects_impossible_links():
    with pytest.raises(ValueError, match="rtt_ms"):
        LinkSpec(rtt_ms=-1)
    with pytest.raises(ValueError, match="mbit"):
        LinkSpec(rtt_ms=50, mbit=0)
    with pytest.raises(ValueError, match="buffer_ms"):
        LinkSpec(rtt_ms=50, buffer_ms=0)
    with pytest.raises(ValueError, match="one_way_s"):
        LinkShape(one_way_s=-0.1)


# -- real namespaces ------------------------------------------------------------------------

def _probe(lab: WanLab, host, mode: str, *args: str) -> dict:
    return json.loads(lab.run_in(host, [*PROBE, mode, *args], timeout=30).splitlines()[-1])


def _serve(lab: WanLab, host) -> None:
    lab.spawn(host, [*PROBE, "serve"]).wait_for(lambda e: e.get("event") == "listening", 15)


def _pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        alive.append(pid)
    return alive


@pytest.mark.netns
@pytest.mark.timeout(60)
@pytest.mark.usefixtures("wan_available")
def test_tcp_sees_each_links_round_trip_and_rate():
    rtts = {("eu", "us"): 40, ("eu", "asia"): 100, ("us", "asia"): 150}
    with WanLab() as lab:
        eu = lab.add_site("eu", hosts=2)
        us, asia = lab.add_site("us"), lab.add_site("asia")
        unlinked = lab.add_site("au")
        lab.link("eu", "us", rtt_ms=40, mbit=20)
        lab.link("eu", "asia", rtt_ms=100, mbit=50)
        lab.link(us, asia, rtt_ms=150, mbit=50)
        for host in (us.hosts[0], asia.hosts[0], eu.hosts[1], unlinked.hosts[0]):
            _serve(lab, host)

        measured = {}
        for src, dst in rtts:
            result = _probe(lab, lab.sites[src].hosts[0], "rtt", "--host",
                            lab.sites[dst].hosts[0].ip, "--connects", "8", "--pings", "15")
            measured[src, dst] = (result["connect_median_ms"], result["ping_median_ms"])
        for (src, dst), rtt in rtts.items():
            connect_ms, ping_ms = measured[src, dst]
            assert rtt * 0.9 <= connect_ms <= rtt * 1.1, (src, dst, measured)
            assert rtt * 0.9 <= ping_ms <= rtt * 1.1, (src, dst, measured)

        local = _probe(lab, eu.hosts[0], "rtt", "--host", eu.hosts[1].ip, "--pings", "10")
        assert local["ping_median_ms"] < 5, local  # inside a site: no added delay

        bulk = _probe(lab, eu.hosts[0], "bulk", "--host", us.hosts[0].ip,
                      "--seconds", "2.5", "--warmup", "1.0")
        # goodput near the 20 Mbit/s wire (unshaped, this path carries > 1 Gbit/s); the upper
        # margin is the receiver's own timing: on a loaded machine it reads in bursts
        assert 20 * 0.8 <= bulk["mbit"] <= 20 * 1.1, bulk

        stats = lab.link_stats("eu", "us")
        assert stats["a_to_b"]["wire_bytes"] >= bulk["bytes"]  # the transfer crossed the line
        assert stats["write_errors"] == 0

        with pytest.raises(RuntimeError, match="unreachable"):
            lab.run_in(eu.hosts[0], [*PROBE, "rtt", "--host", unlinked.hosts[0].ip,
                                     "--connects", "1", "--pings", "0"], timeout=15)

        namespaces = list(lab.namespaces)
        pids = [link.pid for link in lab.links.values()]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in listed for ns in namespaces)
    assert _pids_alive(pids) == []


@pytest.mark.netns
@pytest.mark.timeout(30)
@pytest.mark.usefixtures("wan_available")
def test_links_are_validated_and_a_dead_delay_line_cuts_the_link():
    with WanLab() as lab:
        a, b = lab.add_site("a"), lab.add_site("b")
        with pytest.raises(ValueError, match="site name"):
            lab.add_site("Bad Name")
        with pytest.raises(ValueError, match="two different sites"):
            lab.link(a, a, rtt_ms=10)
        with pytest.raises(ValueError, match="no site"):
            lab.link(a, "nowhere", rtt_ms=10)
        link = lab.link(a, b, rtt_ms=20)
        with pytest.raises(ValueError, match="linked already"):
            lab.link(b, a, rtt_ms=30)
        _serve(lab, b.hosts[0])
        assert _probe(lab, a.hosts[0], "rtt", "--host", b.hosts[0].ip, "--connects", "1",
                      "--pings", "3")["ping_median_ms"] >= 18
        link.process.kill()  # no delay line, no link: packets are never forwarded undelayed
        with pytest.raises(RuntimeError, match=r"timed out|unreachable|No route"):
            lab.run_in(a.hosts[0], [*PROBE, "rtt", "--host", b.hosts[0].ip, "--connects", "0",
                                    "--pings", "1"], timeout=20)


def _control(data_dir, method: str):
    try:
        return client.call(data_dir / "control.sock", method, timeout=5.0)
    except LatticaError:
        return None


def _connected(data_dir) -> dict[str, dict]:
    return {p["peer_id"]: p for p in _control(data_dir, "peers") or [] if p["connected"]}


def _join(lab: WanLab, host, data_dir, *peers: str):
    argv = [sys.executable, "-m", "lattica.cli.main", "join", "--data-dir", str(data_dir),
            "--listen", f"/ip4/{host.ip}/tcp/4001", "--metrics-addr", "off",
            "--bootstrap-timeout", "20"]
    for peer in peers:
        argv += ["--peer", peer]
    return lab.spawn(host, argv, stderr_path=str(data_dir) + ".log")


@pytest.mark.netns
@pytest.mark.timeout(90)
@pytest.mark.usefixtures("wan_available")
def test_daemons_in_two_sites_connect_and_replicate_across_the_delayed_link(tmp_path):
    rtt_ms = 120
    with WanLab() as lab:
        eu, us = lab.add_site("eu"), lab.add_site("us")
        lab.link(eu, us, rtt_ms=rtt_ms, mbit=50)
        eu_dir, us_dir = tmp_path / "eu", tmp_path / "us"
        _join(lab, eu.hosts[0], eu_dir)
        eu_id = wait_for(lambda: (_control(eu_dir, "id") or {}).get("peer_id"), timeout=30)
        assert eu_id, "the daemon in eu did not come up"
        _join(lab, us.hosts[0], us_dir, f"/ip4/{eu.hosts[0].ip}/tcp/4001/p2p/{eu_id}")
        us_id = wait_for(lambda: (_control(us_dir, "id") or {}).get("peer_id"), timeout=30)
        assert us_id, "the daemon in us did not come up"

        assert wait_for(lambda: eu_id in _connected(us_dir), timeout=30)
        assert wait_for(lambda: us_id in _connected(eu_dir), timeout=30)
        # each one's replicated state holds the other as a live member: state crossed the link
        for data_dir, other in ((eu_dir, us_id), (us_dir, eu_id)):
            assert wait_for(lambda d=data_dir, o=other: o in (_control(d, "state") or {}).get("live", []),
                            timeout=30), _control(data_dir, "state")
        # the daemons' own request/reply timing sees at least the emulated round trip
        rtt = wait_for(lambda: _connected(us_dir).get(eu_id, {}).get("rtt_ms"), timeout=20)
        assert rtt is not None, _connected(us_dir)
        assert rtt >= rtt_ms * 0.9, _connected(us_dir)
        stats = lab.link_stats(eu, us)
        assert stats["a_to_b"]["packets"] > 0
        assert stats["b_to_a"]["packets"] > 0
