"""Helpers every CLI command uses: where the data dir is, JSON output, quiet exit on SIGPIPE.

They live apart from ``main`` (the parser and the dispatch) so that the command modules never
import ``main``, which imports them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path


def resolve_data_dir(args: argparse.Namespace) -> Path:
    from lattica.cli.settings import default_data_dir

    if args.data_dir is not None:
        return Path(args.data_dir).expanduser()
    env = os.environ.get("LATTICA_DATA_DIR")
    return Path(env).expanduser() if env else default_data_dir()


def print_json(obj: object) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def install_signal_exit() -> None:
    """Let SIGPIPE end CLI output quietly (``lattica peers | head``)."""
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
