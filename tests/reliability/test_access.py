"""Run access control: the sans-IO policy, and real in-process nodes on loopback.

Three real ``Node`` daemons (host, state sync, px, bye) with a ``TensorService`` and a
``RoundCoordinator`` each: A and B are members of a protected run, C is not (it has no secret,
or is not on the allowlist). C is refused on every protocol; B is served.
Forged state updates (a member's entries signed by someone else) are covered by
``tests/crdt/test_crdt_replica.py`` and ``tests/crdt/test_crdt_service.py``.
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import multiaddr
import pytest
import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.host.exceptions import StreamFailure
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr

from lattica.config import NodeConfig
from lattica.coordination.rounds import ROUND_PROTOCOL, RoundCoordinator
from lattica.crdt.sync import SYNC_PROTOCOL
from lattica.errors import ConfigError, LatticaError
from lattica.net.access import AUTH_PROTOCOL, AccessGate, RunAccess, read_secret_file
from lattica.net.host import build_host
from lattica.net.identity import peer_id_of
from lattica.net.peer_exchange import PX_PROTOCOL
from lattica.net.tensors.transfer import TensorService, TensorServiceConfig
from lattica.net.wire import read_message, write_message
from lattica.node.composition import build_node

SECRET = b"correct horse battery staple 42"
A_ID = "12D3KooWJbM6u2R3tE5hD3ZKg1b3wHv7n9t4yZ6JzWq2mF8o1QxA"
B_ID = "12D3KooWJbM6u2R3tE5hD3ZKg1b3wHv7n9t4yZ6JzWq2mF8o1QxB"


# -- the policy, without any I/O ----------------------------------------------------------------


def test_a_proof_is_bound_to_the_secret_both_peer_ids_and_the_run() -> None:
    a = RunAccess(run_id="r", self_id=A_ID, secret=SECRET)
    nonce = a.challenge()
    mac = a.answer({"run": "r", "nonce": nonce}, verifier=B_ID)["mac"]
    b = RunAccess(run_id="r", self_id=B_ID, secret=SECRET)
    assert b.check_proof(nonce, mac, verifier=B_ID, prover=A_ID)
    assert not b.check_proof(nonce, mac, verifier=A_ID, prover=B_ID)  # replayed the other way
    assert not b.check_proof(a.challenge(), mac, verifier=B_ID, prover=A_ID)  # another nonce
    other_run = RunAccess(run_id="r2", self_id=B_ID, secret=SECRET)
    assert not other_run.check_proof(nonce, mac, verifier=B_ID, prover=A_ID)
    wrong = RunAccess(run_id="r", self_id=B_ID, secret=b"x" * 32)
    assert not wrong.check_proof(nonce, mac, verifier=B_ID, prover=A_ID)
    assert not b.check_proof(nonce, "not bytes", verifier=B_ID, prover=A_ID)


@pytest.mark.parametrize(
    "request_",
    [None, {}, {"run": "other", "nonce": b"n" * 32}, {"run": "r", "nonce": b"short"}, {"run": "r", "nonce": 5}],
)
def test_malformed_or_foreign_challenges_get_no_proof(request_) -> None:
    a = RunAccess(run_id="r", self_id=A_ID, secret=SECRET)
    assert "mac" not in a.answer(request_, verifier=B_ID)


def test_the_allowlist_admits_only_listed_peers_and_ourselves() -> None:
    access = RunAccess(run_id="r", self_id=A_ID, allow_peers=frozenset({B_ID}))
    assert access.listed(A_ID)
    assert access.listed(B_ID)
    assert not access.listed("12D3KooWJbM6u2R3tE5hD3ZKg1b3wHv7n9t4yZ6JzWq2mF8o1QxC")
    assert RunAccess(run_id="r", self_id=A_ID).open


def test_the_secret_file_must_be_private_and_long_enough(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="mode 0644"):
        read_secret_file(path)
    os.chmod(path, 0o600)
    assert read_secret_file(path) == SECRET
    path.write_bytes(b"short")
    with pytest.raises(ConfigError, match="at least"):
        read_secret_file(path)
    with pytest.raises(ConfigError, match="cannot read"):
        read_secret_file(tmp_path / "missing")
    with pytest.raises(ConfigError, match="--allow-peer must be a peer id"):
        NodeConfig(data_dir=tmp_path, allow_peers=("nope",))


# -- real nodes -----------------------------------------------------------------------------------


class _Member:
    def __init__(self, node, tensors: TensorService, rounds: RoundCoordinator) -> None:
        self.node, self.tensors, self.rounds = node, tensors, rounds
        self.peer_id = node.peer_id.to_base58()


async def _start(nursery, data_dir: Path, *, key_pair, peers=(), allow=(), secret=None) -> _Member:
    config = NodeConfig(
        data_dir=data_dir, listen=("/ip4/127.0.0.1/tcp/0",), peers=tuple(peers), run_id="guarded",
        metrics_addr=None, nat=False, allow_peers=tuple(allow), bootstrap_timeout_s=10,
    )
    node = build_node(config, key_pair, secret=secret, extra=lambda context: [_DataPlane(context)])
    await nursery.start(node.run)
    plane = node.services[-1]
    return _Member(node, plane.tensors, plane.rounds)


class _DataPlane:
    """Tensors and round groups, the run protocols a non-member must be refused on."""

    name = "data-plane"

    def __init__(self, context) -> None:
        self.tensors = TensorService(context.host, context.key_pair, config=TensorServiceConfig())
        self.rounds = RoundCoordinator(
            context.host, peer_id=context.peer_id.to_base58(), run_id="guarded",
            candidates=context.peer_book.connected_ids, deadline_s=1.0,
        )

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(self.tensors.run)
            await nursery.start(self.rounds.run)
            task_status.started()


async def _request(member: _Member, peer: str, protocol, message) -> object:
    stream = await member.node.host.new_stream(ID.from_base58(peer), [protocol])
    try:
        await write_message(stream, message, peer_id=peer)
        return await read_message(stream, peer_id=peer)
    finally:
        await stream.close()


@pytest.mark.parametrize("mode", ["secret", "allowlist"])
async def test_a_non_member_is_refused_on_every_protocol_and_a_member_is_served(tmp_path, mode) -> None:
    keys = [create_new_key_pair() for _ in range(3)]
    ids = [peer_id_of(k).to_base58() for k in keys]
    guard = {"secret": SECRET} if mode == "secret" else {"allow": ids[:2]}
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            a = await _start(nursery, tmp_path / "a", key_pair=keys[0], **guard)
            a_addr = a.node.dialable_addrs()[0]
            b = await _start(nursery, tmp_path / "b", key_pair=keys[1], peers=[a_addr], **guard)
            c = await _start(nursery, tmp_path / "c", key_pair=keys[2], peers=[a_addr])  # open: no guard
            weights = torch.arange(1000, dtype=torch.float32)
            a.tensors.serve("w", weights)

            # the member is served: tensors, all-reduce, rounds, px, state
            assert torch.equal((await b.tensors.fetch(a.peer_id, ["w"]))["w"], weights)
            async with trio.open_nursery() as pair:
                for m in (a, b):
                    pair.start_soon(partial(m.tensors.allreduce, [torch.ones(64)], group=sorted(ids[:2]), tag="ok"))
            # the run's candidates are its members; asked from above: a coordinator with a
            # responsive candidate below it would redirect there
            for m in (a, b):
                m.rounds.candidates = lambda: sorted(ids[:2])
            low, high = sorted((a, b), key=lambda m: m.peer_id)
            reply = await _request(high, low.peer_id, ROUND_PROTOCOL, {"key": "k1", "run": "guarded"})
            assert isinstance(reply, dict)
            assert high.peer_id in reply["group"]
            reply = await _request(b, a.peer_id, PX_PROTOCOL, {"run": "guarded"})
            assert isinstance(reply, dict)
            with trio.fail_after(20):
                while b.peer_id not in _state_members(a) or a.peer_id not in _state_members(b):
                    await trio.sleep(0.2)

            # the non-member is refused everywhere
            with pytest.raises(LatticaError):
                await c.tensors.fetch(a.peer_id, ["w"])
            with pytest.raises(LatticaError), trio.fail_after(15):
                await c.tensors.allreduce([torch.ones(64)], group=sorted([a.peer_id, c.peer_id]), tag="no")
            for protocol, message in ((ROUND_PROTOCOL, {"key": "k2", "run": "guarded"}),
                                      (PX_PROTOCOL, {"run": "guarded"})):
                with pytest.raises((LatticaError, StreamFailure)):
                    await _request(c, a.peer_id, protocol, message)
            await trio.sleep(2.5)  # a few state-sync and px rounds
            assert c.peer_id not in _state_members(a)
            assert c.peer_id not in _state_members(b)
            assert a.peer_id not in _state_members(c)
            denied = a.node.access.denied
            for protocol in (str(SYNC_PROTOCOL), str(ROUND_PROTOCOL), str(PX_PROTOCOL),
                             "/lattica/tensors/1.0.0"):
                assert denied[protocol] > 0, (protocol, dict(denied))
            assert a.node.status()["access"]["denied_streams"]
            nursery.cancel_scope.cancel()


def _state_members(member: _Member) -> set[str]:
    return set(member.node.services[0].state.snapshot().get("members", {}))


async def test_an_uninstalled_gate_admits_nobody_with_a_secret() -> None:
    gate = AccessGate(RunAccess(run_id="r", self_id=A_ID, secret=SECRET))
    assert not await gate.admit(B_ID, object())


async def test_a_peer_that_stalls_the_handshake_is_denied_quickly_and_not_asked_again(tmp_path) -> None:
    """A peer answers our challenge never, and opens 20 streams at once: one handshake times out,
    every one of its streams is denied within about that time (not one timeout after another),
    the failure is remembered (no new handshake for its next streams), and a member is served
    meanwhile."""
    keys = [create_new_key_pair() for _ in range(2)]
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            a = await _start(nursery, tmp_path / "a", key_pair=keys[0], secret=SECRET)
            a_addr = a.node.dialable_addrs()[0]
            b = await _start(nursery, tmp_path / "b", key_pair=keys[1], peers=[a_addr], secret=SECRET)
            a.tensors.serve("w", torch.ones(10))
            staller = build_host(create_new_key_pair())
            await nursery.start(_run_host, staller)
            challenges: list[float] = []

            async def never_answer(stream) -> None:
                challenges.append(trio.current_time())
                await trio.sleep_forever()

            staller.set_stream_handler(AUTH_PROTOCOL, never_answer)
            await staller.connect(info_from_p2p_addr(multiaddr.Multiaddr(a_addr)))
            denied: list[float] = []

            async def ask() -> None:
                with pytest.raises((LatticaError, StreamFailure)):  # reset by the gate
                    await _request_as(staller, a.peer_id, PX_PROTOCOL, {"run": "guarded"})
                denied.append(trio.current_time())

            started = trio.current_time()
            async with trio.open_nursery() as flood:
                for _ in range(20):
                    flood.start_soon(ask)
                with trio.fail_after(5):  # a member is not held up by the staller
                    assert torch.equal((await b.tensors.fetch(a.peer_id, ["w"]))["w"], torch.ones(10))
            assert len(denied) == 20
            assert max(denied) - started < 6  # one 3 s handshake, not 20 of them one by one
            assert 1 <= len(challenges) <= 2  # ours and maybe a service's outbound one, shared
            asked = len(challenges)
            again = trio.current_time()
            with pytest.raises((LatticaError, StreamFailure)):
                await _request_as(staller, a.peer_id, PX_PROTOCOL, {"run": "guarded"})
            assert trio.current_time() - again < 1.5  # denied from the remembered failure
            assert len(challenges) == asked
            nursery.cancel_scope.cancel()


async def _run_host(host, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    async with host.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        task_status.started()
        await trio.sleep_forever()


async def _request_as(host, peer: str, protocol, message) -> object:
    stream = await host.new_stream(ID.from_base58(peer), [protocol])
    try:
        await write_message(stream, message, peer_id=peer)
        return await read_message(stream, peer_id=peer)
    finally:
        await stream.close()


class _CountingGate(AccessGate):
    """The gate with its one network step replaced: each handshake stalls past its timeout."""

    def __init__(self, access: RunAccess) -> None:
        super().__init__(access)
        self.handshakes = 0

    async def _verify(self, peer_id: str) -> bool:
        self.handshakes += 1
        with trio.fail_after(3):
            await trio.sleep_forever()
        return True


async def test_a_failed_handshake_is_remembered_per_connection_for_a_short_time(autojump_clock) -> None:
    gate = _CountingGate(RunAccess(run_id="r", self_id=A_ID, secret=SECRET))
    conn, reconnected = object(), object()
    results: list[bool] = []

    async def admit() -> None:
        results.append(await gate.admit(B_ID, conn))

    async with trio.open_nursery() as nursery:
        for _ in range(20):
            nursery.start_soon(admit)
    assert results == [False] * 20
    assert gate.handshakes == 1  # 8 waited for the one handshake, 11 were denied at once
    assert trio.current_time() < 3.5
    assert not await gate.admit(B_ID, conn)  # remembered: no new handshake
    assert gate.handshakes == 1
    with trio.fail_after(4):
        assert not await gate.admit(B_ID, reconnected)  # a new connection is asked afresh
    assert gate.handshakes == 2
    await trio.sleep(5)
    with trio.fail_after(4):
        assert not await gate.admit(B_ID, conn)  # the failure ran out: asked again
    assert gate.handshakes == 3
