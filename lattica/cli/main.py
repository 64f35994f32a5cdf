"""``lattica`` command line: the daemon (``join``) and the commands that talk to it.

Every error reaches the user as one line on stderr with a non-zero exit code; tracebacks are
shown only with ``--log-level debug`` (an internal error of the daemon also appends its
traceback to ``crash.log`` in the data dir).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

from lattica.cli import data as data_cli
from lattica.cli import doctor as doctor_cli
from lattica.cli import export as export_cli
from lattica.cli import tune as tune_cli
from lattica.cli.common import resolve_data_dir
from lattica.config import DEFAULT_INNER_STEPS, DEMO_LONG_ROUNDS, DEMO_ROUNDS, WIRE_CODECS
from lattica.errors import LatticaError, StorageError
from lattica.files import DISK_FULL_ERRNOS, append_private, storage_error

EXIT_ERROR = 1
EXIT_INTERNAL = 2
# ``model_spec.preset_help()`` as text (a test keeps them equal): ``lattica --help`` needs no torch
MODEL_HELP = (
    "GPT presets (byte vocabulary): tiny (125k), mini (859k), small (4.9M), medium (25.6M), gpt2-124m (86.0M), "
    "gpt-125m (121.5M), gpt-350m (303.6M); "
    "Llama presets (parameters at a 32k vocabulary; the vocabulary is the data's): "
    "llama-tiny (2.1M), llama-20m (21.7M), llama-150m (144.1M), llama-1b (1.10B); or hf:<local dir>"
)

# ``family_defaults.family_defaults_help()`` as text (a test keeps them equal)
STRATEGY_DEFAULTS_HELP = (
    "defaults that differ by model family (set explicitly, a value wins): llama presets: diloco outer_lr 0.5; "
    "sparseloco density 0.1, outer_lr 1.75"
)


def _add_data_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", type=Path, help="node data dir (default: $XDG_DATA_HOME/lattica)")


def _add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lattica", description="Decentralized training runtime.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    join = sub.add_parser("join", help="run the node daemon (start a swarm, or join one with --peer)")
    _add_data_dir(join)
    join.add_argument("--config", type=Path, help="TOML config file")
    join.add_argument("--peer", action="append", dest="peers", metavar="MULTIADDR", help="bootstrap peer (repeatable)")
    join.add_argument("--peers-file", type=Path, help="file with one bootstrap multiaddr per line")
    join.add_argument(
        "--listen", action="append", metavar="MULTIADDR",
        help="listen address (repeatable; default all interfaces, port 4001)",
    )
    join.add_argument(
        "--announce", action="append", metavar="MULTIADDR",
        help="address to advertise instead (port-mapped containers)",
    )
    join.add_argument(
        "--upnp", action="store_true", default=None,
        help="map the listen port on the LAN gateway with UPnP (default off)",
    )
    join.add_argument("--run-id", help="id of the training run (default: 'default')")
    join.add_argument("--metrics-addr", help="HOST:PORT for Prometheus metrics, or 'off' (default 127.0.0.1:9400)")
    join.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    join.add_argument(
        "--bootstrap-timeout", type=float, dest="bootstrap_timeout_s",
        help="seconds to reach a bootstrap peer (default 30)",
    )
    join.add_argument("--secret-file", type=Path, help="run secret (mode 0600); members must prove they know it")
    join.add_argument(
        "--allow-peer", action="append", dest="allow_peers", metavar="PEER_ID",
        help="only these peers may take part (repeatable)",
    )
    join.add_argument(
        "--train", action="store_true", help="take part in training (default config unless [train] is set)",
    )
    join.add_argument(
        "--strategy",
        help="outer strategy: diloco, eager, streaming, streaming_eager, noloco, spes, sparseloco, demo, …; "
        + STRATEGY_DEFAULTS_HELP + " (docs/strategies.md)",
    )
    join.add_argument("--model", help=MODEL_HELP.replace("%", "%%"))
    join.add_argument(
        "--init", choices=("seed", "weights"),
        help="hf: models: fresh weights from the seed (default) or the dir's weights",
    )
    join.add_argument(
        "--data",
        help="'stdlib' (default corpus), a folder from 'lattica data prepare', a text file or folder, .jsonl, .bin,"
        " or hf:NAME",
    )
    join.add_argument("--task", help="user task entry point package.module:function")
    join.add_argument("--inner-steps", type=int, help=f"inner steps per outer round (H, default {DEFAULT_INNER_STEPS})")
    join.add_argument("--rounds", type=int, help="outer rounds to train")
    join.add_argument("--min-peers", type=int, help="peers (including this one) needed before training starts")
    join.add_argument("--device", choices=("auto", "cpu", "cuda"))
    join.add_argument("--devices", help="the node's accelerators: auto (every CUDA device, else one CPU; "
                      "default), a list such as cuda:0,cuda:1, or cpu:N (N CPU ranks)")
    join.add_argument("--seed", type=int)
    join.add_argument(
        "--averaging", choices=("allreduce", "gossip"),
        help="DiLoCo: one all-reduce per round (default) or gossip in small groups",
    )
    join.add_argument("--group-size", type=int, help="gossip averaging and NoLoCo: members per group (default 2)")
    join.add_argument("--gossip-overlap", action="store_const", const=True, default=None,
                      help="DiLoCo with gossip: each round's exchange runs during the next inner phase")
    join.add_argument("--codec", choices=WIRE_CODECS,
                      help="the DiLoCo family's wire codec for the pseudo-gradient (run-wide; default fp32)")
    join.add_argument("--tune", action="store_const", const=True, default=None,
                      help="re-tune H from measured links between rounds (run-wide; the admin decides)")
    join.add_argument("--tune-min-rounds", type=int,
                      help="tune: the fewest applied outer rounds a tuned H must leave the run (default 8)")
    join.add_argument("--compile", choices=("auto", "true", "false"),
                      help="torch.compile the model (default auto: on CUDA, not on the CPU)")
    join.add_argument("--micro-batches", type=int, help="gradient accumulation: each step's batch in this many parts")
    join.add_argument("--activation-checkpointing", action="store_const", const=True, default=None,
                      help="recompute each layer's activations in backward (less memory, more compute)")
    join.add_argument("--outer-state-device", choices=("cpu", "same"),
                      help="where DiLoCo/eager keep their outer state (default cpu: pinned host memory on CUDA)")

    ident = sub.add_parser("id", help="print this node's peer id and the addresses others can join")
    _add_data_dir(ident)
    ident.add_argument("--config", type=Path)
    ident.add_argument("--listen", action="append", metavar="MULTIADDR")
    ident.add_argument("--announce", action="append", metavar="MULTIADDR")
    _add_json(ident)

    for name, help_text in (
        ("status", "show the running daemon's status"),
        ("peers", "list the peers the daemon knows"),
        ("state", "dump the run's replicated state (a stopped node's: as stored in its data dir)"),
        ("stop", "ask the running daemon to shut down"),
    ):
        p = sub.add_parser(name, help=help_text)
        _add_data_dir(p)
        _add_json(p)
        if name == "state":
            p.add_argument("--run-id", help="with no daemon running: which run's stored state to show")

    doctor_cli.add_parser(sub)
    data_cli.add_parser(sub)
    export_cli.add_parser(sub)
    tune_cli.add_parser(sub)

    demo = sub.add_parser("demo", help="train a local swarm of daemons on the built-in corpus")
    demo.add_argument("--nodes", type=int, default=4)
    demo.add_argument(
        "--rounds", type=int, help=f"outer rounds (default {DEMO_ROUNDS}; {DEMO_LONG_ROUNDS} with --long)",
    )
    demo.add_argument(
        "--long", action="store_true",
        help=f"train {DEMO_LONG_ROUNDS} rounds instead of {DEMO_ROUNDS} (a lower loss; minutes)",
    )
    demo.add_argument("--inner-steps", type=int, default=DEFAULT_INNER_STEPS, help=f"H (default {DEFAULT_INNER_STEPS})")
    demo.add_argument("--strategy", default="diloco")
    demo.add_argument("--model", default="tiny")
    demo.add_argument("--workdir", type=Path, help="where the nodes keep their data dirs (default: a temp dir)")
    demo.add_argument("--base-port", type=int, default=0, help="first listen port (default: ephemeral)")
    _add_json(demo)
    return parser


def _version() -> str:
    from lattica import __version__

    return f"lattica {__version__}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    debug = getattr(args, "log_level", None) == "debug"
    try:
        return _dispatch(args)
    except BaseExceptionGroup as group:
        # trio nurseries wrap errors; report the first meaningful one as one line
        leaf = _first_leaf(group)
        if isinstance(leaf, LatticaError):
            print(f"lattica: error: {leaf}", file=sys.stderr)
            return EXIT_ERROR
        if isinstance(leaf, KeyboardInterrupt):
            return 130
        if debug:
            raise
        _report_internal(args, leaf)
        return EXIT_INTERNAL
    except LatticaError as exc:
        print(f"lattica: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if debug:
            raise
        _report_internal(args, exc)
        return EXIT_INTERNAL


def _first_leaf(group: BaseExceptionGroup) -> BaseException:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return _first_leaf(exc)
        return exc
    return group


def _report_internal(args: argparse.Namespace, exc: BaseException) -> None:
    """One line for the user; a daemon also keeps the traceback in ``<data dir>/crash.log``
    (not when its disk is full: the line then names the data dir and the space left)."""
    where = ""
    if args.command == "join" and isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
        full = Path(exc.filename) if isinstance(exc.filename, str) else resolve_data_dir(args)
        print(f"lattica: internal error: {storage_error(full, exc, what='to')}", file=sys.stderr)
        return
    if args.command == "join":
        try:
            path = resolve_data_dir(args) / "crash.log"
            append_private(path, "".join(traceback.format_exception(exc)) + "\n", what="crash log")
            where = f" (traceback in {path})"
        except StorageError as not_kept:
            where = f" (no traceback kept: {not_kept})"
        except LatticaError:
            pass  # no data dir to keep it in
    print(f"lattica: internal error: {type(exc).__name__}: {_first_line(exc)}{where}", file=sys.stderr)


def _first_line(exc: BaseException) -> str:
    return (str(exc) or type(exc).__name__).splitlines()[0]


def _dispatch(args: argparse.Namespace) -> int:
    from lattica.cli import commands

    handlers = {
        "join": commands.join,
        "id": commands.identity,
        "status": commands.status,
        "peers": commands.peers,
        "state": commands.state,
        "stop": commands.stop,
        "demo": commands.demo,
        "doctor": doctor_cli.doctor,
        "data": data_cli.data,
        "export": export_cli.export,
        "tune": tune_cli.tune,
    }
    return handlers[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
