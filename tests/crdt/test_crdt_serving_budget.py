"""The node-wide budget for answering state-sync sessions, against many identities on real hosts."""

from __future__ import annotations

import contextlib

import multiaddr
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import info_from_p2p_addr

from lattica.crdt import ReplicatedState, StateConfig, sync
from lattica.errors import PeerBusyError
from lattica.net.host import build_host
from lattica.net.serving_budget import ServingLimits

LOOPBACK = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")
BUDGET = ServingLimits(bytes_per_s=20_000, burst_bytes=40_000, max_answers=4)


class EmptyReplica:
    """An asker that holds nothing: every session is answered with the whole state."""

    run_id = "svc"

    def __init__(self) -> None:
        self.envelopes = 0

    def state_vector(self) -> list[list[str | int]]:
        return []

    def writers(self) -> set[str]:
        return set()

    def missing_for(self, vector: object) -> list:
        return []

    async def accept_batch(self, wire_envelopes: list[object], *, from_peer: str) -> None:
        self.envelopes += len(wire_envelopes)


@contextlib.asynccontextmanager
async def running_state(tmp_path, config: StateConfig):
    key_pair = create_new_key_pair()
    host = build_host(key_pair)
    async with host.run([LOOPBACK]), trio.open_nursery() as nursery:
        state = ReplicatedState(host, key_pair, data_dir=tmp_path, run_id="svc", config=config)
        await nursery.start(state.run)
        yield state
        nursery.cancel_scope.cancel()


async def _pull_until(server: ReplicatedState, until: float, outcome: dict[str, int]) -> None:
    """One fresh identity asking ``server`` for its whole state, again and again."""
    host = build_host(create_new_key_pair())
    async with host.run([LOOPBACK]):
        await host.connect(info_from_p2p_addr(server.host.get_addrs()[0]))
        while trio.current_time() < until:
            replica = EmptyReplica()
            stream = await host.new_stream(server.host.get_id(), [sync.SYNC_PROTOCOL])
            try:
                await sync.initiate(stream, replica, peer_id=server.peer_id)
            except PeerBusyError:
                outcome["busy"] += 1
                await trio.sleep(0.05)
            else:
                outcome["full_states"] += 1
            finally:
                await stream.close()


async def test_many_identities_asking_for_the_full_state_get_no_more_than_the_node_budget(tmp_path):
    outcome = {"full_states": 0, "busy": 0}
    with trio.fail_after(60):
        async with running_state(tmp_path / "server", StateConfig(serving=BUDGET)) as server:
            for i in range(40):  # a state worth asking for: tens of KB of signed updates
                await server.update_member(addrs=[f"/ip4/10.0.{i}.1/tcp/4001"], device="cpu", throughput=float(i))
            state_bytes = sum(env.encoded_size() for env in server.missing_for([]))
            started = trio.current_time()
            async with trio.open_nursery() as askers:
                for _ in range(8):
                    askers.start_soon(_pull_until, server, started + 3.0, outcome)
            elapsed = trio.current_time() - started
            budget = BUDGET.burst_bytes + BUDGET.bytes_per_s * elapsed + state_bytes + 8_192
            assert server.serving.served_bytes <= budget
            assert outcome["full_states"] * state_bytes <= budget
            assert outcome["busy"] > 0
            assert server.counters()["sync_answers_busy"] >= outcome["busy"]
            assert server.counters()["updates_rejected"] == {}


async def test_an_honest_member_is_served_once_the_flood_has_passed(tmp_path):
    fast = dict(sync_interval=0.3, peer_poll_interval=0.1, sync_timeout=3.0, max_backoff=1.0)
    outcome = {"full_states": 0, "busy": 0}
    with trio.fail_after(60):
        async with running_state(tmp_path / "server", StateConfig(serving=BUDGET, **fast)) as server:
            await server.set_run_config({"model": "tiny"})
            async with trio.open_nursery() as askers:
                for _ in range(4):
                    askers.start_soon(_pull_until, server, trio.current_time() + 1.0, outcome)
            config = StateConfig(admins=(server.peer_id,), **fast)
            async with running_state(tmp_path / "member", config) as member:
                await member.host.connect(info_from_p2p_addr(server.host.get_addrs()[0]))
                while member.snapshot().get("config") != {"model": "tiny"}:
                    await trio.sleep(0.1)
                assert member.counters()["updates_rejected"].keys() <= {"replay"}
