"""``tune = true`` across three real ``lattica join --train`` daemons in namespace hosts.

Each daemon runs in its own host of the namespace lab (``lattica_lab.netlab``). The run starts
on the unshaped veth links; after a few rounds every host's egress is capped at 2 Mbit/s with
a tbf qdisc. The admin (the swarm's creator) tunes once measurements exist, re-tunes when the
bandwidth it measures falls by more than 2x, and logs both with their numbers; every member
follows the tuned schedule from the run config — H and the codec each period sends with: all end
with the same periods and codec, the same number of rounds and identical outer-state hashes.
``lattica tune --data-dir`` against the admin prints its measured figures.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from lattica.train.settings.autotune import CODEC_BITS
from lattica_lab.nat_daemons import TRAIN_ENV, LabDaemon
from lattica_lab.netlab import NetLab, lab_unavailable_reason, shape_link

REASON = lab_unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"namespace lab unavailable: {REASON}")

CAP_MBIT = 2
# 24 rounds of the run's H (5): the run ends at step 120, a sync, whatever H was tuned to; steps
# of batch 16 x 128 are slow enough that the unshaped link wants a short H and the capped one a long;
# one applied round is the least a tuned H must leave (the default 8 would hold this short run at H 25)
ARGS = ("--train", "--tune", "--model", "tiny", "--device", "cpu", "--strategy", "diloco",
        "--rounds", "24", "--inner-steps", "5", "--min-peers", "3", "--tune-min-rounds", "1")
ENV = {**TRAIN_ENV, "LATTICA_TRAIN_BATCH_SIZE": "16", "LATTICA_TRAIN_SEQ_LEN": "128"}


def training(daemon: LabDaemon) -> dict[str, Any]:
    return daemon.status().get("training") or {}


def wait(predicate: Any, timeout: float, what: str, daemons: list[LabDaemon]) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for d in daemons:
            assert training(d).get("phase") != "failed", d.log()
        result = predicate()
        if result:
            return result
        time.sleep(0.5)
    pytest.fail(f"{what} within {timeout} s:\n" + "\n\n".join(d.log() for d in daemons))


def test_a_rate_cap_makes_the_run_retune_and_every_member_follows(tmp_path: Path) -> None:
    with NetLab() as lab:
        hosts = [lab.add_public(name) for name in ("a", "b", "c")]
        admin = LabDaemon(lab, hosts[0], tmp_path / "a", extra=ARGS, env=ENV).wait_up()
        others = [LabDaemon(lab, h, tmp_path / h.name, peers=(admin.addr,), extra=ARGS, env=ENV).wait_up()
                  for h in hosts[1:]]
        daemons = [admin, *others]

        def tuned_periods() -> list[Any]:
            return (training(admin).get("tuned") or {}).get("periods") or []

        first = wait(tuned_periods, 60, "no first tuning", daemons)
        measured = subprocess.run(
            [sys.executable, "-m", "lattica.cli.main", "tune", "--data-dir", str(tmp_path / "a"), "--json"],
            capture_output=True, text=True, timeout=60, check=False,
        )
        assert measured.returncode == 0, measured.stderr
        figures = json.loads(measured.stdout.splitlines()[-1])["measured"]
        assert figures["peers"] == 3
        assert figures["bandwidth_mbit"] > CAP_MBIT * 2
        for host in hosts:
            shape_link(host.ns, host.ifname, rate_mbit=CAP_MBIT)
        wait(lambda: len(tuned_periods()) > len(first), 90, "no re-tuning after the cap", daemons)

        def all_done() -> list[dict[str, Any]] | None:
            infos = [training(d) for d in daemons]
            return infos if all(i.get("phase") == "done" for i in infos) else None

        infos = wait(all_done, 120, "not done", daemons)
        rounds = infos[0]["rounds_completed"]
        hashes = wait(lambda: _hashes_at(daemons, rounds), 30, f"no agreed hashes at round {rounds}", daemons)
        logs = [Path(str(d.data_dir) + ".log").read_text(errors="replace") for d in daemons]

    assert "tune: re-tuned after round/" in logs[0]
    assert "more than 2x" in logs[0]
    periods = [i["tuned"]["periods"] for i in infos]
    assert periods[0] == periods[1] == periods[2]
    # the capped link syncs less often or sends fewer bits per value (a later period may shorten H
    # again: fewer steps are left; where the unshaped link already wanted the longest H the steps
    # left allow — the communication CPU of a loaded machine can — only the codec can answer)
    _, first_h, first_codec = periods[0][0]
    assert any(h > first_h or CODEC_BITS[codec] < CODEC_BITS[first_codec] for _, h, codec in periods[0][1:]), periods
    assert [i["rounds_completed"] for i in infos] == [rounds] * 3
    codecs = {i["tuned"]["codec"] for i in infos}  # the codec in force at the end, the same on all
    assert len(codecs) == 1, codecs
    assert codecs <= {p[2] for p in periods[0]}, (codecs, periods[0])
    for log in logs:
        assert f"the run syncs every {periods[0][-1][1]} steps from step {periods[0][-1][0]}" in log
    assert len(hashes) == 1, hashes


def _hashes_at(daemons: list[LabDaemon], rounds: int) -> set[str] | None:
    """Each member's view of every member's published hash at ``rounds``, once all have it."""
    seen: set[str] = set()
    for d in daemons:
        progress = (d.call("state") or {}).get("progress") or {}
        for peer in (m.peer_id for m in daemons):
            record = progress.get(peer) or {}
            if record.get("round") != rounds:
                return None
            seen.add(record["weights_hash"])
    return seen
