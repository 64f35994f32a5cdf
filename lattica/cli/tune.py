"""``lattica tune``: choose H, codec, overlap, group size and chunk size for measured links.

Given one inner step's time, the model's payload, the bandwidth and RTT to the group's peers and
the number of members, it runs the auto-tuner's priority search (``train/settings/autotune.py``) and
prints one line per choice with the numbers behind it, then the run settings to use. Imports
nothing of torch: it runs where the daemon does not.

With all five figures on the command line it runs offline. Otherwise it asks the daemon of
``--data-dir`` (the ``tune`` control request, ``train/tuner.py``) for what it measured — its
inner step, its payload, the last timed transfer to and a clock ping to each member of its last
round — and any figure given on the command line replaces the measured one.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping

from lattica.cli.common import resolve_data_dir
from lattica.control import client
from lattica.decoding import str_map
from lattica.errors import ConfigError, LocalProtocolError

_FIGURES = ("step_ms", "model_bytes", "bandwidth_mbit", "rtt_ms", "peers")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    tune = sub.add_parser("tune", help="choose H, codec, overlap, group size and chunk size for measured links")
    measured = " (default: as the running daemon measured it)"
    tune.add_argument("--step-ms", type=float, help="one inner step, in milliseconds" + measured)
    tune.add_argument("--model-bytes", type=int,
                      help="the model's fp32 payload in bytes (4 × parameters)" + measured)
    tune.add_argument("--bandwidth-mbit", type=float, help="to the slowest peer of the group, Mbit/s" + measured)
    tune.add_argument("--rtt-ms", type=float, help="round-trip time to the farthest peer, ms" + measured)
    tune.add_argument("--peers", type=int, help="members of a round" + measured)
    tune.add_argument("--comm-cpu-ns", type=float,
                      help="CPU nanoseconds per byte sent in an all-reduce (default: as the running daemon measured "
                           "it; 0 offline)")
    tune.add_argument("--comm-cpu-round-ms", type=float,
                      help="the least CPU milliseconds an exchange costs per round (default: as the running daemon "
                           "measured it; 0 offline)")
    tune.add_argument("--shared-cores", action=argparse.BooleanOptionalAction, default=None,
                      help="the inner steps run on the cores communication runs on (default: as the daemon trains: "
                           "yes on a CPU; yes offline)")
    tune.add_argument("--steps", type=int,
                      help="inner steps the run has left (default: as the running daemon counts them; offline: "
                           "unknown, the rounds they leave are not counted)")
    # the default is the tuner's (8), resolved when the command runs: building the parser must not
    # import the training stack (an idle daemon parses the same CLI)
    tune.add_argument("--min-rounds", type=int,
                      help="applied outer rounds an H must leave in those steps to be a candidate (default 8)")
    tune.add_argument("--data-dir", help="the running daemon to measure (default: $LATTICA_DATA_DIR or the default)")
    tune.add_argument("--target", type=float, default=0.95, help="utilization to meet (default 0.95)")
    tune.add_argument("--max-loss", type=float, default=3.0,
                      help="expected loss increase a choice may cost, percent (default 3; utilization first when "
                           "no choice meets both)")
    tune.add_argument("--json", action="store_true", help="one JSON object instead of lines")


def tune(args: argparse.Namespace) -> int:
    from lattica.train.settings.autotune import DEFAULT_MIN_ROUNDS, Measurements, run_settings, tune

    min_rounds = DEFAULT_MIN_ROUNDS if args.min_rounds is None else args.min_rounds
    if not args.max_loss >= 0:
        raise ConfigError(f"tune: --max-loss must be a percentage >= 0 (inf: no budget), got {args.max_loss!r}")

    figures = {name: getattr(args, name) for name in _FIGURES}
    cores: dict[str, float | None] = {"comm_cpu_ns": args.comm_cpu_ns, "comm_cpu_round_ms": args.comm_cpu_round_ms,
                                      "shared_cores": args.shared_cores, "steps_left": args.steps}
    if any(value is None for value in figures.values()):
        daemon = _measured(args)
        cores = {k: cores[k] if cores[k] is not None else daemon.pop(k) for k in cores}
        figures = {**daemon, **{k: v for k, v in figures.items() if v is not None}}
        missing = [name for name, value in figures.items() if value is None]
        if missing:
            raise ConfigError(f"tune: the daemon has not measured {', '.join(missing)} yet (a round with peers "
                              "must have completed); wait, or give --" + missing[0].replace("_", "-"))
        if not args.json:
            print("measured: " + ", ".join(f"{name} {value:g}" for name, value in {**figures, **cores}.items()
                                           if value is not None))
    cpu_ns, round_ms = cores["comm_cpu_ns"] or 0.0, cores["comm_cpu_round_ms"] or 0.0  # offline: none
    shared = cores["shared_cores"] != 0
    left = cores["steps_left"]
    try:
        measured = Measurements(
            step_s=figures["step_ms"] / 1000, model_bytes=int(figures["model_bytes"]),
            bandwidth_bps=figures["bandwidth_mbit"] * 1e6, rtt_s=figures["rtt_ms"] / 1000, peers=int(figures["peers"]),
            comm_cpu_s_per_byte=cpu_ns / 1e9, comm_cpu_s_per_round=round_ms / 1000, shared_cores=shared,
            steps_left=None if left is None else int(left),
        )
        tuned = tune(measured, target=args.target, min_rounds=min_rounds, max_loss=args.max_loss / 100)
    except ValueError as exc:
        raise ConfigError(f"tune: {exc}") from None
    settings = run_settings(tuned.config)
    if args.json:
        print(json.dumps({
            "measured": {**figures, "comm_cpu_ns": cpu_ns, "comm_cpu_round_ms": round_ms, "shared_cores": shared,
                         "steps_left": left},
            "config": tuned.config.__dict__, "settings": settings,
            "meets_target": tuned.meets_target, "within_loss_budget": tuned.within_loss_budget,
            "shortfall": tuned.shortfall,
            "utilization": round(tuned.prediction.utilization, 4), "loss_cost": round(tuned.prediction.loss_cost, 4),
            "choices": [c.line() for c in tuned.choices],
        }))
        return 0
    for choice in tuned.choices:
        print(choice.line())
    verdict = "meets" if tuned.meets_target else "does NOT meet"
    within = "within" if tuned.within_loss_budget else "NOT within"
    print(f"chosen: {tuned.config.describe()} — predicted utilization {tuned.prediction.utilization:.3f} "
          f"({verdict} {args.target}), expected loss {100 * tuned.prediction.loss_cost:+.1f} % ({within} "
          f"+{args.max_loss:g} %)" + (f": {tuned.shortfall}" if tuned.shortfall else ""))
    print("[train]")
    for key, value in settings.items():
        print(f"{key} = {json.dumps(value)}")
    return 0


def _measured(args: argparse.Namespace) -> dict[str, float | None]:
    """The daemon's figures in the CLI's units; a reply that is no such object is refused."""
    reply = str_map(client.call(resolve_data_dir(args) / "control.sock", "tune", timeout=30.0))
    if reply is None:
        raise LocalProtocolError("daemon sent a malformed reply to tune")
    return {
        "step_ms": _scaled(reply, "step_s", 1000), "model_bytes": _scaled(reply, "model_bytes", 1),
        "bandwidth_mbit": _scaled(reply, "bandwidth_bps", 1e-6), "rtt_ms": _scaled(reply, "rtt_s", 1000),
        "peers": _scaled(reply, "peers", 1), "comm_cpu_ns": _scaled(reply, "comm_cpu_s_per_byte", 1e9),
        "comm_cpu_round_ms": _scaled(reply, "comm_cpu_s_per_round", 1000),
        "shared_cores": 0.0 if reply.get("shared_cores") is False else 1.0,
        "steps_left": _scaled(reply, "steps_left", 1),
    }


def _scaled(reply: Mapping[str, object], key: str, factor: float) -> float | None:
    value = reply.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise LocalProtocolError(f"daemon sent a malformed {key} in its reply to tune: {value!r}")
    return value * factor
