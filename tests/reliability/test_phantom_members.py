"""A member fills the replicated state with throwaway keys: the honest trainers do not notice.

Two ``lattica join --train`` daemons on loopback; a third party joins the (open) run with a real
libp2p host and the replicated state (it is a member: connected, syncing, renewing its lease),
claims the run's last round under a hash nobody holds (a round beyond the run's is not even
tried), and relays records signed by fresh keys: trainers with leases until 2036 at round 999.
Those keys never connect, so they are not members, and the member's own claim is dropped after
one failed fetch: the two trainers keep running their rounds together and end on the same
state; ``lattica state`` lists the keys as unverified.
"""

from __future__ import annotations

import itertools
import re
import time
from pathlib import Path

import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import info_from_p2p_addr
from multiaddr import Multiaddr

from lattica.config import NodeConfig
from lattica.crdt import documents
from lattica.crdt.config import StateConfig
from lattica.crdt.envelope import Envelope
from lattica.crdt.liveness import vouches
from lattica.crdt.replica import Replica
from lattica.crdt.state import ReplicatedState
from lattica.crdt.sync import SYNC_PROTOCOL
from lattica.net.host import build_host
from lattica.node.composition import build_node
from lattica_lab.daemons import DaemonProcess, cli_json

RUN = "default"
ROUNDS = 6
PHANTOMS = 4
FAR_LEASE_MS = 2_085_000_000_000  # 2036
ENV = {
    "LATTICA_TRAIN_BATCH_SIZE": "4",
    "LATTICA_TRAIN_SEQ_LEN": "32",
    "LATTICA_TRAIN_WARMUP_STEPS": "2",
    "LATTICA_TRAIN_ROUND_DEADLINE_S": "5",
    "OMP_NUM_THREADS": "1",
}


def _trainer(path: Path, peers: tuple[str, ...] = ()) -> DaemonProcess:
    args = (
        "--train", "--model", "tiny", "--device", "cpu", "--log-level", "info", "--strategy", "diloco",
        "--rounds", str(ROUNDS), "--inner-steps", "5", "--min-peers", "2",
    )
    return DaemonProcess(path, peers=peers, extra_args=args, env=ENV)


def _phantom() -> tuple[str, list[Envelope]]:
    replica = Replica(run_id=RUN, key_pair=create_new_key_pair(), admins=())
    me = replica.peer_id
    envs = replica.local_write(
        me, lambda d: documents.write_member(d, {"role": "trainer", "addrs": ["/ip4/127.0.0.1/tcp/9"]}),
    )
    envs += replica.local_write(me, lambda d: documents.write_lease(d, lease_expires_ms=FAR_LEASE_MS, heartbeat=1))
    envs += replica.local_write(me, lambda d: documents.write_progress(d, round=999, weights_hash="e" * 64))
    return me, envs


def _seconds(clock: str) -> float:
    """Seconds since midnight of a log line's ``HH:MM:SS.mmm``."""
    hours, minutes, seconds = clock.split(":")
    return int(hours) * 3600 + int(minutes) * 60 + float(seconds)


def _training(daemon: DaemonProcess) -> dict:
    try:
        return daemon.call("status").get("training") or {"phase": "starting"}
    except Exception:  # noqa: BLE001 - the control socket is not up yet
        return {"phase": "starting"}


async def test_throwaway_keys_do_not_split_or_stall_a_run(tmp_path: Path) -> None:
    daemons: list[DaemonProcess] = []
    try:
        a = _trainer(tmp_path / "a").start()
        daemons.append(a)
        await trio.to_thread.run_sync(lambda: a.wait_ready(timeout=60))
        a_addr = await trio.to_thread.run_sync(lambda: a.addr)
        phantoms, envelopes = [], []
        for _ in range(PHANTOMS):
            peer, envs = _phantom()
            phantoms.append(peer)
            envelopes += envs
        attacker_keys = create_new_key_pair()
        attacker = build_host(attacker_keys)
        async with attacker.run([Multiaddr("/ip4/127.0.0.1/tcp/0")]), trio.open_nursery() as nursery:
            config = StateConfig(admins=(a_addr.split("/p2p/")[-1],))  # as a joiner through a would
            member = ReplicatedState(attacker, attacker_keys, data_dir=tmp_path / "attacker", run_id=RUN, config=config)
            await nursery.start(member.run)
            await member.update_member(role="observer")
            await member.set_progress(ROUNDS, "d" * 64)  # a claim of its own that it cannot serve
            # the throwaway keys' records, relayed like any other writer's
            await member.accept_batch([e.to_wire() for e in envelopes], from_peer=member.peer_id)
            await attacker.connect(info_from_p2p_addr(Multiaddr(a_addr)))
            with trio.fail_after(30):
                while not set(phantoms) <= set(await trio.to_thread.run_sync(lambda: a.call("state")["members"])):
                    await trio.sleep(0.5)
            b = _trainer(tmp_path / "b", peers=(a_addr,)).start()
            daemons.append(b)
            await trio.to_thread.run_sync(lambda: b.wait_ready(timeout=60))

            def done() -> bool:
                infos = [_training(d) for d in daemons]
                assert all(i["phase"] != "failed" for i in infos), infos
                return all(i["phase"] == "done" for i in infos)

            with trio.fail_after(240):
                while not await trio.to_thread.run_sync(done):
                    await trio.sleep(1.0)
            states = [
                await trio.to_thread.run_sync(lambda d=d: cli_json("state", "--data-dir", str(d.data_dir)))
                for d in daemons
            ]
            nursery.cancel_scope.cancel()
        ids = sorted(await trio.to_thread.run_sync(lambda: [d.peer_id for d in daemons]))
        logs = [d.log_path.read_text() for d in daemons if d.log_path]
        for state in states:
            assert set(phantoms) <= set(state["members"]), "the records did reach every replica"
            assert set(phantoms) <= set(state["unverified"])
            assert not set(phantoms) & set(state["live"])
            assert member.peer_id in state["live"]  # the member itself is one
        for log in logs:
            # the member's own claim: tried, then left alone for a doubling back-off (a fetch
            # loop logged it twice a second); how many tries fit depends on how long the daemons
            # took to start, their spacing does not
            tries = [
                (_seconds(m.group(1)), float(m.group(2))) for m in re.finditer(
                    rf"^(\S+) WARNING .*(?:could not fetch outer state of round {ROUNDS}|"
                    rf"no holder serves the published state of round {ROUNDS}).* ignoring that claim for (\d+) s",
                    log, re.M,
                )
            ]
            assert tries, log[-6000:]
            assert [period for _, period in tries] == [5.0 * 2**k for k in range(len(tries))], log[-6000:]
            for (at, period), (next_at, _) in itertools.pairwise(tries):
                assert next_at - at >= period - 0.5, log[-6000:]
            together = len(re.findall(r"sync round/\d+(?:/retry/\d+)? done with 2 member\(s\)", log))
            assert together >= ROUNDS - 1, log[-6000:]
        for state in states:  # every replica published the last round, with one hash
            assert {state["progress"][p]["round"] for p in ids} == {ROUNDS}
        assert len({state["progress"][p]["weights_hash"] for state in states for p in ids}) == 1
    finally:
        for daemon in daemons:
            daemon.kill()


# -- with a run secret: connected is not enough --------------------------------------------------

SECRET = b"phantom members test secret 0123"


async def _gated_node(nursery, data_dir: Path, *, peers: tuple[str, ...] = (), secret: bytes | None = None):
    config = NodeConfig(
        data_dir=data_dir, listen=("/ip4/127.0.0.1/tcp/0",), peers=peers, run_id="gated",
        metrics_addr=None, nat=False, bootstrap_timeout_s=10,
    )
    node = build_node(config, create_new_key_pair(), secret=secret)
    await nursery.start(node.run)
    return node, node.services[0].state


async def test_a_connected_peer_the_gate_refuses_is_no_member_even_when_a_member_relays_it(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            a, a_state = await _gated_node(nursery, tmp_path / "a", secret=SECRET)
            a_addr = str(a.dialable_addrs()[0])
            _m, m_state = await _gated_node(nursery, tmp_path / "m", peers=(a_addr,), secret=SECRET)
            _x, x_state = await _gated_node(nursery, tmp_path / "x", peers=(a_addr,))  # no secret
            await x_state.update_member(role="trainer")
            x_id, m_id = x_state.peer_id, m_state.peer_id

            async def relay() -> None:  # a member hands on the outsider's fresh records
                while True:
                    wire = [e.to_wire() for e in x_state._replica.retained()]
                    await m_state.accept_batch(wire, from_peer=m_id)
                    await trio.sleep(0.5)

            nursery.start_soon(relay)
            while not (x_id in a_state.snapshot()["members"] and m_id in a_state.live_members()):
                await trio.sleep(0.2)
            await trio.sleep(2.0)  # a few heartbeats and sync sessions
            assert x_id in {p.to_base58() for p in a.running_host.get_connected_peers()}  # connected...
            assert a.access.denied[str(SYNC_PROTOCOL)] > 0  # ...but refused by the gate
            assert x_id not in a_state.live_members()
            assert x_id in a_state.dump()["unverified"]
            assert a_state.live_members() == sorted([a_state.peer_id, m_id])
            nursery.cancel_scope.cancel()


# -- with the secret: members vouching for throwaway keys ----------------------------------------

PHANTOM_LEASE_MS = 4000


async def _renew_leases(phantoms: list[Replica], members: list) -> None:
    """The keys' owner renews their leases (well within the readers' bound) through its members."""
    for beat in itertools.count(1):
        expires = time.time_ns() // 1_000_000 + PHANTOM_LEASE_MS
        for p in phantoms:
            p.local_write(
                p.peer_id, lambda d, b=beat, e=expires: documents.write_lease(d, lease_expires_ms=e, heartbeat=b),
            )
        wire = [env.to_wire() for p in phantoms for env in p.retained()]
        for member in members:
            await member.accept_batch(wire, from_peer=member.peer_id)
        await trio.sleep(0.5)


async def test_two_members_with_the_secret_cannot_vouch_throwaway_keys_in(tmp_path: Path) -> None:
    """Two identities that hold the secret (on one host) list three throwaway keys as proven to
    them and keep their leases fresh: neither honest node counts them (``phantoms_live`` 0)."""
    phantoms = [Replica(run_id="gated", key_pair=create_new_key_pair(), admins=()) for _ in range(3)]
    phantom_ids = {p.peer_id for p in phantoms}
    for phantom in phantoms:
        phantom.local_write(phantom.peer_id, lambda d: documents.write_member(d, {"role": "trainer"}))
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            a, a_state = await _gated_node(nursery, tmp_path / "a", secret=SECRET)
            a_addr = str(a.dialable_addrs()[0])
            _b, b_state = await _gated_node(nursery, tmp_path / "b", peers=(a_addr,), secret=SECRET)
            while b_state.peer_id not in a_state.live_members():
                await trio.sleep(0.2)
            members = []
            for name in ("m1", "m2"):
                _m, m_state = await _gated_node(nursery, tmp_path / name, peers=(a_addr,), secret=SECRET)
                m_state.proven_peers = lambda real=m_state.proven_peers: real() | phantom_ids
                members.append(m_state)
            nursery.start_soon(_renew_leases, phantoms, members)
            honest = (a_state, b_state)

            def everyone_sees_all() -> bool:
                return all(
                    phantom_ids <= set(s.snapshot()["members"])
                    and {m.peer_id for m in members} <= set(s.live_members())
                    and phantom_ids <= set(vouches(s.snapshot()["members"][m.peer_id])) for s in honest for m in members
                )

            while not everyone_sees_all():
                await trio.sleep(0.2)
            with trio.move_on_after(6.0):  # more than a lease of renewals and heartbeats
                while True:
                    phantoms_live = [p for s in honest for p in s.live_members() if p in phantom_ids]
                    assert phantoms_live == []
                    await trio.sleep(0.1)
            for state in honest:
                assert phantom_ids <= set(state.dump()["unverified"])
            nursery.cancel_scope.cancel()
