"""The CLI subcommands. Each returns the process exit code."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from lattica.cli.common import collector_paused_for_start_up, install_signal_exit, print_json, resolve_data_dir
from lattica.cli.render import key_values, short_id, table
from lattica.control import client
from lattica.decoding import str_list, str_map
from lattica.errors import DaemonNotRunningError, LocalProtocolError

if TYPE_CHECKING:
    from libp2p.crypto.keys import KeyPair

    from lattica.config import NodeConfig
    from lattica.node.node import Node


def join(args: argparse.Namespace) -> int:
    with collector_paused_for_start_up():
        config, key_pair, secret = _prepared_join(args)
    from lattica.node.daemon import run_until_stopped  # imported above, by the preparation

    return run_until_stopped(config, key_pair, secret=secret, on_started=_announce_started)


def _prepared_join(args: argparse.Namespace) -> tuple[NodeConfig, KeyPair, bytes | None]:
    """The node config, identity and run secret of ``lattica join``, with the daemon's modules
    imported (the training stack too, for a trainer): everything that can be checked fails
    here, as one line, before anything is started."""
    from lattica.cli.logs import configure_logging
    from lattica.cli.preflight import check_metrics_host, prepare_data_dir
    from lattica.cli.settings import build_node_config
    from lattica.config import parse_host_port
    from lattica.net.access import read_secret_file
    from lattica.net.identity import load_or_create_identity
    from lattica.node import daemon  # noqa: F401 - the daemon's modules load with the collector paused

    flags = {
        "data_dir": args.data_dir,
        "listen": tuple(args.listen) if args.listen else None,
        "announce": tuple(args.announce) if args.announce else None,
        "upnp": args.upnp,
        "peers": tuple(args.peers) if args.peers else None,
        "peers_file": args.peers_file,
        "run_id": args.run_id,
        "metrics_addr": args.metrics_addr,
        "log_level": args.log_level,
        "bootstrap_timeout_s": args.bootstrap_timeout_s,
        "secret_file": args.secret_file,
        "allow_peers": tuple(args.allow_peers) if args.allow_peers else None,
    }
    train_flags = {
        "strategy": args.strategy,
        "model": args.model,
        "init": args.init,
        "data": args.data,
        "task": args.task,
        "inner_steps": args.inner_steps,
        "rounds": args.rounds,
        "min_peers": args.min_peers,
        "device": args.device,
        "devices": args.devices,
        "seed": args.seed,
        "averaging": args.averaging,
        "group_size": args.group_size,
        "gossip_overlap": args.gossip_overlap,
        "tune": args.tune,
        "tune_min_rounds": args.tune_min_rounds,
        "codec": args.codec,
        "compile": {"true": True, "false": False}.get(args.compile, args.compile),
        "micro_batches": args.micro_batches,
        "activation_checkpointing": args.activation_checkpointing,
        "outer_state_device": args.outer_state_device,
    }
    config = build_node_config(
        flags=flags,
        train_flags=train_flags,
        config_path=args.config,
        environ=os.environ,
        with_training=args.train,
    )
    prepare_data_dir(config.data_dir)
    if config.metrics_addr is not None:
        check_metrics_host(parse_host_port(config.metrics_addr, what="--metrics-addr")[0])
    if config.train is not None:  # the training stack (torch) is imported by trainers only
        from lattica.train.settings.settings_check import check_settings

        check_settings(config.train)
    secret = read_secret_file(config.secret_file) if config.secret_file is not None else None
    configure_logging(config.log_level)
    return config, load_or_create_identity(config.data_dir), secret


def _announce_started(node: Node) -> None:
    addrs = node.dialable_addrs()
    lines = [f"lattica node {node.peer_id} is up (run {node.config.run_id!r}, data dir {node.config.data_dir})"]
    if node.config.peers or node.running_connectivity.rejoined:
        lines.append(f"{node.join_summary()}; others can also join through this node with:")
    else:
        lines.append("started a new swarm; others join it with:")
    if addrs:
        lines.append(f"  lattica join --peer {addrs[0]}")
    lines.extend(f"  (also {a})" for a in addrs[1:4])
    print("\n".join(lines), flush=True)


def identity(args: argparse.Namespace) -> int:
    from lattica.cli.preflight import prepare_data_dir
    from lattica.cli.settings import build_node_config
    from lattica.net.addrs import dialable_addrs
    from lattica.net.identity import load_or_create_identity, peer_id_of

    install_signal_exit()
    data_dir = resolve_data_dir(args)
    try:
        result = _reply_map(client.call(data_dir / "control.sock", "id"))
    except DaemonNotRunningError:
        flags = {
            "data_dir": data_dir,
            "listen": tuple(args.listen) if args.listen else None,
            "announce": tuple(args.announce) if args.announce else None,
        }
        config = build_node_config(flags=flags, config_path=args.config, environ=_env_without_train())
        prepare_data_dir(config.data_dir)
        key_pair = load_or_create_identity(config.data_dir)
        peer_id = peer_id_of(key_pair).to_base58()
        if config.announce:
            addrs = [f"{a.split('/p2p/')[0]}/p2p/{peer_id}" for a in config.announce]
        else:
            import multiaddr

            addrs = dialable_addrs([multiaddr.Multiaddr(a) for a in config.listen], peer_id)
        result = {"peer_id": peer_id, "addrs": addrs}
    if args.json:
        print_json(result)
    else:
        print(result.get("peer_id"))
        for addr in str_list(result.get("addrs")) or []:
            print(addr)
    return 0


def _env_without_train() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("LATTICA_TRAIN_")}


def _call(args: argparse.Namespace, method: str) -> object:
    return client.call(resolve_data_dir(args) / "control.sock", method)


def _reply_map(reply: object) -> dict[str, object]:
    """A daemon reply that must be a JSON object (another version's daemon may answer otherwise)."""
    result = str_map(reply)
    if result is None:
        raise LocalProtocolError("daemon sent a malformed reply")
    return result


def status(args: argparse.Namespace) -> int:
    install_signal_exit()
    reply = _call(args, "status")
    if args.json:
        print_json(reply)
        return 0
    result = _reply_map(reply)
    pairs = [(k.replace("_", " "), v) for k, v in result.items() if not isinstance(v, dict)]
    print(key_values(pairs))
    for key, value in result.items():
        section = str_map(value)
        if section is not None:
            print(f"\n[{key}]")
            print(key_values([(k.replace("_", " "), v) for k, v in section.items()]))
    return 0


def _peer_row(p: Mapping[str, object]) -> tuple[str, str, str, str, str]:
    relay, rtt_ms, addrs = p.get("relay"), p.get("rtt_ms"), p.get("addrs")
    return (
        short_id(str(p.get("peer_id"))),
        "yes" if p.get("connected") else ("left" if p.get("left") else "no"),
        (f"relayed via {short_id(str(relay))}" if relay else str(p.get("path") or "")) or "-",
        f"{rtt_ms:.1f}" if isinstance(rtt_ms, int | float) else "-",
        str(addrs[0]) if isinstance(addrs, list) and addrs else "-",
    )


def peers(args: argparse.Namespace) -> int:
    install_signal_exit()
    result = _call(args, "peers")
    if args.json:
        print_json(result)
        return 0
    if not isinstance(result, list):
        raise LocalProtocolError("daemon sent a malformed reply")
    rows = [_peer_row(_reply_map(p)) for p in result]
    print(table(("PEER", "CONNECTED", "PATH", "RTT MS", "ADDRESS"), rows) if rows else "no peers known")
    return 0


def state(args: argparse.Namespace) -> int:
    from lattica.crdt.offline import offline_dump

    install_signal_exit()
    reply: object
    try:
        reply = _call(args, "state")
    except DaemonNotRunningError:
        # a stopped node: what its data dir holds (``crdt/offline.py``)
        reply = offline_dump(resolve_data_dir(args), args.run_id)
        if reply is None:
            raise
    result = str_map(reply)
    if args.json or result is None:
        print_json(reply)
        return 0
    node = str_map(result.get("node")) or {}
    if node.get("offline"):
        print(f"no daemon running: state as stored in {node.get('log')}")
    members = str_map(result.get("members")) or {}
    all_progress = str_map(result.get("progress")) or {}
    live = str_list(result.get("live")) or []
    rows = []
    for peer_id, record in sorted(members.items()):
        member = str_map(record) or {}
        progress = str_map(all_progress.get(peer_id)) or {}
        weights_hash = progress.get("weights_hash")
        rows.append(
            (
                short_id(peer_id),
                "yes" if peer_id in live else "no",
                _shown_role(member.get("role")),
                member.get("device") or "-",
                progress.get("round", "-"),
                (weights_hash if isinstance(weights_hash, str) and weights_hash else "-")[:12],
            )
        )
    print(table(("MEMBER", "LIVE", "ROLE", "DEVICE", "ROUND", "WEIGHTS"), rows) if rows else "no members yet")
    return 0


def _shown_role(role: object) -> str:
    """A member's role as it claims it (``joining``, ``trainer``, ``done``, ``failed``), cut to a
    table cell: any peer can write any text there."""
    if not isinstance(role, str) or not role:
        return "-"
    text = role.encode("ascii", "replace").decode()[:16]
    return text.translate({c: "?" for c in range(32)})


def stop(args: argparse.Namespace) -> int:
    result = _call(args, "shutdown")
    if args.json:
        print_json(result)
    else:
        print("daemon is shutting down")
    return 0


def demo(args: argparse.Namespace) -> int:
    from lattica.cli.demo import run_demo

    return run_demo(args)


