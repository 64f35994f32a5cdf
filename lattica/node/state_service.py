"""The replicated run state as a daemon service (``lattica state``, membership, the founder's genesis)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

import trio
from libp2p.crypto.keys import KeyPair
from trio_typing import TaskStatus

from lattica.config import NodeConfig
from lattica.control.protocol import ControlRequest
from lattica.diagnostics import NodeFacts
from lattica.net.host import LatticaHost
from lattica.node.services import METRICS_INTERVAL_S
from lattica.observability import NodeMetrics


class StateService:
    """The replicated run state as a daemon service: ``lattica state`` and membership."""

    name = "state"

    def __init__(
        self, host: LatticaHost, key_pair: KeyPair, config: NodeConfig, *,
        own_addrs: Callable[[], list[str]], metrics: NodeMetrics, role: str | None = None,
    ) -> None:
        from lattica.crdt import StateConfig
        from lattica.crdt.liveness import VouchPolicy
        from lattica.crdt.state import ReplicatedState
        from lattica.train.swarm.membership import MembershipView  # pure: no training stack

        self.role = role
        self._own_addrs = own_addrs
        self._metrics = metrics
        self.state = ReplicatedState(
            host, key_pair, data_dir=config.data_dir, run_id=config.run_id,
            config=StateConfig(
                admins=config.admins,
                anchors=() if config.admins else bootstrap_ids(config.peers),
                vouching=VouchPolicy(admins_only=bool(config.admins)),  # named admins: only they admit
            ),
        )
        self.view = MembershipView(self.state, peer_id=self.state.peer_id)
        self._found_run = not config.admins  # a founder writes the run config's genesis

    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(self.state.run)
            # a restarted node's record still holds the role of its previous life: replace it
            # with the first write, before the training service gets to it
            if self.role is not None:
                await self.state.update_member(addrs=self._own_addrs(), role=self.role)
            else:
                await self.state.update_member(addrs=self._own_addrs())
            await self._write_genesis()
            task_status.started()
            nursery.start_soon(self._export_metrics)

    async def _write_genesis(self) -> None:
        """The founder of a run (admin by default: it joined through nobody) writes the run
        config's first record, naming itself: its authority is then in every member's state,
        and in its own log across restarts, with or without ``--peer``."""
        state = self.state
        if self._found_run and state.peer_id in state.admins and not self.view.run_config():
            await self.view.publish_run_config({FOUNDER_KEY: state.peer_id})

    async def _export_metrics(self) -> None:
        while True:
            self._metrics.replicated_state_bytes.set(self.statistics().log_bytes)
            await trio.sleep(METRICS_INTERVAL_S)

    async def on_shutdown(self) -> None:
        await self.state.leave()

    def doctor_facts(self, facts: NodeFacts) -> NodeFacts:
        """``facts`` with the reachability each member advertises."""
        return facts.with_member_reachability(self.view.advertised_reachability())

    def statistics(self) -> StateStatus:
        return StateStatus.of(len(self.state.live_members()), self.state.counters(), log_failing=self.state.log_failing)

    def status(self) -> dict[str, object]:
        return {"state": self.statistics().as_json()}

    async def handle_control(self, request: ControlRequest) -> object | None:
        if request.method == "state":
            return self.state.dump()
        return None


FOUNDER_KEY = "founder"  # the run config's genesis: {"founder": <peer id>}


def bootstrap_ids(peers: Sequence[str]) -> tuple[str, ...]:
    """The peer ids of ``--peer`` addresses (a relay address names the peer at its end)."""
    return tuple(dict.fromkeys(p.rsplit("/p2p/", 1)[-1] for p in peers))


@dataclass(frozen=True, kw_only=True)
class StateStatus:
    """The ``state`` part of ``lattica status``: the replica's and its log's counters."""

    live_members: int
    updates_accepted: int
    state_bytes: int
    streams: int  # per-writer streams held
    pending: int  # records waiting for their predecessors
    banned_writers: int  # writers that signed two different histories
    evicted_writers: int
    superseded_own: int
    log_bytes: int
    log_held_records: int  # records not yet written to the log (it is failing)
    sync_answers_busy: int
    sync_answer_bytes: int
    log_failing: str | None = None  # why the log cannot be written now: the node runs on, retrying

    @classmethod
    def of(
        cls, live_members: int, counters: Mapping[str, int | Mapping[str, int]], *, log_failing: str | None,
    ) -> StateStatus:
        """From ``ReplicatedState.counters()``: its counts by name."""

        def count(name: str) -> int:
            value = counters.get(name, 0)
            return value if isinstance(value, int) else 0

        return cls(
            live_members=live_members, updates_accepted=count("updates_accepted"),
            state_bytes=count("state_bytes"), streams=count("streams"), pending=count("pending"),
            banned_writers=count("banned_writers"), evicted_writers=count("evicted_writers"),
            superseded_own=count("superseded_own"), log_bytes=count("log_bytes"),
            log_held_records=count("log_held_records"), sync_answers_busy=count("sync_answers_busy"),
            sync_answer_bytes=count("sync_answer_bytes"), log_failing=log_failing,
        )

    def as_json(self) -> dict[str, object]:
        info: dict[str, object] = asdict(self)
        del info["log_failing"]
        if self.log_failing:
            info["log"] = f"failing, records held in memory, retrying: {self.log_failing}"
        return info

