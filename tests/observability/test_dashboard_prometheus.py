"""Every dashboard query returns data from a real Prometheus scraping a real local swarm.

The swarm is the compose swarm (bootstrap + peers, see observability_harness.py) as local
processes; the Prometheus config is deploy/prometheus.yml with the lattica job's targets replaced
by the local metrics ports and a 1 s scrape interval. Panels in the dashboard's "Training" row
are required only when the swarm trains (``SWARM_TRAINS``).
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
from observability_harness import (
    DEPLOY,
    LocalSwarm,
    dashboard_queries,
    free_port,
    load_yaml,
    start_compose_swarm,
    start_service,
    wait_connected,
    wait_healthy,
)

PEERS = 2  # plus the bootstrap: a 3-node swarm
DEADLINE_S = 40.0
START_S = 120.0  # a training node imports torch before its control socket answers: slow under load

# The swarm trains (every node with --train, each starting as soon as it is up), so the
# Training row's panels are required too. One more peer ("late") is started once the swarm has
# completed a round: it joins mid-run by fetching the outer state, which fills the
# checkpoint-fetch panel. Its metrics port is a scrape target from the start.
SWARM_TRAINS = True
LATE = "late"
TRAIN_ARGS = ("--train", "--model", "tiny", "--inner-steps", "5", "--rounds", "1000")
# This swarm averages with all-reduce (identical replicas: no spread to show); the row of
# gossip-only panels is checked against a second swarm that averages in groups.
GOSSIP_ROW = "Gossip averaging"
# Known only on an accelerator of known peak: on the CPU the series is exported as NaN, so the
# panel's query must find the series, but has no number to show.
ACCELERATOR_ONLY = frozenset({"Model FLOPs utilisation", "Device memory", "Device FLOPs utilisation"})

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="needs the prometheus binary (apt: prometheus)"
)


def prometheus_config(swarm: LocalSwarm, late_metrics_port: int) -> dict:
    config = load_yaml(DEPLOY / "prometheus.yml")
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    [job] = [j for j in config["scrape_configs"] if j["job_name"] == "lattica"]
    job.pop("dns_sd_configs", None)
    job["static_configs"] = [
        {
            "targets": [f"127.0.0.1:{node.metrics_port}"],
            "labels": {"role": "bootstrap"} if node is swarm.bootstrap else {},
        }
        for node in swarm.nodes
    ]
    job["static_configs"].append({"targets": [f"127.0.0.1:{late_metrics_port}"]})
    config["scrape_configs"] = [job]
    return config


class Prometheus:
    def __init__(self, root, config: dict) -> None:
        self.port = free_port()
        (root / "prometheus.json").write_text(json.dumps(config))
        self.log = root / "prometheus.log"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [
                    "prometheus",
                    f"--config.file={root / 'prometheus.json'}",
                    f"--storage.tsdb.path={root / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def get(self, path: str, **params: str) -> dict:
        query = urllib.parse.urlencode(params)
        url = f"http://127.0.0.1:{self.port}{path}" + (f"?{query}" if query else "")
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.loads(response.read())

    def query(self, expr: str) -> list[dict]:
        reply = self.get("/api/v1/query", query=expr)
        assert reply["status"] == "success", reply
        return reply["data"]["result"]

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2):
                    return
            except OSError:
                time.sleep(0.3)
        raise AssertionError(f"prometheus not ready\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)


@pytest.fixture
def swarm(tmp_path):
    started = start_compose_swarm(
        tmp_path, peers=PEERS, extra_join_args=TRAIN_ARGS if SWARM_TRAINS else ()
    )
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
def late_metrics_port():
    return free_port()


@pytest.fixture
def prometheus(tmp_path, swarm, late_metrics_port):
    server = Prometheus(tmp_path, prometheus_config(swarm, late_metrics_port))
    try:
        server.wait_ready(timeout=20)
        yield server
    finally:
        server.stop()


def _swarm_up(swarm: LocalSwarm) -> None:
    """Every node answers its health check, then the bootstrap holds a connection to each peer:
    connections are waited for from the moment the peers run, not from when they were spawned."""
    for node in swarm.nodes:
        wait_healthy(swarm, node, timeout=START_S)
    wait_connected(swarm, swarm.bootstrap, peers=PEERS, timeout=DEADLINE_S)


def _has_data(result: list[dict]) -> bool:
    return any(not math.isnan(float(series["value"][1])) for series in result)


def _scalar(prometheus: Prometheus, expr: str) -> float:
    result = prometheus.query(expr)
    return float(result[0]["value"][1]) if result else math.nan


def _wait_until(condition, timeout: float) -> bool:
    """Poll ``condition`` (a query) until it holds, for at most ``timeout`` seconds. A query that
    times out (a loaded machine) counts as not yet: the next poll asks again."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():
                return True
        except OSError:  # urllib's timeouts and refused connections
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(1.0)


@pytest.mark.timeout(540)  # the sum of the bounded waits below, on a loaded machine
def test_every_dashboard_query_returns_data(swarm, prometheus, late_metrics_port):
    _swarm_up(swarm)
    nodes = PEERS + 1
    if SWARM_TRAINS:
        # once a round is done, a late peer joins mid-run (it fetches the outer state)
        assert _wait_until(
            lambda: _scalar(prometheus, "max(lattica_outer_round)") >= 1, DEADLINE_S
        ), swarm.logs()
        wait_healthy(swarm, start_service(swarm, LATE, metrics_port=late_metrics_port), timeout=START_S)
        nodes += 1
    required = [
        (row, title, expr)
        for row, title, expr in dashboard_queries()
        if (SWARM_TRAINS or row != "Training") and row != GOSSIP_ROW
    ]
    assert len(required) >= 10
    assert SWARM_TRAINS is False or any(t == "Checkpoint fetch time" for _, t, _ in required)
    missing: list[tuple[str, str]] = []

    def found(title: str, expr: str) -> bool:
        result = prometheus.query(expr)
        return bool(result) if title in ACCELERATOR_ONLY else _has_data(result)

    def all_panels_have_data() -> bool:
        missing[:] = [(title, expr) for _, title, expr in required if not found(title, expr)]
        return not missing

    _wait_until(all_panels_have_data, 2 * DEADLINE_S)
    assert not missing, (
        "panels without data:\n" + "\n".join(f"  {t}: {e}" for t, e in missing) + "\n" + swarm.logs()
    )

    # The numbers behind the panels describe this swarm, not just any series.
    assert _wait_until(lambda: _scalar(prometheus, 'sum(up{job="lattica"})') == nodes, DEADLINE_S)
    assert _wait_until(
        lambda: _scalar(prometheus, 'lattica_peers_connected{role="bootstrap"}') == nodes - 1,
        DEADLINE_S,
    )
    # (each waited for: a scrape that failed under load leaves a target's series stale for a while)
    assert _wait_until(
        lambda: _scalar(prometheus, 'sum(lattica_peers_by_path{path="direct"})') >= 2 * PEERS, DEADLINE_S
    ), prometheus.query("lattica_peers_by_path")
    assert _wait_until(lambda: _scalar(prometheus, "sum(lattica_bytes_sent_total)") > 0, DEADLINE_S)
    assert _wait_until(lambda: _scalar(prometheus, "sum(lattica_bytes_received_total)") > 0, DEADLINE_S)

    def node_ids() -> set[str]:
        return {s["metric"]["peer_id"] for s in prometheus.query("lattica_node_info")}

    assert _wait_until(lambda: len(node_ids()) == nodes, DEADLINE_S), node_ids()
    if SWARM_TRAINS:
        # the fetch was the late node's, and every node completes rounds
        late = f"127.0.0.1:{late_metrics_port}"
        fetched = f'lattica_checkpoint_fetch_duration_seconds_count{{instance="{late}"}}'
        assert _wait_until(lambda: _scalar(prometheus, fetched) >= 1, DEADLINE_S), (
            f"{prometheus.query('lattica_checkpoint_fetch_duration_seconds_count')}\n"
            + swarm.nodes[-1].log_tail(60)
        )
        assert _wait_until(
            lambda: _scalar(prometheus, "min(lattica_outer_round)") >= 1, DEADLINE_S
        ), swarm.logs()
        assert _wait_until(lambda: _scalar(prometheus, "sum(lattica_tokens_per_second)") > 0, DEADLINE_S)


@pytest.fixture
def gossip_swarm(tmp_path):
    started = start_compose_swarm(
        tmp_path, peers=PEERS, extra_join_args=(*TRAIN_ARGS, "--averaging", "gossip")
    )
    try:
        yield started
    finally:
        started.stop()


@pytest.mark.timeout(420)  # the sum of the bounded waits below, on a loaded machine
def test_gossip_panels_show_the_spread_of_a_gossip_swarm(gossip_swarm, tmp_path):
    swarm = gossip_swarm
    server = Prometheus(tmp_path, prometheus_config(swarm, free_port()))
    try:
        server.wait_ready(timeout=20)
        _swarm_up(swarm)
        required = [(title, expr) for row, title, expr in dashboard_queries() if row == GOSSIP_ROW]
        assert required, f"the dashboard has no {GOSSIP_ROW!r} row"
        assert _wait_until(
            lambda: all(_has_data(server.query(expr)) for _, expr in required), 3 * DEADLINE_S
        ), "\n".join(f"{t}: {server.query(e)}" for t, e in required) + "\n" + swarm.logs()
        spread: list[dict] = []

        def spread_values() -> list[float]:
            spread[:] = server.query("lattica_consensus_distance")
            return [float(s["value"][1]) for s in spread if not math.isnan(float(s["value"][1]))]

        assert _wait_until(spread_values, DEADLINE_S), spread
        values = spread_values()
        assert all(0 <= v < 1 for v in values), spread  # relative to the weights' norm
    finally:
        server.stop()
