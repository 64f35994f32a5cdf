"""Compute utilization of blocking DiLoCo vs eager vs Streaming DiLoCo behind a slow link.

Four peer processes, each in its own network namespace of the NAT lab
(``lattica.testing.netlab``) with a tbf qdisc capping its egress, train the tiny byte-level GPT
with the real trainer and the real data plane (``TensorService`` over libp2p). Utilization is
the time spent inside inner steps (forward, backward, optimizer) divided by the wall time from
the first inner step to the return of the last one's ``after_inner_step`` — the steady state;
the drain of the final in-flight sync at the end of training is excluded. Data are random bytes:
utilization does not depend on what is learned.

The defaults put the run in the regime the overlapping strategies are designed for: a sync's
communication fits in the inner steps it may overlap (H steps for eager DiLoCo, τ steps for a
Streaming fragment). The output shows whether it did: ``<strategy>_comm_s`` is the mean wall
time of one collective call (it includes waiting for the slowest peer to reach the sync) and
``<strategy>_window_s`` the mean inner-step time times the steps it may overlap. With a cap so
low that communication outlasts the window, eager and streaming block too, by design.
``<strategy>_step_ms`` is the mean inner step: overlapped communication competes with the inner
steps for the cores (and the GIL), which makes them slower without counting as waiting.

    python benchmarks/overlap.py [--rate-mbit 20] [--steps 240] [--inner-steps 40] [--overlap-steps 5]

Needs root, ``ip`` and ``nft`` (the lab); without them it says so and exits with status 2.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

WORKERS = 4
STRATEGIES = ("diloco", "eager", "streaming")


def _strategy_config(name: str, inner_steps: int, overlap_steps: int):
    from lattica.train.strategies.diloco import DiLoCoConfig
    from lattica.train.strategies.eager import EagerDiLoCoConfig
    from lattica.train.strategies.streaming import StreamingDiLoCoConfig

    if name == "diloco":
        return DiLoCoConfig(inner_steps=inner_steps)
    if name == "eager":
        return EagerDiLoCoConfig(inner_steps=inner_steps)
    return StreamingDiLoCoConfig(
        inner_steps=inner_steps, fragments=2, overlap_steps=overlap_steps, mixing=0.5
    )


# ---------------------------------------------------------------------------- one peer process


class _FixedGroups:
    def __init__(self, members):
        self.members = tuple(members)

    async def group_for(self, key):
        return self.members


def _random_batches(seed: int, batch_size: int, context: int):
    import torch

    generator = torch.Generator().manual_seed(seed)
    while True:
        data = torch.randint(0, 256, (batch_size, context + 1), generator=generator)
        yield data[:, :-1], data[:, 1:]


class _TimedCollective:
    """The data plane as the strategy's ``Collective``, timing every call."""

    def __init__(self, service) -> None:
        self.service = service
        self.peer_id = service.peer_id
        self.seconds: list[float] = []

    async def allreduce(self, tensors, **kwargs):
        started = time.perf_counter()
        try:
            return await self.service.allreduce(tensors, **kwargs)
        finally:
            self.seconds.append(time.perf_counter() - started)

    async def exchange(self, tensors, **kwargs):
        started = time.perf_counter()
        try:
            return await self.service.exchange(tensors, **kwargs)
        finally:
            self.seconds.append(time.perf_counter() - started)


async def _train(service, cmd: dict) -> dict:
    """Train one strategy to completion; report inner-step time, wall time and bytes sent."""
    from lattica.train.device import select_device
    from lattica.train.model import build_model
    from lattica.train.schedule import ScheduleConfig
    from lattica.train.strategies import create_strategy
    from lattica.train.task import Task
    from lattica.train.trainer import Trainer, TrainerConfig

    steps = cmd["steps"]
    model = build_model("tiny", seed=0)
    collective = _TimedCollective(service)
    strategy = create_strategy(
        cmd["strategy"],
        model,
        collective=collective,
        groups=_FixedGroups(cmd["peers"]),
        config=_strategy_config(cmd["strategy"], cmd["inner_steps"], cmd["overlap_steps"]),
    )
    task = Task(model=model, train_batches=_random_batches(cmd["seed"], 8, 128))
    config = TrainerConfig(
        total_steps=steps,
        eval_every=0,
        log_every=steps,
        schedule=ScheduleConfig(lr=1e-3, warmup_steps=1, total_steps=steps),
    )
    trainer = Trainer(task, strategy, config, device=select_device("cpu"))
    timing = {"inner": 0.0, "first": None, "last": None}
    whole_step, after_inner_step = trainer._whole_step, strategy.after_inner_step

    def timed_step() -> float:
        started = time.perf_counter()
        timing["first"] = timing["first"] or started
        try:
            return whole_step()
        finally:
            timing["inner"] += time.perf_counter() - started

    async def timed_after(step: int):
        reports = await after_inner_step(step)
        if step == steps:
            timing["last"] = time.perf_counter()
        return reports

    trainer._whole_step = timed_step
    strategy.after_inner_step = timed_after
    sent_before = service.stats.total_sent()
    await trainer.run()
    wall = timing["last"] - timing["first"]
    return {
        "ok": True,
        "inner_s": timing["inner"],
        "wall_s": wall,
        "util": timing["inner"] / wall,
        "bytes_sent": service.stats.total_sent() - sent_before,
        "step_s": timing["inner"] / steps,
        "comm_s": statistics.fmean(collective.seconds) if collective.seconds else 0.0,
    }


async def _serve(ip: str) -> None:
    import multiaddr
    import torch
    import trio
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.peerinfo import info_from_p2p_addr

    from lattica.net.host import build_host
    from lattica.net.tensors.transfer import TensorService, TensorServiceConfig

    torch.set_num_threads(1)
    key_pair = create_new_key_pair()
    host = build_host(key_pair)
    service = TensorService(host, key_pair, config=TensorServiceConfig())
    listen = [multiaddr.Multiaddr(f"/ip4/{ip}/tcp/0")]
    async with host.run(listen), trio.open_nursery() as nursery:
        await nursery.start(service.run)
        _reply({"peer_id": service.peer_id, "addr": str(host.get_addrs()[0])})
        async for line in trio.wrap_file(sys.stdin):
            cmd = json.loads(line)
            if cmd["op"] == "quit":
                break
            if cmd["op"] == "connect":
                for addr in cmd["addrs"]:
                    await host.connect(info_from_p2p_addr(multiaddr.Multiaddr(addr)))
                _reply({"ok": True, "op": "connect"})
            elif cmd["op"] == "train":
                _reply({"op": "train", **await _train(service, cmd)})
        nursery.cancel_scope.cancel()


def _reply(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


# ---------------------------------------------------------------------------- the coordinator


def _run_lab(args: argparse.Namespace) -> dict:
    from lattica.testing.netlab import NetLab, shape_link

    results: dict[str, list[dict]] = {}
    with NetLab() as lab:
        hosts = [lab.add_public(f"p{i}") for i in range(WORKERS)]
        for host in hosts:
            shape_link(host.ns, host.ifname, rate_mbit=args.rate_mbit)
        procs = [
            lab.spawn(
                h,
                [sys.executable, __file__, "--peer", "--ip", h.ip],
                stderr_path=f"{args.log_dir}/overlap-{h.name}.log" if args.log_dir else None,
            )
            for h in hosts
        ]
        hellos = [p.wait_for(lambda e: "peer_id" in e, timeout=180) for p in procs]
        peers = [h["peer_id"] for h in hellos]
        for i, proc in enumerate(procs):
            proc.send({"op": "connect", "addrs": [h["addr"] for h in hellos[i + 1 :]]})
            proc.wait_for(lambda e: e.get("op") == "connect", timeout=60, fresh=True)
        for name in args.strategies:
            for i, proc in enumerate(procs):
                proc.send(
                    {
                        "op": "train",
                        "strategy": name,
                        "peers": peers,
                        "steps": args.steps,
                        "inner_steps": args.inner_steps,
                        "overlap_steps": args.overlap_steps,
                        "seed": i,
                    }
                )
            results[name] = [
                p.wait_for(lambda e: e.get("op") == "train", timeout=1800, fresh=True)
                for p in procs
            ]
            r = results[name]
            print(
                f"{name:<10} util {statistics.fmean(x['util'] for x in r):.3f}  "
                f"wall {statistics.fmean(x['wall_s'] for x in r):.1f}s  "
                f"MB sent/peer {statistics.fmean(x['bytes_sent'] for x in r) / 1e6:.2f}  "
                f"comm {statistics.fmean(x['comm_s'] for x in r):.3f}s per call, "
                f"window {_window_s(name, args, r):.3f}s",
                flush=True,
            )
        for proc in procs:
            proc.send({"op": "quit"})
    return results


def _window_s(name: str, args: argparse.Namespace, rows: list[dict]) -> float:
    """Inner-step time the strategy lets one sync overlap (none for blocking DiLoCo)."""
    steps = {"diloco": 0, "eager": args.inner_steps, "streaming": args.overlap_steps}[name]
    return steps * statistics.fmean(r["step_s"] for r in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ip", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--rate-mbit", type=float, default=20.0, help="egress cap per peer")
    parser.add_argument("--steps", type=int, default=240, help="inner steps per strategy")
    parser.add_argument("--inner-steps", type=int, default=40, help="H")
    parser.add_argument("--overlap-steps", type=int, default=5, help="Streaming's tau")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--log-dir", default="", help="write each peer's stderr here")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.peer:
        import trio

        trio.run(_serve, args.ip)
        return 0
    from lattica.testing.netlab import lab_unavailable_reason

    reason = lab_unavailable_reason()
    if reason:
        print(f"error: the NAT lab is unavailable here: {reason}", file=sys.stderr)
        return 2
    args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    print(
        f"{WORKERS} peers in network namespaces, tbf egress cap {args.rate_mbit} Mbit/s each, "
        f"tiny GPT, {args.steps} steps, H={args.inner_steps}, streaming P=2 tau="
        f"{args.overlap_steps} fp4",
        flush=True,
    )
    results = _run_lab(args)
    key = {"diloco": "blocking_util", "eager": "eager_util", "streaming": "streaming_util"}
    out = {
        "link": f"tbf {args.rate_mbit} Mbit/s egress per peer (netns lab)",
        "workers": WORKERS,
        "steps": args.steps,
        "inner_steps": args.inner_steps,
        "streaming_fragments": 2,
        "streaming_overlap_steps": args.overlap_steps,
    }
    for name, rows in results.items():
        out[key.get(name, f"{name}_util")] = round(statistics.fmean(r["util"] for r in rows), 4)
        out[f"{name}_wall_s"] = round(statistics.fmean(r["wall_s"] for r in rows), 2)
        out[f"{name}_bytes_per_peer"] = int(statistics.fmean(r["bytes_sent"] for r in rows))
        out[f"{name}_comm_s"] = round(statistics.fmean(r["comm_s"] for r in rows), 3)
        # inner steps slow down when communication competes for the cores (and the GIL)
        out[f"{name}_step_ms"] = round(1000 * statistics.fmean(r["step_s"] for r in rows), 1)
        if name != "diloco":
            out[f"{name}_window_s"] = round(_window_s(name, args, rows), 3)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
