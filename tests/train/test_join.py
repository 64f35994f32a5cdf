import pytest
import torch
import trio
import trio.lowlevel

from lattica.errors import PeerUnavailableError, RemoteProtocolError
from lattica.train.engine.model import GPTConfig, build_model
from lattica.train.engine.outer_state import MANIFEST, flatten_outer_state, outer_state_hash, unflatten_outer_state
from lattica.train.strategies.diloco import DiLoCo, DiLoCoConfig
from lattica.train.swarm.join import FetchPacing, fetch_outer_state, first_answer
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


class SilentHolders(Holders):
    """Holders of which some never answer (a cut link: no reply, no error) and some answer
    only after ``delays`` seconds."""

    def __init__(self, flat, *, silent=(), delays=None):
        super().__init__(flat)
        self.silent, self.delays = set(silent), dict(delays or {})

    async def fetch(self, peer, names):
        if peer in self.silent:
            self.calls.append((peer, len(names)))
            await trio.sleep_forever()
        await trio.sleep(self.delays.get(peer, 0.0))
        return await super().fetch(peer, names)


@pytest.mark.parametrize("order", [["silent", "h1", "h2"], ["h1", "silent", "h2"]])
async def test_a_silent_holder_does_not_hold_the_fetch(autojump_clock, order):
    # a holder cut off answered neither its manifest request nor its share for 13 s, and the
    # others had moved two rounds on by then: the fetch failed and the joiner sat out rounds
    state = await _trained_state()
    flat = flatten_outer_state(state)
    holders = SilentHolders(flat, silent={"silent"})
    started = trio.current_time()
    with trio.fail_after(30):
        got = await fetch_outer_state(order, holders.fetch, expected_hash=outer_state_hash(state))
    assert all(torch.equal(got[n], flat[n]) for n in flat)
    assert trio.current_time() - started <= 2 * FetchPacing().hedge_s + FetchPacing().straggler_min_s


async def test_a_holder_only_slower_than_the_others_keeps_its_share(autojump_clock):
    state = await _trained_state()
    flat = flatten_outer_state(state)
    holders = SilentHolders(flat, delays={"h1": 3.0, "h2": 5.0})
    await fetch_outer_state(["h1", "h2"], holders.fetch, expected_hash=outer_state_hash(state))
    assert [p for p, _ in holders.calls] == ["h1", "h1", "h2"]  # manifest, then one share each


class MovedOnHolders(SilentHolders):
    """Holders that move on while the fetch runs: ``shares_served[peer]`` share requests are
    answered, later ones find the round's state no longer on offer; beside silent holders."""

    def __init__(self, flat, *, silent=(), shares_served=None):
        super().__init__(flat, silent=silent)
        self.shares_left = dict(shares_served or {})

    async def fetch(self, peer, names):
        if peer in self.shares_left and names != [MANIFEST]:
            if self.shares_left[peer] == 0:
                self.calls.append((peer, len(names)))
                await trio.lowlevel.checkpoint()
                raise PeerUnavailableError("peer does not serve the round's tensors", peer_id=peer)
            self.shares_left[peer] -= 1
        return await super().fetch(peer, names)


async def test_a_fetch_whose_holders_all_failed_is_not_retried_on_the_silent_one(autojump_clock):
    # h1 delivered its share, the cut holder stalled and its share went to the others, which had
    # moved on by then (the round's state no longer on offer): the fetch then asked each holder
    # alone, in turn, and waited on the cut one (4-6 s in the chaos benchmark, up to the caller's
    # limit) for a state the run had left. It fails now, and the caller fetches the next claim.
    state = await _trained_state()
    holders = MovedOnHolders(flatten_outer_state(state), silent={"cut"}, shares_served={"h1": 1, "h2": 0})
    started = trio.current_time()
    with trio.fail_after(30), pytest.raises(PeerUnavailableError):
        await fetch_outer_state(["h1", "h2", "cut"], holders.fetch, expected_hash=outer_state_hash(state))
    assert trio.current_time() - started <= FetchPacing().straggler_min_s + 0.5


async def test_first_answer_asks_the_next_holder_after_a_failure_or_the_hedge(autojump_clock):
    asked = []

    async def ask(holder):
        asked.append((holder, trio.current_time()))
        if holder == "gone":
            raise PeerUnavailableError("gone", peer_id=holder)
        if holder == "silent":
            await trio.sleep_forever()
        return holder.upper()

    assert await first_answer(["gone", "silent", "ok"], ask, hedge_s=1.0) == ("ok", "OK")
    assert [h for h, _ in asked] == ["gone", "silent", "ok"]
    assert asked[1][1] - asked[0][1] == 0
    assert asked[2][1] - asked[1][1] == 1.0
    with pytest.raises(PeerUnavailableError, match="gone"):
        await first_answer(["gone"], ask, hedge_s=1.0)


def test_fetch_pacing_is_validated():
    for bad in ({"hedge_s": 0}, {"straggler_min_s": -1}, {"straggler_factor": 0.5}):
        with pytest.raises(ValueError, match="FetchPacing"):
            FetchPacing(**bad)
