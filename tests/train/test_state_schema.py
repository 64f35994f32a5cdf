"""A fetched outer state is held to this replica's own before anything of it is loaded.

Every strategy's own states (fresh, and after rounds with outer momentum) fit the schema built
from a fresh replica; hostile manifests and tensors are refused as ``RemoteProtocolError`` — and
nothing else is ever raised, whatever JSON or tensors arrive (hypothesis).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lattica.errors import RemoteProtocolError
from lattica.train.engine.device import select_device
from lattica.train.engine.model import GPTConfig, build_model
from lattica.train.engine.moe import MoEConfig, build_moe_model
from lattica.train.engine.outer_state import MANIFEST, flatten_outer_state, outer_state_hash
from lattica.train.engine.schedule import ScheduleConfig
from lattica.train.engine.task import Task
from lattica.train.engine.trainer import Trainer, TrainerConfig
from lattica.train.strategies import STRATEGIES, strategy_class
from lattica.train.swarm.state_schema import OuterStateSchema, SchemaLimits, check_outer_state
from lattica_lab.collective import FixedGroups, InMemoryCollectiveGroup

PEERS = ("a", "b")
STEPS = 8
MAX_COUNT = 1000
SETTINGS = {"inner_steps": 4, "sync_every": 4, "merge_every": 4, "members": PEERS}
GPT = GPTConfig(n_layer=1, d_model=16, n_head=2, context=8)
MOE = MoEConfig(n_layer=1, d_model=16, n_head=2, context=8, num_experts=4, expert_hidden=16)


def _batches(seed: int):
    generator = torch.Generator().manual_seed(seed)
    while True:
        data = torch.randint(0, 256, (2, 9), generator=generator)
        yield data[:, :-1], data[:, 1:]


def _trainer(name: str, me: str, network: InMemoryCollectiveGroup) -> Trainer:
    model = build_moe_model(MOE, seed=0) if name == "spes" else build_model(GPT, seed=0)
    cls = strategy_class(name)
    config_cls = getattr(cls, "config_class", None)
    config = None
    if config_cls is not None:
        fields = config_cls.__dataclass_fields__
        config = config_cls(**{k: v for k, v in SETTINGS.items() if k in fields})
    strategy = cls(model, collective=network.member(me), groups=FixedGroups(PEERS), config=config)
    schedule = ScheduleConfig(lr=1e-3, warmup_steps=1, total_steps=STEPS)
    trainer_config = TrainerConfig(total_steps=STEPS, eval_every=0, log_every=STEPS, schedule=schedule)
    return Trainer(
        Task(model=model, train_batches=_batches(ord(me))), strategy, trainer_config, device=select_device("cpu"),
    )


def _schema(trainer: Trainer) -> OuterStateSchema:
    return OuterStateSchema.of(trainer.strategy.outer_state_dict(), max_count=STEPS)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
async def test_every_strategys_own_states_fit_the_schema_of_a_fresh_replica(name: str) -> None:
    network = InMemoryCollectiveGroup(list(PEERS))
    trainers = [_trainer(name, me, network) for me in PEERS]
    fresh = _trainer(name, "a", InMemoryCollectiveGroup(list(PEERS)))
    schema = _schema(fresh)
    check_outer_state(flatten_outer_state(fresh.strategy.outer_state_dict()), schema)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for trainer in trainers:
                nursery.start_soon(trainer.run)
    trained = trainers[1].strategy.outer_state_dict()
    outer = check_outer_state(flatten_outer_state(trained), schema)
    check_outer_state(flatten_outer_state(trained), _schema(trainers[0]))  # momentum on both sides
    fresh.adopt_outer_state(outer)
    assert outer_state_hash(fresh.strategy.outer_state_dict()) == outer_state_hash(trained)


# -- hostile states against a DiLoCo replica's schema --------------------------------------------


def _diloco_state() -> dict[str, Any]:
    model = build_model(GPT, seed=0)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    momentum = {n: torch.zeros_like(p) for n, p in params.items()}
    return {"round": 3, "step": 12, "completed_rounds": 3, "params": params, "momentum": momentum}


SCHEMA = OuterStateSchema.of({**_diloco_state(), "momentum": {}}, max_count=MAX_COUNT)  # fresh: no momentum yet


def _with_manifest(flat: dict[str, torch.Tensor], edit) -> dict[str, torch.Tensor]:
    meta = json.loads(bytes(flat[MANIFEST].tolist()))
    edit(meta)
    blob = json.dumps(meta).encode()
    return {**flat, MANIFEST: torch.frombuffer(bytearray(blob), dtype=torch.uint8)}


def _refused(flat: dict[str, torch.Tensor], words: str) -> None:
    with pytest.raises(RemoteProtocolError, match=words):
        check_outer_state(flat, SCHEMA, peer_id="hostile")


def test_a_diloco_state_with_momentum_fits() -> None:
    outer = check_outer_state(flatten_outer_state(_diloco_state()), SCHEMA)
    assert outer["round"] == 3
    assert set(outer["momentum"]) == set(outer["params"])


@pytest.mark.parametrize(
    ("entry", "value", "words"),
    [
        ("round", "not-a-round", "'round' is not a valid count"),
        ("round", True, "not a valid count"),
        ("round", -1, "not a valid count"),
        ("round", MAX_COUNT + 1, "not a valid count"),
        ("round", 3.0, "not a valid count"),
        ("round", [3], "not a valid count"),
        ("step", {"a": {"b": {"c": 1}}}, "'step' is not a valid count"),
        ("step", None, "not a valid count"),
        ("completed_rounds", 10**30, "not a valid count"),
        ("surprise", 1, "unknown manifest entry 'surprise'"),
        ("momentum", {"x": "y"}, "'momentum' is also a group of tensors"),
    ],
)
def test_a_malformed_manifest_entry_is_refused(entry: str, value: object, words: str) -> None:
    _refused(_with_manifest(flatten_outer_state(_diloco_state()), lambda meta: meta.update({entry: value})), words)


def test_a_missing_manifest_entry_is_refused() -> None:
    _refused(
        _with_manifest(flatten_outer_state(_diloco_state()), lambda meta: meta.pop("round")),
        "lacks the manifest entry 'round'",
    )


def test_a_manifest_that_is_not_an_object_or_lists_bad_tensors_is_refused() -> None:
    flat = flatten_outer_state(_diloco_state())
    blob = torch.frombuffer(bytearray(b"[1, 2]"), dtype=torch.uint8)
    _refused({**flat, MANIFEST: blob}, "bad tensor list")
    names = [n for n in flat if n != MANIFEST]
    _refused(_with_manifest(flat, lambda meta: meta.update(tensors=[*names, names[0]])), "names a tensor twice")


def test_tensors_must_be_the_models_parameters_once_each() -> None:
    flat = flatten_outer_state(_diloco_state())
    name = "params/" + next(iter(_diloco_state()["params"]))
    lacking = {n: t for n, t in flat.items() if n != name}
    _refused(_with_manifest(lacking, lambda meta: meta["tensors"].remove(name)), "lacks 1 of the model's params")
    extra = {**flat, "params/evil": torch.zeros(3)}
    _refused(_with_manifest(extra, lambda meta: meta["tensors"].append("params/evil")), "unknown tensor 'params/evil'")
    unlisted = {**flat, "params/evil": torch.zeros(3)}
    _refused(unlisted, "other tensors than its manifest lists")
    other_group = {**flat, "velocity/" + name[7:]: flat[name].clone()}
    _refused(_with_manifest(other_group, lambda meta: meta["tensors"].append("velocity/" + name[7:])), "unknown tensor")


def test_a_group_may_not_be_a_manifest_entry_too() -> None:
    flat = flatten_outer_state(_diloco_state())
    _refused(_with_manifest(flat, lambda meta: meta.update(momentum={})), "also a group of tensors")


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda t: t.reshape(-1)[:-1].clone() if t.numel() > 1 else torch.zeros(2), "the model's is"),
        (lambda t: t.to(torch.float64), "torch.float64"),
        (lambda t: t.to(torch.bfloat16), "torch.bfloat16"),
        (
            lambda t: t.reshape(-1).clone().index_fill_(0, torch.tensor([0]), float("nan")).reshape(t.shape),
            "not finite",
        ),
        (lambda t: torch.full_like(t, float("inf")), "not finite"),
        (lambda t: torch.full_like(t, float("-inf")), "not finite"),
    ],
)
@pytest.mark.parametrize("group", ["params", "momentum"])
def test_a_tensor_of_the_wrong_shape_dtype_or_not_finite_is_refused(change, words: str, group: str) -> None:
    flat = flatten_outer_state(_diloco_state())
    name = sorted(n for n in flat if n.startswith(group + "/"))[-1]
    _refused({**flat, name: change(flat[name])}, words)


def test_schema_limits_bound_lists_mappings_and_strings() -> None:
    schema = OuterStateSchema.of(
        {"syncs_started": [1, 2], "owners": {"0": "peer"}, "label": "x"}, max_count=10,
        limits=SchemaLimits(max_items=3, max_chars=8),
    )

    def check(**meta: object) -> None:
        state = {"syncs_started": [], "owners": {"0": "p"}, "label": "x", **meta}
        check_outer_state(flatten_outer_state(state), schema)

    check(syncs_started=[0, 10, 3], owners={"1": "a", "2": 3}, label="12345678")
    for bad in (
        {"syncs_started": [0, 1, 2, 3]}, {"syncs_started": [11]}, {"syncs_started": ["1"]},
        {"owners": {"0": "p", "1": "p", "2": "p", "3": "p"}}, {"owners": {"0": "123456789"}},
        {"owners": {"123456789": "p"}}, {"owners": {"0": [1]}}, {"owners": {"0": None}},
        {"label": "123456789"}, {"label": 1},
    ):
        with pytest.raises(RemoteProtocolError):
            check(**bad)


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="max_items"):
        SchemaLimits(max_items=0)
    with pytest.raises(ValueError, match="max_count"):
        OuterStateSchema.of({}, max_count=-1)


# -- anything at all: a RemoteProtocolError or a state that fits ---------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(entries=st.dictionaries(
    st.sampled_from(["round", "step", "completed_rounds", "momentum", "tensors", "x"]), JSON,
))
def test_any_manifest_is_refused_cleanly_or_fits(entries: dict[str, object]) -> None:
    flat = _with_manifest(flatten_outer_state(_diloco_state()), lambda meta: meta.update(entries))
    try:
        outer = check_outer_state(flat, SCHEMA)
    except RemoteProtocolError:
        return
    for key in ("round", "step", "completed_rounds"):
        assert type(outer[key]) is int
        assert 0 <= outer[key] <= MAX_COUNT


@settings(max_examples=100, deadline=None)
@given(
    blob=st.binary(max_size=256),
    values=st.lists(st.floats(width=32), min_size=1, max_size=8),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.int64, torch.uint8]),
)
def test_any_bytes_or_tensor_values_are_refused_cleanly_or_fit(blob: bytes, values: list[float], dtype) -> None:
    flat = flatten_outer_state(_diloco_state())
    with pytest.raises(RemoteProtocolError):
        check_outer_state({**flat, MANIFEST: torch.frombuffer(bytearray(blob or b"x"), dtype=torch.uint8)}, SCHEMA)
    name = "params/" + next(iter(_diloco_state()["params"]))
    tensor = torch.tensor(values, dtype=torch.float32).to(dtype)
    with pytest.raises(RemoteProtocolError):
        check_outer_state({**flat, name: tensor}, SCHEMA)
