"""An in-memory ``Collective`` for fast, deterministic tests of outer-step strategies.

All members live in one trio run. ``allreduce`` is a rendezvous: every member of ``group``
deposits its tensors under ``tag``; when the last one arrives, the element-wise mean is computed
once in fp32 and handed to all. ``exchange`` pairs the two deposits of ``(tag, {a, b})``.

Lossy codecs are applied exactly as the real data plane applies them (each contribution goes
through the codec's encode/decode before the fp32 sum, and the mean goes through it once more
before being handed out), so a strategy sees the same numerics in memory as over the network.

``bytes_sent[peer]`` counts what the member would have put on the wire with a butterfly
all-reduce: ``2 (N-1)/N`` of its encoded payload per ``allreduce``, the encoded payload per
``exchange``. Contributions are screened like the real reducer does (``screen.py``); the
excluded ones are listed in ``rejections``. ``PoisonedCollective`` makes a member a hostile
partner (its exchanges send NaN, or anything else a test gives it). ``fail(peer)`` simulates a peer
that died: every pending or later operation that involves it raises ``PeerUnavailableError`` naming
it.

Tensors on an accelerator (the convergence harness on CUDA with DDP's ``reduce_on_device``)
are averaged where they are: fp32 only, summed in group order and divided, without screening
(the harness's workers are honest) — the real data plane never sees such tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import trio

from lattica.errors import LocalProtocolError, PeerUnavailableError
from lattica.numerics import codecs
from lattica.numerics.screen import DEFAULT_SCREEN, ContributionScreen, Rejection, reduce_parts
from lattica.train.engine.collective import Collective


@dataclass
class _Rendezvous:
    expected: frozenset[str]
    deposits: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    done: trio.Event = field(default_factory=trio.Event)
    result: dict[str, list[torch.Tensor]] | None = None
    error: Exception | None = None
    collected: set[str] = field(default_factory=set)


class InMemoryCollectiveGroup:
    """A set of in-memory members; ``member(peer_id)`` returns each one's ``Collective``."""

    def __init__(self, peer_ids: Sequence[str], *, screen: ContributionScreen = DEFAULT_SCREEN) -> None:
        if len(set(peer_ids)) != len(peer_ids):
            raise ValueError("peer ids must be unique")
        self.peer_ids = tuple(peer_ids)
        self.screen = screen
        self.rejections: list[Rejection] = []
        self.bytes_sent: dict[str, int] = {p: 0 for p in peer_ids}
        self.failed: set[str] = set()
        self._rendezvous: dict[tuple, _Rendezvous] = {}
        self._members = {p: InMemoryCollective(self, p) for p in peer_ids}

    def member(self, peer_id: str) -> Collective:
        return self._members[peer_id]

    def fail(self, peer_id: str) -> None:
        """Mark ``peer_id`` dead: operations involving it fail with ``PeerUnavailableError``."""
        self.failed.add(peer_id)
        for rv in self._rendezvous.values():
            if peer_id in rv.expected and not rv.done.is_set():
                rv.error = PeerUnavailableError("peer failed mid-operation", peer_id=peer_id)
                rv.done.set()

    async def _meet(self, key: tuple, expected: frozenset[str], me: str, tensors, combine):
        dead = sorted(expected & self.failed)
        if dead:
            raise PeerUnavailableError("peer is unavailable", peer_id=dead[0])
        rv = self._rendezvous.setdefault(key, _Rendezvous(expected))
        if rv.expected != expected:
            raise LocalProtocolError(f"members disagree on the group of {key[1]!r}")
        if me in rv.deposits:
            raise LocalProtocolError(f"{me} entered {key[1]!r} twice")
        rv.deposits[me] = tensors
        if set(rv.deposits) == expected:
            try:
                rv.result = combine(rv.deposits)
            except LocalProtocolError as exc:
                rv.error = exc
            rv.done.set()
        await rv.done.wait()
        rv.collected.add(me)
        if rv.collected >= set(rv.deposits) and set(rv.deposits) == expected:
            self._rendezvous.pop(key, None)
        if rv.error is not None:
            self._rendezvous.pop(key, None)
            raise rv.error
        assert rv.result is not None
        return rv.result[me]


class InMemoryCollective:
    """One member's view of an ``InMemoryCollectiveGroup``."""

    def __init__(self, group: InMemoryCollectiveGroup, peer_id: str) -> None:
        self._group = group
        self._peer_id = peer_id

    @property
    def peer_id(self) -> str:
        return self._peer_id

    async def allreduce(
        self, tensors: Sequence[torch.Tensor], *, group: Sequence[str], tag: str, codec: str = "fp32"
    ) -> list[torch.Tensor]:
        members = _check_group(group, self._peer_id)
        codecs.check_codec(codec)
        n = len(members)
        encoded = sum(codecs.encoded_size(t, codec) for t in tensors)
        self._group.bytes_sent[self._peer_id] += (2 * (n - 1) * encoded) // n

        def combine(deposits: dict[str, list[torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
            _check_shapes(deposits)
            if any(t.device.type != "cpu" for t in deposits[self._peer_id]):
                return _mean_on_device(deposits, group, codec)
            means = []
            for i, ref in enumerate(deposits[self._peer_id]):
                parts = [codecs.roundtrip(deposits[m][i], codec).to(torch.float32).reshape(-1) for m in group]
                # the same screening and summation order as the real data plane's reducer
                total, rejected = reduce_parts(parts, list(group), self._group.screen)
                self._group.rejections.extend(rejected)
                mean = codecs.roundtrip(total.reshape(ref.shape), codec)
                means.append(mean.to(ref.dtype))
            return {p: [m.clone() for m in means] for p in deposits}

        snapshot = [t.detach().clone() for t in tensors]
        return await self._group._meet(("ar", tag), members, self._peer_id, snapshot, combine)

    async def exchange(
        self, tensors: Sequence[torch.Tensor], *, peer: str, tag: str, codec: str = "fp32"
    ) -> list[torch.Tensor]:
        if peer == self._peer_id or peer not in self._group.peer_ids:
            raise LocalProtocolError(f"cannot exchange with {peer!r}")
        codecs.check_codec(codec)
        self._group.bytes_sent[self._peer_id] += sum(codecs.encoded_size(t, codec) for t in tensors)
        sent = [codecs.roundtrip(t.detach(), codec).to(t.dtype) for t in tensors]

        def swap(deposits: dict[str, list[torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
            a, b = deposits
            return {a: deposits[b], b: deposits[a]}

        pair = frozenset((self._peer_id, peer))
        key = ("x", tag, tuple(sorted(pair)))
        return await self._group._meet(key, pair, self._peer_id, sent, swap)


def _check_group(group: Sequence[str], me: str) -> frozenset[str]:
    members = frozenset(group)
    if len(members) != len(group):
        raise LocalProtocolError("group lists a peer twice")
    if me not in members:
        raise LocalProtocolError(f"{me} is not in the group")
    return members


def _check_shapes(deposits: dict[str, list[torch.Tensor]]) -> None:
    # one layout per member: how many tensors, and each one's shape in order
    layouts = {tuple(tuple(t.shape) for t in tensors) for tensors in deposits.values()}
    if len(layouts) > 1:
        raise LocalProtocolError("members passed tensors of different shapes to one allreduce")


class PoisonedCollective:
    """A member's ``Collective`` that sends ``poison(tensor)`` instead of each tensor it sends in
    an exchange: a hostile or broken group partner (a GPU that produced a NaN, an attacker).
    Its all-reduces and what it receives are untouched."""

    def __init__(self, inner: Collective, poison: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.inner, self.poison = inner, poison

    @property
    def peer_id(self) -> str:
        return self.inner.peer_id

    async def allreduce(
        self, tensors: Sequence[torch.Tensor], *, group: Sequence[str], tag: str, codec: str = "fp32"
    ) -> list[torch.Tensor]:
        return await self.inner.allreduce(tensors, group=group, tag=tag, codec=codec)

    async def exchange(
        self, tensors: Sequence[torch.Tensor], *, peer: str, tag: str, codec: str = "fp32"
    ) -> list[torch.Tensor]:
        return await self.inner.exchange([self.poison(t) for t in tensors], peer=peer, tag=tag, codec=codec)


def _mean_on_device(
    deposits: dict[str, list[torch.Tensor]], group: Sequence[str], codec: str,
) -> dict[str, list[torch.Tensor]]:
    """The fp32 mean of accelerator tensors, on their device (module docstring)."""
    if codec != "fp32":
        raise LocalProtocolError(f"tensors on an accelerator are averaged in fp32 only, not {codec}")
    means = []
    for i in range(len(deposits[group[0]])):
        total = deposits[group[0]][i].to(torch.float32, copy=True)
        for member in group[1:]:
            total += deposits[member][i]
        means.append(total.div_(len(group)))
    return {p: [m.clone() for m in means] for p in deposits}


def nan_like(tensor: torch.Tensor) -> torch.Tensor:
    """A poison for ``PoisonedCollective``: NaN of a floating-point tensor's shape and dtype (an
    encoded payload, bytes, is left as it is)."""
    return torch.full_like(tensor, float("nan")) if tensor.is_floating_point() else tensor


class FixedGroups:
    """A ``GroupProvider`` that always answers the same members (for strategy tests)."""

    def __init__(self, members: Sequence[str]) -> None:
        self.members = list(members)

    async def group_for(self, key: str) -> list[str]:
        return self.members


def scalar_model(value: float = 0.0) -> torch.nn.Module:
    """A one-weight model whose outer-step arithmetic is easy to check by hand."""
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(value)
    return model
