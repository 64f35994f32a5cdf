import torch
import trio

from lattica.testing.collective import InMemoryCollectiveGroup
from lattica.train.api import wrap
from lattica.train.strategies.diloco import DiLoCoConfig


class FixedGroups:
    def __init__(self, members):
        self.members = tuple(members)

    async def group_for(self, key):
        return self.members


class FakeNode:
    def __init__(self, network, peer, peers):
        self.collective = network.member(peer)
        self.groups = FixedGroups(peers)


async def _user_loop(node, seed, out):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outer = wrap(model, inner, node=node, config=DiLoCoConfig(inner_steps=4))
    gen = torch.Generator().manual_seed(seed)
    reports = []
    async with trio.open_nursery() as nursery:
        outer.bind_nursery(nursery)
        for _ in range(8):
            x = torch.randn(16, 3, generator=gen)
            loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
            loss.backward()
            reports += await outer.step()
            outer.zero_grad()
        reports += await outer.finish()
    out[seed] = (model, outer, reports)


async def test_users_own_loop_with_diloco():
    peers = ["p0", "p1"]
    network = InMemoryCollectiveGroup(peers)
    out = {}
    async with trio.open_nursery() as nursery:
        for i, p in enumerate(peers):
            nursery.start_soon(_user_loop, FakeNode(network, p, peers), i, out)
    (m0, o0, r0), (m1, o1, _r1) = out[0], out[1]
    assert [r.round for r in r0] == [0, 1]
    assert o0.completed_rounds == 2
    for a, b in zip(m0.parameters(), m1.parameters(), strict=True):
        assert torch.equal(a, b)
    state = o0.state_dict()
    assert state["step"] == 8
    o1.load_state_dict(state)
    assert o1.step_count == 8
