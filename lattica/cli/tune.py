"""``lattica tune``: choose H, codec, overlap, group size and chunk size for measured links.

Given one inner step's time, the model's payload, the bandwidth and RTT to the group's peers and
the number of members, it runs the auto-tuner's priority search (``train/autotune.py``) and
prints one line per choice with the numbers behind it, then the run settings to use. Imports
nothing of torch: it runs where the daemon does not.
"""

from __future__ import annotations

import argparse
import json

from lattica.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    tune = sub.add_parser("tune", help="choose H, codec, overlap, group size and chunk size for measured links")
    tune.add_argument("--step-ms", type=float, required=True, help="one inner step, in milliseconds")
    tune.add_argument("--model-bytes", type=int, required=True,
                      help="the model's fp32 payload in bytes (4 × parameters)")
    tune.add_argument("--bandwidth-mbit", type=float, required=True, help="to the slowest peer of the group, Mbit/s")
    tune.add_argument("--rtt-ms", type=float, required=True, help="round-trip time to the farthest peer, ms")
    tune.add_argument("--peers", type=int, required=True, help="members of a round")
    tune.add_argument("--target", type=float, default=0.95, help="utilization to meet (default 0.95)")
    tune.add_argument("--json", action="store_true", help="one JSON object instead of lines")


def tune(args: argparse.Namespace) -> int:
    from lattica.train.autotune import Measurements, run_settings, tune

    try:
        measured = Measurements(
            step_s=args.step_ms / 1000, model_bytes=args.model_bytes, bandwidth_bps=args.bandwidth_mbit * 1e6,
            rtt_s=args.rtt_ms / 1000, peers=args.peers,
        )
        tuned = tune(measured, target=args.target)
    except ValueError as exc:
        raise ConfigError(f"tune: {exc}") from None
    settings = run_settings(tuned.config)
    if args.json:
        print(json.dumps({
            "config": tuned.config.__dict__, "settings": settings, "meets_target": tuned.meets_target,
            "utilization": round(tuned.prediction.utilization, 4), "loss_cost": round(tuned.prediction.loss_cost, 4),
            "choices": [c.line() for c in tuned.choices],
        }))
        return 0
    for choice in tuned.choices:
        print(choice.line())
    verdict = "meets" if tuned.meets_target else "does NOT meet"
    print(f"chosen: {tuned.config.describe()} — predicted utilization {tuned.prediction.utilization:.3f} "
          f"({verdict} {args.target})")
    print("[train]")
    for key, value in settings.items():
        print(f"{key} = {json.dumps(value)}")
    return 0
