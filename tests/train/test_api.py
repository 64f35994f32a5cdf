import torch
import trio

from lattica.train.api import wrap
from lattica.train.strategies.diloco import DiLoCoConfig
from lattica_lab.collective import InMemoryCollectiveGroup


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


# -- against real nodes -----------------------------------------------------------------------


def _node_config(data_dir, peers=()):
    from lattica.config import NodeConfig

    return NodeConfig(
        data_dir=data_dir, listen=("/ip4/127.0.0.1/tcp/0",), peers=tuple(peers), run_id="api-test",
        metrics_addr=None, nat=False, dht=False, bootstrap_timeout_s=20,
    )


async def test_users_own_loop_on_two_real_nodes(tmp_path):
    """``open_node`` + ``wrap``: two nodes on loopback (real hosts, state, data plane) run the
    documented loop and end with the same weights after two all-reduce rounds together."""
    from lattica.training_node import open_node

    out = {}
    with trio.fail_after(120):
        async with (
            open_node(_node_config(tmp_path / "a")) as first,
            open_node(_node_config(tmp_path / "b", peers=first.addrs()[:1])) as second,
        ):
            for node in (first, second):
                await node.wait_for_members(2)
            async with trio.open_nursery() as nursery:
                for i, node in enumerate((first, second)):
                    nursery.start_soon(_user_loop, node, i, out)
    (m0, o0, r0), (m1, o1, r1) = out[0], out[1]
    assert [r.round for r in r0] == [0, 1]
    for report in r0 + r1:
        assert not report.skipped
        assert set(report.group) == {first.peer_id, second.peer_id}
    assert o0.completed_rounds == o1.completed_rounds == 2
    for a, b in zip(m0.parameters(), m1.parameters(), strict=True):
        assert torch.equal(a, b)
