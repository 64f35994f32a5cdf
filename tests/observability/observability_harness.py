"""Run the swarm that deploy/docker-compose.yml describes as local processes on loopback.

There is no Docker engine on the test machines, so the compose commands are executed as they
are written, with container paths, ports and host names mapped to a temp dir and loopback:
``/var/lib/lattica`` -> a per-node dir, ``0.0.0.0`` and the bootstrap's fixed compose-network
address -> ``127.0.0.1``, fixed ports -> free ports.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
DOCKERFILE = REPO / "docker" / "Dockerfile"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "lattica.json"
# Values for the dashboard variables when a query is run outside Grafana.
DASHBOARD_VARIABLES = {"$__rate_interval": "10s", "$instance": ".+"}
LATTICA_BIN = Path(sys.executable).parent / "lattica"
DATA_DIR = "/var/lib/lattica"
SHARED_DIR = "/var/lib/lattica-shared"
P2P_PORT = 4001
METRICS_PORT = 9400


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_yaml(path: Path):
    yaml = pytest.importorskip("yaml", reason="PyYAML is needed to read the deploy files")
    return yaml.safe_load(path.read_text())


def compose_file() -> dict:
    return load_yaml(DEPLOY / "docker-compose.yml")


def bootstrap_ip() -> str:
    """The bootstrap service's fixed address on the compose network."""
    return compose_file()["services"]["bootstrap"]["networks"]["swarm"]["ipv4_address"]


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, argument text) pairs, with line continuations joined."""
    logical, current = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        keyword, _, rest = current.partition(" ")
        logical.append((keyword.upper(), rest.strip()))
        current = ""
    return logical


def dockerfile_exec_form(instruction: str) -> list[str]:
    """The JSON argv of an exec-form instruction (ENTRYPOINT, CMD, HEALTHCHECK ... CMD)."""
    [(_, text)] = [(k, v) for k, v in dockerfile_instructions() if k == instruction]
    if instruction == "HEALTHCHECK":
        text = text[text.index("CMD ") + len("CMD ") :]
    return json.loads(text)


def service_command(service: dict) -> tuple[list[str], str]:
    """(entrypoint, command) of a compose service as a shell-quoted string after the entrypoint."""
    entrypoint = service.get("entrypoint") or dockerfile_exec_form("ENTRYPOINT")
    command = service.get("command") or dockerfile_exec_form("CMD")
    if isinstance(command, str):
        command = shlex.split(command)
    return list(entrypoint), shlex.join(command) if entrypoint != ["sh", "-c"] else command[0]


def dashboard_panels() -> list[tuple[str, dict]]:
    """(row title, panel) for every non-row panel, in order."""
    row, out = "", []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        if panel["type"] == "row":
            row = panel["title"]
        else:
            out.append((row, panel))
    return out


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(row, panel title, PromQL with dashboard variables substituted)."""
    queries = []
    for row, panel in dashboard_panels():
        for target in panel["targets"]:
            expr = target["expr"]
            for variable, value in DASHBOARD_VARIABLES.items():
                expr = expr.replace(variable, value)
            queries.append((row, panel["title"], expr))
    return queries


@dataclass
class LocalNode:
    name: str
    data_dir: Path
    metrics_port: int
    process: subprocess.Popen
    log_path: Path

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return f"--- {self.name} (rc={self.process.poll()}) ---\n" + "\n".join(text[-lines:])


@dataclass
class LocalSwarm:
    root: Path
    boot_port: int = 0
    extra_join_args: tuple[str, ...] = ()
    nodes: list[LocalNode] = field(default_factory=list)

    @property
    def bootstrap(self) -> LocalNode:
        return self.nodes[0]

    def logs(self) -> str:
        return "\n".join(node.log_tail() for node in self.nodes)

    def stop(self) -> None:
        for node in self.nodes:
            if node.process.poll() is None:
                node.process.terminate()
        for node in self.nodes:
            try:
                node.process.wait(timeout=8)
            except subprocess.TimeoutExpired:
                node.process.kill()
                node.process.wait(timeout=5)


def localize(text: str, *, data_dir: Path, shared: Path, port: int, metrics: int, boot: int) -> str:
    """Map one compose command onto loopback and the temp dir."""
    for old, new in (
        (SHARED_DIR, str(shared)),
        (DATA_DIR, str(data_dir)),
        (f"/ip4/0.0.0.0/tcp/{P2P_PORT}", f"/ip4/127.0.0.1/tcp/{port}"),
        (f"/ip4/{bootstrap_ip()}/tcp/{P2P_PORT}", f"/ip4/127.0.0.1/tcp/{boot}"),
        (f"0.0.0.0:{METRICS_PORT}", f"127.0.0.1:{metrics}"),
    ):
        text = text.replace(old, new)
    return text


def healthcheck(data_dir: Path) -> subprocess.CompletedProcess:
    """The Dockerfile HEALTHCHECK, run against a local data dir."""
    argv = [a.replace(DATA_DIR, str(data_dir)) for a in dockerfile_exec_form("HEALTHCHECK")]
    return subprocess.run(
        [str(LATTICA_BIN), *argv[1:]], capture_output=True, text=True, timeout=20, env=_env()
    )


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{LATTICA_BIN.parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("LATTICA_DATA_DIR", None)
    return env


def _spawn(name: str, argv: list[str], swarm: LocalSwarm, data_dir: Path, metrics: int):
    log_path = swarm.root / f"{name}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=swarm.root
        )
    swarm.nodes.append(LocalNode(name, data_dir, metrics, process, log_path))


def start_compose_swarm(root: Path, *, peers: int, extra_join_args: tuple[str, ...] = ()):
    """Start the compose bootstrap and ``peers`` peer replicas; returns a LocalSwarm."""
    swarm = LocalSwarm(root, boot_port=free_port(), extra_join_args=extra_join_args)
    (root / "shared").mkdir()
    for index in range(peers + 1):
        start_service(swarm, "bootstrap" if index == 0 else f"peer-{index}")
        if index == 0:
            wait_healthy(swarm, swarm.bootstrap, timeout=40)
    return swarm


def start_service(swarm: LocalSwarm, name: str, *, metrics_port: int | None = None) -> LocalNode:
    """Start the compose ``bootstrap`` service (name "bootstrap") or one more peer (the
    ``peer-1`` service's command; every peer service runs the same one)."""
    service = compose_file()["services"]["bootstrap" if name == "bootstrap" else "peer-1"]
    entrypoint, command = service_command(service)
    data_dir, metrics = swarm.root / name, metrics_port or free_port()
    port = swarm.boot_port if name == "bootstrap" else free_port()
    extra = " " + shlex.join(swarm.extra_join_args) if swarm.extra_join_args else ""
    command = localize(
        command + extra,
        data_dir=data_dir,
        shared=swarm.root / "shared",
        port=port,
        metrics=metrics,
        boot=swarm.boot_port,
    )
    argv = ["sh", "-c", command] if entrypoint == ["sh", "-c"] else [str(LATTICA_BIN), *shlex.split(command)]
    _spawn(name, argv, swarm, data_dir, metrics)
    return swarm.nodes[-1]


def wait_healthy(swarm: LocalSwarm, node: LocalNode, *, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if node.process.poll() is not None:
            raise AssertionError(f"{node.name} exited early\n{swarm.logs()}")
        if node.data_dir.exists() and healthcheck(node.data_dir).returncode == 0:
            return
        time.sleep(0.5)
    raise AssertionError(f"{node.name} not healthy after {timeout} s\n{swarm.logs()}")


def daemon_status(node: LocalNode) -> dict:
    result = subprocess.run(
        [str(LATTICA_BIN), "status", "--data-dir", str(node.data_dir), "--json"],
        capture_output=True,
        text=True,
        timeout=20,
        env=_env(),
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def wait_connected(swarm: LocalSwarm, node: LocalNode, *, peers: int, timeout: float) -> None:
    """Wait until ``lattica status`` of ``node`` reports at least ``peers`` connected peers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if node.process.poll() is not None:
            raise AssertionError(f"{node.name} exited early\n{swarm.logs()}")
        if daemon_status(node)["connected_peers"] >= peers:
            return
        time.sleep(0.5)
    raise AssertionError(f"{node.name} has < {peers} peers after {timeout} s\n{swarm.logs()}")
