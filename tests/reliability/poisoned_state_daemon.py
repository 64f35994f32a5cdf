"""A ``lattica join --train`` daemon that publishes and serves a poisoned outer state, claimed ahead.

Usage: python poisoned_state_daemon.py POISON AHEAD[,AHEAD...] JOIN_ARGS...

It trains and syncs like any member, but where an honest member publishes the state of its last
completed round, it publishes a state claimed ``AHEAD`` rounds further (the offsets taken in turn,
one per publication, the claim at most the run's ``rounds``), served under that round and
published with that state's true hash — so a fetch of it verifies:

- ``manifest``: its own weights, with ``round: "not-a-round"`` in the manifest;
- ``nan``: every weight NaN, its round counters those of the claim.
"""

from __future__ import annotations

import itertools
import sys
from typing import Any

import torch

from lattica.cli.main import main as lattica_main
from lattica.train.engine.outer_state import outer_state_hash
from lattica.train.swarm.outer_sync import OuterStateSync
from lattica.train.swarm.outer_transfer import ServedRounds


def _poisoned(honest: dict[str, Any], poison: str, claimed: int, inner_steps: int) -> dict[str, Any]:
    state = dict(honest)
    if poison == "manifest":
        return {**state, "round": "not-a-round", "completed_rounds": claimed, "step": claimed * inner_steps}
    if poison == "nan":
        params = {name: torch.full_like(t, float("nan")) for name, t in state["params"].items()}
        return {**state, "params": params, "round": claimed, "completed_rounds": claimed, "step": claimed * inner_steps}
    raise SystemExit(f"unknown poison {poison!r}")


def _install(poison: str, offsets: list[int]) -> None:
    ahead = itertools.cycle(offsets)
    # one shelf per offset: with a single one, keeping the highest rounds, a claim 50 ahead
    # unserved the claim 4 ahead one round after it was published — before a peer could fetch it
    served: dict[int, ServedRounds] = {}

    async def publish_round(self: OuterStateSync) -> None:
        strategy = self._trainer().strategy
        honest = strategy.outer_state_dict()
        completed = strategy.completed_rounds
        self.remember(completed, outer_state_hash(honest))  # its own view of its rounds stays true
        offset = next(ahead)
        claimed = min(completed + offset, self.settings.rounds)
        state = _poisoned(honest, poison, claimed, self.settings.inner_steps)
        served.setdefault(offset, ServedRounds(self.store, keep=4)).publish(claimed, state)
        await self.view.publish_progress(claimed, outer_state_hash(state))

    OuterStateSync.publish_round = publish_round  # type: ignore[method-assign]


if __name__ == "__main__":
    _install(sys.argv[1], [int(n) for n in sys.argv[2].split(",")])
    sys.exit(lattica_main(sys.argv[3:]))
