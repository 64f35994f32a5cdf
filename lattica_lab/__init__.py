"""The test and lab harness of Lattica: not part of the product and not in the wheel.

It holds what tests and benchmarks drive the product with: real ``lattica join`` processes
(``daemons``), the network-namespace NAT lab (``netlab``, ``nat_daemons``, ``nat_node``,
``nat_scenarios``), data-plane peer processes (``peer_main``, ``peer_driver``), the in-memory
collective for strategy tests (``collective``), the replicated-state demo node and
benchmark (``demo_node``, ``crdt_bench``), and the swarm-scale run's sites, worker processes
and peers' loop (``swarm``, ``swarm_worker``).

It is a top-level package beside ``lattica/`` in the checkout and is never installed: the
wheel holds only ``lattica`` and ``lattica.*``, and nothing in ``lattica/`` imports it. It is
made importable like this:

- pytest: ``pythonpath = ["."]`` in ``pyproject.toml`` puts the checkout root on ``sys.path``;
- benchmarks: ``benchmarks/_checkout.py`` (imported first by each script) does the same;
- by hand: ``python -m lattica_lab.crdt_bench`` from the checkout root (``-m`` puts the
  current directory on ``sys.path``);
- processes the harness starts itself (``python -m lattica_lab.peer_main`` ...): their
  environment comes from :func:`lab_env`, which puts the checkout root on ``PYTHONPATH``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
"""The checkout that holds ``lattica_lab/`` (and, when not installed, ``lattica/``)."""


def lab_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with the checkout root first on PYTHONPATH."""
    env = dict(os.environ if base is None else base)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(ROOT)]
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *parts])
    return env

