"""``lattica join`` as a hostile group partner: everything it sends in an exchange is NaN.

    python -m lattica_lab.hostile_daemon JOIN-ARGS...

The daemon is the product's, run by the CLI's own ``main`` with the given ``join`` arguments;
only this process's data plane is changed, before anything starts: ``TensorService.exchange``
replaces every floating-point tensor it sends by NaN of the same shape and dtype — what a member
whose GPU produced a NaN would send its gossip partners, or an attacker. What it receives, trains
on and publishes is untouched, and nothing in ``lattica/`` can switch this on.
``NanPartnerDaemon`` is the ``DaemonProcess`` that runs it, for tests.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lattica.cli.main import main
from lattica.net.tensors.transfer import TensorService
from lattica_lab import lab_env
from lattica_lab.collective import nan_like
from lattica_lab.daemons import DaemonProcess


def poison_exchanges() -> None:
    """From now on, every ``TensorService`` of this process sends NaN in its exchanges."""
    honest = TensorService.exchange

    async def exchange(
        self: TensorService, tensors: Sequence[torch.Tensor], *, peer: str, tag: str, codec: str = "fp32",
    ) -> list[torch.Tensor]:
        return await honest(self, [nan_like(t) for t in tensors], peer=peer, tag=tag, codec=codec)

    TensorService.exchange = exchange  # type: ignore[method-assign]


@dataclass
class NanPartnerDaemon(DaemonProcess):
    """A ``lattica join`` daemon whose exchanges carry NaN (module docstring)."""

    def command(self) -> list[str]:
        return [sys.executable, "-m", "lattica_lab.hostile_daemon", *self.join_args()]

    def environment(self) -> dict[str, str] | None:
        return lab_env(super().environment())


if __name__ == "__main__":
    poison_exchanges()
    sys.exit(main(sys.argv[1:]))
