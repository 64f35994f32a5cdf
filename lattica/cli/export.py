"""``lattica export``: write the weights the swarm agreed on (``train/swarm/export.py``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    export = sub.add_parser(
        "export",
        help="write the newest agreed outer weights of a node's data dir as safetensors or a transformers folder",
    )
    export.add_argument("--data-dir", type=Path, help="node data dir (default: $XDG_DATA_HOME/lattica)")
    export.add_argument("--out", type=Path, required=True, help="folder to write (must not exist, unless --force)")
    export.add_argument("--format", choices=("safetensors", "hf"), default="safetensors",
                        help="safetensors + model description (default), or hf: a folder AutoModelForCausalLM loads")
    export.add_argument("--run-id", help="which run's weights, when the data dir holds several")
    export.add_argument("--force", action="store_true", help="replace --out if it exists")


def export(args: argparse.Namespace) -> int:
    from lattica.cli.common import resolve_data_dir
    from lattica.train.swarm.export import export as write_export

    agreed, notes = write_export(
        resolve_data_dir(args), args.out, fmt=args.format, run_id=args.run_id, force=args.force,
    )
    for note in notes:
        print(f"lattica: warning: {note}", file=sys.stderr)
    print(
        f"exported run {agreed.run_id!r} round {agreed.round} (step {agreed.step}, outer state "
        f"{agreed.state_hash[:12]}…) to {args.out} as {args.format}"
    )
    return 0
