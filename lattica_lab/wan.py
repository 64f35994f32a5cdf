"""Wide-area sites in the namespace lab: real TCP round trips of 20-200 ms between namespaces.

Topology built by :class:`WanLab`::

    site "eu" (198.18.101.0/24)                          site "us" (198.18.102.0/24)
    [eu-1 .2] [eu-2 .3] ... --- [eu router .1] ==tun== delay line ==tun== [us router .1] --- [us-1 .2]

- A site is a router namespace with a LAN bridge and ``hosts`` host namespaces on it (each its
  own address; several peers may also share one host on different ports). Hosts of one site
  talk through the bridge with no added delay.
- :meth:`WanLab.link` joins two sites: a delay-line process (``lattica_lab.delay_line``) owns a
  TUN device in each router and forwards packets after ``rtt_ms / 2`` each way, at ``mbit``
  per direction, with a tail-drop buffer of ``buffer_ms``. Each router routes the other's
  prefix into its TUN, so TCP itself sees the round trip, the rate and the losses. Only linked
  sites reach each other (no transit through a third site).
- The kernel has no netem; this is the user-space substitute. Traffic between sites crosses a
  Python process, so its packet rate is bounded (``docs/netlab.md`` has the measured figures);
  TCP crosses it as whole GSO packets.
- Addresses: site ``k`` (1-based) is 198.18.(100+k).0/24, router ``.1``, hosts ``.2`` on.
  Namespaces are named ``ltnat-<pid>-wan<token>-<role>`` like the NAT lab's, so
  :func:`lattica_lab.netlab.remove_stale_labs` removes those of a crashed run.
  :meth:`WanLab.close` ends the delay lines and spawned processes (by pid), then deletes the
  namespaces — also when building failed half-way.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from lattica_lab import lab_env
from lattica_lab.netlab import (
    NS_PREFIX,
    LabHost,
    LabProcess,
    NetLabUnavailable,
    _delete_namespace,
    _run,
    lab_unavailable_reason,
    remove_stale_labs,
)

MAX_SITES = 60
MAX_HOSTS_PER_SITE = 200
_SITE_NAME = re.compile(r"^[a-z][a-z0-9]{0,9}$")
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def wan_unavailable_reason() -> str | None:
    """Why WAN sites cannot be built here (no root, tools or TUN), or ``None``."""
    reason = lab_unavailable_reason()
    if reason:
        return reason
    if not os.path.exists("/dev/net/tun"):
        return "/dev/net/tun is missing (kernel TUN support)"
    return None


@dataclass(frozen=True)
class LinkSpec:
    """A wide-area link between two sites: round trip, rate per direction, queue depth."""

    rtt_ms: float
    mbit: float | None = None  # None: no rate limit (bounded by the delay line's speed)
    buffer_ms: float = 50.0  # a packet that would queue longer for the wire is dropped

    def __post_init__(self) -> None:
        if not 0 <= self.rtt_ms <= 10_000:
            raise ValueError(f"rtt_ms must be within 0..10000, got {self.rtt_ms}")
        if self.mbit is not None and not 0 < self.mbit <= 100_000:
            raise ValueError(f"mbit must be positive (or None for unlimited), got {self.mbit}")
        if not 0 < self.buffer_ms <= 10_000:
            raise ValueError(f"buffer_ms must be within 0..10000 (exclusive 0), got {self.buffer_ms}")


@dataclass
class Site:
    name: str
    index: int
    router_ns: str
    prefix: str  # "198.18.101"
    hosts: list[LabHost] = field(default_factory=list)

    @property
    def subnet(self) -> str:
        return f"{self.prefix}.0/24"


@dataclass
class WanLink:
    a: Site
    b: Site
    spec: LinkSpec
    process: LabProcess
    scheduling: str = "normal"  # "fifo" (real-time), "nice" or "normal": see delay_line

    @property
    def pid(self) -> int:
        return self.process.popen.pid


class WanLab:
    """Builds sites and links; use as a context manager so it is always torn down."""

    def __init__(self) -> None:
        reason = wan_unavailable_reason()
        if reason:
            raise NetLabUnavailable(reason)
        remove_stale_labs()
        self.tag = f"{NS_PREFIX}{os.getpid()}-wan{secrets.token_hex(2)}"
        self.namespaces: list[str] = []
        self.processes: list[LabProcess] = []
        self.sites: dict[str, Site] = {}
        self.links: dict[frozenset[str], WanLink] = {}

    # -- building -------------------------------------------------------------------------------
    def add_site(self, name: str, *, hosts: int = 1) -> Site:
        """A router namespace with a LAN and ``hosts`` host namespaces ``<name>-1`` ... on it."""
        if not _SITE_NAME.match(name):
            raise ValueError(f"site name must match {_SITE_NAME.pattern}, got {name!r}")
        if name in self.sites:
            raise ValueError(f"site {name!r} exists")
        if not 1 <= hosts <= MAX_HOSTS_PER_SITE:
            raise ValueError(f"hosts must be within 1..{MAX_HOSTS_PER_SITE}, got {hosts}")
        if len(self.sites) >= MAX_SITES:
            raise ValueError(f"at most {MAX_SITES} sites")
        index = len(self.sites) + 1
        router = self._add_namespace(name)
        site = Site(name=name, index=index, router_ns=router, prefix=f"198.18.{100 + index}")
        self.sites[name] = site
        for key in ("all", "default"):
            _sysctl(router, f"net.ipv4.conf.{key}.rp_filter", "0")
            _sysctl(router, f"net.ipv6.conf.{key}.disable_ipv6", "1")  # no stray v6 on links
        _sysctl(router, "net.ipv4.ip_forward", "1")
        _ip(router, "link add lan type bridge")
        _ip(router, f"addr add {site.prefix}.1/24 dev lan")
        _ip(router, "link set lan up")
        for _ in range(hosts):
            self._add_host(site)
        return site

    def _add_host(self, site: Site) -> LabHost:
        number = len(site.hosts) + 1
        ns = self._add_namespace(f"{site.name}-{number}")
        port = f"h{number}"
        _run(["ip", "link", "add", port, "netns", site.router_ns, "type", "veth",
              "peer", "name", "eth0", "netns", ns])
        _ip(site.router_ns, f"link set {port} master lan")
        _ip(site.router_ns, f"link set {port} up")
        ip = f"{site.prefix}.{number + 1}"
        _ip(ns, f"addr add {ip}/24 dev eth0")
        _ip(ns, "link set eth0 up")
        _ip(ns, f"route add default via {site.prefix}.1")
        host = LabHost(name=f"{site.name}-{number}", ns=ns, ip=ip, ifname="eth0")
        site.hosts.append(host)
        return host

    def _add_namespace(self, role: str) -> str:
        ns = f"{self.tag}-{role}"
        _run(["ip", "netns", "add", ns])
        self.namespaces.append(ns)
        _ip(ns, "link set lo up")
        return ns

    def link(self, a: str | Site, b: str | Site, *, rtt_ms: float, mbit: float | None = None,
             buffer_ms: float = 50.0) -> WanLink:
        """Join sites ``a`` and ``b`` with a delayed, rate-limited link (both directions)."""
        spec = LinkSpec(rtt_ms=rtt_ms, mbit=mbit, buffer_ms=buffer_ms)
        site_a, site_b = self._site(a), self._site(b)
        if site_a is site_b:
            raise ValueError("a link joins two different sites")
        key = self._link_key(site_a, site_b)
        if key in self.links:
            raise ValueError(f"sites {site_a.name} and {site_b.name} are linked already")
        tun_a, tun_b = f"wan{site_b.index}", f"wan{site_a.index}"  # named after the far site
        argv = [sys.executable, "-m", "lattica_lab.delay_line",
                "--ns-a", site_a.router_ns, "--tun-a", tun_a,
                "--ns-b", site_b.router_ns, "--tun-b", tun_b,
                "--rtt-ms", str(spec.rtt_ms), "--buffer-ms", str(spec.buffer_ms)]
        if spec.mbit is not None:
            argv += ["--mbit", str(spec.mbit)]
        process = self._popen(f"link-{site_a.name}-{site_b.name}", argv)
        ready = process.wait_for(lambda e: e.get("event") == "ready", timeout=20)
        for site, tun, far in ((site_a, tun_a, site_b), (site_b, tun_b, site_a)):
            _ip(site.router_ns, f"link set {tun} up")
            _ip(site.router_ns, f"route add {far.subnet} dev {tun}")
        link = WanLink(site_a, site_b, spec, process, scheduling=str(ready.get("scheduling")))
        self.links[key] = link
        return link

    def unlink(self, a: str | Site, b: str | Site) -> None:
        """Cut the link: its delay line ends, its TUN devices and routes go with it."""
        link = self.links.pop(self._link_key(a, b), None)
        if link is None:
            raise ValueError("these sites are not linked")
        link.process.kill()
        self.processes.remove(link.process)

    def _link_key(self, a: str | Site, b: str | Site) -> frozenset[str]:
        return frozenset((self._site(a).name, self._site(b).name))

    def _site(self, site: str | Site) -> Site:
        name = site.name if isinstance(site, Site) else site
        if name not in self.sites:
            raise ValueError(f"no site {name!r}")
        return self.sites[name]

    # -- running --------------------------------------------------------------------------------
    def _popen(self, name: str, argv: Sequence[str], *, stderr_path: str | None = None) -> LabProcess:
        stderr_file = open(stderr_path, "w") if stderr_path else None  # noqa: SIM115
        try:
            popen = subprocess.Popen(
                list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=stderr_file if stderr_file is not None else subprocess.DEVNULL,
                text=True, bufsize=1, env=lab_env(),
            )
        finally:
            if stderr_file is not None:
                stderr_file.close()
        process = LabProcess(name, popen)
        self.processes.append(process)
        return process

    def spawn(self, host: LabHost, argv: Sequence[str], *, name: str | None = None,
              stderr_path: str | None = None) -> LabProcess:
        """Start ``argv`` inside ``host``'s namespace; its stdout must be JSON lines."""
        return self._popen(name or host.name, ["ip", "netns", "exec", host.ns, *argv],
                           stderr_path=stderr_path)

    def run_in(self, host: LabHost, argv: Sequence[str], *, timeout: float = 60.0) -> str:
        """Run a command in ``host``'s namespace to its end; its stdout."""
        proc = subprocess.run(["ip", "netns", "exec", host.ns, *argv], capture_output=True,
                              text=True, timeout=timeout, env=lab_env(), check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} in {host.name} failed: {proc.stderr.strip()}")
        return proc.stdout

    def link_stats(self, a: str | Site, b: str | Site) -> dict:
        """The delay line's counters (``a_to_b``, ``b_to_a``) and its CPU seconds so far."""
        link = self.links.get(self._link_key(a, b))
        if link is None:
            raise ValueError("these sites are not linked")
        link.process.send({"cmd": "stats"})
        event = dict(link.process.wait_for(lambda e: e.get("event") == "stats", 10, fresh=True))
        if link.a.name != self._site(a).name:
            event["a_to_b"], event["b_to_a"] = event["b_to_a"], event["a_to_b"]
        event["cpu_s"] = process_cpu_seconds(link.pid)
        return event

    # -- teardown -------------------------------------------------------------------------------
    def close(self) -> None:
        for process in self.processes:
            process.kill()
        self.processes.clear()
        self.links.clear()
        for ns in reversed(self.namespaces):
            _delete_namespace(ns)
        self.namespaces.clear()

    def __enter__(self) -> WanLab:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def process_cpu_seconds(pid: int) -> float:
    """User plus system CPU time of ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def _ip(ns: str, command: str) -> None:
    _run(["ip", "-n", ns, *command.split()])


def _sysctl(ns: str, key: str, value: str) -> None:
    _run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"{key}={value}"])

