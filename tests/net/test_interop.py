"""A Lattica node among standard libp2p peers (py-libp2p's own services, no Lattica protocol).

Real hosts on loopback: a standard DHT server as the only bootstrap peer learns that the node
serves Kademlia and keeps it in its routing table; a node whose only address is a relay
address on a standard relay is joined with ``--peer <relay addr>/p2p-circuit/p2p/<id>``; with
only a plain node to bootstrap from, start-up says so (and fails with a run secret), a failed
bootstrap names its cause, and no stream is opened for a protocol the peer lacks.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import multiaddr
import pytest
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.kad_dht.common import PROTOCOL_ID as KAD_PROTOCOL
from libp2p.peer.peerinfo import PeerInfo
from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport
from standard_node import standard_node

from lattica.config import NodeConfig
from lattica.crdt.sync import SYNC_PROTOCOL
from lattica.net.host import build_host
from lattica.net.identity import peer_id_of
from lattica.net.nat import AutoNATConfig, RelayReservations, RelayServer
from lattica.net.nat.autonat import retry_delay
from lattica.node.composition import build_node
from lattica.node.node import Node
from lattica_lab.daemons import DaemonProcess, free_port, lattica_command, run_cli, wait_for

pytestmark = pytest.mark.timeout(90)

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def _config(data_dir: Path, peers: tuple[str, ...], **overrides) -> NodeConfig:
    fields = dict(data_dir=data_dir, listen=(LOOPBACK,), peers=peers, run_id="interop",
                  metrics_addr=None, bootstrap_timeout_s=20)
    fields.update(overrides)
    return NodeConfig(**fields)


async def _wait(predicate, timeout: float) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.1)


async def test_a_standard_dht_server_adds_the_node_to_its_routing_table(tmp_path) -> None:
    async with standard_node() as server, trio.open_nursery() as nursery:
        node: Node = build_node(_config(tmp_path / "n", (server.addr,)), create_new_key_pair())
        await nursery.start(node.run)
        me = node.peer_id.to_base58()
        # what identify told the server (a go-libp2p server adds a peer on exactly this)
        await _wait(lambda: str(KAD_PROTOCOL) in server.describe(me)["protocols"], 15)
        await _wait(lambda: server.describe(me)["in_routing_table"], 15)
        # and it stays there: the server's own identify-checked add accepts the node
        assert await server.kad.routing_table.add_peer(node.peer_id)
        node.request_shutdown()


async def test_a_node_behind_a_relay_is_joined_by_its_circuit_address(tmp_path) -> None:
    async with standard_node() as relay, trio.open_nursery() as nursery:
        # the target: reachable only through its reservation on the standard relay (nobody
        # is told a direct address of it)
        target = build_host(create_new_key_pair(), listen_addrs=[multiaddr.Multiaddr(LOOPBACK)])
        async with target.run([multiaddr.Multiaddr(LOOPBACK)]):
            await nursery.start(RelayServer(target, serve=False).run)  # answers STOP
            reservations = RelayReservations(
                target, relays=[PeerInfo(relay.host.get_id(), relay.host.get_addrs())], want=1)
            await nursery.start(reservations.run)
            await _wait(reservations.relay_addrs, 10)
            circuit = str(reservations.relay_addrs()[0])
            assert circuit.endswith(f"/p2p-circuit/p2p/{target.get_id()}")
            node: Node = build_node(
                _config(tmp_path / "n", (circuit,), dht=False, peer_exchange=False),
                create_new_key_pair())
            with trio.fail_after(30):
                await nursery.start(node.run)  # start-up fails unless the bootstrap peer answered
            assert target.get_id() in node.running_host.get_connected_peers()
            record = node.peer_book.get(target.get_id().to_base58())
            assert record is not None
            assert record.bootstrap
            node.request_shutdown()
            nursery.cancel_scope.cancel()


# -- a plain libp2p node as the only bootstrap peer: what start-up says, and what it opens ---------


def _join_argv(data_dir: Path, peer: str, *extra: str) -> list[str]:
    return lattica_command("join", "--data-dir", str(data_dir), "--listen", f"/ip4/127.0.0.1/tcp/{free_port()}",
                           "--metrics-addr", "off", "--peer", peer, *extra)


def _first_lines_until(argv: list[str], marker: str, timeout: float) -> list[str]:
    """Start ``argv``, collect stdout lines until one contains ``marker``, then stop it."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + timeout
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.rstrip())
            if marker in line:
                break
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return lines


def _one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode != 0, proc
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines, proc
    return lines[-1]


async def test_joining_through_a_plain_libp2p_node_says_what_was_joined(tmp_path) -> None:
    async with standard_node() as server:
        lines = await trio.to_thread.run_sync(
            _first_lines_until, _join_argv(tmp_path / "n", server.addr), "others can also join", 60)
    text = "\n".join(lines)
    assert "speak no Lattica protocol" in text, text
    assert "joined run" not in text, text


async def test_with_a_secret_a_plain_libp2p_bootstrap_peer_is_no_member(tmp_path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    secret.chmod(0o600)
    async with standard_node() as server:
        proc = await trio.to_thread.run_sync(lambda: run_cli(
            *_join_argv(tmp_path / "n", server.addr, "--secret-file", str(secret),
                        "--bootstrap-timeout", "3")[3:], timeout=60))
    line = _one_line_error(proc)
    assert "no bootstrap peer proved to be a member" in line, line
    assert "speaks no Lattica protocol" in line, line


async def test_a_bootstrap_failure_names_its_cause(tmp_path) -> None:
    key_pair = create_new_key_pair()
    plaintext_only = new_host(key_pair=key_pair, sec_opt={PLAINTEXT_PROTOCOL_ID: InsecureTransport(key_pair)})
    listen = multiaddr.Multiaddr(LOOPBACK)
    async with plaintext_only.run([listen]):
        peer = str(plaintext_only.get_addrs()[0])
        proc = await trio.to_thread.run_sync(lambda: run_cli(
            *_join_argv(tmp_path / "n", peer, "--bootstrap-timeout", "2")[3:], timeout=60))
    line = _one_line_error(proc)
    assert "failed to negotiate the secure protocol" in line, line
    assert "Noise" in line, line


def _run_bounded(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` to its end; a process still running after ``timeout`` fails the test."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:  # run() killed it
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout
        pytest.fail(f"still running after {timeout:g} s, having printed: {out!r}")


async def test_a_relay_that_refuses_the_circuit_fails_start_up_naming_its_status(tmp_path) -> None:
    """The relay answers CONNECT with 204 NO_RESERVATION (the target holds no reservation
    there): connected to the relay only, the node has reached no bootstrap peer."""
    async with standard_node() as relay:
        target = peer_id_of(create_new_key_pair()).to_base58()
        circuit = f"{relay.addr}/p2p-circuit/p2p/{target}"
        argv = _join_argv(tmp_path / "n", circuit, "--bootstrap-timeout", "3")
        proc = await trio.to_thread.run_sync(_run_bounded, argv, 45)
    assert "joined run" not in proc.stdout, proc.stdout
    line = _one_line_error(proc)
    assert "could not reach any bootstrap peer" in line, line
    assert circuit in line, line
    assert f"relay {relay.host.get_id()} refused the circuit: status 204 NO_RESERVATION" in line, line


async def test_doctor_probes_a_relay_address_through_the_relay_and_names_its_refusal(tmp_path) -> None:
    async with standard_node() as relay:
        circuit = f"{relay.addr}/p2p-circuit/p2p/{peer_id_of(create_new_key_pair()).to_base58()}"
        report = await trio.to_thread.run_sync(lambda: run_cli(
            "doctor", "--data-dir", str(tmp_path / "n"), "--peer", circuit,
            "--listen", f"/ip4/127.0.0.1/tcp/{free_port()}", "--json", timeout=60))
    assert "Traceback" not in report.stderr, report.stderr
    assert report.returncode == 1
    [finding] = [f for f in json.loads(report.stdout)["findings"] if f["check"] == "bootstrap"]
    assert finding["status"] == "problem"
    assert finding["detail"].startswith(circuit), finding
    assert "refused the circuit: status 204 NO_RESERVATION" in finding["detail"], finding
    assert "does not lead to the peer" in finding["advice"], finding


async def test_doctor_finds_nothing_wrong_with_a_plain_libp2p_bootstrap_peer(tmp_path) -> None:
    def doctor() -> tuple[subprocess.CompletedProcess[str], dict]:
        report = run_cli("doctor", "--data-dir", str(daemon.data_dir), "--json", timeout=60)
        assert "Traceback" not in report.stderr, report.stderr
        return report, json.loads(report.stdout)

    def joined() -> bool:  # the control socket answers while bootstrap still runs
        return bool(daemon.call("status").get("joined", "").startswith("connected to 1"))

    async with standard_node() as server:
        daemon = DaemonProcess(tmp_path / "n", peers=(server.addr,)).start()
        try:
            await trio.to_thread.run_sync(daemon.wait_ready, 60.0)
            assert await trio.to_thread.run_sync(wait_for, joined, 30.0), daemon.log_path.read_text()[-2000:]
            report, facts = await trio.to_thread.run_sync(doctor)
        finally:
            daemon.kill()
    bootstrap = [f for f in facts["findings"] if f["check"] == "bootstrap"]
    assert [f["status"] for f in bootstrap] == ["ok", "ok"], bootstrap
    assert bootstrap[0]["detail"].startswith(server.addr), bootstrap  # the whole address, not an id
    assert "speaks no Lattica protocol" in bootstrap[0]["detail"], bootstrap
    problems = [f for f in facts["findings"] if f["status"] == "problem"]
    assert (report.returncode, problems) == (0, []), facts


async def test_no_stream_is_opened_again_and_again_for_a_protocol_the_peer_lacks(tmp_path) -> None:
    async with standard_node() as server, trio.open_nursery() as nursery:
        node: Node = build_node(_config(tmp_path / "n", (server.addr,)), create_new_key_pair())
        await nursery.start(node.run)
        host = node.running_host
        opened: list[str] = []
        new_stream = host.new_stream

        async def counting_new_stream(peer_id, protocol_ids):
            if peer_id == server.host.get_id():
                opened.extend(str(p) for p in protocol_ids)
            return await new_stream(peer_id, protocol_ids)

        host.new_stream = counting_new_stream  # type: ignore[method-assign]
        await trio.sleep(8.0)  # peer exchange runs every 2 s, AutoNAT retried at first after 2 s
        for protocol in ("/lattica/px/1.0.0", str(SYNC_PROTOCOL), "/libp2p/autonat/1.0.0"):
            assert protocol not in opened, opened
        node.request_shutdown()


def test_autonat_without_a_verdict_backs_off() -> None:
    config = AutoNATConfig(recheck_interval=120.0, first_retry=2.0)
    delays = [retry_delay(config, verdicts=0, fruitless_checks=n) for n in range(1, 10)]
    assert delays[:4] == [2.0, 4.0, 8.0, 16.0]
    assert delays[-1] == 120.0
    assert retry_delay(config, verdicts=1, fruitless_checks=0) == 120.0
