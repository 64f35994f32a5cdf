"""Logging setup: our messages at the chosen level, py-libp2p's kept quiet unless debugging."""

from __future__ import annotations

import logging
import sys

_NOISY = ("libp2p", "multiaddr", "trio", "asyncio", "urllib3")


def configure_logging(level: str) -> None:
    numeric = getattr(logging, level.upper())
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(numeric)
    # py-libp2p logs routine disconnects as errors with tracebacks; show them only when asked.
    library_level = numeric if numeric <= logging.DEBUG else logging.CRITICAL
    for name in _NOISY:
        logging.getLogger(name).setLevel(library_level)
