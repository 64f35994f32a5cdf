"""What ``lattica doctor`` concludes from what a node and its machine report — pure checks.

Facts come in (``NodeFacts`` from a running daemon's control socket or from a standalone probe,
``MachineFacts`` from this machine), findings come out: one ``Finding`` per check, each with a
status (``ok``, ``warn``, ``problem``), what was seen, and for every warning or problem one
sentence of what to do. Nothing here touches sockets, clocks or files.

NAT behaviour is read from the addresses peers observe us at (identify's ``observed_addr``) on
connections *we* dialed, compared with the local end of each such socket:

- the observed IP is one of ours -> no NAT on the way (``public``, if AutoNAT agrees);
- the observed port equals the local port -> a port-preserving NAT (``cone``): a hole punch can
  predict our external address (observed IP x listen port) and usually works;
- the observed port differs -> the NAT picks a port per connection (``symmetric``): nobody can
  predict where to reach us, so connections to other NAT'd peers stay relayed.

AutoNAT (peers dialing us back) decides public vs private; observations decide cone vs
symmetric. Without either the verdict is ``unknown``.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

Status = Literal["ok", "warn", "problem"]
NatKind = Literal["public", "cone", "symmetric", "unknown"]

CLOCK_WARN_S = 1.0  # beyond the measurement error; state leases and round deadlines are seconds
CLOCK_PROBLEM_S = 5.0
SLOW_RTT_MS = 300.0
MIN_FREE_BYTES = 1 << 30  # with no checkpoint yet to size it by


@dataclass(frozen=True)
class Observation:
    """One peer's view of us on a connection we dialed: our socket's end and what it saw."""

    observer: str
    local: str  # "ip:port" of our socket
    observed: str  # "ip:port" the observer saw


@dataclass(frozen=True)
class PeerFacts:
    peer_id: str
    connected: bool
    path: str | None = None  # direct, hole-punched, relayed
    relay: str | None = None
    rtt_ms: float | None = None
    last_transfer_bytes: int | None = None
    last_transfer_mbit_s: float | None = None
    clock_offset_s: float | None = None
    clock_error_s: float | None = None
    reachability: str | None = None  # as the peer advertises it in its membership record


@dataclass(frozen=True)
class NodeFacts:
    peer_id: str
    listen: tuple[str, ...] = ()
    announce: tuple[str, ...] = ()
    advertised: tuple[str, ...] = ()
    reachability: str = "unknown"  # AutoNAT: public, private, unknown
    dialback: dict[str, bool] = field(default_factory=dict)  # AutoNAT server -> reached us
    observations: tuple[Observation, ...] = ()
    relay_addrs: tuple[str, ...] = ()
    relay_serving: bool = False
    peers: tuple[PeerFacts, ...] = ()
    bootstrap_failures: dict[str, str] = field(default_factory=dict)  # address -> why
    bootstrap_plain: tuple[str, ...] = ()  # reached addresses of plain libp2p nodes (relay, DHT)
    bootstrap_tried: int = 0

    def with_last_transfers(self, sent: Mapping[str, tuple[int, float]]) -> NodeFacts:
        """These facts with the last large tensor message sent to each peer: ``sent`` maps a
        peer to (bytes, seconds); a message of no measurable duration gives no rate."""
        rates = {
            peer: (size, round(size * 8 / seconds / 1e6, 2)) for peer, (size, seconds) in sent.items() if seconds > 0
        }
        return replace(self, peers=tuple(
            replace(p, last_transfer_bytes=rates[p.peer_id][0], last_transfer_mbit_s=rates[p.peer_id][1])
            if p.peer_id in rates else p
            for p in self.peers
        ))

    def with_member_reachability(self, reachability: Mapping[str, str]) -> NodeFacts:
        """These facts with each peer's reachability as the peer advertises it (run members)."""
        return replace(self, peers=tuple(
            replace(p, reachability=reachability[p.peer_id]) if p.peer_id in reachability else p for p in self.peers
        ))


@dataclass(frozen=True)
class MachineFacts:
    data_dir: str
    free_bytes: int | None
    checkpoint_bytes: int | None = None  # the newest checkpoint's size, if any
    device: str = "cpu"  # cuda or cpu: what training would use
    device_name: str | None = None
    memory_total_bytes: int | None = None
    memory_free_bytes: int | None = None
    gpu_present: bool = False  # an NVIDIA device node exists, whether or not torch can use it


@dataclass(frozen=True)
class Finding:
    check: str
    status: Status
    detail: str
    advice: str | None = None


@dataclass(frozen=True)
class NatVerdict:
    kind: NatKind
    evidence: str


# -- NAT -----------------------------------------------------------------------------------


def split_host_port(text: str) -> tuple[str, int] | None:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def classify_nat(reachability: str, observations: tuple[Observation, ...]) -> NatVerdict:
    nated, preserved, rewritten = [], 0, 0
    for obs in observations:
        local, seen = split_host_port(obs.local), split_host_port(obs.observed)
        if local is None or seen is None or local[0] == seen[0]:
            continue
        nated.append(obs)
        if local[1] == seen[1]:
            preserved += 1
        else:
            rewritten += 1
    if reachability == "public" or (not nated and observations and reachability != "private"):
        how = "peers dialed back" if reachability == "public" else "peers see our own address"
        return NatVerdict("public", f"reachable directly: {how}")
    if rewritten:
        example = next(o for o in nated if split_host_port(o.local)[1] != split_host_port(o.observed)[1])  # type: ignore[index]
        return NatVerdict(
            "symmetric",
            f"the NAT rewrites ports per connection ({rewritten} of {len(nated)} observations; e.g. "
            f"our {example.local} was seen as {example.observed} by {short(example.observer)})",
        )
    if preserved:
        return NatVerdict(
            "cone", f"behind a port-preserving NAT ({preserved} observation(s) kept our port; "
            f"external IP {split_host_port(nated[0].observed)[0]})",  # type: ignore[index]
        )
    if reachability == "private":
        return NatVerdict("unknown", "peers could not dial us back, and none reported our address yet")
    return NatVerdict("unknown", "no peer has observed this node yet")


def nat_finding(facts: NodeFacts) -> tuple[NatVerdict, Finding]:
    verdict = classify_nat(facts.reachability, facts.observations)
    if verdict.kind == "public":
        return verdict, Finding("nat", "ok", f"public: {verdict.evidence}")
    if verdict.kind == "cone":
        return verdict, Finding(
            "nat", "ok", f"cone NAT: {verdict.evidence}; peers reach this node through a relay, then "
            "hole punching makes the connection direct",
        )
    if verdict.kind == "symmetric":
        return verdict, Finding(
            "nat", "warn", f"symmetric NAT: {verdict.evidence}; hole punching cannot predict this node's "
            "address, so connections to other NAT'd peers stay relayed (slower, and limited by the relay)",
            "forward a TCP port to this machine and start with --announce /ip4/<public IP>/tcp/<port> "
            "(or --upnp), or run on a host with a public address",
        )
    return verdict, Finding(
        "nat", "warn", f"NAT behaviour unknown: {verdict.evidence}",
        "wait until the node is connected to at least one publicly reachable peer, then run doctor again",
    )


# -- addresses -----------------------------------------------------------------------------


def _ip_of(addr: str) -> str | None:
    parts = addr.split("/")
    if len(parts) > 2 and parts[1] in ("ip4", "ip6"):
        return parts[2]
    return None


def _is_local_only(ip: str) -> bool:
    try:
        parsed = ipaddress.ip_address(ip)
    except ValueError:
        return False
    return parsed.is_loopback or parsed.is_link_local


def address_findings(facts: NodeFacts, nat: NatVerdict) -> list[Finding]:
    findings: list[Finding] = []
    listen_ips = [ip for ip in (_ip_of(a) for a in facts.listen) if ip]
    if listen_ips and all(_is_local_only(ip) for ip in listen_ips):
        findings.append(Finding(
            "listen", "warn", f"listening only on {', '.join(facts.listen)}: peers on other machines cannot dial it",
            "to train with other machines, listen on all interfaces: --listen /ip4/0.0.0.0/tcp/4001",
        ))
    else:
        findings.append(Finding("listen", "ok", f"listening on {', '.join(facts.listen) or 'nothing yet'}"))
    reached = sum(facts.dialback.values())
    failed = len(facts.dialback) - reached
    direct = [a for a in facts.advertised if "/p2p-circuit" not in a]
    shown = ", ".join(facts.announce or direct[:3]) or "no address"
    if facts.dialback and not reached:
        advice = (
            "check that the announced host port is mapped to the container's listen port "
            "(docker run -p HOST_PORT:4001) and that --announce names the machine's public IP and HOST_PORT"
            if facts.announce else
            "peers can still reach this node through relays; for direct connections forward the "
            "listen port and set --announce"
        )
        status: Status = "problem" if facts.announce else "warn"
        findings.append(Finding(
            "dialable", status, f"{failed} peer(s) tried to dial this node back at {shown} and none could", advice,
        ))
    elif reached:
        findings.append(
            Finding("dialable", "ok", f"{reached} of {len(facts.dialback)} peer(s) dialed this node back at {shown}"),
        )
    else:
        findings.append(Finding(
            "dialable", "warn", f"no peer has tried to dial this node back yet (advertising {shown})",
            "connect to a Lattica peer with a public address; AutoNAT asks it to dial back",
        ))
    for addr in facts.announce:
        ip = _ip_of(addr)
        if ip and _is_local_only(ip):
            findings.append(Finding(
                "announce", "problem", f"announced address {addr} is a loopback or link-local address",
                "announce the address other machines use to reach this one",
            ))
    return findings


def relay_finding(facts: NodeFacts, nat: NatVerdict) -> Finding:
    if nat.kind == "public":
        serving = "and serves as a relay for NAT'd peers" if facts.relay_serving else "and needs no relay"
        return Finding("relay", "ok", f"publicly reachable {serving}")
    if facts.relay_addrs:
        return Finding("relay", "ok", f"reachable through {len(facts.relay_addrs)} relay reservation(s): "
                       + ", ".join(facts.relay_addrs[:2]))
    if facts.reachability == "private" or nat.kind in ("cone", "symmetric"):
        return Finding(
            "relay", "problem", "behind a NAT with no relay reservation: peers cannot open connections to this node",
            "join through at least one publicly reachable Lattica peer (every public node serves as a relay)",
        )
    return Finding("relay", "ok", "no relay reservation (none needed so far)")


# -- peers ---------------------------------------------------------------------------------


def short(peer_id: str) -> str:
    return peer_id if len(peer_id) <= 16 else f"{peer_id[:8]}…{peer_id[-6:]}"


def peer_findings(facts: NodeFacts, nat: NatVerdict) -> list[Finding]:
    findings = []
    for peer in facts.peers:
        if not peer.connected:
            continue
        findings.append(_peer_finding(peer, nat))
    if not any(p.connected for p in facts.peers):
        findings.append(Finding(
            "peers", "warn" if facts.bootstrap_tried or facts.peers else "ok",
            "no peer connected" if facts.bootstrap_tried or facts.peers else "no peer connected (a new swarm)",
            "check the bootstrap findings below" if facts.bootstrap_tried else None,
        ))
    return findings


def _peer_finding(peer: PeerFacts, nat: NatVerdict) -> Finding:
    figures = []
    if peer.rtt_ms is not None:
        figures.append(f"RTT {peer.rtt_ms:.1f} ms")
    if peer.last_transfer_mbit_s is not None and peer.last_transfer_bytes:
        figures.append(
            f"last transfer {peer.last_transfer_bytes / 1e6:.1f} MB at {peer.last_transfer_mbit_s:.1f} Mbit/s",
        )
    path = peer.path or "unknown path"
    if path == "relayed":
        via = f" via {short(peer.relay)}" if peer.relay else ""
        detail = f"relayed{via} ({', '.join(figures) or 'no figures yet'}) because {_why_relayed(peer, nat)}"
        return Finding(f"peer {short(peer.peer_id)}", "warn", detail, _relayed_advice(peer, nat))
    detail = f"{path} ({', '.join(figures) or 'no figures yet'})"
    if peer.rtt_ms is not None and peer.rtt_ms > SLOW_RTT_MS:
        return Finding(f"peer {short(peer.peer_id)}", "warn", detail + " — a slow link",
                       "prefer peers nearby, or raise --inner-steps so rounds communicate less often")
    return Finding(f"peer {short(peer.peer_id)}", "ok", detail)


def _why_relayed(peer: PeerFacts, nat: NatVerdict) -> str:
    if nat.kind == "symmetric":
        return "this node is behind a symmetric NAT, so a hole punch cannot reach it"
    if peer.reachability == "private":
        return "both sides are behind NATs and a hole punch has not succeeded (the peer's NAT may be symmetric)"
    return "no direct connection has succeeded yet"


def _relayed_advice(peer: PeerFacts, nat: NatVerdict) -> str:
    if nat.kind == "symmetric":
        return "forward a TCP port and set --announce (or --upnp) on this node, so peers dial it directly"
    return "forward a TCP port and set --announce on one of the two nodes, so the other can dial it directly"


# -- bootstrap, clock, machine -------------------------------------------------------------


def bootstrap_findings(facts: NodeFacts) -> list[Finding]:
    """One problem per failed bootstrap address; a plain libp2p node (a go-libp2p or Kubo
    relay or DHT server, no Lattica protocol) is a supported bootstrap peer, noted as such."""
    findings = []
    for addr, why in facts.bootstrap_failures.items():
        findings.append(Finding("bootstrap", "problem", f"{addr}: {why}", _bootstrap_advice(why)))
    for addr in facts.bootstrap_plain:
        findings.append(Finding(
            "bootstrap", "ok", f"{addr}: a plain libp2p node (speaks no Lattica protocol); it serves as "
            "relay and DHT server, and run members are found through its DHT",
        ))
    if facts.bootstrap_tried and not facts.bootstrap_failures:
        findings.append(Finding("bootstrap", "ok", f"reached all {facts.bootstrap_tried} bootstrap peer(s)"))
    return findings


def _bootstrap_advice(why: str) -> str:
    text = why.lower()
    if "refused the circuit" in text:
        return ("the relay answers but does not lead to the peer: the peer is down or reserved on another "
                "relay; ask for its current address (`lattica status` on it lists relay_addrs)")
    if "refused" in text:
        return ("nothing listens there: check that the bootstrap daemon runs and the port (and a container's -p "
                "mapping) is right")
    if "timed out" in text or "timeout" in text or "unreachable" in text:
        return ("packets get no answer: check the IP (a private address is not reachable from another "
                "network), firewalls, and that the bootstrap node announces its public address")
    if "peer id" in text or "mismatch" in text or "expected" in text:
        return "the address names another peer id: copy it again from `lattica id` on the bootstrap node"
    if "member" in text or "secret" in text or "allowlist" in text:
        return "use the run's --secret-file and --run-id, or ask an admin to add this peer id to allow_peers"
    if "noise" in text or "yamux" in text or "lattica protocol" in text:
        return "the address is not a Lattica node; use an address printed by `lattica id`"
    return "check the address, and that the bootstrap node is running and reachable from here"


def clock_findings(facts: NodeFacts) -> list[Finding]:
    offsets = [p for p in facts.peers if p.clock_offset_s is not None]
    if not offsets:
        return [Finding("clock", "ok", "no peer to compare clocks with")] if not facts.peers else [
            Finding("clock", "warn", "no peer answered a clock query", "run doctor again once peers are connected")
        ]
    worst = max(offsets, key=lambda p: abs(p.clock_offset_s or 0.0) - (p.clock_error_s or 0.0))
    skew = abs(worst.clock_offset_s or 0.0) - (worst.clock_error_s or 0.0)
    detail = (f"largest clock difference {worst.clock_offset_s:+.3f} s (±{worst.clock_error_s or 0.0:.3f} s) "
              f"against {short(worst.peer_id)}, over {len(offsets)} peer(s)")
    if skew > CLOCK_WARN_S:
        status: Status = "problem" if skew > CLOCK_PROBLEM_S else "warn"
        return [Finding("clock", status, detail, "synchronize the clock with NTP (timedatectl set-ntp true, or "
                        "chrony) on this node or on that peer")]
    return [Finding("clock", "ok", detail)]


def disk_finding(machine: MachineFacts) -> Finding:
    if machine.free_bytes is None:
        return Finding("disk", "problem", f"cannot read free space of {machine.data_dir}",
                       "create the data dir, or point --data-dir at a writable volume")
    need = max(MIN_FREE_BYTES, 3 * machine.checkpoint_bytes) if machine.checkpoint_bytes else MIN_FREE_BYTES
    detail = f"{machine.free_bytes / 2**30:.1f} GiB free in {machine.data_dir}"
    if machine.checkpoint_bytes:
        detail += f" (a checkpoint takes {machine.checkpoint_bytes / 2**20:.1f} MiB)"
    if machine.free_bytes < need:
        return Finding("disk", "problem", detail + f"; at least {need / 2**30:.1f} GiB is needed for checkpoints",
                       "free space, or point --data-dir at a larger volume (-v in docker run)")
    return Finding("disk", "ok", detail)


def device_finding(machine: MachineFacts) -> Finding:
    memory = ""
    if machine.memory_total_bytes:
        memory = f", {machine.memory_total_bytes / 2**30:.1f} GiB"
        if machine.memory_free_bytes is not None:
            memory += f" ({machine.memory_free_bytes / 2**30:.1f} GiB free)"
    if machine.device == "cuda":
        return Finding("device", "ok", f"CUDA: {machine.device_name or 'GPU'}{memory}")
    if machine.gpu_present:
        return Finding("device", "problem",
                       f"an NVIDIA GPU is present but PyTorch cannot use it; training would run on the CPU{memory}",
                       "start the container with --gpus all, and use a CUDA build of PyTorch matching the driver")
    return Finding("device", "ok", f"CPU{memory} (no GPU found)")


@dataclass(frozen=True)
class Diagnosis:
    nat: NatVerdict | None
    findings: tuple[Finding, ...]

    @property
    def healthy(self) -> bool:
        return not any(f.status == "problem" for f in self.findings)


def diagnose(node: NodeFacts | None, machine: MachineFacts) -> Diagnosis:
    findings: list[Finding] = []
    nat: NatVerdict | None = None
    if node is not None:
        nat, nat_found = nat_finding(node)
        findings.append(nat_found)
        findings.extend(address_findings(node, nat))
        findings.append(relay_finding(node, nat))
        findings.extend(peer_findings(node, nat))
        findings.extend(bootstrap_findings(node))
        findings.extend(clock_findings(node))
    findings.append(disk_finding(machine))
    findings.append(device_finding(machine))
    return Diagnosis(nat, tuple(findings))
