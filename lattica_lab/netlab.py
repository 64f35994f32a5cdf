"""A real-network lab on one machine: network namespaces, veth links, nftables NAT.

Topology built by :class:`NetLab`::

    [pub-1]   [pub-2]        [nat-1 router] ---- [lan host 198.19.1.2]
       \\        |           /
        +----- "internet" bridge (198.18.0.0/24, its own namespace) ----- [nat-2 router] --- ...

- The internet is a bridge ``br0`` inside its own namespace; every public host and every NAT
  router's WAN side hangs off it with an address 198.18.0.N/24.
- A NAT router forwards its LAN (198.19.K.0/24) to the internet with nftables ``masquerade``
  (port preserving where possible, like most home routers), or ``masquerade random,fully-random``
  for a symmetric NAT (a fresh port per destination). Unsolicited inbound traffic on the WAN side
  is *dropped*, as a home router does; only conntrack-established flows come back in.
- Only 198.18.0.0/15 addresses are used, and no namespace has a route to the host's interfaces.

Every namespace is named ``ltnat-<pid>-<token>-<role>``: ``<pid>`` is the process that built the
lab, so a later run removes namespaces left behind by a crashed run (its pid is gone) and never
touches a lab that is still alive. :meth:`NetLab.close` kills the processes this lab spawned (by
pid), then deletes its namespaces, which destroys their veths too.

``shape_link`` puts a tbf qdisc on an interface (bandwidth only: netem is not available here).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import secrets
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lattica_lab import lab_env

NS_PREFIX = "ltnat-"
_NS_RE = re.compile(r"^ltnat-(\d+)-")
INTERNET_NET = "198.18.0"


class NetLabUnavailable(RuntimeError):
    """Root, ``ip`` or ``nft`` is missing: namespaces cannot be built here."""


def lab_unavailable_reason() -> str | None:
    """Why this machine cannot build a lab, or ``None`` when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nft", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt: iproute2 nftables)"
    return None


def _run(argv: Sequence[str], *, input_text: str | None = None, check: bool = True) -> str:
    proc = subprocess.run(
        list(argv), input=input_text, capture_output=True, text=True, timeout=20, check=False
    )
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {proc.stderr.strip()}")
    return proc.stdout


def _list_namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete_namespace(ns: str) -> None:
    pids = _run(["ip", "netns", "pids", ns], check=False).split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _run(["ip", "netns", "del", ns], check=False)


def remove_stale_labs() -> list[str]:
    """Delete namespaces of labs whose building process no longer exists."""
    removed = []
    for ns in _list_namespaces():
        match = _NS_RE.match(ns)
        if match and not _pid_alive(int(match.group(1))):
            _delete_namespace(ns)
            removed.append(ns)
    return removed


def shape_link(ns: str, ifname: str, *, rate_mbit: float, burst: str = "64kb",
               latency: str = "50ms") -> None:
    """Limit egress of ``ifname`` in ``ns`` to ``rate_mbit`` with a token bucket filter."""
    if rate_mbit <= 0:
        raise ValueError("rate_mbit must be positive")
    _run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", ifname, "root", "tbf",
          "rate", f"{rate_mbit}mbit", "burst", burst, "latency", latency])


@dataclass
class LabHost:
    """A machine in the lab: its namespace, its address and its default interface."""

    name: str
    ns: str
    ip: str
    ifname: str
    behind: LabRouter | None = None
    port: str | None = None  # its port on the internet bridge (public hosts)


@dataclass
class LabRouter:
    name: str
    ns: str
    wan_ip: str
    lan_prefix: str
    symmetric: bool
    hosts: list[LabHost] = field(default_factory=list)


class LabProcess:
    """A process in a namespace whose stdout is a stream of JSON events (one per line)."""

    def __init__(self, name: str, popen: subprocess.Popen[str]) -> None:
        self.name = name
        self.popen = popen
        self.events: list[dict] = []
        self._queue: queue.Queue[dict | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict):
                self._queue.put(event)
        self._queue.put(None)

    def send(self, command: dict) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write(json.dumps(command) + "\n")
        self.popen.stdin.flush()

    def wait_for(self, predicate: Callable[[dict], bool], timeout: float, *,
                 fresh: bool = False) -> dict:
        """Return the first event matching ``predicate``: seen before (unless ``fresh``) or new."""
        for event in [] if fresh else self.events:
            if predicate(event):
                return event
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{self.name}: no matching event in {timeout}s; "
                                   f"last events: {self.events[-5:]}")
            try:
                received = self._queue.get(timeout=remaining)
            except queue.Empty:
                continue
            if received is None:
                self._queue.put(None)
                raise RuntimeError(f"{self.name} exited (rc={self.popen.poll()}); "
                                   f"last events: {self.events[-5:]}")
            self.events.append(received)
            if predicate(received):
                return received

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=5)


@dataclass
class ScenarioResult:
    """What a NAT scenario measured (tests and ``benchmarks/nat_matrix.py``)."""

    scenario: str
    direct_possible: bool
    connected: bool = False
    path: str | None = None
    connect_s: float | None = None
    direct_s: float | None = None
    details: dict[str, Any] = field(default_factory=dict)


class NetLab:
    """Builds a lab; use as a context manager so it is always torn down."""

    def __init__(self) -> None:
        reason = lab_unavailable_reason()
        if reason:
            raise NetLabUnavailable(reason)
        remove_stale_labs()
        self.tag = f"{NS_PREFIX}{os.getpid()}-{secrets.token_hex(2)}"
        self.namespaces: list[str] = []
        self.processes: list[LabProcess] = []
        self._next_wan = 1
        self._next_lan = 1
        self._inet = self._add_namespace("inet")
        self._exec(self._inet, "ip link add br0 type bridge")
        self._exec(self._inet, "ip link set br0 up")

    # -- building -------------------------------------------------------------------------
    def _add_namespace(self, role: str) -> str:
        ns = f"{self.tag}-{role}"
        _run(["ip", "netns", "add", ns])
        self.namespaces.append(ns)
        self._exec(ns, "ip link set lo up")
        return ns

    def _exec(self, ns: str, command: str) -> str:
        return _run(["ip", "netns", "exec", ns, *command.split()])

    def _wire_to_internet(self, ns: str, ifname: str) -> str:
        index = self._next_wan
        self._next_wan += 1
        if index > 250:
            raise RuntimeError("the lab internet is full")
        port = f"p{index}"
        _run(["ip", "link", "add", port, "netns", self._inet, "type", "veth",
              "peer", "name", ifname, "netns", ns])
        self._exec(self._inet, f"ip link set {port} master br0")
        self._exec(self._inet, f"ip link set {port} up")
        ip = f"{INTERNET_NET}.{index}"
        self._exec(ns, f"ip addr add {ip}/24 dev {ifname}")
        self._exec(ns, f"ip link set {ifname} up")
        return ip

    def add_public(self, name: str) -> LabHost:
        ns = self._add_namespace(name)
        ip = self._wire_to_internet(ns, "eth0")
        return LabHost(name=name, ns=ns, ip=ip, ifname="eth0", port=f"p{ip.rsplit('.', 1)[1]}")

    def cut_link(self, host: LabHost) -> None:
        """Pull ``host``'s cable at the internet bridge: its packets vanish, silently both ways
        (no reset, no error on either side), until ``heal_link``."""
        self._exec(self._inet, f"ip link set {self._port_of(host)} down")

    def heal_link(self, host: LabHost) -> None:
        self._exec(self._inet, f"ip link set {self._port_of(host)} up")

    @staticmethod
    def _port_of(host: LabHost) -> str:
        if host.port is None:
            raise ValueError(f"{host.name} is not wired to the internet bridge")
        return host.port

    def add_nat(self, name: str, *, symmetric: bool = False) -> LabRouter:
        ns = self._add_namespace(name)
        wan_ip = self._wire_to_internet(ns, "wan")
        lan = f"198.19.{self._next_lan}"
        self._next_lan += 1
        self._exec(ns, "sysctl -q -w net.ipv4.ip_forward=1")
        masquerade = "masquerade random,fully-random" if symmetric else "masquerade"
        rules = f"""
table ip lab_nat {{
  chain post {{ type nat hook postrouting priority 100; oifname "wan" {masquerade}; }}
}}
table inet lab_filter {{
  chain input {{ type filter hook input priority 0; policy accept;
    iifname "wan" ct state established,related accept; iifname "wan" drop; }}
  chain forward {{ type filter hook forward priority 0; policy accept;
    iifname "wan" ct state established,related accept; iifname "wan" drop; }}
}}
"""
        _run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input_text=rules)
        return LabRouter(name=name, ns=ns, wan_ip=wan_ip, lan_prefix=lan, symmetric=symmetric)

    def add_private(self, name: str, router: LabRouter) -> LabHost:
        ns = self._add_namespace(name)
        index = len(router.hosts) + 2
        lan_if = f"l{index}"
        _run(["ip", "link", "add", lan_if, "netns", router.ns, "type", "veth",
              "peer", "name", "eth0", "netns", ns])
        if not router.hosts:
            self._exec(router.ns, "ip link add lan type bridge")
            self._exec(router.ns, f"ip addr add {router.lan_prefix}.1/24 dev lan")
            self._exec(router.ns, "ip link set lan up")
        self._exec(router.ns, f"ip link set {lan_if} master lan")
        self._exec(router.ns, f"ip link set {lan_if} up")
        ip = f"{router.lan_prefix}.{index}"
        self._exec(ns, f"ip addr add {ip}/24 dev eth0")
        self._exec(ns, "ip link set eth0 up")
        self._exec(ns, f"ip route add default via {router.lan_prefix}.1")
        host = LabHost(name=name, ns=ns, ip=ip, ifname="eth0", behind=router)
        router.hosts.append(host)
        return host

    # -- running ----------------------------------------------------------------------------
    def spawn(self, host: LabHost, argv: Sequence[str], *, name: str | None = None,
              stderr_path: str | None = None) -> LabProcess:
        """Start ``argv`` inside ``host``'s namespace; its stdout must be JSON lines."""
        stderr_file = open(stderr_path, "w") if stderr_path else None  # noqa: SIM115
        try:
            popen = subprocess.Popen(
                ["ip", "netns", "exec", host.ns, *argv],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=stderr_file if stderr_file is not None else subprocess.DEVNULL,
                text=True, bufsize=1, env=lab_env(),  # lattica_lab modules importable
            )
        finally:
            if stderr_file is not None:
                stderr_file.close()
        process = LabProcess(name or host.name, popen)
        self.processes.append(process)
        return process

    def run_in(self, host: LabHost, argv: Sequence[str]) -> str:
        """Run a short command in ``host``'s namespace and return its stdout."""
        return _run(["ip", "netns", "exec", host.ns, *argv])

    # -- teardown ---------------------------------------------------------------------------
    def close(self) -> None:
        for process in self.processes:
            process.kill()
        self.processes.clear()
        for ns in reversed(self.namespaces):
            _delete_namespace(ns)
        self.namespaces.clear()

    def __enter__(self) -> NetLab:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
