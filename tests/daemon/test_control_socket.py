"""The control socket: whatever a local client does costs that client's connection only.

In-process tests drive ``ControlServer`` over a real Unix socket with short timeouts; the
process tests do the same to a real ``lattica join`` daemon and check it is still up and
answering afterwards.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from lattica.control import server as server_module
from lattica.control.protocol import MAX_REQUEST_BYTES, ControlRequest, encode_request
from lattica.control.server import ControlServer
from lattica_lab.daemons import DaemonProcess, run_cli

# -- in process ------------------------------------------------------------------------------


async def _echo(request: ControlRequest) -> object:
    if request.method == "state":
        await trio.sleep_forever()
    return {"method": request.method}


@pytest.fixture
async def control(nursery, tmp_path):
    path = tmp_path / "c.sock"
    server = ControlServer(path, _echo, max_clients=4)
    await nursery.start(server.run)
    return path


async def _exchange(path: Path, data: bytes, *, half_close: bool = True) -> bytes:
    stream = await trio.open_unix_socket(str(path))
    async with stream:
        await stream.send_all(data)
        if half_close:
            await stream.send_eof()
        received = bytearray()
        with trio.fail_after(10):
            while chunk := await stream.receive_some(65536):
                received += chunk
        return bytes(received)


async def _request(path: Path, method: str) -> dict[str, object]:
    return json.loads(await _exchange(path, encode_request(method), half_close=False))


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (b"hello\n", "not JSON"),
        (b"\xff\xfe\n", "not JSON"),
        (b"[1, 2]\n", "JSON object"),
        (b'{"method": "sta', "not JSON"),  # truncated: EOF before the newline
        (b'{"method": "rm -rf"}\n', "unknown method"),
        (b"x" * (MAX_REQUEST_BYTES + 10), "larger than"),
    ],
)
async def test_malformed_requests_get_an_error_reply_and_the_server_stays(control, data, error):
    reply = json.loads(await _exchange(control, data))
    assert reply["ok"] is False
    assert error in reply["error"]
    assert await _request(control, "status") == {"ok": True, "result": {"method": "status"}}


async def test_connect_and_hang_up_is_ignored(control):
    for _ in range(5):
        stream = await trio.open_unix_socket(str(control))
        await stream.aclose()
    assert await _exchange(control, b"") == b""
    assert (await _request(control, "id"))["ok"] is True


async def test_a_client_that_leaves_before_the_reply_costs_nothing(control):
    for _ in range(5):
        stream = await trio.open_unix_socket(str(control))
        await stream.send_all(encode_request("status"))
        await stream.aclose()
    assert (await _request(control, "id"))["ok"] is True


async def test_a_silent_client_is_answered_with_an_error_after_the_read_timeout(control, monkeypatch):
    monkeypatch.setattr(server_module, "READ_TIMEOUT_S", 0.3)
    stream = await trio.open_unix_socket(str(control))
    async with stream:
        await stream.send_all(b'{"method"')
        with trio.fail_after(5):
            reply = await stream.receive_some(4096)
    assert b"no request line within" in reply


async def test_a_handler_that_hangs_is_cut_off(control, monkeypatch):
    monkeypatch.setattr(server_module, "HANDLER_TIMEOUT_S", 0.3)
    reply = await _request(control, "state")
    assert reply["ok"] is False
    assert "did not finish" in str(reply["error"])


async def test_slow_clients_give_way_to_new_ones(control):
    hogs = []
    try:
        for _ in range(8):  # twice max_clients, each still owing its request line
            hog = await trio.open_unix_socket(str(control))
            hogs.append(hog)
            await hog.send_all(b'{"meth')
            await trio.sleep(0.05)
        with trio.fail_after(5):
            assert (await _request(control, "status"))["ok"] is True
            assert await hogs[0].receive_some(100) == b""  # the oldest was closed, unanswered
    finally:
        for hog in hogs:
            await hog.aclose()


def test_max_clients_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="client limit"):
        ControlServer(tmp_path / "c.sock", _echo, max_clients=0)


# -- a real daemon ---------------------------------------------------------------------------


def _running_daemon(path: Path) -> Iterator[DaemonProcess]:
    d = DaemonProcess(path).start()
    try:
        d.wait_ready()
        yield d
    finally:
        d.kill()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory) -> Iterator[DaemonProcess]:
    """One daemon for the tests that must leave it running (each checks it still is)."""
    yield from _running_daemon(tmp_path_factory.mktemp("shared") / "d")


@pytest.fixture
def own_daemon(tmp_path) -> Iterator[DaemonProcess]:
    """A daemon of its own, for a test that stops it."""
    yield from _running_daemon(tmp_path / "d")


def _raw(path: Path, data: bytes, *, read: bool = True, shut: bool = True) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(path))
        try:
            s.sendall(data)
            if shut:
                s.shutdown(socket.SHUT_WR)
        except OSError:  # the daemon may refuse the rest of an oversized request
            pass
        if not read:
            return b""
        received = bytearray()
        try:
            while chunk := s.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass
        return bytes(received)


def _assert_alive(daemon: DaemonProcess) -> None:
    assert daemon.proc is not None
    assert daemon.proc.poll() is None, daemon.log()
    assert daemon.call("status")["peer_id"]
    assert "Traceback" not in daemon.log()


def test_connect_then_close_does_not_kill_the_daemon(daemon):
    sock = daemon.data_dir / "control.sock"
    for _ in range(3):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(sock))
        time.sleep(0.3)
        _assert_alive(daemon)


def test_garbage_oversized_truncated_and_vanishing_clients_do_not_kill_the_daemon(daemon):
    sock = daemon.data_dir / "control.sock"
    assert b"not JSON" in _raw(sock, b"hello\n")
    assert b"not JSON" in _raw(sock, b"\x00\xff" * 100 + b"\n")
    assert b"not JSON" in _raw(sock, b'{"method": "sta')  # truncated
    _raw(sock, b"x" * (4 * MAX_REQUEST_BYTES), read=False, shut=False)  # oversized, then gone
    _raw(sock, b"y" * (4 * MAX_REQUEST_BYTES))
    _raw(sock, encode_request("status"), read=False, shut=False)  # asks, leaves before the reply
    _raw(sock, encode_request("state"), read=False)
    time.sleep(0.5)
    _assert_alive(daemon)


def test_many_slow_clients_do_not_lock_out_lattica_stop(own_daemon):
    daemon = own_daemon
    sock = daemon.data_dir / "control.sock"
    hogs = []
    try:
        for _ in range(2 * server_module.MAX_CLIENTS):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(sock))
            s.sendall(b'{"meth')
            hogs.append(s)
        time.sleep(0.5)
        assert daemon.call("status")["peer_id"]
        result = run_cli("stop", "--data-dir", str(daemon.data_dir))
        assert result.returncode == 0, result.stderr
        assert daemon.proc is not None
        assert daemon.proc.wait(timeout=10) == 0
    finally:
        for s in hogs:
            s.close()


def test_a_second_daemon_on_the_same_data_dir_fails_and_leaves_the_first_running(daemon):
    result = run_cli(
        "join", "--data-dir", str(daemon.data_dir), "--listen", "/ip4/127.0.0.1/tcp/0",
        "--metrics-addr", "off",
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"lattica: error: another daemon is already running with data dir {daemon.data_dir}"
    ]
    time.sleep(0.5)
    _assert_alive(daemon)

