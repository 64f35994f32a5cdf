"""The NAT scenarios with real ``lattica join`` daemons in a namespace lab.

Shared by ``tests/nat/test_daemon_scenarios.py`` and ``benchmarks/nat_matrix.py``. Each
scenario builds its own :class:`NetLab`, starts daemons inside its hosts (control sockets in
data dirs on the shared file system, so they are queried from outside the namespaces), waits
for what the scenario is about by polling the daemons' ``peers`` / ``status`` answers — the
data ``lattica peers --json`` and ``lattica status --json`` print — and returns a
:class:`ScenarioResult`. Everything is torn down when the scenario returns or fails.

Times are wall-clock seconds measured from outside: ``connect_s`` from the moment the dialing
side's daemon is up (control socket answers; bootstrap starts right after) to the first poll
that shows the peer connected, ``direct_s`` to the first poll that shows a direct or
hole-punched path. They include discovery (AutoNAT verdict, relay reservation, the relay
address travelling through the replicated state and peer exchange), not only the dial.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lattica.control import client
from lattica.errors import LatticaError
from lattica_lab.netlab import LabHost, LabProcess, NetLab, ScenarioResult

PORT = 4001
POLL_S = 0.1
DIRECT_PATHS = ("direct", "hole-punched")
# Rounds to spare: b and c start training before the relayed connection between them exists
# (``--min-peers`` counts members in the replicated state, which a relays), and every round they
# reach unconnected runs alone. On a loaded machine the connection takes long enough for a short
# run to end before one round ran together; the scenario stops at the first one that did.
TRAIN_ARGS = ("--train", "--model", "tiny", "--device", "cpu", "--rounds", "200",
              "--inner-steps", "3", "--min-peers", "2")
TRAIN_ENV = {"LATTICA_TRAIN_BATCH_SIZE": "4", "LATTICA_TRAIN_SEQ_LEN": "32",
             "LATTICA_TRAIN_WARMUP_STEPS": "1", "OMP_NUM_THREADS": "1"}
QUIET_ENV = {"LATTICA_PEER_EXCHANGE": "false", "LATTICA_DHT": "false"}
# py-libp2p's own host, relay v2 and Kademlia server: a relay or DHT server run by someone else
STANDARD_NODE = Path(__file__).resolve().parents[1] / "tests" / "net" / "standard_node.py"


class LabDaemon:
    """One ``lattica join`` process in a lab host."""

    def __init__(self, lab: NetLab, host: LabHost, data_dir: Path, *, peers: tuple[str, ...] = (),
                 extra: tuple[str, ...] = (), env: dict[str, str] | None = None) -> None:
        self.host = host
        self.data_dir = data_dir
        data_dir.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "lattica.cli.main", "join", "--data-dir", str(data_dir),
                "--listen", f"/ip4/{host.ip}/tcp/{PORT}", "--metrics-addr", "off",
                "--bootstrap-timeout", "30", "--log-level", "info", *extra]
        for peer in peers:
            argv += ["--peer", peer]
        if env:
            argv = ["env", *(f"{k}={v}" for k, v in env.items()), *argv]
        self.process: LabProcess = lab.spawn(host, argv, name=host.name,
                                             stderr_path=str(data_dir) + ".log")
        self.ready_at: float | None = None
        self.peer_id: str = ""

    def call(self, method: str) -> Any:
        try:
            return client.call(self.data_dir / "control.sock", method, timeout=5.0)
        except LatticaError:
            return None

    def wait_up(self, timeout: float = 60.0) -> LabDaemon:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.popen.poll() is not None:
                raise RuntimeError(f"{self.host.name} exited: {self.log()}")
            answer = self.call("id")
            if answer:
                self.ready_at = time.monotonic()
                self.peer_id = answer["peer_id"]
                return self
            time.sleep(POLL_S)
        raise TimeoutError(f"{self.host.name} did not come up in {timeout} s: {self.log()}")

    @property
    def addr(self) -> str:
        return f"/ip4/{self.host.ip}/tcp/{PORT}/p2p/{self.peer_id}"

    def peers(self) -> dict[str, dict[str, Any]]:
        return {p["peer_id"]: p for p in self.call("peers") or []}

    def peer(self, peer_id: str) -> dict[str, Any]:
        return self.peers().get(peer_id) or {}

    def status(self) -> dict[str, Any]:
        return self.call("status") or {}

    def kill(self) -> None:
        self.process.kill()

    def log(self) -> str:
        path = Path(str(self.data_dir) + ".log")
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""


class StandardPeer:
    """A standard libp2p node (``tests/net/standard_node.py``: relay + DHT server, no Lattica
    protocol) in a lab host."""

    def __init__(self, lab: NetLab, host: LabHost, log_path: Path) -> None:
        argv = [sys.executable, str(STANDARD_NODE), "--listen", f"/ip4/{host.ip}/tcp/{PORT}"]
        self.process: LabProcess = lab.spawn(host, argv, name=host.name, stderr_path=str(log_path))
        up = self.process.wait_for(lambda e: e.get("event") == "up", 60)
        self.peer_id: str = up["peer_id"]
        self.addr: str = up["addrs"][0]

    def knows(self, peer_id: str) -> dict[str, Any]:
        """What it learnt of ``peer_id`` (identify's protocols and addresses, its DHT table)."""
        self.process.send({"cmd": "peer", "id": peer_id})
        return self.process.wait_for(lambda e: e.get("event") == "peer" and e.get("id") == peer_id,
                                     10, fresh=True)


def wait_until(predicate: Callable[[], Any], timeout: float) -> tuple[Any, float | None]:
    """Poll until ``predicate`` is truthy: (its value, seconds waited), or (last value, None)."""
    start = time.monotonic()
    while True:
        value = predicate()
        if value:
            return value, time.monotonic() - start
        if time.monotonic() - start > timeout:
            return value, None
        time.sleep(POLL_S)


def follow_connection(result: ScenarioResult, observer: LabDaemon, target: str, *,
                      t0: float, timeout: float, want_direct: bool) -> None:
    """Fill ``result`` from ``observer``'s view of ``target``: first connection, then (if
    ``want_direct``) the first direct / hole-punched path."""
    seen: list[str] = []

    def connected() -> dict[str, Any] | None:
        entry = observer.peer(target)
        if entry.get("connected"):
            if entry.get("path") and (not seen or seen[-1] != entry["path"]):
                seen.append(entry["path"])
            return entry
        return None

    entry, _ = wait_until(connected, timeout)
    if entry:
        result.connected = True
        result.connect_s = round(time.monotonic() - t0, 3)
        result.path = entry.get("path")
    if entry and want_direct:
        entry, _ = wait_until(lambda: (e := connected()) and e.get("path") in DIRECT_PATHS and e,
                              timeout)
        if entry:
            result.direct_s = round(time.monotonic() - t0, 3)
            result.path = entry.get("path")
    result.details["paths_seen"] = seen
    if entry:  # the RTT is measured within about half a second of a (new) path
        wait_until(lambda: observer.peer(target).get("rtt_ms") is not None, 5)


def status_becomes(daemon: LabDaemon, key: str, value: Any, timeout: float = 15.0) -> Any:
    """``daemon``'s ``status[key]`` once it equals ``value`` (or its last value after timeout)."""
    found, _ = wait_until(lambda: daemon.status().get(key) == value, timeout)
    return value if found else daemon.status().get(key)


def _up(*daemons: LabDaemon) -> float:
    for daemon in daemons:
        daemon.wait_up()
    return max(d.ready_at or 0.0 for d in daemons)


Hook = Callable[[ScenarioResult, dict[str, LabDaemon]], None]


def _finish(result: ScenarioResult, hook: Hook | None, **daemons: LabDaemon) -> ScenarioResult:
    """Hand the result and the still-running daemons to ``hook`` (a test's assertions)."""
    if hook is not None:
        hook(result, daemons)
    return result


def public_public(root: Path, *, before_teardown: Hook | None = None) -> ScenarioResult:
    result = ScenarioResult("public<->public", direct_possible=True)
    with NetLab() as lab:
        ha, hb = lab.add_public("a"), lab.add_public("b")
        a = LabDaemon(lab, ha, root / "a").wait_up()
        # b also asks for UPnP: the lab has no gateway, which must cost nothing
        b = LabDaemon(lab, hb, root / "b", peers=(a.addr,), extra=("--upnp",))
        t0 = _up(b)
        follow_connection(result, b, a.peer_id, t0=t0, timeout=20, want_direct=True)
        result.details["a_sees_b"] = a.peer(b.peer_id).get("path")
        result.details["reachability_a"] = status_becomes(a, "reachability", "public")
        result.details["rtt_ms"] = b.peer(a.peer_id).get("rtt_ms")
        return _finish(result, before_teardown, a=a, b=b)


def nat_public(root: Path, *, before_teardown: Hook | None = None) -> ScenarioResult:
    """NAT'd ``b`` joins public ``a`` (outbound, direct); public ``p`` then reaches ``b`` back.

    ``b`` runs without peer exchange and DHT, so it never dials ``p`` itself: ``p`` connects to
    it through ``b``'s relay address (on ``a``), and DCUtR reverses that to a direct connection.
    """
    result = ScenarioResult("nat<->public", direct_possible=True)
    with NetLab() as lab:
        ha, hp = lab.add_public("a"), lab.add_public("p")
        hb = lab.add_private("b", lab.add_nat("nat1"))
        a = LabDaemon(lab, ha, root / "a").wait_up()
        b = LabDaemon(lab, hb, root / "b", peers=(a.addr,), env=QUIET_ENV).wait_up()
        _, out_s = wait_until(lambda: b.peer(a.peer_id).get("connected"), 30)
        result.details["nat_to_public"] = b.peer(a.peer_id).get("path")
        result.details["nat_to_public_s"] = round(out_s, 3) if out_s is not None else None
        p = LabDaemon(lab, hp, root / "p", peers=(a.addr,))
        t0 = _up(p)
        follow_connection(result, p, b.peer_id, t0=t0, timeout=30, want_direct=True)
        result.details["b_sees_p"] = b.peer(p.peer_id).get("path")
        result.details["reachability_b"] = status_becomes(b, "reachability", "private")
        result.details["reachability_a"] = status_becomes(a, "reachability", "public")
        return _finish(result, before_teardown, a=a, b=b, p=p)


def nat_nat(root: Path, *, symmetric: bool, before_teardown: Hook | None = None) -> ScenarioResult:
    """``b`` and ``c`` behind two NATs find each other through public ``a`` (bootstrap and
    relay). Port-preserving NATs: relayed first, then hole-punched. With ``symmetric`` the
    punch cannot work: they stay relayed and train together (tensors over the relay)."""
    name = "nat<->symmetric-nat" if symmetric else "nat<->nat"
    result = ScenarioResult(name, direct_possible=not symmetric)
    with NetLab() as lab:
        ha = lab.add_public("a")
        hb = lab.add_private("b", lab.add_nat("nat1"))
        hc = lab.add_private("c", lab.add_nat("nat2", symmetric=symmetric))
        a = LabDaemon(lab, ha, root / "a").wait_up()
        extra, env = (TRAIN_ARGS, TRAIN_ENV) if symmetric else ((), None)
        b = LabDaemon(lab, hb, root / "b", peers=(a.addr,), extra=extra, env=env)
        c = LabDaemon(lab, hc, root / "c", peers=(a.addr,), extra=extra, env=env)
        t0 = _up(b, c)
        follow_connection(result, b, c.peer_id, t0=t0, timeout=40, want_direct=not symmetric)
        entry = b.peer(c.peer_id)
        result.details["relay"] = entry.get("relay")
        result.details["rtt_ms"] = entry.get("rtt_ms")
        result.details["relay_is_a"] = entry.get("relay") == a.peer_id if entry.get("relay") else None
        result.details["reachability"] = [status_becomes(d, "reachability", "private") for d in (b, c)]
        if symmetric and result.connected:
            def trained() -> Any:
                # a round that starts before b and c are connected runs alone (nothing sent);
                # wait for one they ran together
                infos = [(d.status().get("training") or {}) for d in (b, c)]
                return all((i.get("bytes_sent") or 0) > 0 for i in infos) and infos

            infos, train_s = wait_until(trained, 120)
            result.details["train_s"] = round(train_s, 1) if train_s is not None else None
            infos = infos or [(d.status().get("training") or {}) for d in (b, c)]
            result.details["rounds_completed"] = [i.get("rounds_completed") for i in infos]
            result.details["bytes_sent"] = [i.get("bytes_sent") for i in infos]
            result.details["path_after_training"] = b.peer(c.peer_id).get("path")
        return _finish(result, before_teardown, a=a, b=b, c=c)


def nat_nat_via_dht(root: Path, *, before_teardown: Hook | None = None) -> ScenarioResult:
    """``b`` and ``c`` behind two NATs know only a standard libp2p node ``s`` (relay and DHT
    server, no Lattica protocol): no replicated state or peer exchange to learn from, only
    its DHT, where each is known by its LAN address and its relay address on ``s``."""
    result = ScenarioResult("nat<->nat-via-dht", direct_possible=True)
    root.mkdir(parents=True, exist_ok=True)
    with NetLab() as lab:
        server = StandardPeer(lab, lab.add_public("s"), root / "s.log")
        hb = lab.add_private("b", lab.add_nat("nat1"))
        hc = lab.add_private("c", lab.add_nat("nat2"))
        b = LabDaemon(lab, hb, root / "b", peers=(server.addr,))
        c = LabDaemon(lab, hc, root / "c", peers=(server.addr,))
        t0 = _up(b, c)
        follow_connection(result, b, c.peer_id, t0=t0, timeout=40, want_direct=True)
        result.details["relay_is_s"] = b.peer(c.peer_id).get("relay") in (None, server.peer_id)
        return _finish(result, before_teardown, b=b, c=c)


def relay_failover(root: Path, *, before_teardown: Hook | None = None) -> ScenarioResult:
    """``b`` and ``c`` behind symmetric NATs, relayed through ``r1`` or ``r2``: the relay in
    use is killed; they reconnect through the other one (their reservations move there).

    ``c`` dials nobody but its bootstrap relays (``peer_exchange`` and ``dht`` off), so the
    only connection between them is the one ``b`` dials, through one relay: after the kill
    ``b`` has to dial again, not merely fall back on a second connection.
    """
    result = ScenarioResult("relay-failover", direct_possible=False)
    with NetLab() as lab:
        h1, h2 = lab.add_public("r1"), lab.add_public("r2")
        hb = lab.add_private("b", lab.add_nat("nat1", symmetric=True))
        hc = lab.add_private("c", lab.add_nat("nat2", symmetric=True))
        r1 = LabDaemon(lab, h1, root / "r1").wait_up()
        r2 = LabDaemon(lab, h2, root / "r2", peers=(r1.addr,)).wait_up()
        relays = {r1.peer_id: r1, r2.peer_id: r2}
        b = LabDaemon(lab, hb, root / "b", peers=(r1.addr, r2.addr))
        c = LabDaemon(lab, hc, root / "c", peers=(r1.addr, r2.addr), env=QUIET_ENV)
        t0 = _up(b, c)
        follow_connection(result, b, c.peer_id, t0=t0, timeout=40, want_direct=False)
        used, _ = wait_until(lambda: b.peer(c.peer_id).get("relay"), 10)
        result.details["first_relay"] = used
        if used not in relays:
            return _finish(result, before_teardown, r1=r1, r2=r2, b=b, c=c)
        relays[used].kill()
        killed_at = time.monotonic()
        others = [r for r in relays if r != used]

        def moved() -> Any:
            entry = b.peer(c.peer_id)
            return entry.get("connected") and entry.get("relay") in others and entry

        entry, reconnect_s = wait_until(moved, 40)
        result.details["reconnect_s"] = round(reconnect_s, 3) if reconnect_s is not None else None
        result.details["second_relay_is_other"] = bool(entry)
        circuits, _ = wait_until(
            lambda: (addrs := c.status().get("relay_addrs")) and all(used not in a for a in addrs)
            and addrs, 40)
        # c's reservations no longer name the dead relay (seconds from the kill)
        result.details["rereserve_s"] = round(time.monotonic() - killed_at, 3) if circuits else None
        result.details["c_relay_addrs"] = circuits
        result.path = (entry or {}).get("path", result.path)
        result.connected = bool(entry)
        return _finish(result, before_teardown, r1=r1, r2=r2, b=b, c=c)


SCENARIOS: dict[str, Callable[[Path], ScenarioResult]] = {
    "public<->public": public_public,
    "nat<->public": nat_public,
    "nat<->nat": lambda root: nat_nat(root, symmetric=False),
    "nat<->symmetric-nat": lambda root: nat_nat(root, symmetric=True),
    "nat<->nat-via-dht": nat_nat_via_dht,
    "relay-failover": relay_failover,
}


def log_tail(root: Path, limit: int = 1500) -> str:
    """The end of every daemon log under ``root`` (for a failure message)."""
    parts = []
    for path in sorted(root.glob("*.log")):
        text = path.read_text(errors="replace")
        parts.append(f"--- {path.name}\n{text[-limit:]}")
    return "\n".join(parts) if parts else "(no logs)"


