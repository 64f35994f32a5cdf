"""A user-space WAN link: two TUN devices in two namespaces, packets forwarded after a delay.

The kernel here has no netem, so the lab's wide-area links are emulated in user space. One
process per link (``python -m lattica_lab.delay_line``, started by ``lattica_lab.wan``):

Theory of operation
-------------------
- At start the process enters namespace A, creates TUN device ``--tun-a`` there, enters
  namespace B and creates ``--tun-b``; the file descriptors stay bound to their namespaces. It
  prints one JSON line ``{"event": "ready", ...}``; the caller then brings the devices up and
  routes the other site's prefix through them. A packet the kernel routes into ``tun-a`` is read
  here, held, and written into ``tun-b``: namespace B receives it as if it arrived on a wire.
- Each direction is a :class:`LinkQueue`, a sans-IO model of one wire: a packet offered at
  ``t`` starts serializing when the wire is free (``rate``), and is released ``one_way`` after
  its last bit left. A packet that would wait longer than ``buffer`` for the wire is dropped
  (a router's tail drop), so TCP sees loss when it overruns the rate, as on a real bottleneck.
  Release times in a direction never decrease, so a deque (no heap) orders them.
- Whole GSO packets: the devices are opened with ``IFF_VNET_HDR`` and TSO/checksum offload, so
  a TCP sender's 64 KB super-packet crosses this process as one read and one write (the kernel
  segments it later). Rate accounting counts the headers of every segment it stands for.
- The clock starts when a packet is read, so the emulated delay is exact only while this
  process keeps up; ``stats`` reports how late releases ran behind their due time. The process
  asks for real-time scheduling (else a high nice level) so that a busy machine does not
  stretch the wire: measured here under a load of 14 on 2 cores, releases ran < 0.3 ms late
  with it and up to 10 ms late without.
- Control: JSON lines on stdin. ``{"cmd": "stats"}`` answers a ``stats`` event on stdout. End
  of stdin (the lab closed it, or the lab's process died) ends this process; it also asks the
  kernel for SIGKILL when its parent dies. The namespaces' deletion removes the devices.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import fcntl
import json
import os
import select
import signal
import struct
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

VNET_HDR = struct.Struct("<BBHHHH")  # flags, gso_type, hdr_len, gso_size, csum_start, csum_offset
VNET_HDR_LEN = VNET_HDR.size
MAX_PACKET = 65536 + 512
READS_PER_WAKE = 256

_TUNSETIFF = 0x400454CA
_TUNSETOFFLOAD = 0x400454D0
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
_IFF_VNET_HDR = 0x4000
_TUN_F_CSUM, _TUN_F_TSO4, _TUN_F_TSO6 = 0x01, 0x02, 0x04
_CLONE_NEWNET = 0x40000000
_PR_SET_PDEATHSIG = 1
_LATE_BUCKETS_MS = (1.0, 2.0, 5.0, 10.0, 20.0)


@dataclass(frozen=True)
class LinkShape:
    """One direction of a link: propagation delay, wire rate and how long a queue may grow."""

    one_way_s: float
    rate_bps: float | None = None  # None: no rate limit
    buffer_s: float = 0.05

    def __post_init__(self) -> None:
        if not 0 <= self.one_way_s <= 10:
            raise ValueError(f"one_way_s must be within 0..10 s, got {self.one_way_s}")
        if self.rate_bps is not None and self.rate_bps <= 0:
            raise ValueError(f"rate_bps must be positive, got {self.rate_bps}")
        if self.buffer_s <= 0:
            raise ValueError(f"buffer_s must be positive, got {self.buffer_s}")


@dataclass
class DirectionStats:
    packets: int = 0  # reads (a GSO packet counts once)
    segments: int = 0  # wire packets they stand for
    wire_bytes: int = 0
    dropped: int = 0
    late: list[int] = field(default_factory=lambda: [0] * (len(_LATE_BUCKETS_MS) + 1))
    max_late_ms: float = 0.0

    def record_release(self, late_s: float) -> None:
        late_ms = late_s * 1000
        self.max_late_ms = max(self.max_late_ms, late_ms)
        for i, bound in enumerate(_LATE_BUCKETS_MS):
            if late_ms < bound:
                self.late[i] += 1
                return
        self.late[-1] += 1

    def as_dict(self) -> dict[str, object]:
        names = [f"<{b:g}ms" for b in _LATE_BUCKETS_MS] + [f">={_LATE_BUCKETS_MS[-1]:g}ms"]
        return {
            "packets": self.packets, "segments": self.segments, "wire_bytes": self.wire_bytes,
            "dropped": self.dropped, "late": dict(zip(names, self.late, strict=True)),
            "max_late_ms": round(self.max_late_ms, 3),
        }


class LinkQueue:
    """Sans-IO model of one direction of a link: offer packets, pop those that are due."""

    def __init__(self, shape: LinkShape) -> None:
        self.shape = shape
        self.stats = DirectionStats()
        self._wire_free_at = 0.0
        self._queue: deque[tuple[float, bytes]] = deque()

    def offer(self, now: float, packet: bytes, *, wire_bytes: int, segments: int = 1) -> bool:
        """Queue ``packet`` (arrived at ``now``); ``False`` when the buffer is full (dropped)."""
        start = max(now, self._wire_free_at)
        if start - now > self.shape.buffer_s:
            self.stats.dropped += 1
            return False
        if self.shape.rate_bps is not None:
            start += wire_bytes * 8 / self.shape.rate_bps
            self._wire_free_at = start
        self._queue.append((start + self.shape.one_way_s, packet))
        self.stats.packets += 1
        self.stats.segments += segments
        self.stats.wire_bytes += wire_bytes
        return True

    def next_release(self) -> float | None:
        return self._queue[0][0] if self._queue else None

    def pop_due(self, now: float) -> Iterator[tuple[float, bytes]]:
        """Yield ``(due, packet)`` for every packet due at ``now``, in order."""
        queue = self._queue
        while queue and queue[0][0] <= now:
            yield queue.popleft()

    def __len__(self) -> int:
        return len(self._queue)


def wire_size(packet: bytes) -> tuple[int, int]:
    """``(segments, wire_bytes)`` of a packet read with a virtio-net header in front.

    A GSO packet stands for ``segments`` IP packets, each carrying its own IP and TCP/UDP
    headers; the header is measured from the packet (the virtio ``hdr_len`` is only a hint).
    """
    ip_bytes = len(packet) - VNET_HDR_LEN
    if ip_bytes <= 0:
        return 1, max(ip_bytes, 0)
    _flags, gso_type, _hdr_len, gso_size, _cs, _co = VNET_HDR.unpack_from(packet)
    if gso_type == 0 or gso_size == 0:
        return 1, ip_bytes
    header = _l3l4_header_len(memoryview(packet)[VNET_HDR_LEN:])
    payload = ip_bytes - header
    if header <= 0 or payload <= 0:
        return 1, ip_bytes
    segments = -(-payload // gso_size)
    return segments, ip_bytes + (segments - 1) * header


def _l3l4_header_len(ip: memoryview) -> int:
    if len(ip) < 20:
        return 0
    version = ip[0] >> 4
    if version == 4:
        l3, proto = (ip[0] & 0x0F) * 4, ip[9]
    elif version == 6 and len(ip) >= 40:
        l3, proto = 40, ip[6]
    else:
        return 0
    if proto == 6 and len(ip) >= l3 + 13:
        return l3 + (ip[l3 + 12] >> 4) * 4
    if proto == 17:
        return l3 + 8
    return 0


# -- the process: namespaces, TUN devices, the event loop ----------------------------------------

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def enter_namespace(name: str) -> None:
    """Move this (single-threaded) process into network namespace ``name`` (``ip netns``)."""
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if _libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({name}): {os.strerror(err)}")
    finally:
        os.close(fd)


def open_tun(name: str) -> int:
    """Create TUN device ``name`` in the current namespace with GSO offload; its fd."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        ifreq = struct.pack("16sH22x", name.encode(), _IFF_TUN | _IFF_NO_PI | _IFF_VNET_HDR)
        fcntl.ioctl(fd, _TUNSETIFF, ifreq)
        fcntl.ioctl(fd, _TUNSETOFFLOAD, _TUN_F_CSUM | _TUN_F_TSO4 | _TUN_F_TSO6)
    except OSError:
        os.close(fd)
        raise
    return fd


class DelayLine:
    """The event loop of one link: two TUN fds, a :class:`LinkQueue` per direction."""

    def __init__(self, fd_a: int, fd_b: int, shape: LinkShape) -> None:
        # each entry: (read from, write to, queue of that direction)
        self.directions = [(fd_a, fd_b, LinkQueue(shape)), (fd_b, fd_a, LinkQueue(shape))]
        self.write_errors = 0

    def _read_into(self, fd: int, queue: LinkQueue) -> None:
        for _ in range(READS_PER_WAKE):
            try:
                packet = os.read(fd, MAX_PACKET)
            except BlockingIOError:
                return
            segments, wire = wire_size(packet)
            queue.offer(time.monotonic(), packet, wire_bytes=wire, segments=segments)

    def _release_due(self) -> float | None:
        """Write every due packet; the time the next one is due (``None``: queues empty)."""
        now = time.monotonic()
        next_due: float | None = None
        for _src, dst, queue in self.directions:
            for due, packet in queue.pop_due(now):
                try:
                    os.write(dst, packet)
                except OSError:
                    self.write_errors += 1
                queue.stats.record_release(now - due)
            head = queue.next_release()
            if head is not None and (next_due is None or head < next_due):
                next_due = head
        return next_due

    def stats(self) -> dict[str, object]:
        return {
            "event": "stats", "a_to_b": self.directions[0][2].stats.as_dict(),
            "b_to_a": self.directions[1][2].stats.as_dict(), "write_errors": self.write_errors,
        }

    def run(self, control_fd: int) -> None:
        """Forward until ``control_fd`` (stdin) reaches its end."""
        readers = {src: queue for src, _dst, queue in self.directions}
        watched = [*readers, control_fd]
        control = _ControlReader(control_fd)
        while True:
            next_due = self._release_due()
            timeout = None if next_due is None else max(0.0, next_due - time.monotonic())
            # select(), not epoll: its timeout has microsecond resolution (epoll's: milliseconds,
            # rounded up, which would add half a millisecond to every hop on average)
            ready, _w, _x = select.select(watched, [], [], timeout)
            for fd in ready:
                if fd == control_fd:
                    commands = control.read()
                    if commands is None:
                        return
                    for command in commands:
                        if command.get("cmd") == "stats":
                            _emit(self.stats())
                else:
                    self._read_into(fd, readers[fd])


class _ControlReader:
    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buffer = b""

    def read(self) -> list[dict] | None:
        """Commands received so far, ``None`` at end of input."""
        chunk = os.read(self.fd, 4096)
        if not chunk:
            return None
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        commands = []
        for line in lines:
            try:
                command = json.loads(line)
            except ValueError:
                continue
            if isinstance(command, dict):
                commands.append(command)
        return commands


def _run_ahead_of_the_load() -> str:
    """Real-time priority (SCHED_FIFO 1), else nice -15: a wire's timing must not depend on
    how busy the machine is. The line sleeps between packets and its CPU is proportional to
    the traffic (the kernel's real-time throttling still leaves 5 % to the rest); where
    real-time scheduling is refused (a container) the nice level still favours it."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    except OSError:
        pass
    else:
        return "fifo"
    try:
        os.setpriority(os.PRIO_PROCESS, 0, -15)
    except OSError:
        return "normal"
    return "nice"


def _emit(event: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lattica_lab.delay_line", description=__doc__)
    parser.add_argument("--ns-a", required=True)
    parser.add_argument("--tun-a", required=True)
    parser.add_argument("--ns-b", required=True)
    parser.add_argument("--tun-b", required=True)
    parser.add_argument("--rtt-ms", type=float, required=True)
    parser.add_argument("--mbit", type=float, default=None)
    parser.add_argument("--buffer-ms", type=float, default=50.0)
    args = parser.parse_args(argv)
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    scheduling = _run_ahead_of_the_load()
    shape = LinkShape(
        one_way_s=args.rtt_ms / 2000,
        rate_bps=None if args.mbit is None else args.mbit * 1e6,
        buffer_s=args.buffer_ms / 1000,
    )
    enter_namespace(args.ns_a)
    fd_a = open_tun(args.tun_a)
    enter_namespace(args.ns_b)
    fd_b = open_tun(args.tun_b)
    _emit({"event": "ready", "pid": os.getpid(), "tun_a": args.tun_a, "tun_b": args.tun_b,
           "scheduling": scheduling})
    DelayLine(fd_a, fd_b, shape).run(sys.stdin.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
