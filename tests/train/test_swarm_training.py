"""DiLoCo (and SPES) across real ``lattica join --train`` processes on loopback.

Every test starts its own daemons (tiny model, 5 inner steps, batch 4), waits on their control
sockets and reads the outcome the way a user would: ``lattica status`` / ``lattica state``.
"""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lattica_lab.daemons import DaemonProcess, free_port
from lattica_lab.daemons import wait_for as _wait_for
from lattica_lab.training_daemons import (
    TRAIN_ENV,
    final_hashes,
    rounds_completed,
    train_args,
    training,
    wait_done,
)

INNER_STEPS = 5


def _trainer(
    path: Path, *, rounds: int, min_peers: int, peers: tuple[str, ...] = (), env: dict[str, str] | None = None,
    strategy: str = "diloco", metrics_port: int | None = None,
) -> DaemonProcess:
    args = train_args(strategy, rounds=rounds, inner_steps=INNER_STEPS, min_peers=min_peers)
    if metrics_port is not None:
        args += ("--metrics-addr", f"127.0.0.1:{metrics_port}")
    return DaemonProcess(path, peers=peers, extra_args=args, env={**TRAIN_ENV, **(env or {})})


class Swarm:
    """Training daemons started by one test; all of them are killed at the end."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.daemons: list[DaemonProcess] = []
        self.bootstrap: str | None = None

    def start(self, name: str, *, alone: bool = False, **kwargs: Any) -> DaemonProcess:
        return self.start_many([name], alone=alone, **kwargs)[0]

    def start_many(self, names: list[str], *, alone: bool = False, **kwargs: Any) -> list[DaemonProcess]:
        """Start ``names`` together (the first alone when there is no swarm yet), then wait."""
        if self.bootstrap is None and not alone and len(names) > 1:
            return [self.start(names[0], **kwargs), *self.start_many(names[1:], **kwargs)]
        peers = () if self.bootstrap is None or alone else (self.bootstrap,)
        started = [_trainer(self.root / name, peers=peers, **kwargs).start() for name in names]
        self.daemons.extend(started)
        for daemon in started:
            daemon.wait_ready(timeout=60)
        if self.bootstrap is None and not alone:
            self.bootstrap = started[0].addr
        return started

    def kill_all(self) -> None:
        for daemon in self.daemons:
            daemon.kill()


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[Swarm]:
    s = Swarm(tmp_path)
    try:
        yield s
    finally:
        s.kill_all()


def _final_val_loss(daemons: list[DaemonProcess]) -> float:
    """The summary's val loss, once every replica reports the same: one that adopted the final
    state after its run (its last round ran alone or failed) validates it before reporting it."""

    def agreed() -> set[Any] | None:
        losses = {(training(d).get("summary") or {}).get("val_loss") for d in daemons}
        return losses if len(losses) == 1 else None

    losses = _wait_for(agreed, timeout=30, interval=0.5)
    assert losses, [training(d) for d in daemons]
    (val_loss,) = losses
    assert val_loss is not None
    return val_loss


def test_three_daemons_end_with_identical_outer_weights(swarm: Swarm) -> None:
    daemons = swarm.start_many(["a", "b", "c"], rounds=3, min_peers=3)
    infos = wait_done(daemons, timeout=90)
    assert [i["rounds_completed"] for i in infos] == [3, 3, 3]
    assert len(final_hashes(daemons, rounds=3)) == 1
    # `lattica status` after the run: the val loss of the final replicated weights, everywhere
    val_loss = _final_val_loss(daemons)
    assert all(training(d)["val_loss"] == round(val_loss, 4) for d in daemons)
    # every round ran with all three members: nobody trained alone
    for d in daemons:
        assert "sealed without" not in d.log(), d.log()


def test_joiner_fetches_the_outer_state_and_ends_identical(swarm: Swarm) -> None:
    rounds = 10
    first = swarm.start_many(["a", "b", "c"], rounds=rounds, min_peers=3)
    assert _wait_for(lambda: all(training(d)["rounds_completed"] >= 1 for d in first), 60), [
        d.log() for d in first
    ]
    joiner = swarm.start("d", rounds=rounds, min_peers=1)
    daemons = [*first, joiner]
    wait_done(daemons, timeout=90)
    adopted = re.search(r"adopted outer state of round (\d+)", joiner.log())
    assert adopted, joiner.log()
    assert 1 <= int(adopted.group(1)) <= rounds
    assert "resumed at step" not in joiner.log()
    if int(adopted.group(1)) < rounds:  # it arrived in time to sync with the others
        assert training(joiner)["bytes_sent"] > 0
    assert len(final_hashes(daemons, rounds=rounds)) == 1
    _final_val_loss(daemons)


def test_sigkilled_peer_does_not_stall_the_others(swarm: Swarm) -> None:
    rounds, deadline_s = 5, 3.0
    env = {"LATTICA_TRAIN_ROUND_DEADLINE_S": str(deadline_s)}
    daemons = swarm.start_many(["a", "b", "c"], rounds=rounds, min_peers=3, env=env)
    assert _wait_for(lambda: all(training(d)["rounds_completed"] >= 1 for d in daemons), 60)
    # the lowest peer id coordinates every sync: killing it is the harder case
    victim = min(daemons, key=lambda d: d.peer_id)
    survivors = [d for d in daemons if d is not victim]
    victim.kill()
    killed_at = time.monotonic()
    infos = wait_done(survivors, timeout=60)
    elapsed = time.monotonic() - killed_at
    # at most: lease expiry (~6 s) plus a deadline and a retry per remaining round, plus slack
    assert elapsed < 6 + rounds * (2 * deadline_s + 2), elapsed
    assert [i["rounds_completed"] for i in infos] == [rounds, rounds], [d.log()[-6000:] for d in survivors]
    assert len(final_hashes(survivors, rounds=rounds)) == 1


def test_restart_resumes_from_the_checkpoint(swarm: Swarm) -> None:
    daemon = swarm.start("a", rounds=200, min_peers=1)
    assert _wait_for(lambda: training(daemon)["rounds_completed"] >= 1, 60), daemon.log()
    assert daemon.stop() == 0, daemon.log()
    checkpoints = sorted((daemon.data_dir / "checkpoints").glob("step-*.pt"))
    assert checkpoints
    last = checkpoints[-1]
    step = int(last.stem.removeprefix("step-"))
    assert step > 0
    assert step % INNER_STEPS == 0
    done_rounds = step // INNER_STEPS
    written = {p.name: p.stat().st_mtime_ns for p in checkpoints}

    restarted = swarm.start("a", alone=True, rounds=done_rounds + 2, min_peers=1)
    first = _wait_for(lambda: (i := training(restarted))["phase"] in ("training", "done") and i, 30)
    assert first, restarted.log()
    assert first["rounds_completed"] >= done_rounds, first
    info = wait_done([restarted], timeout=60)[0]
    assert f"resumed at step {step}" in restarted.log()
    assert info["rounds_completed"] == done_rounds + 2
    assert info["summary"]["steps"] == (done_rounds + 2) * INNER_STEPS
    # the old checkpoints were not written again: training went on from the last one
    for path in (daemon.data_dir / "checkpoints").glob("step-*.pt"):
        if path.name in written:
            assert path.stat().st_mtime_ns == written[path.name], path.name
    assert (daemon.data_dir / "checkpoints" / f"step-{(done_rounds + 2) * INNER_STEPS:09d}.pt").exists()


def test_a_peer_restarted_after_kill_9_rejoins_without_waiting_for_min_peers(swarm: Swarm) -> None:
    rounds = 8
    env = {"LATTICA_TRAIN_ROUND_DEADLINE_S": "3"}
    a, b, c = swarm.start_many(["a", "b", "c"], rounds=rounds, min_peers=3, env=env)
    assert _wait_for(lambda: all(training(d)["rounds_completed"] >= 1 for d in (a, b, c)), 60)
    c.kill()  # gone for good: only two trainers are left, fewer than --min-peers
    before = training(b)["rounds_completed"]
    b.kill()
    b.start().wait_ready(60)
    resumed = _wait_for(lambda: (i := training(b))["phase"] in ("training", "done") and i, 60)
    assert resumed, b.log()
    assert resumed["rounds_completed"] >= before  # no completed round lost
    infos = wait_done([a, b], timeout=120)
    assert [i["rounds_completed"] for i in infos] == [rounds, rounds], [d.log()[-6000:] for d in (a, b)]
    assert len(final_hashes([a, b], rounds=rounds)) == 1


# -- SPES: expert ownership in the replicated state -----------------------------------------

NUM_EXPERTS = 8  # tiny-moe


def _expert_owners(daemon: DaemonProcess, live: set[str]) -> dict[int, list[str]] | None:
    """expert -> claimants among ``live``, from one node's replica (``lattica state`` over the
    control socket: a CLI process per read costs seconds under load, rounds here take a fraction
    of one); None until it is complete."""
    experts = daemon.call("state")["experts"]
    owners = {int(e): sorted(set(c) & live) for e, c in experts.items()}
    if sorted(e for e, c in owners.items() if c) != list(range(NUM_EXPERTS)):
        return None
    return owners


# SIGKILL (the lease runs out) is the default case; SIGTERM differs only in how the leaver stops
# being live ("left" in the state, covered by tests/daemon/test_swarm_processes.py::
# test_sigterm_exits_zero_within_five_seconds_and_says_goodbye and tests/crdt), the
# reassignment at the next sync is the same (tests/train/test_ownership.py, test_spes.py)
@pytest.mark.parametrize("leave", [pytest.param("sigterm", marks=pytest.mark.slow), "sigkill"])
def test_owner_leaves_its_experts_are_reassigned_and_training_goes_on(swarm: Swarm, leave: str) -> None:
    rounds = 8
    env = {"LATTICA_TRAIN_ROUND_DEADLINE_S": "3"}
    port = free_port()
    daemons = [
        swarm.start("a", rounds=rounds, min_peers=3, env=env, strategy="spes", metrics_port=port),
        *swarm.start_many(["b", "c"], rounds=rounds, min_peers=3, env=env, strategy="spes"),
    ]
    ids = {d.peer_id for d in daemons}
    assert _wait_for(lambda: all(training(d)["rounds_completed"] >= 2 for d in daemons), 90), [
        d.log() for d in daemons
    ]
    before = _wait_for(lambda: _expert_owners(daemons[0], ids), 15)
    assert before, daemons[0].call("state")
    # one owner per expert, every node owns some (8 experts over 3 nodes: 3, 3, 2)
    assert all(len(c) == 1 for c in before.values()), before
    assert sorted(sum(1 for c in before.values() if c == [p]) for p in ids) == [2, 3, 3]

    # not "a" (it exports metrics) and not the round coordinator (the lowest id)
    victim = max(daemons[1:], key=lambda d: d.peer_id)
    orphaned = sorted(e for e, c in before.items() if c == [victim.peer_id])
    survivors = [d for d in daemons if d is not victim]
    if leave == "sigterm":
        assert victim.stop() == 0, victim.log()  # it writes "left" to the state
    else:
        victim.kill()  # its lease expires
    # the map moves only at a sync without the victim: it must leave while rounds remain
    assert all(rounds_completed(d) < rounds for d in survivors), "the run ended before the victim left"

    infos = wait_done(survivors, timeout=120)
    assert [i["rounds_completed"] for i in infos] == [rounds, rounds], [d.log()[-6000:] for d in survivors]
    assert len(final_hashes(survivors, rounds=rounds)) == 1

    alive = {d.peer_id for d in survivors}
    for d in survivors:
        after = _wait_for(lambda d=d: _expert_owners(d, alive), 15)
        assert after, d.call("state")
        assert all(len(c) == 1 for c in after.values()), after
        # survivors keep their experts; the victim's went to them, four each
        assert all(after[e] == c for e, c in before.items() if e not in orphaned)
        assert sorted(sum(1 for c in after.values() if c == [p]) for p in alive) == [4, 4]
    # each orphan's new owner took the latest copy in the sync that reassigned it
    taken = {
        int(m.group(1))
        for d in survivors
        for m in re.finditer(r"expert (\d+) now owned here; latest copy from (\S+)", d.log())
    }
    assert set(orphaned) <= taken, [d.log() for d in survivors]
    # per-node traffic and memory accounting reaches Prometheus
    metrics = _scrape(port)
    assert metrics["lattica_strategy_bytes_sent_total"] > 0
    assert metrics["lattica_strategy_syncs_total"] >= 1
    assert metrics["lattica_sync_peak_bytes"] > 0
    assert metrics['lattica_optimizer_state_bytes{kind="inner"}'] > 0
    # SPES: the experts a node does not own are frozen
    assert metrics['lattica_parameter_bytes{kind="frozen"}'] > 0
    assert metrics['lattica_parameter_bytes{kind="trainable"}'] > 0


def _scrape(port: int) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values
