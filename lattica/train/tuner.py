"""The daemon's side of tuning: what it measures for ``lattica tune``, and ``tune = true``.

A thin shell around ``retune`` (the decision and the schedule, sans-IO) and ``autotune`` (the
cost model and the search). ``measure`` gathers this node's figures — the inner step (timed per
inner phase with ``tune = true``; else from the reported throughput, which counts the syncs
too), the fp32 payload, the last timed transfer to each member of the last round and a clock
ping to each, and the last round's own rate — for the ``tune`` control request and for the
admin's tuning. ``RunTuner`` reads the tuned schedule from the run config for the strategy
wrapper (``retune.TunedPeriods``) and,
on an admin, decides after each round whether to (re-)tune and publishes the new entry.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Protocol

import trio

from lattica.config import TrainSettings
from lattica.errors import LatticaError
from lattica.train.settings.autotune import DEFAULT_TARGET, Measurements
from lattica.train.settings.retune import (
    TUNED_KEY,
    Period,
    TunedEntry,
    TunedPeriods,
    decide,
    fixed_knobs,
    parse_entry,
    period_at,
    slowest_bandwidth_bps,
    step_and_comm_cpu,
)
from lattica.train.strategies.base import OuterStepReport, OuterStrategy
from lattica.train.swarm.membership import MembershipView

log = logging.getLogger(__name__)

CLOCK_PING_S = 5.0  # the RTT pings of one measurement, all together


class Traffic(Protocol):
    @property
    def last_sent(self) -> Mapping[str, tuple[int, float]]: ...


# the node's RTT probe: peers -> seconds there and back (``NodeHandle.round_trip_times``)
RoundTrips = Callable[[Sequence[str]], Awaitable[dict[str, float]]]


async def measure(
    round_trip_times: RoundTrips, traffic: Traffic, *, peer_id: str, group: Sequence[str], step_s: float | None,
    model_bytes: int, round_bps: float | None, comm_cpu_s_per_byte: float = 0.0, comm_cpu_s_per_round: float = 0.0,
    shared_cores: bool = True, steps_left: int | None = None,
) -> dict[str, object]:
    """This node's figures for the tuner (module docstring), with each peer's; JSON.

    The bandwidth is the lower of the slowest peer's last timed message and the last round's
    own rate (its bytes sent over its wall time): a message that fits in the socket buffers
    is sent faster than the link carries it, and a round also waits for its last member, so
    the lower figure is the one a round is held to."""
    peers = [p for p in group if p != peer_id]
    rtts: dict[str, float] = {}
    with trio.move_on_after(CLOCK_PING_S):
        rtts = await round_trip_times(peers)
    sent = traffic.last_sent
    per_peer = {
        p: {"rtt_ms": round(1000 * rtts[p], 2) if p in rtts else None,
            "mbit_s": round(bps / 1e6, 2) if (bps := slowest_bandwidth_bps(sent, [p])) is not None else None}
        for p in peers
    }
    rates = [r for r in (slowest_bandwidth_bps(sent, peers), round_bps) if r is not None]
    bandwidth = min(rates) if rates else None
    return {
        "step_s": step_s, "model_bytes": model_bytes, "bandwidth_bps": bandwidth,
        "rtt_s": max(rtts.values()) if rtts else None, "peers": len(group), "per_peer": per_peer,
        "comm_cpu_s_per_byte": comm_cpu_s_per_byte, "comm_cpu_s_per_round": comm_cpu_s_per_round,
        "shared_cores": shared_cores, "steps_left": steps_left,
    }


def measurements_of(figures: Mapping[str, object]) -> Measurements:
    """The cost model's input from ``measure``'s figures; ``ValueError`` naming what is missing."""
    missing = [k for k in ("step_s", "bandwidth_bps", "rtt_s") if figures.get(k) is None]
    if missing:
        raise ValueError(f"not measured yet: {', '.join(missing)} (a round with peers must have completed)")
    def number(key: str) -> float:
        value = figures.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{key} must be a number, got {value!r}")  # noqa: TRY004 - bad input, one kind
        return float(value)

    left = figures.get("steps_left")
    if left is not None and (isinstance(left, bool) or not isinstance(left, int)):
        raise ValueError(f"steps_left must be an integer, got {left!r}")
    shared = figures.get("shared_cores", True)
    if not isinstance(shared, bool):
        raise ValueError(f"shared_cores must be true or false, got {shared!r}")  # noqa: TRY004 - bad input, one kind
    return Measurements(
        step_s=number("step_s"), model_bytes=int(number("model_bytes")), bandwidth_bps=number("bandwidth_bps"),
        rtt_s=number("rtt_s"), peers=int(number("peers")),
        comm_cpu_s_per_byte=number("comm_cpu_s_per_byte") if figures.get("comm_cpu_s_per_byte") is not None else 0.0,
        comm_cpu_s_per_round=number("comm_cpu_s_per_round") if figures.get("comm_cpu_s_per_round") is not None
        else 0.0,
        shared_cores=shared, steps_left=left,
    )


class RunTuner:
    """``tune = true`` on one member (module docstring)."""

    def __init__(
        self, view: MembershipView, settings: TrainSettings, *, round_trip_times: RoundTrips, traffic: Traffic,
        target: float = DEFAULT_TARGET,
    ) -> None:
        self.view, self.settings, self.round_trip_times, self.traffic, self.target = (
            view, settings, round_trip_times, traffic, target
        )
        self.peer_id = view.peer_id
        self.strategy: TunedPeriods | None = None
        self.model_bytes: Callable[[], int] = lambda: 0
        self.shared_cores = True  # the inner steps run on the CPU, beside the communication
        self._entry: TunedEntry | None = None
        self._raw: object = None
        self._lock = trio.Lock()
        self._rounds_seen = 0  # rounds with peers this node took part in
        self.last_decision: str | None = None

    def wrap(self, strategy: OuterStrategy[object]) -> OuterStrategy[object]:
        s = self.settings
        self.strategy = TunedPeriods(strategy, periods=self.periods, end=s.rounds * s.inner_steps)
        self.model_bytes = lambda: 4 * sum(p.numel() for p in strategy.model.parameters())
        self.shared_cores = all(p.device.type == "cpu" for p in strategy.model.parameters())
        return self.strategy

    def entry(self) -> TunedEntry | None:
        """The run config's tuned entry; one that does not validate is refused (logged once)
        and the last valid one stays in force."""
        raw = self.view.run_config().get(TUNED_KEY)
        if raw is None or raw == self._raw:
            return self._entry
        self._raw = raw
        try:
            entry = parse_entry(raw)
        except ValueError as exc:
            log.warning("tune: the run config's tuned entry is refused (%s); the schedule in force stays", exc)
            return self._entry
        if self._entry is None or entry.periods != self._entry.periods:
            for period in entry.periods[len(self._entry.periods) if self._entry else 0:]:
                log.info("tune: the run syncs every %d steps from step %d%s (tuned for %.1f Mbit/s)",
                         period.inner_steps, period.from_step,
                         f", sending {period.codec}" if period.codec else "", entry.bandwidth_bps / 1e6)
        self._entry = entry
        return entry

    def periods(self) -> tuple[Period, ...]:
        entry = self.entry()
        return entry.periods if entry is not None else ()

    async def after_round(self, report: OuterStepReport, step: int) -> None:
        """On an admin, after a round with peers: measure, and publish a new entry when
        ``retune.decide`` says so. Never fails the training: a failure is logged."""
        if self.peer_id not in self.view.admins or report.skipped or len(report.group) < 2 or self.strategy is None:
            return
        self._rounds_seen += 1
        if self._rounds_seen < 2 or self.strategy.timer.step_s is None or report.seconds <= 0:
            return  # the first round's wall time holds the members' start skew: its rate is not the link's
        if step >= self.strategy.end:
            return  # the run's last sync: no period would come into force
        async with self._lock:  # one decision at a time: each builds on the entry in force
            try:
                await self._tune(report, step)
            except (LatticaError, ValueError, OSError) as exc:
                log.warning("tune: no tuning after %s: %s", report.key, exc)

    async def _tune(self, report: OuterStepReport, step: int) -> None:
        assert self.strategy is not None
        s = self.settings
        fixed = fixed_knobs(s.strategy, s.averaging, s.group_size, s.gossip_overlap)
        step_s, cpu = step_and_comm_cpu(self.strategy.timer, overlapped=bool(fixed["overlap"]),
                                        bytes_sent=report.bytes_sent)
        next_sync = self.strategy.sync_step_after(step)
        figures = await measure(
            self.round_trip_times, self.traffic, peer_id=self.peer_id, group=report.group,
            step_s=step_s, model_bytes=self.model_bytes(), round_bps=report.bytes_sent * 8 / report.seconds,
            comm_cpu_s_per_byte=cpu, comm_cpu_s_per_round=cpu * report.bytes_sent, shared_cores=self.shared_cores,
            steps_left=max(0, self.strategy.end - next_sync),  # where a new period comes into force
        )
        measured = measurements_of(figures)
        decision = decide(
            measured, current=self.entry(), fixed=fixed,
            next_sync=next_sync, base=self.strategy.base, target=self.target,
            base_codec=self.strategy.base_codec, min_rounds=s.tune_min_rounds,
        )
        if decision is None:
            return
        for choice in decision.applied.choices:
            log.info("tune: %s", choice.line())
        config = {**self.view.run_config(), TUNED_KEY: decision.entry.to_json()}
        await self.view.publish_run_config(config)
        new = decision.entry.periods[-1] if decision.entry.periods else None
        self.last_decision = (
            f"{decision.reason}; step {measured.step_s * 1000:.1f} ms, payload {measured.model_bytes / 1e6:.1f} MB, "
            f"RTT {measured.rtt_s * 1000:.1f} ms, communication CPU {measured.comm_cpu_s_per_byte * 1e9:.0f} ns/byte, "
            f"at least {measured.comm_cpu_s_per_round * 1000:.0f} ms a round "
            f"({'shared' if measured.shared_cores else 'own'} cores), {measured.peers} members -> H "
            f"{decision.applied.config.inner_steps}"
            + (f", {decision.applied.config.codec}" if self.strategy.base_codec is not None else "")
            + f" (predicted utilization {decision.applied.prediction.utilization:.3f}, "
            + f"{'meets' if decision.applied.meets_target else 'below'} the target {self.target})"
            + (f" from step {new.from_step}" if new is not None else "")
        )
        log.warning("tune: re-tuned after %s: %s", report.key, self.last_decision)
        for line in decision.entry.not_applied:
            log.warning("tune: not applied: %s", line)

    def status(self, step: int) -> dict[str, object]:
        """``lattica status``'s ``tuned``: H in force, the periods, what is not applied."""
        entry = self.entry()
        base = self.strategy.base if self.strategy is not None else self.settings.inner_steps
        info: dict[str, object] = {"inner_steps": period_at(step, base=base, periods=self.periods())}
        codec = self.strategy.codec_now(step) if self.strategy is not None else None
        if codec is not None:
            info["codec"] = codec
        if entry is not None:
            info |= {"periods": entry.to_json()["periods"], "tuned_for_mbit_s": round(entry.bandwidth_bps / 1e6, 2),
                     "not_applied": list(entry.not_applied)}
        if self.last_decision is not None:
            info["last_decision"] = self.last_decision
        return info
