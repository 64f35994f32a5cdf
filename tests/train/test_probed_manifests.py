"""A state found served by probing its manifest can be fetched at once, on the real data plane.

A holder answers the same fetch request at most once per ``fetch_repeat_s``; a peer restarted
into a running swarm probes a holder's manifest (is the published state served at all?) and
then fetches the state, whose first request is that manifest again.
"""

from __future__ import annotations

import multiaddr
import pytest
import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import info_from_p2p_addr

from lattica.errors import PeerUnavailableError
from lattica.net.host import build_host
from lattica.net.tensors import TensorService, TensorServiceConfig
from lattica.train.engine.outer_state import MANIFEST, outer_state_hash, read_manifest
from lattica.train.swarm.join import fetch_outer_state
from lattica.train.swarm.outer_transfer import ProbedManifests, ServedRounds, fetch_of_round

ROUND = 3


def _outer_state() -> dict:
    return {
        "round": ROUND, "step": 15, "completed_rounds": ROUND,
        "params": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(4)},
        "momentum": {"w": torch.full((3, 4), 0.5)},
    }


async def _run_host(host, *, task_status=trio.TASK_STATUS_IGNORED):
    async with host.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        task_status.started()
        await trio.sleep_forever()


async def _holder_and_joiner(nursery: trio.Nursery) -> tuple[TensorService, TensorService]:
    services = []
    for _ in range(2):
        key_pair = create_new_key_pair()
        host = build_host(key_pair)
        await nursery.start(_run_host, host)
        service = TensorService(host, key_pair, config=TensorServiceConfig())
        await nursery.start(service.run)
        services.append((host, service))
    await services[1][0].connect(info_from_p2p_addr(services[0][0].get_addrs()[0]))
    return services[0][1], services[1][1]


async def test_the_state_is_fetched_right_after_its_manifest_was_probed() -> None:
    state = _outer_state()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            holder, joiner = await _holder_and_joiner(nursery)
            ServedRounds(holder).publish(ROUND, state)
            probed = ProbedManifests()
            manifest = await fetch_of_round(joiner.fetch, ROUND)(holder.peer_id, [MANIFEST])  # the probe
            read_manifest(manifest)
            probed.keep(holder.peer_id, ROUND, manifest)
            flat = await fetch_outer_state(
                [holder.peer_id], probed.round_fetch(joiner.fetch, ROUND), expected_hash=outer_state_hash(state)
            )
            assert torch.equal(flat["params/w"], state["params"]["w"])
            nursery.cancel_scope.cancel()


async def test_without_the_kept_manifest_the_repeated_request_is_refused() -> None:
    # what a restarted peer met: the holder refuses the manifest it has just sent to it
    state = _outer_state()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            holder, joiner = await _holder_and_joiner(nursery)
            ServedRounds(holder).publish(ROUND, state)
            fetch = fetch_of_round(joiner.fetch, ROUND)
            read_manifest(await fetch(holder.peer_id, [MANIFEST]))
            with pytest.raises(PeerUnavailableError, match="does not serve"):
                await fetch_outer_state([holder.peer_id], fetch, expected_hash=outer_state_hash(state))
            nursery.cancel_scope.cancel()


def test_a_kept_manifest_answers_one_request_of_its_holder_and_round_only() -> None:
    probed = ProbedManifests(max_kept=2)
    calls: list[tuple[str, list[str]]] = []

    async def fetch(peer, names):
        calls.append((peer, list(names)))
        return {n: torch.zeros(1) for n in names}

    kept = {MANIFEST: torch.ones(1, dtype=torch.uint8)}
    probed.keep("a", ROUND, kept)

    async def main() -> None:
        assert await probed.round_fetch(fetch, ROUND + 1)("a", [MANIFEST]) is not kept  # another round
        assert await probed.round_fetch(fetch, ROUND)("b", [MANIFEST]) is not kept  # another holder
        assert await probed.round_fetch(fetch, ROUND)("a", [MANIFEST]) is kept
        assert await probed.round_fetch(fetch, ROUND)("a", [MANIFEST]) is not kept  # once

    trio.run(main)
    assert len(calls) == 3
    for holder in ("x", "y", "z"):  # bounded
        probed.keep(holder, ROUND, kept)
    assert len(probed._kept) == 2
