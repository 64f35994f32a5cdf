"""A gossip partner that sends NaN, as a real daemon: refused, scored down and avoided.

Two honest ``lattica join --train`` daemons and one whose exchanges carry NaN
(``lattica_lab.hostile_daemon``) train DiLoCo with gossip averaging on loopback. Three members
and groups of two draw one group of three, so the first round puts the hostile member in every
honest replica's group. The honest replicas refuse its contribution, average with each other,
leave it out of their next draws, and end with a finite loss; without the screen they average
the NaN and their loss is NaN from the first outer step on.
"""

from __future__ import annotations

import math
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from lattica_lab.daemons import DaemonProcess, free_port, wait_for
from lattica_lab.hostile_daemon import NanPartnerDaemon
from lattica_lab.training_daemons import GOSSIP_ENV, killed_at_end, train_args, wait_done

ROUNDS = 5
INNER_STEPS = 4


def _args() -> tuple[str, ...]:
    return (*train_args("diloco", rounds=ROUNDS, inner_steps=INNER_STEPS, min_peers=3),
            "--averaging", "gossip", "--group-size", "2")


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_honest_replicas_refuse_a_nan_partner_avoid_it_and_keep_a_finite_loss(tmp_path: Path) -> None:
    metrics_port = free_port()
    with killed_at_end() as started:
        metrics = ("--metrics-addr", f"127.0.0.1:{metrics_port}")
        first = DaemonProcess(tmp_path / "honest0", extra_args=(*_args(), *metrics), env=GOSSIP_ENV).start()
        started.append(first)
        first.wait_ready(60)
        second = DaemonProcess(tmp_path / "honest1", peers=(first.addr,), extra_args=_args(), env=GOSSIP_ENV)
        hostile = NanPartnerDaemon(tmp_path / "hostile", peers=(first.addr,), extra_args=_args(), env=GOSSIP_ENV)
        for d in (second, hostile):
            started.append(d.start())
        for d in (second, hostile):
            d.wait_ready(60)
        honest, evil = [first, second], hostile.peer_id
        infos = wait_done([*honest, hostile], timeout=120)
        for d, info in zip(honest, infos[:2], strict=True):
            context = (info, d.log())
            assert math.isfinite(info["loss"]), context
            assert math.isfinite(info["val_loss"]), context
            assert info["rounds_completed"] == ROUNDS, context
            # refused once (the first round's group of three), then left out of the draws: the
            # honest pair meets alone for the rounds after
            assert 1 <= info["rejected_contributions"].get(evil, 0) <= 2, context
            assert info["avoided_partners"] == [evil], context
            log = d.log_path.read_text()
            assert f"excluded {evil}'s contribution: non-finite values in phi" in log, context
            assert f"leaving {evil} out of gossip groups" in log, context
        # and on the founder's /metrics (copied from its status every second)
        assert wait_for(lambda: _metric(metrics_port, "lattica_rejected_contributions_total") >= 1, 10)
        assert _metric(metrics_port, "lattica_avoided_partners") == 1
