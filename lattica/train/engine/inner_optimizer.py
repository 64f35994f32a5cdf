"""The inner optimizer a trainer builds when the task brings none: AdamW, fastest form per device.

PyTorch's AdamW has three implementations with the same update: a loop over the parameters,
``foreach`` (a few batched kernels over all of them) and ``fused`` (one kernel). The fused one
is the fastest on CUDA, and on the CPU too: measured on a 2-core machine, one AdamW step of
``tiny`` took 0.95 ms as a loop, 0.79 ms foreach and 0.22 ms fused; of ``mini`` 2.2, 2.2 and
0.66 ms. Replicas never compare inner optimizer state, and every member builds the same
implementation for its device, so a run is as deterministic from its seed as before.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from lattica.train.engine.eager_optimizers import EagerAdamW

BETAS = (0.9, 0.95)


def adamw_implementation(device: torch.device) -> dict[str, bool]:
    """The ``torch.optim.AdamW`` keyword that picks the fastest implementation on ``device``."""
    return {"fused": True} if device.type in ("cuda", "cpu") else {}


def build_adamw(
    params: Iterable[torch.nn.Parameter], *, device: torch.device, lr: float, weight_decay: float,
) -> torch.optim.AdamW:
    return EagerAdamW(  # torch.optim.AdamW's arithmetic, without importing torch._dynamo
        params, lr=lr, betas=BETAS, weight_decay=weight_decay, **adamw_implementation(device),
    )
