"""Which peers a training member waits for: heartbeats, settling, and "did I run alone?".

Theory of operation: every member renews its lease at least once per heartbeat interval (each
write of its record, its round's progress included, renews it), and the counter it bumps
travels with the replicated state through whichever peer relays it. A peer is
*heard* while that counter keeps changing (a change is timed when this peer first sees it); it
is *alive* when it is also connected to us. A member cut off or killed stops renewing for
everyone, whereas one we have just not dialled yet is still heard.

A peer seen silent is not *responsive* again until it has been heard for ``SETTLE_BEATS``
intervals — back from a cut or a restart it first catches up, and rounds should not wait for
that — unless it is not behind us (``not_behind``): seen from a peer whose own link was cut,
every other peer went silent and comes back ahead of it, and it must not take them for
stragglers (it would seal rounds without them, alone).

A round of one was *run alone* when other trainers take part in the run, counting for a while
those whose lease ran out while we stay connected (``membership.RecentTrainers``). Its state is
then held back while the others' result of that round may still come (``outer_sync``); it
cannot once every other member is restarting (``others_in_rounds``): a member back as
``joining`` resumes from a checkpoint at or before that round, and brings no newer state of it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence

from lattica.train.strategies.base import OuterStepReport
from lattica.train.swarm.membership import TRAINER_ROLE, MembershipView, RecentTrainers

SILENT_BEATS = 3.5  # heartbeat intervals without a lease renewal: unresponsive
SETTLE_BEATS = 3.0  # heartbeat intervals a peer seen silent must be heard before it is again
VANISHED_S = 60.0  # a connected trainer whose lease ran out (a cut link) still counts this long


class PeerLiveness:
    """This peer's view of who is heard, alive and responsive; ``connected()`` gives the peer
    ids we hold a connection to, ``candidates()`` the round candidates, ``not_behind(peer)``
    whether a peer needs no catching up, ``clock`` the monotonic time."""

    def __init__(
        self,
        view: MembershipView,
        *,
        connected: Callable[[], Collection[str]],
        candidates: Callable[[], Sequence[str]],
        not_behind: Callable[[str], bool],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.view, self.connected, self.candidates = view, connected, candidates
        self.not_behind, self.clock = not_behind, clock
        self._beats: dict[str, tuple[int | None, float]] = {}  # peer -> (heartbeat, when it last changed)
        self._back_at: dict[str, float] = {}  # peer seen silent -> last time it was (settling)
        self._recent = RecentTrainers(peer_id=view.peer_id, memory_s=VANISHED_S)

    def heard(self, peer: str) -> bool:
        """Its lease renewals (one per heartbeat interval) still arrive."""
        now, interval = self.clock(), self.view.heartbeat_interval
        beat = self.view.heartbeat(peer)
        seen = self._beats.get(peer)
        if seen is None or seen[0] != beat:
            self._beats[peer] = seen = (beat, now)
        return now - seen[1] < SILENT_BEATS * interval

    def alive(self, peer: str) -> bool:
        """Connected, and its lease renewals still arrive."""
        if peer in self.connected() and self.heard(peer):
            return True
        self._back_at[peer] = self.clock()  # silent: when heard again, it settles first
        return False

    def responsive(self, peer: str) -> bool:
        """Alive, and not settling after a silence (unless it is not behind us)."""
        if not self.alive(peer):
            return False
        back = self._back_at.get(peer)
        settled = back is None or self.clock() - back >= SETTLE_BEATS * self.view.heartbeat_interval
        return settled or self.not_behind(peer)

    def look(self) -> None:
        """Time every member's heartbeat change now, and keep the memory of recent trainers
        current (called twice per heartbeat interval: a change seen late makes a silent member
        look alive for longer)."""
        self.others_train()
        for peer in self.view.live():
            if peer != self.view.peer_id:
                self.heard(peer)

    def others_train(self) -> bool:
        """Whether other trainers take part in the run (see the module docstring)."""
        self._recent.observe(self.view.members(), self.view.live(), set(self.connected()), self.clock())
        return bool(self._recent.others()) or len(self.candidates()) > 1

    def others_in_rounds(self) -> bool:
        """Whether another member may still complete a round we ran alone: a live trainer, or
        one whose link was cut (remembered, see ``others_train``). Members back as ``joining``
        (restarted from a checkpoint) do not, and a killed one is forgotten."""
        self.others_train()
        return any(self.view.role(peer) == TRAINER_ROLE for peer in self._recent.others()) or any(
            peer != self.view.peer_id for peer in self.view.trainers()
        )

    def ran_alone(self, report: OuterStepReport) -> bool:
        others = self.others_train()  # looked at every round: the memory must predate a cut
        return not report.skipped and len(report.group) <= 1 and others
