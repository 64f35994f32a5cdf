"""``lattica doctor``: why this node does (not) see the others, and what to do about it.

With a daemon running for ``--data-dir`` the node's facts come from its control socket
(``lattica.node.doctor``); without one, ``--peer`` addresses are probed by a
short-lived host (``lattica.net.probe``) — the check to run on a rented machine before joining.
This machine's free disk and compute device are read here. ``lattica.diagnostics`` turns
both into findings. Exit code 0 when no finding is a problem, 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
from pathlib import Path

from lattica.decoding import build, str_map
from lattica.diagnostics import Diagnosis, MachineFacts, NodeFacts, Observation, PeerFacts, diagnose
from lattica.errors import DaemonNotRunningError, LocalProtocolError

_MARKS = {"ok": "ok     ", "warn": "WARN   ", "problem": "PROBLEM"}


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    doctor = sub.add_parser(
        "doctor", help="diagnose connectivity (NAT, relays, peers, bootstrap), clock, disk and device",
    )
    doctor.add_argument("--data-dir", type=Path, help="node data dir (default: $XDG_DATA_HOME/lattica)")
    doctor.add_argument("--config", type=Path, help="TOML config file (listen/announce for a probe)")
    doctor.add_argument("--peer", action="append", dest="peers", metavar="MULTIADDR",
                        help="with no daemon running: bootstrap peer to probe (repeatable)")
    doctor.add_argument("--listen", action="append", metavar="MULTIADDR", help="probe: listen address")
    doctor.add_argument("--announce", action="append", metavar="MULTIADDR", help="probe: address to advertise")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")


def doctor(args: argparse.Namespace) -> int:
    from lattica.cli.common import install_signal_exit, print_json, resolve_data_dir
    from lattica.control import client

    install_signal_exit()
    data_dir = resolve_data_dir(args)
    mode = "daemon"
    node: NodeFacts | None
    try:
        node = node_facts_from_json(client.call(data_dir / "control.sock", "doctor", timeout=20.0))
    except DaemonNotRunningError:
        node = _probe(args, data_dir) if args.peers else None
        mode = "probe" if node is not None else "machine"
    diagnosis = diagnose(node, machine_facts(data_dir))
    if args.json:
        print_json(report_json(mode, node, diagnosis))
    else:
        print(render(mode, diagnosis))
    return 0 if diagnosis.healthy else 1


def report_json(mode: str, node: NodeFacts | None, diagnosis: Diagnosis) -> dict[str, object]:
    return {
        "mode": mode,
        "healthy": diagnosis.healthy,
        "nat": dataclasses.asdict(diagnosis.nat) if diagnosis.nat is not None else None,
        "findings": [dataclasses.asdict(f) for f in diagnosis.findings],
        "node": dataclasses.asdict(node) if node is not None else None,
    }


def render(mode: str, diagnosis: Diagnosis) -> str:
    heading = {
        "daemon": "the running daemon, as its peers see it:",
        "probe": "no daemon running; probed the given peers with a short-lived host:",
        "machine": "no daemon running (give --peer MULTIADDR to probe a swarm before joining); this machine:",
    }[mode]
    out = [heading]
    for finding in diagnosis.findings:
        out.append(f"  {_MARKS[finding.status]} {finding.check}: {finding.detail}")
        if finding.advice:
            out.append(f"          -> {finding.advice}")
    return "\n".join(out)


def node_facts_from_json(raw: object) -> NodeFacts:
    """The daemon's answer (our own process's JSON) back into ``NodeFacts``."""
    data = dict(_json_object(raw))
    data["observations"] = tuple(build(Observation, _json_object(o)) for o in _json_list(data.get("observations")))
    data["peers"] = tuple(build(PeerFacts, _json_object(p)) for p in _json_list(data.get("peers")))
    for key in ("listen", "announce", "advertised", "relay_addrs", "bootstrap_plain"):
        data[key] = tuple(_json_list(data.get(key)))
    known = {f.name for f in dataclasses.fields(NodeFacts)}
    return build(NodeFacts, {k: v for k, v in data.items() if k in known})


def _json_object(value: object) -> dict[str, object]:
    data = str_map(value)
    if data is None:
        raise LocalProtocolError("daemon sent a malformed doctor reply")
    return data


def _json_list(value: object) -> list[object]:
    if value is None:
        return []
    if not isinstance(value, list | tuple):
        raise LocalProtocolError("daemon sent a malformed doctor reply")
    return list(value)


def _probe(args: argparse.Namespace, data_dir: Path) -> NodeFacts:
    import trio

    from lattica.cli.logs import configure_logging
    from lattica.cli.preflight import prepare_data_dir
    from lattica.cli.settings import build_node_config
    from lattica.net.identity import load_or_create_identity
    from lattica.net.probe import probe

    flags = {
        "data_dir": data_dir,
        "listen": tuple(args.listen) if args.listen else None,
        "announce": tuple(args.announce) if args.announce else None,
    }
    environ = {k: v for k, v in os.environ.items() if not k.startswith("LATTICA_TRAIN_")}
    config = build_node_config(flags=flags, config_path=args.config, environ=environ)
    prepare_data_dir(config.data_dir)
    key_pair = load_or_create_identity(config.data_dir)
    configure_logging("error")  # py-libp2p logs failed handshakes; the findings say it once
    return trio.run(lambda: probe(key_pair, listen=config.listen, announce=config.announce, peers=args.peers))


# -- this machine ------------------------------------------------------------------------------


def machine_facts(data_dir: Path) -> MachineFacts:
    device, name, total, free = _device()
    return MachineFacts(
        data_dir=str(data_dir), free_bytes=_free_bytes(data_dir), checkpoint_bytes=_checkpoint_bytes(data_dir),
        device=device, device_name=name, memory_total_bytes=total, memory_free_bytes=free,
        gpu_present=Path("/dev/nvidia0").exists() or Path("/proc/driver/nvidia/gpus").is_dir(),
    )


def _free_bytes(path: Path) -> int | None:
    """Free space where the data dir is (or would be created)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            try:
                return shutil.disk_usage(candidate).free
            except OSError:
                return None
    return None


def _checkpoint_bytes(data_dir: Path) -> int | None:
    try:
        files = [p for p in (data_dir / "checkpoints").iterdir() if p.suffix == ".pt"]
    except OSError:
        return None
    newest = max(files, key=lambda p: p.stat().st_mtime, default=None)
    return newest.stat().st_size if newest is not None else None


def _device() -> tuple[str, str | None, int | None, int | None]:
    """("cuda" or "cpu", device name, total and free memory in bytes)."""
    import torch

    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        return "cuda", torch.cuda.get_device_name(0), int(total), int(free)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return "cpu", None, int(total), _available_memory()


def _available_memory() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
