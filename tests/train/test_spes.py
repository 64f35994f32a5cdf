import pytest
import torch
import trio

from lattica.config import TrainSettings
from lattica.coordination.groups import draw_step_groups
from lattica.train.engine.model import lm_loss
from lattica.train.engine.moe import MoEConfig, build_moe_model, dense_parameters, expert_parameters
from lattica.train.settings.strategy_settings import strategy_config
from lattica.train.strategies.accounting import optimizer_state_bytes
from lattica.train.strategies.experts import DerivedOwnership, assign_experts
from lattica.train.strategies.spes import (
    SPES,
    SPESConfig,
    merge_alpha_at,
    merge_similar_experts,
)
from lattica_lab.collective import InMemoryCollectiveGroup

CFG = MoEConfig(n_layer=1, d_model=8, n_head=2, context=8, num_experts=8, top_k=2, expert_hidden=8)


class Groups:
    """Every member until round ``leave_at``, then without ``leaver``."""

    def __init__(self, members, leaver=None, leave_at=None):
        self.members, self.leaver, self.leave_at = list(members), leaver, leave_at

    async def group_for(self, key):
        r = int(key.split("/")[1])
        if self.leave_at is not None and r >= self.leave_at:
            return [m for m in self.members if m != self.leaver]
        return self.members


def test_initial_assignment_is_contiguous_over_sorted_members():
    owners = assign_experts(["d", "b", "a", "c"], 8)
    assert owners == {0: "a", 1: "a", 2: "b", 3: "b", 4: "c", 5: "c", 6: "d", 7: "d"}
    assert assign_experts(["a", "b", "c"], 7) == {
        0: "a",
        1: "a",
        2: "a",
        3: "b",
        4: "b",
        5: "c",
        6: "c",
    }


def test_orphans_go_to_least_loaded_and_survivors_keep_theirs():
    before = assign_experts(["a", "b", "c", "d"], 8)
    after = assign_experts(["a", "b", "d"], 8, previous=before)
    # c's experts 4 and 5: first to a (tie, lowest id), then to b
    assert after == {0: "a", 1: "a", 2: "b", 3: "b", 4: "a", 5: "b", 6: "d", 7: "d"}
    # a joiner takes work from the most loaded (highest id on ties), highest expert first
    joined = assign_experts(["a", "b", "d", "e"], 8, previous=after)
    assert joined == {0: "a", 1: "a", 2: "b", 3: "b", 4: "e", 5: "e", 6: "d", 7: "d"}


def test_merge_moves_each_expert_toward_its_nearest_neighbours():
    experts = [[torch.tensor([1.0, 0.0])], [torch.tensor([1.0, 0.1])], [torch.tensor([0.0, 1.0])]]
    merge_similar_experts(experts, neighbors=1, alpha=0.5)
    # nearest: 0 -> 1, 1 -> 0, 2 -> 1 (cos 0.0995 > 0)
    torch.testing.assert_close(experts[0][0], torch.tensor([1.0, 0.05]))
    torch.testing.assert_close(experts[1][0], torch.tensor([1.0, 0.05]))
    torch.testing.assert_close(experts[2][0], torch.tensor([0.5, 0.55]))
    assert merge_alpha_at(5000, alpha=0.05, decay_steps=20000) == pytest.approx(0.0375)
    assert merge_alpha_at(30000, alpha=0.05, decay_steps=20000) == 0.0


def make_nodes(peers, *, config, groups):
    group = InMemoryCollectiveGroup(peers)
    nodes = []
    for p in peers:
        model = build_moe_model(CFG, seed=0)
        strategy = SPES(
            model,
            collective=group.member(p),
            groups=groups,
            config=config,
            ownership=DerivedOwnership(peers, CFG.num_experts),
        )
        optimizer = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-2)
        strategy.attach_inner_optimizer(optimizer)
        nodes.append((model, strategy, optimizer))
    return group, nodes


async def test_sync_averages_dense_and_copies_each_expert_from_its_owner():
    peers = ["a", "b", "c", "d"]
    cfg = SPESConfig(sync_every=1, merge_alpha=0.0)
    group, nodes = make_nodes(peers, config=cfg, groups=Groups(peers))
    for i, (model, strategy, _) in enumerate(nodes):
        with torch.no_grad():
            for p in dense_parameters(model):
                p.fill_(float(i))
            for e, params in expert_parameters(model).items():
                value = 10.0 + e if e in strategy.owned_experts else -1.0
                for p in params:
                    p.fill_(value)
    async with trio.open_nursery() as nursery:
        for _, strategy, _ in nodes:
            nursery.start_soon(strategy.after_inner_step, 1)
    for model, _, _ in nodes:
        for p in dense_parameters(model):
            assert bool((p == 1.5).all())  # mean of 0, 1, 2, 3
        for e, params in expert_parameters(model).items():
            assert all(bool((p == 10.0 + e).all()) for p in params)
    # each node sent the dense all-reduce plus its two experts to each of three peers
    expert_bytes = sum(p.numel() * 4 for p in expert_parameters(nodes[0][0])[0]) * 2
    dense_bytes = sum(p.numel() * 4 for p in dense_parameters(nodes[0][0]))
    assert group.bytes_sent["a"] == 2 * 3 * dense_bytes // 4 + 3 * expert_bytes


def train_step(model, optimizer, seed):
    idx = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(seed))
    loss = lm_loss(model(idx[:, :-1]), idx[:, 1:])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


async def run(nodes, peers, steps, *, stop=None):
    async def node(i):
        model, strategy, optimizer = nodes[i]
        for step in range(1, steps + 1):
            if stop and peers[i] == stop[0] and step > stop[1]:
                return
            train_step(model, optimizer, seed=1000 * i + step)
            await strategy.after_inner_step(step)

    async with trio.open_nursery() as nursery:
        for i in range(len(nodes)):
            nursery.start_soon(node, i)


async def test_three_rounds_keep_replicas_identical_and_foreign_experts_stateless():
    peers = ["a", "b", "c", "d"]
    cfg = SPESConfig(sync_every=2, merge_every=2, merge_alpha=0.05, merge_decay_steps=100)
    _, nodes = make_nodes(peers, config=cfg, groups=Groups(peers))
    initial = [p.detach().clone() for p in nodes[0][0].parameters()]
    await run(nodes, peers, steps=6)
    reference = list(nodes[0][0].parameters())
    for model, strategy, optimizer in nodes:
        assert strategy.completed_rounds == 3
        assert all(torch.equal(x, y) for x, y in zip(reference, model.parameters(), strict=True))
        for e, params in expert_parameters(model).items():
            owned = e in strategy.owned_experts
            assert all(p.requires_grad == owned for p in params)
            assert all((p in optimizer.state) == owned for p in params)
    assert not all(torch.equal(x, y) for x, y in zip(initial, reference, strict=True))
    # optimizer state: AdamW's two moments of dense + the 2 owned experts of 8
    model, strategy, optimizer = nodes[0]
    dense = sum(p.numel() for p in dense_parameters(model))
    experts = sum(p.numel() for ps in expert_parameters(model).values() for p in ps)
    moments = optimizer_state_bytes(optimizer) - 4 * len(optimizer.state)  # minus step counters
    assert moments == 2 * 4 * (dense + experts * 2 // 8)
    assert strategy.optimizer_state_bytes == optimizer_state_bytes(optimizer)


async def test_owner_leaves_its_experts_are_reassigned_and_training_goes_on():
    peers = ["a", "b", "c"]
    cfg = SPESConfig(sync_every=2, merge_alpha=0.0)
    groups = Groups(peers, leaver="c", leave_at=2)  # syncs are rounds 1, 2, 3 at steps 2, 4, 6
    _, nodes = make_nodes(peers, config=cfg, groups=groups)
    orphaned = nodes[2][1].owned_experts
    assert orphaned == [6, 7]
    await run(nodes, peers, steps=4, stop=("c", 2))
    survivors = nodes[:2]
    copies_at_round_2 = [p.detach().clone() for p in survivors[0][0].parameters()]
    owners = survivors[0][1].owners
    assert set(owners.values()) == {"a", "b"}
    assert owners == survivors[1][1].owners
    new_owner = {e: owners[e] for e in orphaned}
    assert all(o in ("a", "b") for o in new_owner.values())
    # both survivors hold c's experts as of the last sync c took part in
    for e in orphaned:
        torch.testing.assert_close(
            expert_parameters(survivors[0][0])[e][0], expert_parameters(survivors[1][0])[e][0]
        )
    # the new owners train them from here on
    for model, strategy, optimizer in survivors:
        for step in (5, 6):
            train_step(model, optimizer, seed=7 * step + len(strategy.owned_experts))
    async with trio.open_nursery() as nursery:
        for _, strategy, _ in survivors:
            nursery.start_soon(strategy.after_inner_step, 6)
    a, b = survivors[0][0], survivors[1][0]
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    moved = expert_parameters(a)[orphaned[0]]
    before = {id(p): i for i, p in enumerate(a.parameters())}
    assert not torch.equal(moved[0], copies_at_round_2[before[id(moved[0])]])


async def test_gossip_averages_dense_in_pairs_and_copies_only_the_partners_experts():
    peers = ["a", "b", "c", "d"]
    cfg = SPESConfig(sync_every=1, merge_alpha=0.0, averaging="gossip", group_size=2, exchange_timeout_s=2.0)
    group, nodes = make_nodes(peers, config=cfg, groups=Groups(peers))
    for i, (model, strategy, _) in enumerate(nodes):
        with torch.no_grad():
            for p in dense_parameters(model):
                p.fill_(float(i))
            for e, params in expert_parameters(model).items():
                value = 10.0 + e if e in strategy.owned_experts else -1.0 - i  # stale copies differ
                for p in params:
                    p.fill_(value)
    reports = {}

    async def sync(strategy):
        reports[strategy] = await strategy.after_inner_step(1)

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for _, strategy, _ in nodes:
                nursery.start_soon(sync, strategy)
    stripes = draw_step_groups(peers, key="round/1", group_size=2)
    for i, (model, strategy, _) in enumerate(nodes):
        me = peers[i]
        stripe = next(s for s in stripes if me in s)
        partner = next(q for q in stripe if q != me)
        assert not strategy.replicas_agree
        for p in dense_parameters(model):
            assert bool((p == (i + peers.index(partner)) / 2).all())  # the pair's mean only
        for e, params in expert_parameters(model).items():
            owner = strategy.owners[e]
            expected = 10.0 + e if owner in stripe else -1.0 - i  # from its owner, or left as it was
            assert all(bool((p == expected).all()) for p in params), (me, e, owner)
        [report] = reports[strategy]
        assert report.consensus_distance is not None
        assert report.consensus_distance > 0
        assert strategy.owners == nodes[0][1].owners  # the map does not move with a group
    # each node sent its dense parameters and its two experts to its one partner, no all-reduce
    expert_bytes = sum(p.numel() * 4 for p in expert_parameters(nodes[0][0])[0]) * 2
    dense_bytes = sum(p.numel() * 4 for p in dense_parameters(nodes[0][0]))
    assert group.bytes_sent["a"] == dense_bytes + expert_bytes


async def test_gossip_without_an_answer_keeps_the_weights_and_trains_on():
    peers = ["a", "b"]
    cfg = SPESConfig(sync_every=1, merge_alpha=0.0, averaging="gossip", exchange_timeout_s=0.5)
    _, nodes = make_nodes(peers, config=cfg, groups=Groups(peers))
    model, strategy, _ = nodes[0]
    before = [p.detach().clone() for p in model.parameters()]
    with trio.fail_after(10):
        (report,) = await strategy.after_inner_step(1)  # b never syncs
    assert report.group == ("a",)
    assert "b" in report.detail
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert strategy.completed_rounds == 1


def test_gossip_settings_reach_spes():
    cfg = strategy_config(TrainSettings(strategy="spes", averaging="gossip", group_size=3, group_grace_s=2.5),
                          members=("a", "b"))
    assert (cfg.averaging, cfg.group_size, cfg.exchange_timeout_s) == ("gossip", 3, 2.5)
    assert SPES.averages_in_groups(cfg)
    assert not SPES.averages_in_groups(SPESConfig(members=("a",)))
    with pytest.raises(ValueError, match="averaging"):
        SPESConfig(averaging="ring")
    with pytest.raises(ValueError, match="exchange_timeout_s"):
        SPESConfig(averaging="gossip", exchange_timeout_s=0)
