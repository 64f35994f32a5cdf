"""The NAT lab scenarios with the small lab node (``tests/nat/test_scenarios.py``).

They exercise the NAT services directly, without the daemon: quick checks of the mechanisms.
The same scenarios with real ``lattica join`` daemons, which the benchmark measures, are in
``lattica_lab/nat_daemons.py``.

Each scenario builds its own topology in a fresh :class:`NetLab`, starts lab nodes, dials, and
returns a :class:`ScenarioResult` measured from the nodes' own events. Everything is torn
down when the scenario returns or fails.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from lattica_lab.netlab import LabHost, LabProcess, NetLab, ScenarioResult

PORT = 4001
TIMEOUT = 12.0


def start_node(lab: NetLab, host: LabHost, *extra: str, log: str | None = None) -> LabProcess:
    argv = [sys.executable, "-m", "lattica_lab.nat_node",
            "--listen", f"/ip4/{host.ip}/tcp/{PORT}", *extra]
    node = lab.spawn(host, argv, stderr_path=log)
    node.wait_for(lambda e: e["event"] == "ready", TIMEOUT)
    return node


def ready(node: LabProcess) -> dict:
    return node.wait_for(lambda e: e["event"] == "ready", TIMEOUT)


def peer_id(node: LabProcess) -> str:
    return ready(node)["peer_id"]


def addrs(node: LabProcess) -> list[str]:
    return ready(node)["addrs"]


def relay_addrs(node: LabProcess, timeout: float = TIMEOUT, *, avoid: str | None = None) -> list[str]:
    event = node.wait_for(
        lambda e: e["event"] == "relay_addrs" and bool(e["value"])
        and (avoid is None or all(avoid not in a for a in e["value"])), timeout,
        fresh=avoid is not None)
    return event["value"]


def reachability(node: LabProcess, value: str, timeout: float = TIMEOUT) -> dict:
    return node.wait_for(lambda e: e["event"] == "reachability" and e["value"] == value, timeout)


def dial(src: LabProcess, dst_id: str, dst_addrs: list[str], result: ScenarioResult) -> dict:
    src.send({"cmd": "dial", "peer": dst_id, "addrs": dst_addrs})
    event = src.wait_for(lambda e: e["event"] in ("connected", "error")
                         and e.get("peer", dst_id) == dst_id, TIMEOUT, fresh=True)
    if event["event"] == "connected":
        result.connected = True
        result.path = event["path"]
        result.connect_s = event["connect_s"]
        if result.path == "direct":
            result.direct_s = result.connect_s
    else:
        result.details["dial_error"] = event["error"]
    return event


def transfer(src: LabProcess, dst_id: str, n: int, timeout: float = TIMEOUT) -> dict:
    src.send({"cmd": "send", "peer": dst_id, "bytes": n})
    return src.wait_for(lambda e: e["event"] in ("transfer", "error"), timeout, fresh=True)


def wait_punch(src: LabProcess, dst_id: str, result: ScenarioResult, timeout: float) -> dict:
    event = src.wait_for(lambda e: e["event"] == "hole_punch" and e["peer"] == dst_id, timeout)
    result.details["hole_punch"] = event["result"]
    if event["result"] == "succeeded":
        result.path = "hole-punched"
        result.direct_s = event["direct_s"]
    return event


def public_public(log_dir: str | None = None) -> ScenarioResult:
    result = ScenarioResult("public<->public", direct_possible=True)
    with NetLab() as lab:
        a, b = lab.add_public("a"), lab.add_public("b")
        na, nb = start_node(lab, a), start_node(lab, b)
        dial(na, peer_id(nb), addrs(nb), result)
        result.details["reachability_a"] = reachability(na, "public")["value"]
        result.details["transfer"] = transfer(na, peer_id(nb), 1 << 20)["ok"]
    return result


def nat_public(log_dir: str | None = None) -> ScenarioResult:
    """A NAT'd node dials a public one; later the public one reaches the NAT'd one back."""
    result = ScenarioResult("nat<->public", direct_possible=True)
    with NetLab() as lab:
        pub, relay_host = lab.add_public("pub"), lab.add_public("relay")
        nat = lab.add_nat("nat1")
        priv = lab.add_private("priv", nat)
        relay = start_node(lab, relay_host, "--relay-serve", "on")
        relay_ma = addrs(relay)[0]
        npub = start_node(lab, pub, "--relay-serve", "off")
        npriv = start_node(lab, priv, "--relay", relay_ma, "--relay-serve", "off")
        # NAT -> public: a plain outbound dial.
        out = ScenarioResult("nat->public", direct_possible=True)
        dial(npriv, peer_id(npub), addrs(npub), out)
        result.details["nat_to_public"] = out.path
        result.details["reachability_priv"] = reachability(npriv, "private")["value"]
        result.details["reachability_pub"] = reachability(npub, "public")["value"]
        # public -> NAT: direct fails (NAT drops it), so relay, then DCUtR reverses it.
        circuits = relay_addrs(npriv)
        npub.send({"cmd": "status"})  # keep the event log fresh for debugging
        # a fresh public peer that was never connected to priv
        pub2_host = lab.add_public("pub2")
        npub2 = start_node(lab, pub2_host, "--relay-serve", "off")
        dial(npub2, peer_id(npriv), addrs(npriv) + circuits, result)
        if result.path == "relayed":
            wait_punch(npub2, peer_id(npriv), result, TIMEOUT)
        result.details["transfer"] = transfer(npub2, peer_id(npriv), 1 << 20)["ok"]
    return result


def nat_nat(symmetric: bool, log_dir: str | None = None) -> ScenarioResult:
    name = "nat<->symmetric-nat" if symmetric else "nat<->nat"
    result = ScenarioResult(name, direct_possible=not symmetric)
    with NetLab() as lab:
        relay_host = lab.add_public("relay")
        r1, r2 = lab.add_nat("nat1"), lab.add_nat("nat2", symmetric=symmetric)
        h1, h2 = lab.add_private("h1", r1), lab.add_private("h2", r2)
        relay = start_node(lab, relay_host, "--relay-serve", "on",
                           log=f"{log_dir}/relay.log" if log_dir else None)
        relay_ma = addrs(relay)[0]
        n1 = start_node(lab, h1, "--relay", relay_ma, "--relay-serve", "off",
                        log=f"{log_dir}/h1.log" if log_dir else None)
        n2 = start_node(lab, h2, "--relay", relay_ma, "--relay-serve", "off",
                        log=f"{log_dir}/h2.log" if log_dir else None)
        circuits = relay_addrs(n2)
        relay_addrs(n1)
        dial(n1, peer_id(n2), addrs(n2) + circuits, result)
        if result.connected:
            result.details["first_path"] = result.path
            wait_punch(n1, peer_id(n2), result, 20.0)
            t = transfer(n1, peer_id(n2), 4 << 20, timeout=20.0)
            result.details["transfer_ok"] = t.get("ok")
            result.details["transfer_path"] = t.get("path")
            result.details["transfer_via"] = t.get("via")
            result.details["transfer_s"] = t.get("seconds")
    return result


def relay_failover(log_dir: str | None = None) -> ScenarioResult:
    """The relay in use dies: the NAT'd peer reserves on a second relay and is reached again."""
    result = ScenarioResult("relay-failover", direct_possible=False)
    with NetLab() as lab:
        ra, rb = lab.add_public("relayA"), lab.add_public("relayB")
        r1, r2 = lab.add_nat("nat1", symmetric=True), lab.add_nat("nat2", symmetric=True)
        h1, h2 = lab.add_private("h1", r1), lab.add_private("h2", r2)
        relay_a = start_node(lab, ra, "--relay-serve", "on")
        relay_b = start_node(lab, rb, "--relay-serve", "on")
        relays = ["--relay", addrs(relay_a)[0], "--relay", addrs(relay_b)[0]]
        n1 = start_node(lab, h1, *relays, "--want", "1", "--relay-serve", "off")
        n2 = start_node(lab, h2, *relays, "--want", "1", "--relay-serve", "off")
        first = relay_addrs(n2)
        used = first[0].split("/p2p-circuit")[0].rsplit("/p2p/", 1)[1]
        dial(n1, peer_id(n2), first, ScenarioResult("first", False))
        victim = relay_a if peer_id(relay_a) == used else relay_b
        victim.kill()
        killed_at = time.monotonic()
        second = relay_addrs(n2, avoid=used)
        result.details["rereserve_s"] = round(time.monotonic() - killed_at, 3)
        # n1 redials n2 at its new circuit address (as it would after reading it from the DHT).
        dial(n1, peer_id(n2), second, result)
        result.details["reconnect_s"] = round(time.monotonic() - killed_at, 3)
        result.details["transfer"] = transfer(n1, peer_id(n2), 1 << 20)["ok"]
    return result


SCENARIOS: dict[str, Callable[..., ScenarioResult]] = {
    "public<->public": public_public,
    "nat<->public": nat_public,
    "nat<->nat": lambda log_dir=None: nat_nat(False, log_dir),
    "nat<->symmetric-nat": lambda log_dir=None: nat_nat(True, log_dir),
    "relay-failover": relay_failover,
}
