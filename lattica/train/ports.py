"""What training needs of the node, declared once: the Protocols the node's parts satisfy.

The training service and its swarm bookkeeping never import the node (``lattica.node``), the
replicated state's service (``crdt.state``) nor the data plane (``net.tensors``): they name what
they use of each here, and the composition root hands them the real thing. mypy checks that it
fits; tests hand in memory fakes (``lattica_lab.collective``, in-memory run states).

- ``RunState``: the replicated run state (``crdt.state.ReplicatedState``), read and written only
  through ``swarm.membership.MembershipView``;
- ``TensorStore``, ``OuterStateStore``, ``DataPlane``: the tensor data plane
  (``net.tensors.transfer.TensorService``) as outer-state transfer, outer-state sync and the
  service use it — ``DataPlane`` is also the ``Collective`` strategies sync through;
- ``NodeHandle``, ``TrainingMetrics``: the node's identity, host, config and the metrics the
  service times;
- ``ControlRequest``: a control-socket request as the service answers it (``train``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import trio
from trio_typing import TaskStatus

from lattica.train.engine.collective import Collective

if TYPE_CHECKING:
    import torch
    from libp2p.abc import IHost
    from libp2p.peer.id import ID

    from lattica.config import NodeConfig
    from lattica.crdt.config import StateConfig
    from lattica.crdt.documents import Snapshot
    from lattica.numerics.screen import Rejection


class RunState(Protocol):
    """What training needs of ``ReplicatedState``."""

    @property
    def config(self) -> StateConfig: ...

    @property
    def admins(self) -> frozenset[str]: ...

    def snapshot(self) -> Snapshot: ...

    def live_members(self) -> list[str]: ...

    async def wait_changed(self) -> None: ...

    async def update_member(self, **fields: str) -> None: ...

    async def set_progress(self, round: int, weights_hash: str) -> None: ...

    async def set_run_config(self, config: dict[str, object]) -> None: ...

    async def set_owned_experts(self, experts: list[str]) -> None: ...


class TensorStore(Protocol):
    """Named tensors offered to peers (a joiner fetches the outer state by these names)."""

    def serve(self, name: str, tensor: torch.Tensor) -> None: ...

    def unserve(self, name: str) -> None: ...


class OuterStateStore(TensorStore, Protocol):
    """The data plane as outer-state sync uses it: serve our states, fetch others'."""

    async def fetch(self, peer: str, names: Sequence[str]) -> Mapping[str, torch.Tensor]: ...


class ReceivedBytes(Protocol):
    @property
    def last_sent(self) -> Mapping[str, tuple[int, float]]:
        """peer -> (bytes, seconds) of the last large message sent to it (``lattica doctor``)."""
        ...

    @property
    def rejected_contributions(self) -> Mapping[str, int]:
        """peer -> its contributions refused (all-reduce parts, group partners' exchanges)."""
        ...

    def total_received(self) -> int: ...


class DataPlane(Collective, OuterStateStore, Protocol):
    """The tensor data plane (``net.tensors.transfer.TensorService``), built by the composition
    root: the ``Collective`` strategies sync through, and the named tensors joiners fetch."""

    @property
    def stats(self) -> ReceivedBytes: ...

    def score_down(self, rejection: Rejection) -> None:
        """Count a refused contribution against its peer (``stats.rejected_contributions``)."""

    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None: ...


class Histogram(Protocol):
    def observe(self, amount: float) -> None: ...

    def labels(self, **labels: str) -> Histogram: ...


class TrainingMetrics(Protocol):
    """The node metrics the training service times (``observability.NodeMetrics``)."""

    @property
    def collective_seconds(self) -> Histogram: ...

    @property
    def checkpoint_fetch_seconds(self) -> Histogram: ...


class NodeHandle(Protocol):
    """What the training service needs of its node: identity, host, config and metrics."""

    @property
    def peer_id(self) -> ID: ...

    @property
    def host(self) -> IHost: ...

    @property
    def config(self) -> NodeConfig: ...

    @property
    def metrics(self) -> TrainingMetrics: ...

    async def round_trip_times(self, peers: Sequence[str]) -> dict[str, float]:
        """Seconds to each of ``peers`` and back (the tuner's RTTs); silent peers left out."""
        ...


class ControlRequest(Protocol):
    """A control-socket request (``control.protocol.ControlRequest``) as the service reads it."""

    @property
    def method(self) -> str: ...
