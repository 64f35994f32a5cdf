import pytest
import torch
import trio
import trio.lowlevel

from lattica.errors import PeerUnavailableError, RemoteProtocolError
from lattica.train.engine.model import GPTConfig, build_model
from lattica.train.engine.outer_state import flatten_outer_state, outer_state_hash, unflatten_outer_state
from lattica.train.strategies.diloco import DiLoCo, DiLoCoConfig
from lattica.train.swarm.join import fetch_outer_state
from lattica_lab.collective import InMemoryCollectiveGroup

TINY = GPTConfig(n_layer=1, d_model=16, n_head=2, context=8)


class FixedGroups:
    async def group_for(self, key):
        return ("a",)


async def _trained_state():
    model = build_model(TINY, seed=0)
    s = DiLoCo(
        model,
        collective=InMemoryCollectiveGroup(["a"]).member("a"),
        groups=FixedGroups(),
        config=DiLoCoConfig(inner_steps=1),
    )
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    await s.after_inner_step(1)
    return s.outer_state_dict()


class Holders:
    def __init__(self, flat, *, dead=(), liars=()):
        self.flat, self.dead, self.liars = flat, set(dead), set(liars)
        self.calls = []

    async def fetch(self, peer, names):
        self.calls.append((peer, len(names)))
        await trio.lowlevel.checkpoint()
        if peer in self.dead:
            raise PeerUnavailableError("gone", peer_id=peer)
        out = {n: self.flat[n].clone() for n in names}
        if peer in self.liars:
            for t in out.values():
                if t.is_floating_point():
                    t.add_(1.0)
        return out


async def test_parallel_fetch_spreads_over_holders_and_verifies():
    state = await _trained_state()
    flat = flatten_outer_state(state)
    holders = Holders(flat)
    got = await fetch_outer_state(["h1", "h2", "h3"], holders.fetch, expected_hash=outer_state_hash(state))
    assert {p for p, _ in holders.calls} == {"h1", "h2", "h3"}
    assert sum(n for _, n in holders.calls) == len(flat)  # manifest once, then each tensor once
    rebuilt = unflatten_outer_state(got)
    assert outer_state_hash(rebuilt) == outer_state_hash(state)
    assert (rebuilt["round"], rebuilt["step"]) == (state["round"], state["step"])


async def test_dead_holder_share_is_refetched_elsewhere():
    state = await _trained_state()
    flat = flatten_outer_state(state)
    holders = Holders(flat, dead={"h2"})
    got = await fetch_outer_state(["h1", "h2"], holders.fetch, expected_hash=outer_state_hash(state))
    assert set(got) == set(flat)


async def test_lying_holder_is_detected_and_honest_one_used():
    state = await _trained_state()
    flat = flatten_outer_state(state)
    holders = Holders(flat, liars={"bad"})
    got = await fetch_outer_state(["bad", "good"], holders.fetch, expected_hash=outer_state_hash(state))
    assert all(torch.equal(got[n], flat[n]) for n in flat)
    with pytest.raises(RemoteProtocolError, match="peer bad"):
        await fetch_outer_state(["bad"], holders.fetch, expected_hash=outer_state_hash(state))


async def test_no_holders_and_bad_names():
    with pytest.raises(PeerUnavailableError):
        await fetch_outer_state([], Holders({}).fetch, expected_hash="0")
    with pytest.raises(RemoteProtocolError, match="manifest"):
        unflatten_outer_state({"weird": torch.zeros(1)})
    flat = flatten_outer_state({"params": {"w": torch.zeros(2)}, "round": 1})
    flat["params/extra"] = torch.ones(1)
    with pytest.raises(RemoteProtocolError, match="unexpected tensor"):
        unflatten_outer_state(flat)


async def test_every_strategy_state_shape_round_trips():
    spes_like = {"params": {"w": torch.arange(3.0)}, "owners": {0: "a", 1: "b"}, "completed_rounds": 2}
    streaming_like = {"params": {"w": torch.ones(2)}, "momentum": {}, "completed_syncs": 3, "syncs_started": [1, 2]}
    noloco_like = {"params": {"w": torch.ones(2)}, "velocity": {"w": torch.zeros(2)}, "rounds": 4}
    for state in (spes_like, streaming_like, noloco_like):
        back = unflatten_outer_state(flatten_outer_state(state))
        assert outer_state_hash(back) == outer_state_hash(state)
        for key, value in state.items():
            if isinstance(value, dict) and value and isinstance(next(iter(value.values())), torch.Tensor):
                assert all(torch.equal(back[key][n], t) for n, t in value.items())
    assert unflatten_outer_state(flatten_outer_state(spes_like))["owners"] == {"0": "a", "1": "b"}
