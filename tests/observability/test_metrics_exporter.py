"""The trio /metrics exporter, over real loopback HTTP."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from lattica.observability import MeteredStream, MetricsServer, NodeMetrics
from lattica.observability import exporter as exporter_module

EXPECTED_FAMILIES = {
    "lattica_build_info",
    "lattica_node_info",
    "lattica_peers_connected",
    "lattica_peers_by_path",
    "lattica_bytes_sent",
    "lattica_bytes_received",
    "lattica_outer_round",
    "lattica_rounds_completed",
    "lattica_round_duration_seconds",
    "lattica_collective_duration_seconds",
    "lattica_inner_steps_per_second",
    "lattica_tokens_per_second",
    "lattica_train_loss",
    "lattica_validation_loss",
    "lattica_staleness_rounds",
    "lattica_consensus_distance",
    "lattica_relay_reservations",
    "lattica_dht_routing_table_peers",
    "lattica_replicated_state_bytes",
    "lattica_rejected_updates",
    "lattica_checkpoint_fetch_duration_seconds",
    "lattica_rejected_contributions",
    "lattica_avoided_partners",
    "lattica_strategy_bytes_sent",
    "lattica_strategy_syncs",
    "lattica_sync_bytes",
    "lattica_sync_peak_bytes",
    "lattica_optimizer_state_bytes",
    "lattica_parameter_bytes",
    "process_cpu_seconds",
    "process_resident_memory_bytes",
}


def _http_get(url: str, *, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


async def _get(address: tuple[str, int], path: str = "/metrics", *, method: str = "GET"):
    url = f"http://{address[0]}:{address[1]}{path}"
    return await trio.to_thread.run_sync(lambda: _http_get(url, method=method))


async def _raw(address: tuple[str, int], data: bytes) -> bytes:
    stream = await trio.open_tcp_stream(*address)
    async with stream:
        await stream.send_all(data)
        received = bytearray()
        while chunk := await stream.receive_some(65536):
            received += chunk
        return bytes(received)


@pytest.fixture
async def served(nursery):
    metrics = NodeMetrics(peer_id="12D3KooWTest", run_id="test-run")
    server = MetricsServer(metrics, "127.0.0.1", 0)
    address = await nursery.start(server.run)
    return metrics, address


async def test_get_metrics_returns_every_family(served):
    metrics, address = served
    metrics.bytes_sent.labels(protocol="/lattica/test/1").inc(1234)
    metrics.outer_round.set(7)
    metrics.round_seconds.observe(3.0)

    with trio.fail_after(10):
        status, headers, body = await _get(address)

    assert status == 200
    assert headers["Content-Type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert set(families) >= EXPECTED_FAMILIES, EXPECTED_FAMILIES - set(families)
    sent = {s.labels["protocol"]: s.value for s in families["lattica_bytes_sent"].samples}
    assert sent["/lattica/test/1"] == 1234
    assert families["lattica_outer_round"].samples[0].value == 7
    node = families["lattica_node_info"].samples[0].labels
    assert node == {"peer_id": "12D3KooWTest", "run_id": "test-run"}
    paths = {s.labels["path"] for s in families["lattica_peers_by_path"].samples}
    assert paths == {"direct", "hole-punched", "relayed"}


async def test_openmetrics_is_negotiated(served):
    _, address = served
    with trio.fail_after(10):
        reply = await _raw(
            address,
            b"GET /metrics HTTP/1.1\r\nHost: x\r\n"
            b"Accept: application/openmetrics-text; version=1.0.0\r\n\r\n",
        )
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    assert b"application/openmetrics-text" in head
    assert body.rstrip().endswith(b"# EOF")


async def test_two_nodes_in_one_process_do_not_collide(nursery):
    first, second = NodeMetrics(peer_id="a"), NodeMetrics(peer_id="b")
    first.outer_round.set(1)
    second.outer_round.set(2)
    address_a = await nursery.start(MetricsServer(first, "127.0.0.1", 0).run)
    address_b = await nursery.start(MetricsServer(second, "127.0.0.1", 0).run)
    with trio.fail_after(10):
        _, _, body_a = await _get(address_a)
        _, _, body_b = await _get(address_b)
    assert b'lattica_node_info{peer_id="a"' in body_a
    assert b"lattica_outer_round 1.0" in body_a
    assert b"lattica_outer_round 2.0" in body_b


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"\x00\xff garbage \r\n\r\n", b"400"),
        (b"GET\r\n\r\n", b"400"),
        (b"GET metrics HTTP/1.1\r\n\r\n", b"400"),
        (b"GET /metrics HTTP/1.1\r\nno colon here\r\n\r\n", b"400"),
        (b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n", b"405"),
        (b"GET /nope HTTP/1.1\r\n\r\n", b"404"),
        (b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n", b"431"),
    ],
)
async def test_bad_requests_get_an_error_and_the_server_survives(served, request_bytes, status):
    _, address = served
    with trio.fail_after(10):
        reply = await _raw(address, request_bytes)
        assert reply.split(b" ", 2)[1] == status
        ok_status, _, _ = await _get(address)
    assert ok_status == 200


async def test_head_request_has_no_body(served):
    _, address = served
    with trio.fail_after(10):
        reply = await _raw(address, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    assert body == b""


async def test_silent_client_is_dropped_and_does_not_block_others(served, monkeypatch):
    monkeypatch.setattr(exporter_module, "HEAD_TIMEOUT", 0.3)
    _, address = served
    silent = await trio.open_tcp_stream(*address)
    async with silent:
        await silent.send_all(b"GET /metr")  # never finishes its request
        with trio.fail_after(10):
            status, _, _ = await _get(address)
            assert status == 200
            # The exporter gives up on the silent client: we see EOF without any reply.
            assert await silent.receive_some(1024) == b""


async def _trickle(address: tuple[str, int], stop: trio.Event) -> None:
    """A slowloris: one byte of a request head every 0.2 s, reconnecting when dropped."""
    while not stop.is_set():
        try:
            stream = await trio.open_tcp_stream(*address)
            async with stream:
                for byte in b"GET /metrics HTTP/1.1\r\nX-Slow: " + b"a" * 4000:
                    await stream.send_all(bytes([byte]))
                    await trio.sleep(0.2)
                    if stop.is_set():
                        return
        except (trio.BrokenResourceError, OSError):
            await trio.sleep(0.01)  # displaced or timed out: come straight back


async def test_trickling_connections_do_not_keep_scrapes_out(nursery):
    server = MetricsServer(NodeMetrics(process=False), "127.0.0.1", 0, max_connections=16)
    address = await nursery.start(server.run)
    stop = trio.Event()
    async with trio.open_nursery() as attackers:
        for _ in range(16):  # every slot taken, and taken again as soon as it frees up
            attackers.start_soon(_trickle, address, stop)
        await trio.sleep(1.0)
        statuses = []
        with trio.fail_after(60):
            for _ in range(20):
                reply = await _raw(address, b"GET /metrics HTTP/1.1\r\n\r\n")
                statuses.append(int(reply.split(b" ", 2)[1]))
                await trio.sleep(0.05)
        stop.set()
    assert statuses == [200] * 20


async def test_a_client_still_sending_its_head_gives_way_to_a_new_one(nursery):
    server = MetricsServer(NodeMetrics(process=False), "127.0.0.1", 0, max_connections=1)
    address = await nursery.start(server.run)
    hog = await trio.open_tcp_stream(*address)
    async with hog:
        await hog.send_all(b"GET /metr")
        await trio.sleep(0.1)  # let the server accept and park the hog
        with trio.fail_after(10):
            reply = await _raw(address, b"GET /metrics HTTP/1.1\r\n\r\n")
            assert reply.startswith(b"HTTP/1.1 200 ")
            assert await hog.receive_some(1024) == b""  # the hog was closed without a reply


def test_invalid_configuration_is_rejected():
    with pytest.raises(ValueError, match="port"):
        MetricsServer(NodeMetrics(process=False), "127.0.0.1", 70000)
    with pytest.raises(ValueError, match="client limit"):
        MetricsServer(NodeMetrics(process=False), "127.0.0.1", 0, max_connections=0)


def test_staleness_is_never_negative():
    metrics = NodeMetrics(process=False)
    metrics.set_staleness(own_round=5, max_seen_round=8)
    assert metrics.registry.get_sample_value("lattica_staleness_rounds") == 3
    metrics.set_staleness(own_round=9, max_seen_round=8)
    assert metrics.registry.get_sample_value("lattica_staleness_rounds") == 0


def test_set_peers_counts_each_connection_path():
    metrics = NodeMetrics(process=False)
    metrics.set_peers(["direct", "direct", "relayed", "unknown"])
    value = metrics.registry.get_sample_value
    assert value("lattica_peers_connected") == 4
    assert value("lattica_peers_by_path", {"path": "direct"}) == 2
    assert value("lattica_peers_by_path", {"path": "relayed"}) == 1
    assert value("lattica_peers_by_path", {"path": "hole-punched"}) == 0
    metrics.set_peers([])
    assert value("lattica_peers_by_path", {"path": "direct"}) == 0


class _FakeStream:
    def __init__(self, incoming: bytes) -> None:
        self.incoming, self.written = incoming, b""

    def get_protocol(self) -> str:
        return "/lattica/px/1"

    async def read(self, n: int | None = None) -> bytes:
        data, self.incoming = self.incoming[:n], self.incoming[n:]
        return data

    async def write(self, data: bytes) -> None:
        self.written += data


async def test_metered_stream_counts_bytes_by_protocol():
    metrics = NodeMetrics(process=False)
    inner = _FakeStream(b"0123456789")
    stream = MeteredStream(inner, metrics)
    assert await stream.read(4) == b"0123"
    await stream.write(b"hello")
    assert stream.get_protocol() == "/lattica/px/1"  # everything else passes through
    value = metrics.registry.get_sample_value
    assert value("lattica_bytes_received_total", {"protocol": "/lattica/px/1"}) == 4
    assert value("lattica_bytes_sent_total", {"protocol": "/lattica/px/1"}) == 5
    assert inner.written == b"hello"
