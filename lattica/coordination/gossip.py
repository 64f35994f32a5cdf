"""``GossipGroups``: a ``GroupProvider`` without a coordinator, over libp2p.

Theory of operation
-------------------
``group_for(key)`` draws this peer's proposal for the key from the live members it holds
(``groups.proposed_group``), marks the key open, and sends ``{"run", "key", "group", "hold"}``
on ``/lattica/group/1.0.0`` to each other member of the proposal — concurrently, each under its
hold plus the grace. Each answers from its own view with ``{"group": its proposal}``,
``{"gone": true}`` or ``{"late": true}`` (``groups.GroupHandshakes``); no answer is awaited past
the hold plus the grace. The result is this peer and the partners whose proposal holds it
(``groups.GroupHandshakes.settle``): possibly this peer alone, and then the strategy steps on
its own. Peers outside the proposal are never contacted, so a frozen or dead peer costs only its
own group, at most the hold plus the grace, and only at the steps it is drawn into that group. A
partner that this peer does not hear (``responsive``) is not asked at all. A peer whose training
ended or failed ``leave``s: it answers every request ``gone`` at once.

A request for a step this peer has not reached is held until it opens the step or the asker's
hold (about one of the asker's step periods) ends (``groups.GroupHandshakes.decide``; ``late``
at once for a peer that cannot make it within that hold), so a partner is confirmed only once it
is there: a peer drawn with a straggler is told ``late`` and averages alone without waiting out
the grace, while a partner a little behind (it averaged with someone last step while this peer
was alone) is waited for. Every answer carries the answerer's latest step, and every request the
asker's; ``next_step()`` tells a strategy that fell behind where the swarm is
(``groups.SwarmStep``).

A partner whose contribution this peer refused (``avoid``, called by the node when its
strategy's screen refuses one) is left out of this peer's draws for a while
(``coordination.avoidance``): the proposal is drawn from the view without it.

Messages are length-prefixed msgpack (``net.wire``), capped at a few KiB; a malformed request
ends that one stream and is logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import trio
from libp2p.abc import IHost, INetStream
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from trio_typing import TaskStatus

from lattica.coordination.avoidance import AvoidanceConfig, PartnerAvoidance
from lattica.coordination.groups import (
    WAIT,
    GossipGroupsConfig,
    GroupHandshakes,
    Reply,
    SwarmStep,
    handshake_request,
    parse_reply,
    parse_request,
    proposed_group,
    step_of,
)
from lattica.net.wire import read_message, write_message

log = logging.getLogger(__name__)

GROUP_PROTOCOL = TProtocol("/lattica/group/1.0.0")
_MESSAGE_BYTES = 16 * 1024


class GossipGroups:
    """A ``GroupProvider`` whose groups each peer derives itself and confirms with its group only.

    ``members()``: the live members of the run as this peer sees them (its view).
    ``responsive(peer)``: whether the peer is heard at all; one that is not is not asked.
    """

    def __init__(
        self,
        host: IHost,
        *,
        peer_id: str,
        run_id: str,
        members: Callable[[], Sequence[str]],
        config: GossipGroupsConfig | None = None,
        responsive: Callable[[str], bool] | None = None,
        avoidance: AvoidanceConfig | None = None,
    ) -> None:
        self.host = host
        self.peer_id = peer_id
        self.run_id = run_id
        self.members = members
        self.config = config or GossipGroupsConfig()
        self.responsive = responsive or (lambda peer: True)
        self.avoidance = PartnerAvoidance(avoidance)
        self._handshakes = GroupHandshakes(self.config)
        self._swarm = SwarmStep()
        self._opened = trio.Event()  # set (and replaced) whenever this peer opens a key
        self.left_out: tuple[str, ...] = ()  # why the last group_for left proposed partners out

    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.host.set_stream_handler(GROUP_PROTOCOL, self._handle)
        task_status.started()
        await trio.sleep_forever()

    def begin(self) -> None:
        """This peer's first inner phase starts now: its first sync's interval (and so a pace
        partners can be told ``late`` from) counts from here, not from its second sync."""
        self._handshakes.begin(trio.current_time())

    def leave(self) -> None:
        """This peer steps no more (training ended or failed): requests held for a step it has
        not opened, and every later one, are answered ``gone`` at once instead of after the
        asker's hold."""
        self._handshakes.leave()
        opened, self._opened = self._opened, trio.Event()
        opened.set()  # held requests decide again

    def proposal(self, key: str) -> tuple[str, ...]:
        """This peer's stripe for ``key``, drawn from its view without the partners it avoids."""
        step = step_of(key)
        view = self.avoidance.drawable(self.members(), step=self._step_now() if step is None else step)
        return proposed_group(view, self.peer_id, key=key, group_size=self.config.group_size)

    def avoid(self, peer: str) -> None:
        """``peer``'s contribution was refused: leave it out of the next draws (module docstring)."""
        until = self.avoidance.refused(peer, step=self._step_now())
        log.info("leaving %s out of gossip groups until step %d", peer, until)

    def avoided(self) -> list[str]:
        """The partners left out of this peer's draws now."""
        return self.avoidance.avoided(step=self._step_now())

    def _step_now(self) -> int:
        return self._handshakes.latest_step or 0

    def next_step(self) -> int | None:
        """The step the swarm goes to next, as partners announced it (None: nothing heard).
        A strategy whose next key is below it jumps there (it fell behind)."""
        return self._swarm.next_step(len(set(self.members()) | {self.peer_id}))

    async def group_for(self, key: str) -> Sequence[str]:
        """This peer and the partners that confirmed the key's group (sorted)."""
        hold = self._handshakes.open(key, trio.current_time())
        opened, self._opened = self._opened, trio.Event()
        opened.set()
        proposal = self.proposal(key)
        answers: dict[str, Reply] = {}

        async def ask(partner: str) -> None:
            with trio.move_on_after(hold + self.config.grace_s):
                try:
                    answers[partner] = await self._ask(partner, key, proposal, hold)
                except Exception as exc:  # noqa: BLE001 - libp2p raises many kinds on a dead peer
                    log.info("group partner %s for %s did not confirm: %r", partner, key, exc)

        declined = self._handshakes.declined(key)
        async with trio.open_nursery() as nursery:
            for partner in proposal:
                if partner != self.peer_id and partner not in declined and self.responsive(partner):
                    nursery.start_soon(ask, partner)
        for partner, reply in answers.items():
            if reply.step is not None:
                self._swarm.heard(partner, reply.step)
        # partners that answered late, or that we told late meanwhile, are out; so is (declined)
        # every partner not confirmed, so a ready answer that came too late pairs nobody
        group = self._handshakes.settle(key, self.peer_id, proposal, answers)
        self.left_out = tuple(_why(p, answers, self.peer_id) for p in proposal if p not in group)
        if self.left_out:
            log.info(
                "group for %s: %d of %d proposed member(s) confirmed (%s)", key, len(group), len(proposal),
                "; ".join(self.left_out),
            )
        return group

    async def _ask(self, partner: str, key: str, proposal: Sequence[str], hold: float) -> Reply:
        stream = await self.host.new_stream(ID.from_base58(partner), [GROUP_PROTOCOL])
        try:
            request = handshake_request(self.run_id, key, proposal, hold_s=hold)
            await write_message(stream, request, peer_id=partner)
            reply = await read_message(stream, max_size=_MESSAGE_BYTES, peer_id=partner)
        finally:
            await stream.close()
        return parse_reply(reply, peer_id=partner)

    async def _handle(self, stream: INetStream) -> None:
        peer = stream.muxed_conn.peer_id.to_base58()
        try:
            with trio.fail_after(self.config.grace_s):
                message = await read_message(stream, max_size=_MESSAGE_BYTES, peer_id=peer)
            request = parse_request(message, run_id=self.run_id, peer_id=peer)
            key, asked_at = request.key, trio.current_time()
            asker_step = step_of(key)
            if asker_step is not None:
                self._swarm.heard(peer, asker_step)  # the asker has reached that step
            while True:
                verdict = self._handshakes.decide(
                    key, asker=peer, asked_at=asked_at, now=trio.current_time(), hold_s=request.hold_s,
                    swarm_next=self.next_step(),
                )
                if verdict.kind != WAIT:
                    break
                assert verdict.until is not None
                with trio.move_on_at(verdict.until):
                    await self._opened.wait()  # this peer opened a key: decide again
            reply = self._handshakes.answer(key, self.proposal(key), verdict, asker=peer)
            log.debug("group request from %s for %s (hold %.1f s) answered %s after %.1f s, our latest step %s, "
                      "pace %s", peer, key, request.hold_s or 0.0, verdict.kind, trio.current_time() - asked_at,
                      self._handshakes.latest_step, self._handshakes.pace)
            with trio.fail_after(self.config.grace_s):
                await write_message(stream, reply, peer_id=peer)
        except Exception as exc:  # noqa: BLE001 - one bad request ends one stream
            log.info("group request from %s failed: %r", peer, exc)
        finally:
            await stream.close()


def _why(partner: str, answers: dict[str, Reply], me: str) -> str:
    """Why ``partner`` is not in our group, for the log."""
    short = partner[-6:]
    if partner not in answers:
        return f"{short}: no answer"
    reply = answers[partner]
    if reply.late:
        return f"{short}: late (at step {reply.step})"
    if reply.group is None:
        return f"{short}: gone (at step {reply.step})"
    if me not in reply.group:
        return f"{short}: its group is {','.join(p[-6:] for p in reply.group)}"
    return f"{short}: declined (late)"
