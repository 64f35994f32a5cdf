"""The Dockerfile, compose file, Prometheus config and dashboard agree with the code.

The container commands are checked against the CLI parser and then actually run on loopback
(see observability_harness.py); the image itself is built and the compose stack run by
scripts/docker_smoke.sh (tests/deploy/test_docker_smoke.py, slow).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shlex
import shutil
import subprocess
import tomllib

import pytest
from observability_harness import (
    DATA_DIR,
    DEPLOY,
    LATTICA_BIN,
    METRICS_PORT,
    P2P_PORT,
    REPO,
    compose_file,
    daemon_status,
    dashboard_panels,
    dashboard_queries,
    dockerfile_exec_form,
    dockerfile_instructions,
    healthcheck,
    load_yaml,
    service_command,
    start_compose_swarm,
    wait_connected,
    wait_healthy,
)

from lattica.cli.main import build_parser
from lattica.cli.settings import build_node_config
from lattica.observability import NodeMetrics


def lattica_invocations(script: str) -> list[list[str]]:
    """Every ``lattica ...`` argv in a shell script (pipes and && split, ``exec`` dropped)."""
    found = []
    for part in re.split(r"&&|\||;", script):
        words = shlex.split(part.split(">")[0])
        if words[:1] == ["exec"]:
            words = words[1:]
        if words[:1] == ["lattica"]:
            found.append(words[1:])
    return found


def all_container_commands() -> list[list[str]]:
    commands = [dockerfile_exec_form("CMD"), dockerfile_exec_form("HEALTHCHECK")[1:]]
    for name, service in compose_file()["services"].items():
        if service.get("image", "").startswith("${LATTICA_IMAGE"):
            entrypoint, command = service_command(service)
            if entrypoint == ["sh", "-c"]:
                commands += lattica_invocations(command)
            else:
                assert entrypoint == dockerfile_exec_form("ENTRYPOINT"), name
                commands.append(shlex.split(command))
    return commands


def peer_services() -> dict[str, dict]:
    return {n: s for n, s in compose_file()["services"].items() if n.startswith("peer-")}


def compose_default(value: str) -> str:
    """``${NAME:-default}`` as Compose substitutes it with NAME unset."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


# -- Dockerfile ----------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [["--version"], ["lattica", "--version"]])
def test_entrypoint_reaches_the_installed_cli_both_ways(argv):
    """``docker run IMAGE --version`` and ``docker run IMAGE lattica --version``."""
    [entrypoint] = dockerfile_exec_form("ENTRYPOINT")
    instructions = dockerfile_instructions()
    [script] = [arg.split()[0] for kind, arg in instructions if kind == "COPY" and arg.endswith(entrypoint)]
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert "lattica" in scripts
    env = {**os.environ, "PATH": f"{LATTICA_BIN.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    version = subprocess.run(["sh", str(REPO / script), *argv], capture_output=True, text=True,
                             timeout=30, env=env)
    assert version.returncode == 0, version.stderr
    assert version.stdout.startswith("lattica ")


def test_dockerfile_defaults_to_cuda_pytorch_builds_in_two_stages_runs_as_non_root():
    instructions = dockerfile_instructions()
    args = dict(a.split("=", 1) for kind, a in instructions if kind == "ARG" and "=" in a)
    assert args["BASE_IMAGE"].startswith("pytorch/pytorch:")
    assert "cuda" in args["BASE_IMAGE"]
    bases = [arg.split()[0] for kind, arg in instructions if kind == "FROM"]
    assert bases == ["${BASE_IMAGE}", "${BASE_IMAGE}"]
    assert any(kind == "COPY" and arg.startswith("--from=build /opt/lattica") for kind, arg in instructions)
    run_text = " ".join(arg for kind, arg in instructions if kind == "RUN")
    for needed in ("gcc", "libgmp-dev", "python3-dev", "pip install ."):
        assert needed in run_text
    users = [arg for kind, arg in instructions if kind == "USER"]
    assert users
    assert users[-1] not in ("root", "0")
    volumes = " ".join(arg for kind, arg in instructions if kind == "VOLUME")
    assert DATA_DIR in volumes
    exposed = " ".join(arg for kind, arg in instructions if kind == "EXPOSE")
    assert f"{P2P_PORT}/tcp" in exposed
    assert f"{METRICS_PORT}/tcp" in exposed


def test_default_command_listens_on_the_exposed_ports():
    args = build_parser().parse_args(dockerfile_exec_form("CMD"))
    assert args.command == "join"
    assert str(args.data_dir) == DATA_DIR
    assert args.listen == [f"/ip4/0.0.0.0/tcp/{P2P_PORT}"]
    assert args.metrics_addr == f"0.0.0.0:{METRICS_PORT}"


# -- compose -------------------------------------------------------------------------------


def test_every_container_command_parses_with_the_cli():
    commands = all_container_commands()
    assert len(commands) >= 5  # CMD, HEALTHCHECK, bootstrap id + join, peer join
    parser = build_parser()
    for argv in commands:
        parser.parse_args(argv)  # SystemExit (a test error) on an unknown command or flag


def test_compose_services_and_mounted_files_exist():
    compose = compose_file()
    assert "name" not in compose  # docker-compose 1.29 (Debian's) refuses a top-level name
    services = compose["services"]
    assert {"bootstrap", "peer-1", "peer-2", "prometheus", "grafana"} <= set(services)
    data_volumes = set()
    for name, service in peer_services().items():
        assert service["depends_on"]["bootstrap"]["condition"] == "service_healthy"
        [data] = [v.split(":")[0] for v in service["volumes"] if v.split(":")[1] == DATA_DIR]
        data_volumes.add(data)
        assert data in compose["volumes"], name
    assert len(data_volumes) == len(peer_services())  # each peer resumes from its own volume
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), source


def test_compose_network_lies_in_the_benchmarking_range():
    [pool] = compose_file()["networks"]["swarm"]["ipam"]["config"]
    subnet = ipaddress.ip_network(pool["subnet"])
    assert subnet.subnet_of(ipaddress.ip_network("198.18.0.0/15"))
    assert ipaddress.ip_network(pool["ip_range"]).subnet_of(subnet)
    boot = ipaddress.ip_address(compose_file()["services"]["bootstrap"]["networks"]["swarm"]["ipv4_address"])
    assert boot in subnet
    assert boot not in ipaddress.ip_network(pool["ip_range"])


def test_peer_training_environment_is_valid_settings():
    for name, service in peer_services().items():
        environ = {k: compose_default(str(v)) for k, v in service["environment"].items()}
        args = build_parser().parse_args(shlex.split(service_command(service)[1]))
        config = build_node_config(flags={"data_dir": args.data_dir}, config_path=None, environ=environ)
        assert config.train is not None, name
        assert config.train.model == "tiny"
        assert config.train.min_peers == len(peer_services())


def test_prometheus_scrapes_the_metrics_port_of_every_node():
    config = load_yaml(DEPLOY / "prometheus.yml")
    [job] = [j for j in config["scrape_configs"] if j["job_name"] == "lattica"]
    targets = {t for group in job["static_configs"] for t in group["targets"]}
    nodes = {"bootstrap", *peer_services()}
    assert targets == {f"{n}:{METRICS_PORT}" for n in nodes}


def test_grafana_provisioning_points_at_the_mounted_dashboards():
    services = compose_file()["services"]
    mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"])
    provider = load_yaml(DEPLOY / "grafana/provisioning/dashboards/lattica.yml")
    assert mounts["./grafana/dashboards"] == provider["providers"][0]["options"]["path"]
    datasource = load_yaml(DEPLOY / "grafana/provisioning/datasources/prometheus.yml")
    [prom] = datasource["datasources"]
    assert prom["url"] == "http://prometheus:9090"
    assert (
        prom["jsonData"]["timeInterval"]
        == load_yaml(DEPLOY / "prometheus.yml")["global"]["scrape_interval"]
    )


@pytest.mark.skipif(shutil.which("promtool") is None, reason="needs promtool (apt: prometheus)")
def test_promtool_accepts_config_and_every_dashboard_query(tmp_path):
    check = subprocess.run(
        ["promtool", "check", "config", "--syntax-only", str(DEPLOY / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query_{i}", "expr": expr}
                    for i, (_, _, expr) in enumerate(dashboard_queries())
                ],
            }
        ]
    }
    rules_file = tmp_path / "rules.json"
    rules_file.write_text(json.dumps(rules))
    check = subprocess.run(
        ["promtool", "check", "rules", str(rules_file)], capture_output=True, text=True, timeout=30
    )
    assert check.returncode == 0, check.stdout + check.stderr


# -- dashboard -----------------------------------------------------------------------------


def _families() -> set[str]:
    return {m.name for m in NodeMetrics(process=False).registry.collect()}


def test_dashboard_queries_only_defined_metrics_and_shows_all_of_them():
    families = _families()
    used = set()
    for _, title, expr in dashboard_queries():
        for name in re.findall(r"\blattica_[a-z_]+", expr):
            family = re.sub(r"_(total|bucket|sum|count|created|info)$", "", name)
            assert family in families, f"{title}: {name} is not defined in NodeMetrics"
            used.add(family)
    assert used == families, f"metrics without a panel: {families - used}"


def test_training_panels_sit_in_the_training_row():
    rows = {row for row, _ in dashboard_panels()}
    assert "Training" in rows
    training = {p["title"] for row, p in dashboard_panels() if row == "Training"}
    assert {"Outer round", "Loss", "Tokens per second", "Round duration"} <= training
    for row, _, expr in dashboard_queries():
        trains = re.search(r"lattica_(outer_round|train_loss|tokens_per|round_duration)", expr)
        assert bool(trains) <= (row == "Training"), expr


# -- running the container commands locally ------------------------------------------------


def test_compose_commands_start_a_swarm_and_pass_the_healthcheck(tmp_path):
    swarm = start_compose_swarm(tmp_path, peers=1)
    try:
        peer = swarm.nodes[1]
        wait_healthy(swarm, peer, timeout=40)
        assert healthcheck(swarm.bootstrap.data_dir).returncode == 0
        peers_file = (tmp_path / "shared" / "bootstrap.peers").read_text().split()
        assert len(peers_file) == 1
        assert peers_file[0].startswith("/ip4/127.0.0.1/tcp/")
        boot = daemon_status(swarm.bootstrap)
        assert peers_file[0].endswith(f"/p2p/{boot['peer_id']}")
        wait_connected(swarm, peer, peers=1, timeout=30)
    finally:
        swarm.stop()
    assert healthcheck(swarm.bootstrap.data_dir).returncode != 0, "stopped daemon reported healthy"
