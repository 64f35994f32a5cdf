"""A real link cut between training daemons, healed: the swarm goes on, the cut peer re-converges.

Three ``lattica join --train`` daemons, each in its own network namespace of a ``NetLab``. One
peer's cable is pulled at the lab's internet bridge for longer than a lease, so it is silent
(no reset, no error on either side): the two others keep training, the cut one trains alone.
After healing, the cut peer must adopt the majority's state — even when it ran more rounds on
its own — and every replica must end with the same outer state.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lattica_lab.daemons import DaemonProcess, cli_json, wait_for
from lattica_lab.netlab import NetLab, lab_unavailable_reason

pytestmark = [
    pytest.mark.netns,
    pytest.mark.timeout(300),
    pytest.mark.skipif(lab_unavailable_reason() is not None, reason=str(lab_unavailable_reason())),
]

ROUNDS = 14
LEASE_S = 5.0  # the daemons' default lease
ENV = {
    "LATTICA_TRAIN_BATCH_SIZE": "4",
    "LATTICA_TRAIN_SEQ_LEN": "32",
    "LATTICA_TRAIN_WARMUP_STEPS": "2",
    "LATTICA_TRAIN_ROUND_DEADLINE_S": "3",
    "OMP_NUM_THREADS": "1",
}


def _training(d: DaemonProcess) -> dict[str, Any]:
    try:
        return d.call("status").get("training") or {}
    except Exception:  # noqa: BLE001 - a busy or starting daemon answers later
        return {}


@pytest.fixture
def lab_swarm(tmp_path: Path) -> Iterator[tuple[NetLab, list, list[DaemonProcess]]]:
    args = (
        "--train", "--model", "tiny", "--device", "cpu", "--log-level", "info",
        "--rounds", str(ROUNDS), "--inner-steps", "5", "--min-peers", "3",
    )
    with NetLab() as lab:
        hosts = [lab.add_public(f"n{i}") for i in range(3)]
        daemons = [
            DaemonProcess(tmp_path / h.name, port=4001, extra_args=args, env=ENV, netns=h.ns, listen_ip=h.ip)
            for h in hosts
        ]
        try:
            daemons[0].start().wait_ready(60)
            for d in daemons[1:]:
                d.peers = (daemons[0].addr,)
                d.start()
            for d in daemons[1:]:
                d.wait_ready(60)
            yield lab, hosts, daemons
        finally:
            for d in daemons:
                d.kill()


def test_a_peer_cut_off_longer_than_its_lease_rejoins_the_majoritys_state(lab_swarm) -> None:
    lab, hosts, daemons = lab_swarm
    assert wait_for(lambda: all(_training(d).get("rounds_completed", 0) >= 2 for d in daemons), 120), [
        d.log() for d in daemons
    ]
    cut = 2
    others = [d for i, d in enumerate(daemons) if i != cut]
    lab.cut_link(hosts[cut])
    before = min(_training(d)["rounds_completed"] for d in others)
    cut_at = time.monotonic()

    def majority_went_on() -> bool:
        # cut for longer than the lease (5 s), and meanwhile the connected majority completed
        # a round without the cut peer
        long_cut = time.monotonic() - cut_at > LEASE_S + 1
        return long_cut and min(_training(d)["rounds_completed"] for d in others) > before

    went_on = wait_for(majority_went_on, 60)
    lab.heal_link(hosts[cut])
    assert went_on, "the connected majority stopped training while one peer was cut off"

    def all_done() -> bool:
        return all(_training(d).get("phase") == "done" for d in daemons)

    assert wait_for(all_done, 180), [d.log() for d in daemons]
    ids = [d.peer_id for d in daemons]

    def final_hashes() -> set[str] | None:
        seen = set()
        for d in daemons:
            progress = d.call("state")["progress"]  # what `lattica state` prints, without a process start
            records = [progress.get(p) or {} for p in ids]
            if any(r.get("round") != ROUNDS for r in records):
                return None
            seen |= {r["weights_hash"] for r in records}
        return seen

    hashes = wait_for(final_hashes, 30, interval=0.5)
    assert hashes, [cli_json("state", "--data-dir", str(d.data_dir))["progress"] for d in daemons]
    assert len(hashes) == 1
    cut_log = daemons[cut].log_path.read_text()
    assert "adopted outer state" in cut_log, cut_log[-4000:]
